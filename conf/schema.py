"""The whole config tree, `PPOFlowConfig`: verl's key names, ppoflow's defaults, each written once,
here and in the section modules. YAML files under conf/ hold overrides only (see loader.py)."""

import hashlib
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, model_validator
from pydantic_core import to_jsonable_python

from .schema_actor import ActorRolloutRefConfig
from .schema_algorithm import AlgorithmConfig, CustomRewardFunctionConfig, RewardConfig, RewardModelConfig
from .schema_checks import resolve_and_check
from .schema_common import Section, section_type
from .schema_critic import CriticConfig
from .schema_data import DataConfig
from .schema_trainer import TrainerConfig


class PPOFlowConfig(Section):
    """Everything a ppoflow run reads. Building one fills the keys that follow others (critic sizes,
    rollout lengths) and checks verl's batch-size arithmetic, so each section can be handed to a
    task on its own."""

    data: DataConfig = Field(default_factory=DataConfig)
    """Datasets and batching."""
    actor_rollout_ref: ActorRolloutRefConfig = Field(default_factory=ActorRolloutRefConfig)
    """Policy, reference policy and rollout."""
    critic: CriticConfig = Field(default_factory=CriticConfig)
    """Value model (used by adv_estimator=gae)."""
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    """verl's reward-model switch."""
    custom_reward_function: CustomRewardFunctionConfig = Field(default_factory=CustomRewardFunctionConfig)
    """A user reward function."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """The composite reward's weights and error handling."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Advantage estimation and KL control."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """The training loop."""

    @model_validator(mode="after")
    def _resolve_and_check(self) -> "PPOFlowConfig":
        resolve_and_check(self)
        return self

    @property
    def world_size(self) -> int:
        """Processes taking part in an update: trainer.nnodes × trainer.n_gpus_per_node."""
        return self.trainer.world_size

    @property
    def use_critic(self) -> bool:
        """Whether the critic stages run: only GAE needs a value model (as in verl)."""
        return self.algorithm.adv_estimator == "gae"

    @property
    def use_reference_policy(self) -> bool:
        """Whether reference log-probs are needed: a KL loss or a KL penalty in the reward."""
        return self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def run_dir(self) -> Path:
        """The run directory: trainer.default_local_dir, else runs/<trainer.experiment_name>."""
        return self.trainer.run_dir

    def to_yaml(self) -> str:
        """The full effective config as YAML; load_config reads it back to an equal config."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def all_keys(model: type[BaseModel] = PPOFlowConfig, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the tree, in declaration order (dict-valued fields are leaves)."""
    keys: list[str] = []
    for name, field in model.model_fields.items():
        sub = section_type(field)
        keys.extend(all_keys(sub, f"{prefix}{name}.") if sub else [prefix + name])
    return keys


def config_fingerprint(section: BaseModel | dict[str, Any]) -> str:
    """sha256 hex of a section's canonical JSON: independent of key order, for cache keys."""
    data = section.model_dump(mode="json") if isinstance(section, BaseModel) else to_jsonable_python(section)
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()
