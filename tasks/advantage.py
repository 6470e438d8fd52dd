"""Stage 3: critic values, KL-in-reward and advantages → iter=N/advantage/part-00000.parquet."""

from __future__ import annotations

import pyarrow as pa
import torch
from prefect import task

from ppoflow.engine.forward import compute_values
from ppoflow.engine.kl import kl_penalty
from ppoflow.engine.pf_ppo import pf_ppo_resample_indices
from ppoflow.engine.ppo import AdvantageSettings, compute_advantage_stage, unpad

from .batches import sequence_batch, token_tensor
from .common import ModelState, Run, StageResult, StageTimer, current_cache_key, stage_cache_key
from .faults import inject_fault
from .models import model_of, tokenizer_of
from .schemas import SCHEMAS
from .storage import ArtifactRef, read_table, stage_path, write_table


@task(name="compute_advantages", task_run_name="compute_advantages-step{step}", cache_key_fn=stage_cache_key)
def advantage_stage(
    run: Run,
    step: int,
    actor: ModelState,
    critic: ModelState | None,
    rollouts: ArtifactRef,
    rewards: ArtifactRef,
    algorithm: dict,
    kl_coef: float,
    values_micro_batch: int,
    seed: int,
) -> StageResult:
    """Values V(s_t) from the critic (GAE only), token-level rewards (minus β·KL when
    algorithm.use_kl_in_reward), then the configured estimator's advantages and returns."""
    timer = StageTimer()
    table = read_table(run.path, rollouts)
    scores = torch.tensor(read_table(run.path, rewards)["score"].to_pylist(), dtype=torch.float32)
    batch = sequence_batch(table, tokenizer_of(run, actor).pad_token_id)
    width, mask = batch.response_ids.shape[1], batch.response_mask
    old = token_tensor(table, "old_log_probs", width)
    ref = token_tensor(table, "ref_log_probs", width)
    values = None
    if critic is not None:
        values = compute_values(model_of(run, critic), batch, micro_batch_size=values_micro_batch)
    settings = AdvantageSettings(
        adv_estimator=algorithm["adv_estimator"],
        gamma=algorithm["gamma"],
        lam=algorithm["lam"],
        norm_adv_by_std_in_grpo=algorithm["norm_adv_by_std_in_grpo"],
        use_kl_in_reward=algorithm["use_kl_in_reward"],
        kl_penalty=algorithm["kl_penalty"],
    )
    result = compute_advantage_stage(
        scores,
        mask,
        settings=settings,
        kl_coef=kl_coef,
        old_log_probs=old,
        ref_log_probs=ref,
        values=values,
        group_id=torch.tensor(table["group_id"].to_pylist()),
    )
    kl = kl_penalty(old, ref, algorithm["kl_penalty"]) * mask if ref is not None else None
    columns = {
        "prompt_id": table["prompt_id"],
        "sample_idx": table["sample_idx"],
        "values": unpad(values, mask) if values is not None else [None] * table.num_rows,
        "token_level_rewards": unpad(result.token_level_rewards, mask),
        "advantages": unpad(result.advantages, mask),
        "returns": unpad(result.returns, mask),
        "kl": unpad(kl, mask) if kl is not None else [None] * table.num_rows,
        "train_weight": _train_weights(scores, algorithm, seed * 1_000_003 + step),
    }
    inject_fault("advantage", step)
    table_out = pa.Table.from_pydict(columns, schema=SCHEMAS["advantages"])
    ref_out = write_table(table_out, run.path, stage_path(step, "advantage"), SCHEMAS["advantages"])
    values_out = (("current_kl", result.current_kl),) if result.current_kl is not None else ()
    return StageResult("advantage", (ref_out,), current_cache_key(), timer.seconds, values_out)


def _train_weights(scores: torch.Tensor, algorithm: dict, seed: int) -> list[int]:
    """1 per row, or PF-PPO's resample counts (rows drawn ∝ a weight of their score)."""
    if not algorithm["use_pf_ppo"]:
        return [1] * len(scores)
    pf = algorithm["pf_ppo"]
    picks = pf_ppo_resample_indices(
        scores,
        reweight_method=pf["reweight_method"],
        weight_pow=pf["weight_pow"],
        generator=torch.Generator().manual_seed(seed),
    )
    return torch.bincount(picks, minlength=len(scores)).tolist()
