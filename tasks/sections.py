"""The config each stage receives: only its own sections, as plain dicts, with derived sizes
resolved once. A change to one section changes only the cache keys of the stages that read it."""

from __future__ import annotations

from dataclasses import dataclass

from ppoflow.conf import PPOFlowConfig
from ppoflow.engine.data import steps_per_epoch

from .reward_runner import custom_function_section


@dataclass(frozen=True)
class StageConfig:
    rollout: dict
    val_rollout: dict
    batching: dict
    actor: dict
    critic: dict
    algorithm: dict
    reward: dict
    trainer: dict
    seed: int
    use_critic: bool
    use_reference: bool
    critic_warmup: int
    test_freq: int
    save_freq: int
    val_before_train: bool


def stage_config(cfg: PPOFlowConfig) -> StageConfig:
    arr = cfg.actor_rollout_ref
    n, world = arr.rollout.n, cfg.world_size
    rollout = arr.rollout.model_dump(mode="json")
    actor = arr.actor.model_dump(mode="json") | {
        "effective_clip_ratio_low": arr.actor.effective_clip_ratio_low,
        "effective_clip_ratio_high": arr.actor.effective_clip_ratio_high,
    }
    batching = {
        "train_batch_size": cfg.data.train_batch_size,
        "shuffle": cfg.data.shuffle,
        "seed": cfg.data.seed,
        "truncation": cfg.data.truncation,
        "actor_mini_batch_rows": arr.actor.ppo_mini_batch_size * n // world,
        "critic_mini_batch_rows": (cfg.critic.ppo_mini_batch_size or arr.actor.ppo_mini_batch_size)
        * n
        // world,
    }
    val_rollout = {key: rollout[key] for key in ("name", "prompt_length", "response_length", "val_kwargs")}
    val_rollout["log_generations"] = cfg.trainer.log_val_generations
    return StageConfig(
        rollout=rollout,
        val_rollout=val_rollout,
        batching=batching,
        actor=actor,
        critic=cfg.critic.model_dump(mode="json"),
        algorithm=cfg.algorithm.model_dump(mode="json"),
        reward={
            "weights": cfg.reward.weights,
            "reward_fn_key": cfg.data.reward_fn_key,
            "timeout_s": cfg.reward.timeout_s,
            "on_error": cfg.reward.on_error,
            "gsm8k_method": cfg.reward.gsm8k_method,
            "custom_function": custom_function_section(
                cfg.custom_reward_function.path, cfg.custom_reward_function.name
            ),
        },
        trainer={
            "max_actor_ckpt_to_keep": cfg.trainer.max_actor_ckpt_to_keep,
            "max_critic_ckpt_to_keep": cfg.trainer.max_critic_ckpt_to_keep,
        },
        seed=cfg.trainer.seed,
        use_critic=cfg.use_critic,
        use_reference=cfg.use_reference_policy,
        critic_warmup=cfg.trainer.critic_warmup,
        test_freq=cfg.trainer.test_freq,
        save_freq=cfg.trainer.save_freq,
        val_before_train=cfg.trainer.val_before_train,
    )


def total_training_steps(cfg: PPOFlowConfig, train_rows: int) -> int:
    """trainer.total_training_steps when set, else total_epochs × full batches per epoch (verl)."""
    if cfg.trainer.total_training_steps:
        return cfg.trainer.total_training_steps
    return cfg.trainer.total_epochs * steps_per_epoch(train_rows, cfg.data.train_batch_size)
