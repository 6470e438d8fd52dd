"""algorithm.adv_estimator=remax through the flow: the rollouts stage also decodes every prompt greedily,
the rewards stage scores that response as the baseline, and each token's advantage is the response's
score minus its prompt's baseline score (verl's compute_remax_outcome_advantage; no KL in the reward)."""

from __future__ import annotations

import pytest

from ppoflow.tasks.storage.catalog import check_invariants
from ppoflow.tasks.storage.confined_query import query

from .conftest import train
from .test_train_flow import task_states

REMAX = ["algorithm.adv_estimator=remax", "actor_rollout_ref.rollout.n=2", "trainer.test_freq=2"]


@pytest.fixture(scope="module")
def remax_run(prefect_server, tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("remax")
    summary, flow_run_id = train(run_dir, *REMAX)
    return run_dir, summary, flow_run_id


def test_each_advantage_is_the_score_minus_the_greedy_baseline_score(remax_run):
    run_dir, _, _ = remax_run
    columns, rows = query(
        run_dir,
        "SELECT r.score, r.baseline_score, a.advantages, a.returns FROM rewards r "
        "JOIN advantages a USING (iter, prompt_id, sample_idx) ORDER BY iter, prompt_id, sample_idx",
    )
    assert len(rows) == 2 * 32 * 2
    for score, baseline, advantages, returns in rows:
        assert advantages == pytest.approx([score - baseline] * len(advantages), abs=1e-6)
        assert returns == pytest.approx([score] * len(returns), abs=1e-6)
    assert {score > baseline for score, baseline, _, _ in rows} == {True, False}  # both signs occur
    spread = "SELECT count(DISTINCT baseline_score) FROM rewards GROUP BY iter, prompt_id"
    assert {n for (n,) in query(run_dir, spread)[1]} == {1}  # one baseline per prompt
    assert query(run_dir, "SELECT count(*) FROM critic_update")[1] == [(0,)]
    assert check_invariants(run_dir) == {}


def test_the_baseline_is_the_greedy_answer_of_the_actor_that_sampled(remax_run):
    """Step 1 samples with the base actor, which validation at step 0 decoded greedily: for the same
    prompt text, the baseline response and its score are that validation answer and its score."""
    run_dir, _, _ = remax_run
    _, rows = query(
        run_dir,
        "SELECT o.baseline_response_text, v.response_text, r.baseline_score, v.score "
        "FROM rollouts o JOIN rewards r USING (iter, prompt_id, sample_idx) "
        "JOIN validation v ON v.iter = 0 AND v.prompt_text = o.prompt_text WHERE o.iter = 1",
    )
    assert len(rows) == 32 * 2
    for baseline_text, greedy_text, baseline_score, greedy_score in rows:
        assert (baseline_text, baseline_score) == (greedy_text, greedy_score)


def test_a_rerun_serves_the_baselines_from_cache(remax_run):
    run_dir, summary, first_id = remax_run
    again, second_id = train(run_dir, *REMAX)
    states = task_states(second_id, expected=len(task_states(first_id)))
    assert set(states.values()) == {"Cached"}
    assert again["val_scores"] == summary["val_scores"]
