"""The `advantages` stage: critic values, KL-in-reward and advantages →
iter=N/advantages/part-00000.parquet."""

from __future__ import annotations

import time

import pyarrow as pa
import torch
from prefect import task

from ppoflow.engine.kl import kl_penalty
from ppoflow.engine.pf_ppo import pf_ppo_resample_indices
from ppoflow.engine.ppo import StepTensors, compute_advantage_stage, unpad
from ppoflow.engine.rollout_correction import Correction
from ppoflow.tasks.faults import inject_fault
from ppoflow.tasks.pipeline.cache_keys import current_cache_key, stage_cache_key
from ppoflow.tasks.pipeline.run import Run
from ppoflow.tasks.pipeline.settings import AdvantageStageSettings, PFPPOSettings
from ppoflow.tasks.pipeline.states import ModelState, StageResult, StageTimer, timing_values
from ppoflow.tasks.storage.schemas import SCHEMAS
from ppoflow.tasks.storage.tables import ArtifactRef, read_table, stage_path, write_table
from ppoflow.tasks.storage.tensors import padded_column, sequence_batch, token_tensor


@task(name="advantages", task_run_name="advantages-step{step}", cache_key_fn=stage_cache_key)
def advantages(
    run: Run,
    step: int,
    actor: ModelState,
    critic: ModelState | None,
    rollouts: ArtifactRef,
    rewards: ArtifactRef,
    kl_coef: float,
    settings: AdvantageStageSettings,
) -> StageResult:
    """Values V(s_t) from the critic (GAE only), token-level rewards (minus β·KL when
    algorithm.use_kl_in_reward), then the configured estimator's advantages and returns. Reports
    verl's timers values and adv."""
    timer = StageTimer()
    table = read_table(run.path, rollouts, clock=run.io)
    scored = read_table(run.path, rewards, clock=run.io)
    scores = torch.tensor(scored["score"].to_pylist(), dtype=torch.float32)
    batch = sequence_batch(table, run.models.tokenizer(run, actor).pad_token_id)
    width, mask = batch.response_ids.shape[1], batch.response_mask
    old = token_tensor(table, "old_log_probs", width)
    ref = token_tensor(table, "ref_log_probs", width)
    values, phases = None, {}
    if critic is not None:
        started = time.perf_counter()
        values = run.models.values(run, critic, batch, batching=settings.values_batching)
        phases["values"] = time.perf_counter() - started
    estimator = settings.estimator
    needs = estimator.estimator.needs
    step_tensors = StepTensors(
        response_mask=mask,
        old_log_probs=old,
        ref_log_probs=ref,
        rollout_log_probs=token_tensor(table, "rollout_log_probs", width),
        values=values,
        group_id=torch.tensor(table["group_id"].to_pylist()),
        reward_baselines=_reward_baselines(scored, "reward_baselines" in needs),
        sum_pi_squared=_sum_pi_squared(table, width) if "sum_pi_squared" in needs else None,
        reward_components=_components(scored) if "reward_components" in needs else None,
    )
    result = compute_advantage_stage(scores, step_tensors, settings=estimator, kl_coef=kl_coef)
    kl = kl_penalty(old, ref, estimator.kl_penalty) * mask if ref is not None else None
    correction = result.correction
    columns = {
        "prompt_id": table["prompt_id"],
        "sample_idx": table["sample_idx"],
        "values": unpad(values, batch) if values is not None else [None] * table.num_rows,
        "token_level_rewards": unpad(result.token_level_rewards, batch),
        "advantages": unpad(result.advantages, batch),
        "returns": unpad(result.returns, batch),
        "kl": unpad(kl, batch) if kl is not None else [None] * table.num_rows,
        "train_weight": _train_weights(scores, settings.pf_ppo, settings.seed * 1_000_003 + step),
        **_correction_columns(correction, batch, table.num_rows),
    }
    inject_fault("advantages", step)
    table_out = pa.Table.from_pydict(columns, schema=SCHEMAS["advantages"])
    ref_out = write_table(
        table_out, run.path, stage_path(step, "advantages"), SCHEMAS["advantages"], clock=run.io
    )
    seconds = timer.seconds  # read once: the timers add up to the stage's seconds
    phases["adv"] = seconds - phases.get("values", 0.0)
    values_out = (("current_kl", result.current_kl),) if result.current_kl is not None else ()
    values_out += tuple(sorted(correction.metrics.items())) if correction is not None else ()
    return StageResult(
        "advantages", (ref_out,), current_cache_key(), seconds, values_out + timing_values(phases)
    )


def _correction_columns(correction: Correction | None, batch, rows: int) -> dict[str, list]:
    """rollout_is_weights, rollout_rs_rejected and rollout_rs_rejected_by of each row (null where
    the run has no importance sampling, or no rejection)."""
    nothing = [None] * rows
    if correction is None:
        return {
            "rollout_is_weights": nothing,
            "rollout_rs_rejected": nothing,
            "rollout_rs_rejected_by": nothing,
        }
    weights = unpad(correction.weights, batch) if correction.weights is not None else nothing
    if not correction.rejecting:
        return {
            "rollout_is_weights": weights,
            "rollout_rs_rejected": nothing,
            "rollout_rs_rejected_by": nothing,
        }
    rejected = (batch.response_mask != 0) & (correction.response_mask == 0)
    return {
        "rollout_is_weights": weights,
        "rollout_rs_rejected": [[bool(v) for v in row] for row in unpad(rejected.float(), batch)],
        "rollout_rs_rejected_by": correction.rejected_by,
    }


def _sum_pi_squared(table: pa.Table, width: int) -> torch.Tensor:
    if "sum_pi_squared" not in table.column_names or table["sum_pi_squared"].null_count == len(table):
        raise ValueError(
            "this estimator needs rollouts.sum_pi_squared (Σπ² of each token from the old-log-prob "
            "pass), but this step's rollouts were generated without it"
        )
    return padded_column(table, "sum_pi_squared", width)


def _components(scored: pa.Table) -> dict[str, torch.Tensor]:
    """Each reward component as a (N,) tensor; a row that lacks one (a failed row) counts 0."""
    rows = [dict(c) for c in scored["components"].to_pylist()]
    names = sorted({name for row in rows for name in row})
    return {name: torch.tensor([row.get(name, 0.0) for row in rows], dtype=torch.float64) for name in names}


def _reward_baselines(scored: pa.Table, needed: bool) -> torch.Tensor | None:
    """ReMax's baseline of each row (rewards.baseline_score, the score of the prompt's greedy
    response); None for the other estimators."""
    if not needed:
        return None
    baselines = scored["baseline_score"].to_pylist()
    if None in baselines:
        raise ValueError(
            "algorithm.adv_estimator=remax needs rewards.baseline_score (the reward of each prompt's "
            "greedy response), but this step's rollouts were generated without greedy responses"
        )
    return torch.tensor(baselines, dtype=torch.float32)


def _train_weights(scores: torch.Tensor, pf_ppo: PFPPOSettings | None, seed: int) -> list[int]:
    """1 per row, or PF-PPO's resample counts (rows drawn ∝ a weight of their score)."""
    if pf_ppo is None:
        return [1] * len(scores)
    picks = pf_ppo_resample_indices(
        scores,
        reweight_method=pf_ppo.reweight_method,
        weight_pow=pf_ppo.weight_pow,
        generator=torch.Generator().manual_seed(seed),
    )
    return torch.bincount(picks, minlength=len(scores)).tolist()
