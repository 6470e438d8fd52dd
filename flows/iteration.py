"""One PPO iteration: a plain function calling one task per stage (a subflow would cost ~1 s)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ppoflow.tasks.advantage import advantage_stage
from ppoflow.tasks.common import ModelState, Run, StageResult, TrainState
from ppoflow.tasks.kl_control import next_kl_coef
from ppoflow.tasks.metrics import metrics_stage
from ppoflow.tasks.models import schedule_horizon
from ppoflow.tasks.results import run_stage
from ppoflow.tasks.reward import reward_stage
from ppoflow.tasks.rollout import rollout_stage
from ppoflow.tasks.sections import StageConfig, checkpoint_due
from ppoflow.tasks.update import actor_update_stage, critic_update_stage
from ppoflow.tasks.validation import validation_stage


@dataclass(frozen=True)
class Datasets:
    train: StageResult | None  # None when only validating (trainer.val_only)
    val: StageResult


def validate(
    run: Run, sc: StageConfig, step: int, actor: ModelState, data: Datasets
) -> tuple[StageResult, bool]:
    """The validation stage of `step`; returns (result, was_cached)."""
    return run_stage(
        validation_stage,
        run,
        step=step,
        actor=actor,
        prompts=data.val.ref,
        val_rollout=sc.val_rollout,
        truncation=sc.batching["truncation"],
        reward=sc.reward,
    )


def ppo_iteration(
    run: Run, sc: StageConfig, step: int, total: int, state: TrainState, data: Datasets, epoch: int
) -> tuple[TrainState, StageResult, bool]:
    """Stages 1–7 of training step `step` (of `total`), whose batch comes from pass `epoch` (0-based).
    Returns the next state, the metrics, and whether every stage was served from cache."""
    save = checkpoint_due(step, total, sc.save_freq)
    cached: list[bool] = []

    def stage(task, **parameters):
        result, was_cached = run_stage(task, run, **parameters)
        cached.append(was_cached)
        return result

    rollout = stage(
        rollout_stage,
        step=step,
        actor=state.actor,
        reference=state.reference,
        prompts=data.train.ref,
        rollout=sc.rollout,
        batching=sc.batching,
        seed=sc.rollout_seed,
    )
    reward = stage(reward_stage, step=step, rollouts=rollout.ref, prompts=data.train.ref, reward=sc.reward)
    advantage = stage(
        advantage_stage,
        step=step,
        actor=state.actor,
        critic=state.critic,
        rollouts=rollout.ref,
        rewards=reward.ref,
        algorithm=sc.algorithm,
        kl_coef=state.kl_coef,
        values_micro_batch=sc.critic["forward_micro_batch_size_per_gpu"],
        seed=sc.seed,
    )
    critic_update = actor_update = None
    critic, actor = state.critic, state.actor
    if critic is not None:
        critic_update, critic = stage(
            critic_update_stage,
            step=step,
            critic=critic,
            rollouts=rollout.ref,
            advantages=advantage.ref,
            critic_config=sc.critic,
            batching=sc.batching,
            trainer=sc.trainer,
            total_steps=schedule_horizon(sc.critic, total),
            save=save,
        )
    if step >= sc.critic_warmup:  # verl: the actor updates once critic_warmup <= global step
        actor_update, actor = stage(
            actor_update_stage,
            step=step,
            actor=actor,
            rollouts=rollout.ref,
            advantages=advantage.ref,
            actor_config=sc.actor,
            temperature=sc.logit_temperature,
            batching=sc.batching,
            trainer=sc.trainer,
            total_steps=schedule_horizon(sc.actor, total),
            save=save,
        )
    validation = None
    if sc.test_freq > 0 and (step % sc.test_freq == 0 or step == total):
        validation, was_cached = validate(run, sc, step, actor, data)
        cached.append(was_cached)
    current_kl = dict(advantage.values).get("current_kl")
    metrics = stage(
        metrics_stage,
        step=step,
        epoch=epoch,
        rollout=rollout,
        reward=reward,
        advantage=advantage,
        critic_update=critic_update,
        actor_update=actor_update,
        validation=validation,
        kl={"coef": state.kl_coef, "current": current_kl},
        limits={k: sc.rollout[k] for k in ("prompt_length", "response_length")},
        n_devices=sc.n_devices,
    )
    kl_coef = next_kl_coef(sc.algorithm["kl_ctrl"], state.kl_coef, current_kl, rollout.ref.rows)
    return replace(state, actor=actor, critic=critic, kl_coef=kl_coef), metrics, all(cached)
