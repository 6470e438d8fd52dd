"""algorithm.rollout_correction.bypass_mode (verl's): the rollout engine's log-probs are the old
log-probs, the actor's old-log-prob pass is skipped, and the setting is part of the rollouts' cache key."""

from __future__ import annotations

import json

import pytest

from ppoflow.conf.loader import load_config
from ppoflow.conf.schema_common import ConfigError
from ppoflow.tasks.storage.confined_query import query

from .conftest import train

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


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algorithm.rollout_correction.rollout_is=sequence", "importance-sampling correction"),
        ("algorithm.rollout_correction.rollout_rs=token_k1", "rejection sampling"),
    ],
)
def test_importance_and_rejection_sampling_are_refused(override, message):
    with pytest.raises(ConfigError, match=f"algorithm.rollout_correction.*{message}"):
        load_config(None, [override])


def test_the_reinforce_loss_of_bypass_mode_is_refused_and_loss_type_alone_is_inert():
    with pytest.raises(ConfigError, match="loss_type.*use ppo_clip"):
        load_config(None, [BYPASS, "algorithm.rollout_correction.loss_type=reinforce"])
    cfg = load_config(None, ["algorithm.rollout_correction.loss_type=reinforce"])  # not in bypass mode
    assert not cfg.algorithm.rollout_correction.bypass_mode
