"""The `metrics` stage: one row of the step's metrics (verl's names) → iter=N/metrics/; for a step that
only validates (before training, or a validation-only run) the row of validation's metrics."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import torch
from prefect import task

from ppoflow.engine.metrics import (
    compute_data_metrics,
    compute_group_metrics,
    compute_rollout_probs_diff,
    compute_throughput_metrics,
    compute_timing_metrics,
    memory_metrics,
    reduce_update_steps,
)
from ppoflow.tasks.faults import inject_fault
from ppoflow.tasks.pipeline.cache_keys import current_cache_key, stage_cache_key
from ppoflow.tasks.pipeline.run import Run
from ppoflow.tasks.pipeline.settings import MetricsSettings, RewardKL
from ppoflow.tasks.pipeline.states import TIMING_PREFIX, StageResult, StageTimer, StepResults
from ppoflow.tasks.stages.rewards import reward_error_metrics
from ppoflow.tasks.stages.turns import turn_metrics
from ppoflow.tasks.storage.schemas import metrics_table
from ppoflow.tasks.storage.tables import read_table, stage_path, write_table
from ppoflow.tasks.storage.tensors import length_mask, padded_column, policy_mask, token_tensor


def _data_metrics(
    run: Run,
    rollouts: pa.Table,
    reward: StageResult,
    advantage: StageResult,
    settings: MetricsSettings,
    *,
    recomputed: bool,
) -> dict[str, float]:
    adv = read_table(run.path, advantage.ref, clock=run.io)
    width = pc.max(rollouts["response_length"]).as_py() or 0
    mask = policy_mask(rollouts, width)  # multi-turn: 0 on tool tokens
    mask = length_mask(rollouts["response_length"], width) if mask is None else mask
    if "rollout_rs_rejected" in adv.column_names and adv["rollout_rs_rejected"].null_count < len(adv):
        mask = mask * (1.0 - padded_column(adv, "rollout_rs_rejected", width))  # as the update saw it
    rewards = read_table(run.path, reward.ref, clock=run.io)
    scores = torch.tensor(rewards["score"].to_numpy(), dtype=torch.float64)
    metrics = compute_data_metrics(
        scores=scores,
        token_level_rewards=padded_column(adv, "token_level_rewards", width),
        advantages=padded_column(adv, "advantages", width),
        returns=padded_column(adv, "returns", width),
        response_mask=mask,
        prompt_lengths=torch.tensor(rollouts["prompt_length"].to_numpy(), dtype=torch.long),
        max_prompt_length=settings.prompt_length,
        max_response_length=settings.response_length,
        values=token_tensor(adv, "values", width),
        response_lengths=torch.tensor(rollouts["response_length"].to_numpy(), dtype=torch.long),
    )
    metrics |= reward_error_metrics(rewards)
    metrics |= compute_group_metrics(scores, torch.tensor(rollouts["group_id"].to_numpy(), dtype=torch.long))
    metrics |= turn_metrics(rollouts)
    if recomputed:  # verl measures the mismatch where it recomputes old log-probs (not in bypass mode)
        metrics |= compute_rollout_probs_diff(
            padded_column(rollouts, "rollout_log_probs", width),
            padded_column(rollouts, "old_log_probs", width),
            mask,
        )
    return metrics


PER_TOKEN = {
    "gen": "response",
    "ref": "all",
    "values": "all",
    "adv": "all",
    "update_critic": "all",
    "update_actor": "all",
}
"""verl's token counts for timing_per_token_ms: response tokens for generation, prompt + response
tokens for the reference, value, advantage and update passes; none for the others."""


def _token_counts(rollouts: pa.Table) -> dict[str, int]:
    response = int(pc.sum(rollouts["response_length"]).as_py() or 0)
    return {"response": response, "all": response + int(pc.sum(rollouts["prompt_length"]).as_py() or 0)}


def _named_metrics(result: StageResult | None) -> dict[str, float]:
    """The verl-named metrics a stage measured (dynamic sampling's generation batches, decoupled
    rollout correction's rollout_corr/*): its values with a '/' in their name, timers aside."""
    if result is None:
        return {}
    return {k: v for k, v in result.values if "/" in k and not k.startswith(TIMING_PREFIX)}


def _update_metrics(run: Run, result: StageResult | None, role: str) -> dict[str, float]:
    if result is None:
        return {}
    rows = read_table(run.path, result.ref, clock=run.io).to_pylist()
    steps = []
    for row in rows:
        others = dict(row.pop("other_metrics", None) or [])  # already named in full (rollout_corr/…)
        named = {
            f"{role}/{k}": v for k, v in row.items() if k not in ("epoch", "mini_batch") and v is not None
        }
        steps.append(named | others)
    return reduce_update_steps(steps)


@task(name="metrics", task_run_name="metrics-step{step}", cache_key_fn=stage_cache_key)
def metrics(
    run: Run,
    step: int,
    epoch: int,
    stages: StepResults,
    kl: RewardKL,
    settings: MetricsSettings,
) -> StageResult:
    """All of the step's metrics in one row (verl's names) → iter=N/metrics/. Timings are verl's
    timers as the stages measured them (timing_s/gen, …, timing_s/testing) and timing_s/step, the
    sum of the stages' seconds."""
    timer = StageTimer()
    rollouts = read_table(run.path, stages.rollouts.ref, clock=run.io)
    recomputed = any(name == f"{TIMING_PREFIX}old_log_prob" for name, _ in stages.rollouts.values)
    values = _data_metrics(run, rollouts, stages.rewards, stages.advantages, settings, recomputed=recomputed)
    values |= _update_metrics(run, stages.critic_update, "critic") | _update_metrics(
        run, stages.actor_update, "actor"
    )
    values |= dict(stages.validation.values) if stages.validation is not None else {}
    values |= _named_metrics(stages.rollouts) | _named_metrics(stages.advantages)
    if kl.current is not None:  # verl logs both only with algorithm.use_kl_in_reward
        values |= {"actor/reward_kl_penalty": kl.current, "actor/reward_kl_penalty_coeff": kl.coef}
    values |= {"training/global_step": float(step), "training/epoch": float(epoch)}  # epoch: 0-based
    tokens = _token_counts(rollouts)
    done = stages.finished()
    timing: dict[str, float] = {}
    for s in done:  # a verl timer two stages share (reward: reward_model and rewards) is their sum
        for name, seconds in s.values:
            if name.startswith(TIMING_PREFIX):
                timer_name = name.removeprefix(TIMING_PREFIX)
                timing[timer_name] = timing.get(timer_name, 0.0) + seconds
    timing["step"] = sum(s.seconds for s in done)
    values |= compute_timing_metrics(timing, {timer_: tokens[kind] for timer_, kind in PER_TOKEN.items()})
    values |= compute_throughput_metrics(
        total_tokens=tokens["all"], step_seconds=timing["step"], n_devices=settings.n_devices
    )
    values |= memory_metrics()
    inject_fault("metrics", step)
    ref = write_table(metrics_table(values, step), run.path, stage_path(step, "metrics"), clock=run.io)
    return StageResult("metrics", (ref,), current_cache_key(), timer.seconds, tuple(sorted(values.items())))


@task(name="metrics", task_run_name="metrics-step{step}", cache_key_fn=stage_cache_key)
def validation_only_metrics(run: Run, step: int, validation: StageResult) -> StageResult:
    """The row of a step that validates and trains nothing: the validation before training
    (trainer.val_before_train, at the step the model was trained to) or a validation-only run
    (trainer.val_only). Validation's metrics (val-core/…, val-aux/…) only, as verl logs them there:
    no timings, no training/global_step; every other column of the table reads NULL."""
    timer = StageTimer()
    values = {name: v for name, v in validation.values if not name.startswith(TIMING_PREFIX)}
    inject_fault("metrics", step)
    ref = write_table(metrics_table(values, step), run.path, stage_path(step, "metrics"), clock=run.io)
    return StageResult("metrics", (ref,), current_cache_key(), timer.seconds, tuple(sorted(values.items())))
