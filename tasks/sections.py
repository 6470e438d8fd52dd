"""The config each stage receives: only its own sections, as plain dicts, with derived sizes
resolved once. A change to one section changes only the cache keys of the stages that read it."""

from __future__ import annotations

from dataclasses import dataclass

from ppoflow.conf import PPOFlowConfig
from ppoflow.engine.data import steps_per_epoch

from .reward_runner import custom_function_section
from .rollout import sampling_params

ROLLOUT_KEYS = (
    "name",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "do_sample",
    "prompt_length",
    "response_length",
    "log_prob_micro_batch_size_per_gpu",
)
"""What generating training rollouts reads (validation settings and vLLM knobs stay out of its key)."""


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
    rollout_seed: int
    use_critic: bool
    use_reference: bool
    critic_warmup: int
    test_freq: int
    save_freq: int
    val_before_train: bool
    logit_temperature: float
    n_devices: int


def stage_config(cfg: PPOFlowConfig) -> StageConfig:
    if cfg.algorithm.adv_estimator == "remax":
        raise ValueError(
            "algorithm.adv_estimator=remax needs an extra greedy generation per prompt for its baseline, "
            "which the pipeline does not run yet (engine.advantages.compute_remax_advantage exists); "
            "use grpo, rloo, reinforce_plus_plus(_baseline) or gae"
        )
    arr = cfg.actor_rollout_ref
    # Updates run in one process, so a mini-batch is all of its mini·n responses (verl splits it
    # over world_size ranks; the number of optimizer steps is the same).
    n = arr.rollout.n
    full_rollout = arr.rollout.model_dump(mode="json")
    rollout = {key: full_rollout[key] for key in ROLLOUT_KEYS}
    rollout["ref_log_prob_micro_batch_size_per_gpu"] = arr.ref.log_prob_micro_batch_size_per_gpu
    actor = arr.actor.model_dump(mode="json") | {
        "effective_clip_ratio_low": arr.actor.effective_clip_ratio_low,
        "effective_clip_ratio_high": arr.actor.effective_clip_ratio_high,
    }
    batching = {
        "train_batch_size": cfg.data.train_batch_size,
        "shuffle": cfg.data.shuffle,
        "seed": cfg.data.seed,
        "truncation": cfg.data.truncation,
        "actor_mini_batch_rows": arr.actor.ppo_mini_batch_size * n,
        "critic_mini_batch_rows": (cfg.critic.ppo_mini_batch_size or arr.actor.ppo_mini_batch_size) * n,
    }
    val_rollout = {
        key: full_rollout[key] for key in ("name", "prompt_length", "response_length", "val_kwargs")
    }
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
        rollout_seed=cfg.trainer.seed if arr.rollout.seed is None else arr.rollout.seed,
        use_critic=cfg.use_critic,
        use_reference=cfg.use_reference_policy,
        critic_warmup=cfg.trainer.critic_warmup,
        test_freq=cfg.trainer.test_freq,
        save_freq=cfg.trainer.save_freq,
        val_before_train=cfg.trainer.val_before_train,
        # the temperature old_log_probs were computed at (1.0 for greedy rollouts)
        logit_temperature=sampling_params(rollout, validation=False).logit_temperature,
        n_devices=1,  # updates run in one process
    )


MAX_UNSAVED_STEPS = 50
"""A checkpoint at least this often, whatever trainer.save_freq says, so that a state to rebuild by
replay is never more than this many updates away from one on disk."""


def checkpoint_due(step: int, total: int, save_freq: int) -> bool:
    """trainer.save_freq (≤ 0: only at the end, as verl's -1), the last step, and every
    MAX_UNSAVED_STEPS steps."""
    return (save_freq > 0 and step % save_freq == 0) or step == total or step % MAX_UNSAVED_STEPS == 0


def total_training_steps(cfg: PPOFlowConfig, train_rows: int) -> int:
    """trainer.total_training_steps when set, else total_epochs × full batches per epoch (verl)."""
    if cfg.trainer.total_training_steps:
        return cfg.trainer.total_training_steps
    return cfg.trainer.total_epochs * steps_per_epoch(train_rows, cfg.data.train_batch_size)
