"""Stage 7: one row of the iteration's metrics (verl's names) → iter=N/metrics/, the manifest,
and a refreshed DuckDB catalog."""

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

from .catalog import refresh_catalog_if_stale
from .common import Run, StageResult, StageTimer, current_cache_key, stage_cache_key
from .reward import reward_error_metrics
from .schemas import metrics_table
from .storage import read_table, stage_path, write_manifest, write_table


def _data_metrics(
    run: Run, rollouts: pa.Table, reward: StageResult, advantage: StageResult, limits: dict
) -> dict[str, float]:
    adv = read_table(run.path, advantage.ref)
    lengths = rollouts["response_length"].to_pylist()
    width = max(lengths, default=0)
    mask = pad_rows([[1.0] * n for n in lengths], width)
    rewards = read_table(run.path, reward.ref)
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


PER_TOKEN = {"rollout": "response", "advantage": "all", "critic_update": "all", "actor_update": "all"}
"""verl's token counts for timing_per_token_ms: response tokens for generation (the rollout stage), prompt +
response tokens for log-prob, value, advantage and update passes; none for reward and validation."""


def _token_counts(rollouts: pa.Table) -> dict[str, int]:
    response = int(pc.sum(rollouts["response_length"]).as_py() or 0)
    return {"response": response, "all": response + int(pc.sum(rollouts["prompt_length"]).as_py() or 0)}


def _update_metrics(run: Run, result: StageResult | None, role: str) -> dict[str, float]:
    if result is None:
        return {}
    rows = read_table(run.path, result.ref).to_pylist()
    steps = [
        {f"{role}/{k}": v for k, v in row.items() if k not in ("epoch", "mini_batch") and v is not None}
        for row in rows
    ]
    return reduce_update_steps(steps)


@task(name="record_metrics", task_run_name="record_metrics-step{step}", cache_key_fn=stage_cache_key)
def metrics_stage(
    run: Run,
    step: int,
    epoch: int,
    rollout: StageResult,
    reward: StageResult,
    advantage: StageResult,
    critic_update: StageResult | None,
    actor_update: StageResult | None,
    validation: StageResult | None,
    kl: dict,
    limits: dict,
    n_devices: int,
) -> StageResult:
    """All of the step's metrics in one row; then the manifest (written last) and the catalog."""
    timer = StageTimer()
    stages = [
        s for s in (rollout, reward, advantage, critic_update, actor_update, validation) if s is not None
    ]
    rollouts = read_table(run.path, rollout.ref)
    metrics = _data_metrics(run, rollouts, reward, advantage, limits)
    metrics |= _update_metrics(run, critic_update, "critic") | _update_metrics(run, actor_update, "actor")
    metrics |= dict(validation.values) if validation is not None else {}
    if kl.get("current") is not None:  # verl logs both only with algorithm.use_kl_in_reward
        metrics |= {"actor/reward_kl_penalty": kl["current"], "actor/reward_kl_penalty_coeff": kl["coef"]}
    metrics |= {"training/global_step": float(step), "training/epoch": float(epoch)}  # epoch: 0-based
    tokens = _token_counts(rollouts)
    timing = {s.stage: s.seconds for s in stages}
    timing["step"] = sum(timing.values())
    metrics |= compute_timing_metrics(timing, {stage: tokens[kind] for stage, kind in PER_TOKEN.items()})
    metrics |= compute_throughput_metrics(
        total_tokens=tokens["all"], step_seconds=timing["step"], n_devices=n_devices
    )
    metrics |= memory_metrics()
    ref = write_table(metrics_table(metrics, step), run.path, stage_path(step, "metrics"))
    key = current_cache_key()
    manifest = {
        s.stage: {
            "refs": list(s.refs),
            "rows": sum(r.rows for r in s.refs),
            "cache_key": s.cache_key,
            "seconds": s.seconds,
        }
        for s in stages
    }
    manifest["metrics"] = {"refs": [ref], "rows": 1, "cache_key": key, "seconds": timer.seconds}
    manifest_ref = write_manifest(run.path, step, manifest)
    refresh_catalog_if_stale(run.path)
    return StageResult("metrics", (ref, manifest_ref), key, timer.seconds, tuple(sorted(metrics.items())))
