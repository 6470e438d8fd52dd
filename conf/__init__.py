"""ppoflow's typed config tree (the only home of defaults) and its loader.

    from ppoflow.conf import load_config
    cfg = load_config(None, ["actor_rollout_ref.actor.optim.lr=1e-3"])
    cfg.actor_rollout_ref.actor.optim.lr, cfg.run_dir, cfg.to_yaml()

Keys use verl's dotted names; see all_keys() for the full list."""

from .loader import EMBEDDED_DEFAULT, load_config, suggest_key
from .schema import PPOFlowConfig, all_keys, config_fingerprint
from .schema_actor import (
    ActorConfig,
    ActorModelConfig,
    ActorRolloutRefConfig,
    RefConfig,
    RolloutConfig,
    ValKwargs,
)
from .schema_algorithm import (
    AlgorithmConfig,
    CustomRewardFunctionConfig,
    KLControlConfig,
    PFPPOConfig,
    RewardConfig,
    RewardModelConfig,
)
from .schema_common import CheckpointConfig, ConfigError, DeepSpeedConfig, FsdpConfig, OptimConfig
from .schema_critic import CriticConfig, CriticModelConfig, CriticOptimConfig
from .schema_data import DataConfig
from .schema_trainer import TrainerConfig

__all__ = [
    "EMBEDDED_DEFAULT",
    "ActorConfig",
    "ActorModelConfig",
    "ActorRolloutRefConfig",
    "AlgorithmConfig",
    "CheckpointConfig",
    "ConfigError",
    "CriticConfig",
    "CriticModelConfig",
    "CriticOptimConfig",
    "CustomRewardFunctionConfig",
    "DataConfig",
    "DeepSpeedConfig",
    "FsdpConfig",
    "KLControlConfig",
    "OptimConfig",
    "PFPPOConfig",
    "PPOFlowConfig",
    "RefConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "TrainerConfig",
    "ValKwargs",
    "all_keys",
    "config_fingerprint",
    "load_config",
    "suggest_key",
]
