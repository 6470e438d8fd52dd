"""The whole config tree, `PPOFlowConfig`: verl's key names, ppoflow's defaults, each written once,
here and in the section modules. YAML files under conf/ hold overrides only (see loader.py)."""

import functools
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, PrivateAttr, model_validator
from pydantic_core import to_jsonable_python

from .effects import greedy_rollout_warning, without_effect
from .schema_actor import ActorRolloutRefConfig
from .schema_algorithm import AlgorithmConfig, CustomRewardFunctionConfig, RewardConfig, RewardModelConfig
from .schema_checks import DERIVED, followed_source, resolve_and_check
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

    _origins: dict[str, str] = PrivateAttr(default_factory=dict)
    """Dotted key → the layer that set it (load_config fills it); keys not in it are defaults."""

    def __eq__(self, other: object) -> bool:  # the values, whichever layers set them
        return isinstance(other, PPOFlowConfig) and self.model_dump() == other.model_dump()

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

    def to_yaml(self, *, origins: bool = False) -> str:
        """The full effective config as YAML; load_config reads it back to an equal config. With
        `origins`, each value set by a layer carries a comment naming it (the rest are defaults)."""
        text = yaml.safe_dump(
            self.model_dump(mode="json"), sort_keys=False, allow_unicode=True, width=float("inf")
        )
        if not origins:
            return text
        header = (
            "# The effective config: a comment names the layer that set a value, or the key it follows;"
            " the rest are defaults.\n"
        )
        return header + _annotated(text, self._origins | self._followed())

    def _followed(self) -> dict[str, str]:
        """`follows <key>` for each key left unset that took another key's value (DERIVED)."""
        followed = {}
        for key, sources in DERIVED.items():
            value = value_at(self, key)
            if key in self._origins or value is None or value == default_of(key):
                continue
            followed[key] = f"follows {followed_source(self, key) or sources[0]}"
        return followed

    def origin_of(self, key: str) -> str:
        """The layer that set a dotted key: a config file, an override, the embedded default."""
        return self._origins.get(key, "the model default")

    def settings_without_effect(self) -> list[tuple[str, str]]:
        """(key, why) for each key a user's layer set to other than its default that has no effect in
        this run (conf/effects.py); a whole effective config read back as a file is not noise."""
        chosen = [
            key
            for key, origin in self._origins.items()
            if not origin.startswith("embedded default")
            and value_at(self, key) != default_of(key)
            and followed_source(self, key) is None  # a read-back effective config: as it would be anyway
        ]
        return without_effect(self, chosen)

    def warnings(self) -> list[str]:
        """What to say at start about this config: keys without effect, and a rollout setting that
        leaves nothing to learn."""
        return [w for w in (self.no_effect_warning(), greedy_rollout_warning(self)) if w is not None]

    def no_effect_warning(self) -> str | None:
        """One line naming the keys set that have no effect in this run, grouped by why; or None."""
        reasons: dict[str, list[str]] = {}
        for key, why in self.settings_without_effect():
            reasons.setdefault(why, []).append(key)
        if not reasons:
            return None
        return "no effect in this run: " + "; ".join(f"{', '.join(k)} ({why})" for why, k in reasons.items())


def value_at(cfg: BaseModel, key: str) -> Any:
    """The value at a dotted key, entries of free-form mappings included."""
    value: Any = cfg
    for name in key.split("."):
        value = value.get(name) if isinstance(value, dict) else getattr(value, name)
    return value


def default_of(key: str) -> Any:
    """A dotted key's value in the default config (keys that follow others included; an entry of a
    free-form mapping that is not there by default: None)."""
    return value_at(_default_config(), key)


@functools.cache
def _default_config() -> "PPOFlowConfig":
    return PPOFlowConfig()


_KEY_LINE = re.compile(r"^( *)(?:- )?([^ #:'\"][^:]*|'[^']*'|\"[^\"]*\"):(?: |$)")


def _annotated(text: str, origins: dict[str, str]) -> str:
    """YAML from safe_dump with `# <origin>` after each key that a layer set."""
    path: list[tuple[int, str]] = []
    lines = []
    for line in text.splitlines():
        match = _KEY_LINE.match(line)
        if match is not None and not line.lstrip().startswith("- "):
            indent, key = len(match.group(1)), match.group(2).strip("'\"")
            path = [(i, k) for i, k in path if i < indent] + [(indent, key)]
            origin = origins.get(".".join(k for _, k in path))
            if origin is not None:
                line = f"{line}  # {origin}"
        lines.append(line)
    return "\n".join(lines) + "\n"


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
