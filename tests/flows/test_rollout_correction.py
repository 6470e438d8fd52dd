"""algorithm.rollout_correction.bypass_mode (verl's): the rollout engine's log-probs are the old
log-probs, the actor's old-log-prob pass is skipped, and the setting is part of the rollouts' cache key."""

from __future__ import annotations

import json

import pytest

from ppoflow.tasks.storage.confined_query import query

from .conftest import train
from .test_metrics_sql import assert_metrics_match_rows

ONE_STEP = ["trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.test_freq=0"]
BYPASS = "algorithm.rollout_correction.bypass_mode=true"


def test_the_engine_log_probs_are_the_trainer_log_probs_within_tolerance(small_run):
    """What makes bypass mode sound with the transformers engine: the log-prob it sampled each token
    with is the one the trainer's forward pass recomputes, up to float rounding (KV-cached decoding
    against one whole-sequence pass)."""
    run_dir, _, _ = small_run
    [(largest, tokens)] = query(
        run_dir,
        "SELECT max(abs(rollout_log_probs[i] - old_log_probs[i])), count(*) FROM ("
        "SELECT *, unnest(range(1, len(rollout_log_probs) + 1)) AS i FROM rollouts)",
    )[1]
    assert tokens > 100 and largest < 1e-4


def test_bypass_mode_takes_the_rollout_log_probs_and_skips_the_old_log_prob_pass(prefect_server, tmp_path):
    grpo = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", *ONE_STEP]
    train(tmp_path, *grpo)
    assert "timing_s/old_log_prob" in query(tmp_path, "SELECT * FROM metrics")[0]
    recomputing_key = _rollouts_cache_key(tmp_path)

    train(tmp_path, *grpo, BYPASS)  # the same run directory: the rollouts stage must not come from cache
    assert _rollouts_cache_key(tmp_path) != recomputing_key
    [(rows, same)] = query(
        tmp_path, "SELECT count(*), count(*) FILTER (WHERE old_log_probs = rollout_log_probs) FROM rollouts"
    )[1]
    assert rows == same == 64
    columns = query(tmp_path, "SELECT * FROM metrics")[0]
    assert "timing_s/old_log_prob" not in columns and "timing_s/gen" in columns
    assert not any(c.startswith("training/rollout_probs_diff") for c in columns)  # as verl in bypass mode
    assert "actor/ppo_kl" in columns and "actor/pg_clipfrac" in columns


def _rollouts_cache_key(run_dir) -> str:
    return json.loads((run_dir / "iter=000001/_manifest.json").read_text())["stages"]["rollouts"]["cache_key"]


CORRECTED = [
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=2",
    "algorithm.rollout_correction.rollout_is=token",
    "algorithm.rollout_correction.rollout_is_threshold=1.000001",
    "algorithm.rollout_correction.rollout_rs=token_k2",
    # ½(log ρ)² ≤ 1e-13: |log ρ| above 4.5e-7 (float32 numerics of two passes) is rejected
    "algorithm.rollout_correction.rollout_rs_threshold=1e-13",
    *ONE_STEP,
]


def test_decoupled_correction_weights_and_rejects_tokens_with_the_tables_saying_which_and_why(
    prefect_server, tmp_path
):
    """Decoupled mode takes importance weights and rejection of the old log-probs against the
    rollout's in the advantages stage: the weights and rejections are per-token columns, a query
    answers which responses were rejected and by what, rejected tokens get no advantage, and the
    step's rollout_corr/* metrics agree with the tables."""
    train(tmp_path, *CORRECTED)
    [(rows, weighted, rejected_rows, by_k2)] = query(
        tmp_path,
        "SELECT count(*), count(rollout_is_weights), "
        "count(*) FILTER (WHERE len(rollout_rs_rejected_by) > 0), "
        "count(*) FILTER (WHERE list_contains(rollout_rs_rejected_by, 'token_k2')) FROM advantages",
    )[1]
    assert rows == weighted == 64 and 0 < rejected_rows == by_k2 < rows
    [(rejected, advantage_sum, weight_max, tokens)] = query(
        tmp_path,
        "SELECT count(*) FILTER (WHERE r), sum(abs(a)) FILTER (WHERE r), max(w), count(*) FROM ("
        "SELECT unnest(rollout_rs_rejected) r, unnest(advantages) a, unnest(rollout_is_weights) w "
        "FROM advantages)",
    )[1]
    assert rejected > 0 and advantage_sum == 0.0 and weight_max <= 1.000001
    columns, [row] = query(tmp_path, "SELECT * FROM metrics WHERE iter = 1")
    metrics = dict(zip(columns, row, strict=True))
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(rejected / tokens)
    assert metrics["rollout_corr/rollout_rs_token_k2_seq_masked_fraction"] == pytest.approx(
        rejected_rows / rows
    )
    assert metrics["rollout_corr/rollout_is_max"] <= 1.000001


def test_bypass_modes_reinforce_loss_weighs_by_the_current_policy_and_reports_it(prefect_server, tmp_path):
    """loss_type=reinforce in bypass mode: the bypass_mode loss (−A·log π_θ weighted by truncated
    π_θ/π_rollout), whose rollout_corr/* metrics of the current policy against the rollout's are in
    each actor_update row and in the step's metrics; it reports no clip fraction."""
    train(
        tmp_path,
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=2",
        BYPASS,
        "algorithm.rollout_correction.loss_type=reinforce",
        "algorithm.rollout_correction.rollout_is=sequence",
        *ONE_STEP,
    )
    [(steps, clipfracs, with_corr)] = query(
        tmp_path,
        "SELECT count(*), count(pg_clipfrac), count(*) FILTER (WHERE "
        "other_metrics['rollout_corr/rollout_is_mean'] IS NOT NULL) FROM actor_update",
    )[1]
    assert steps == with_corr == 8 and clipfracs == 0  # the default's 4 epochs × 2 mini-batches
    columns = query(tmp_path, "SELECT * FROM metrics WHERE iter = 1")[0]
    assert "rollout_corr/rollout_is_eff_sample_size" in columns and "actor/pg_clipfrac" not in columns
    assert_metrics_match_rows(tmp_path)  # the step's rollout_corr/* are the means of the rows' maps
