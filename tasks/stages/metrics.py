"""The `metrics` stage: one row of the step's metrics (verl's names) → iter=N/metrics/."""

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
from ppoflow.engine.ppo import pad_rows
from ppoflow.tasks.faults import inject_fault
from ppoflow.tasks.run import Run
from ppoflow.tasks.stages.rewards import reward_error_metrics
from ppoflow.tasks.storage.cache_keys import current_cache_key, stage_cache_key
from ppoflow.tasks.storage.schemas import metrics_table
from ppoflow.tasks.storage.states import TIMING_PREFIX, StageResult, StageTimer, StepResults
from ppoflow.tasks.storage.tables import read_table, stage_path, write_table


def _data_metrics(
    run: Run, rollouts: pa.Table, reward: StageResult, advantage: StageResult, limits: dict
) -> dict[str, float]:
    adv = read_table(run.path, advantage.ref, clock=run.io)
    lengths = rollouts["response_length"].to_pylist()
    width = max(lengths, default=0)
    mask = pad_rows([[1.0] * n for n in lengths], width)
    rewards = read_table(run.path, reward.ref, clock=run.io)
    scores = torch.tensor(rewards["score"].to_pylist(), dtype=torch.float64)
    values = adv["values"].to_pylist()
    metrics = compute_data_metrics(
        scores=scores,
        token_level_rewards=pad_rows(adv["token_level_rewards"].to_pylist(), width),
        advantages=pad_rows(adv["advantages"].to_pylist(), width),
        returns=pad_rows(adv["returns"].to_pylist(), width),
        response_mask=mask,
        prompt_lengths=torch.tensor(rollouts["prompt_length"].to_pylist()),
        max_prompt_length=limits["prompt_length"],
        max_response_length=limits["response_length"],
        values=None if values[0] is None else pad_rows(values, width),
    )
    metrics |= reward_error_metrics(rewards)
    metrics |= compute_group_metrics(scores, torch.tensor(rollouts["group_id"].to_pylist()))
    metrics |= compute_rollout_probs_diff(
        pad_rows(rollouts["rollout_log_probs"].to_pylist(), width),
        pad_rows(rollouts["old_log_probs"].to_pylist(), width),
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


def _update_metrics(run: Run, result: StageResult | None, role: str) -> dict[str, float]:
    if result is None:
        return {}
    rows = read_table(run.path, result.ref, clock=run.io).to_pylist()
    steps = [
        {f"{role}/{k}": v for k, v in row.items() if k not in ("epoch", "mini_batch") and v is not None}
        for row in rows
    ]
    return reduce_update_steps(steps)


@task(name="metrics", task_run_name="metrics-step{step}", cache_key_fn=stage_cache_key)
def metrics(
    run: Run,
    step: int,
    epoch: int,
    stages: StepResults,
    kl: dict,
    limits: dict,
    n_devices: int,
) -> StageResult:
    """All of the step's metrics in one row (verl's names) → iter=N/metrics/. Timings are verl's
    timers as the stages measured them (timing_s/gen, …, timing_s/testing) and timing_s/step, the
    sum of the stages' seconds."""
    timer = StageTimer()
    rollouts = read_table(run.path, stages.rollouts.ref, clock=run.io)
    values = _data_metrics(run, rollouts, stages.rewards, stages.advantages, limits)
    values |= _update_metrics(run, stages.critic_update, "critic") | _update_metrics(
        run, stages.actor_update, "actor"
    )
    values |= dict(stages.validation.values) if stages.validation is not None else {}
    if kl.get("current") is not None:  # verl logs both only with algorithm.use_kl_in_reward
        values |= {"actor/reward_kl_penalty": kl["current"], "actor/reward_kl_penalty_coeff": kl["coef"]}
    values |= {"training/global_step": float(step), "training/epoch": float(epoch)}  # epoch: 0-based
    tokens = _token_counts(rollouts)
    done = stages.finished()
    timing = {
        name.removeprefix(TIMING_PREFIX): seconds
        for s in done
        for name, seconds in s.values
        if name.startswith(TIMING_PREFIX)
    }
    timing["step"] = sum(s.seconds for s in done)
    values |= compute_timing_metrics(timing, {timer_: tokens[kind] for timer_, kind in PER_TOKEN.items()})
    values |= compute_throughput_metrics(
        total_tokens=tokens["all"], step_seconds=timing["step"], n_devices=n_devices
    )
    values |= memory_metrics()
    inject_fault("metrics", step)
    ref = write_table(metrics_table(values, step), run.path, stage_path(step, "metrics"), clock=run.io)
    return StageResult("metrics", (ref,), current_cache_key(), timer.seconds, tuple(sorted(values.items())))
