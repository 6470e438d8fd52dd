"""`ppoflow diagnose`'s checks on hand-built metric rows, each at its thresholds' edges, with no
Prefect run: the fitted change, every check in CHECKS, the noise-aware validation_diverges and the
exit code. tests/flows/test_diagnose.py runs them on small real runs of the tiny model."""

from __future__ import annotations

import duckdb
import pytest

from ppoflow.tasks.observe.diagnose import ROW_STATS, exit_code
from ppoflow.tasks.observe.diagnose_checks import CHECKS
from ppoflow.tasks.observe.diagnose_policy import (
    check_aggressive_updates,
    check_entropy,
    check_learning_rate,
    check_policy_not_moving,
    check_reference_kl,
)
from ppoflow.tasks.observe.diagnose_rewards import (
    check_critic_fit,
    check_group_spread,
    check_response_length,
    check_reward_signal,
    check_truncation,
    check_validation_vs_reward,
)
from ppoflow.tasks.observe.diagnose_run import Finding, RunData, fitted_change


def evidence(finding: Finding, name: str) -> tuple[float, ...]:
    return next(e.values for e in finding.evidence if e.metric == name)


# Hand-built runs: metric -> values at iterations 1, 2, …; rows likewise; config as nested keys.


def hand(metrics=None, rows=None, start=1, **settings) -> RunData:
    config: dict = {}
    for key, value in settings.items():
        node = config
        *parents, leaf = key.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    as_iters = {k: {start + i: float(v) for i, v in enumerate(vs)} for k, vs in (metrics or {}).items()}
    row_iters = {k: {start + i: float(v) for i, v in enumerate(vs)} for k, vs in (rows or {}).items()}
    return RunData(as_iters, row_iters, config)


OFF_POLICY = {
    "data__train_batch_size": 32,
    "actor_rollout_ref__actor__ppo_mini_batch_size": 16,
    "actor_rollout_ref__actor__ppo_epochs": 4,
}
ON_POLICY = OFF_POLICY | {
    "actor_rollout_ref__actor__ppo_mini_batch_size": 32,
    "actor_rollout_ref__actor__ppo_epochs": 1,
}


def test_fitted_change_is_the_least_squares_slope_times_the_span():
    assert fitted_change([(0, 1.0), (1, 3.0), (2, 2.0)]) == pytest.approx(1.0)  # slope 0.5 over 2
    assert fitted_change([(1, 0.0), (3, 1.0)]) == pytest.approx(1.0)
    assert fitted_change([(1, 5.0)]) == 0.0


def test_policy_not_moving_edges_and_the_on_policy_case():
    still = {"actor/ppo_kl": [9e-4, -9e-4], "actor/pg_clipfrac": [9e-4, 0.0], "actor/grad_norm": [1.0, 1.0]}
    (finding,) = check_policy_not_moving(hand(still, **OFF_POLICY))
    assert finding.severity == "warning" and "learning rate" in finding.causes[0]
    assert check_policy_not_moving(hand(still | {"actor/ppo_kl": [9e-4, 1e-3]}, **OFF_POLICY)) == []
    assert check_policy_not_moving(hand(still | {"actor/pg_clipfrac": [1e-3, 0]}, **OFF_POLICY)) == []
    (zero_grad,) = check_policy_not_moving(hand(still | {"actor/grad_norm": [0.0, 0.0]}, **OFF_POLICY))
    assert "advantage is 0" in zero_grad.causes[0]
    assert "actor_rollout_ref.actor.optim.lr" not in zero_grad.config_keys
    (expected,) = check_policy_not_moving(hand(still, **ON_POLICY))
    assert expected.severity == "info" and "as expected" in expected.title
    # The update table's row count (one per optimizer step) outranks the config.
    (counted,) = check_policy_not_moving(hand(still, rows={"actor_update/steps": [1, 1]}, **OFF_POLICY))
    assert counted.severity == "info"


def test_aggressive_updates_edges():
    calm = {"actor/ppo_kl": [0.5, 0.1], "actor/pg_clipfrac": [0.3, 0.1]}
    assert check_aggressive_updates(hand(calm)) == []
    (clipped,) = check_aggressive_updates(hand(calm | {"actor/pg_clipfrac": [0.1, 0.3001]}))
    assert clipped.severity == "warning" and "[2]" in clipped.title
    (kl_one,) = check_aggressive_updates(hand(calm | {"actor/ppo_kl": [1.0, 0.1]}))
    assert kl_one.severity == "warning"
    (jump,) = check_aggressive_updates(hand(calm | {"actor/ppo_kl": [1.01, 0.1]}))
    assert jump.severity == "critical"


def test_learning_rate_too_small_needs_a_gradient():
    still = {"actor/ppo_kl": [1e-4, 1e-4], "actor/pg_clipfrac": [0, 0], "actor/lr": [1e-6, 1e-6]}
    (small,) = check_learning_rate(hand(still | {"actor/grad_norm": [1e-3, 1e-3]}, **OFF_POLICY))
    assert "lr 1e-06 is too small" in small.title
    assert small.config_keys == {
        "actor_rollout_ref.actor.optim.lr": "raise it ×10, then watch ppo_kl and pg_clipfrac"
    }
    assert check_learning_rate(hand(still | {"actor/grad_norm": [9.9e-4, 9.9e-4]}, **OFF_POLICY)) == []
    assert check_learning_rate(hand(still | {"actor/grad_norm": [1.0, 1.0]}, **ON_POLICY)) == []


def test_learning_rate_too_large_or_an_exploding_gradient():
    jump = {"actor/ppo_kl": [0.51, 0.01], "actor/lr": [0.05, 0.05]}
    clip = {"actor_rollout_ref__actor__grad_clip": 1.0}
    (large,) = check_learning_rate(hand(jump | {"actor/grad_norm": [10.0, 0.0]}, **clip))
    assert "too large" in large.title and "iteration(s) [1]" in large.title
    (exploding,) = check_learning_rate(hand(jump | {"actor/grad_norm": [10.01, 0.0]}, **clip))
    assert exploding.title.startswith("exploding gradient")
    assert check_learning_rate(hand({"actor/ppo_kl": [0.5, 0.5], "actor/grad_norm": [1, 1]})) == []


def test_reward_signal_edges_and_the_explained_variance_note():
    (everywhere,) = check_reward_signal(
        hand(
            {"critic/vf_explained_var": [-2e5, -1.5e5]},
            rows={"rewards/score_std": [0, 0], "rewards/score_mean": [0, 0]},
        )
    )
    assert everywhere.severity == "critical" and "scores 0 in every iteration" in everywhere.title
    assert evidence(everywhere, "critic/vf_explained_var") == (-2e5, -1.5e5)
    assert any("vf_explained_var is meaningless" in c for c in everywhere.causes)
    (later,) = check_reward_signal(
        hand(rows={"rewards/score_std": [0.4, 9e-7], "rewards/score_mean": [0.5, 1]})
    )
    assert later.severity == "warning" and "scores 1 in iteration(s) [2]" in later.title
    assert not any("explained" in c for c in later.causes)  # no critic, no note
    assert check_reward_signal(hand(rows={"rewards/score_std": [1e-6, 0.3]})) == []


def test_critic_fit_edges():
    returns = {"advantages/returns_var": [0.2, 0.2, 0.2]}
    loss = {"critic/vf_loss": [0.2, 0.2, 0.2]}
    (bad,) = check_critic_fit(hand(loss | {"critic/vf_explained_var": [0.0, -0.11, -0.2]}, rows=returns))
    assert bad.severity == "warning" and "iterations [2, 3]" in bad.title  # iteration 1: untrained critic
    edge = loss | {"critic/vf_explained_var": [0.0, -0.1, -0.2]}
    assert check_critic_fit(hand(edge, rows=returns)) == []
    flat = {"advantages/returns_var": [0.2, 9e-5, 9e-5]}  # the seed's case: no variance, no verdict
    assert check_critic_fit(hand(loss | {"critic/vf_explained_var": [0, -2e5, -2e5]}, rows=flat)) == []
    diverging = {"critic/vf_loss": [1.0, 5.0, 10.0], "critic/vf_explained_var": [0.0, -3.0, -9.0]}
    (blowup,) = check_critic_fit(hand(diverging, rows=returns))
    assert blowup.severity == "critical" and "×10" in blowup.title
    assert "lower" in blowup.config_keys["critic.optim.lr"]


def test_entropy_edges():
    assert check_entropy(hand({"actor/entropy": [0.5, 0.05]})) == []  # exactly a tenth
    (warning,) = check_entropy(hand({"actor/entropy": [0.5, 0.0499, 0.2]}))
    assert warning.severity == "warning" and "iteration 2" in warning.title
    (critical,) = check_entropy(hand({"actor/entropy": [0.005, 9.9e-4]}))
    assert critical.severity == "critical"


def test_response_length_and_truncation_edges():
    assert check_response_length(hand({"response_length/mean": [2.5, 1.25]})) == []
    (short,) = check_response_length(
        hand({"response_length/mean": [2.5, 1.24]}, rows={"rollouts/empty": [0, 0.5]})
    )
    assert "(50% empty)" in short.title
    assert check_truncation(hand(rows={"rollouts/truncated": [0.1, 0.0]})) == []
    (cut,) = check_truncation(hand(rows={"rollouts/truncated": [0.0, 0.1001]}, data__max_response_length=2))
    assert "(2 tokens)" in cut.title and "[2]" in cut.title


def test_reference_kl_edges():
    assert check_reference_kl(hand({"actor/kl_loss": [0.5, 1.0]})) == []
    (rising,) = check_reference_kl(hand({"actor/kl_loss": [0.5, 1.01]}))
    assert rising.severity == "warning" and "actor_rollout_ref.actor.kl_loss_coef" in rising.config_keys
    assert check_reference_kl(hand({"actor/reward_kl_penalty": [6.0, 5.5]})) == []  # falling back
    (penalty,) = check_reference_kl(hand({"actor/reward_kl_penalty": [1.0, 5.01]}))
    assert penalty.severity == "critical" and "algorithm.kl_ctrl.kl_coef" in penalty.config_keys


def test_validation_vs_reward_edges():
    # Rewards on a 0..5 scale: rising means a fitted +0.25 at least, flat means at most +0.05.
    scale = {"rewards/score_range": [5.0, 5.0, 5.0]}
    train_up = {"critic/score/mean": [0.0, 0.125, 0.25]}
    flat_val = {"validation/score_mean": [1.0, 1.0, 1.0, 1.0]}
    (finding,) = check_validation_vs_reward(hand(train_up, rows=scale | flat_val))
    assert "stays flat" in finding.title
    slow_train = {"critic/score/mean": [0.0, 0.12, 0.24]}
    assert check_validation_vs_reward(hand(slow_train, rows=scale | flat_val)) == []
    val_up = {"validation/score_mean": [1.0, 1.0, 1.0, 1.0625]}  # fitted +0.0563 over iterations 0-3
    assert check_validation_vs_reward(hand(train_up, rows=scale | val_up)) == []
    short = {"validation/score_mean": [1.0, 0.5]}
    assert check_validation_vs_reward(hand(train_up, rows=scale | short)) == []


def diverging(train, val, *, train_sem=None, val_sem=None, score_range=1.0, val_range=None) -> RunData:
    """Training reward at iterations 1…, validation from iteration 0 (before training), each with a
    per-iteration standard error as ROW_STATS computes it from the raw rows. `score_range`: one
    value for every iteration, or one per iteration."""
    ranges = score_range if isinstance(score_range, list) else [score_range] * len(train)
    rows = {
        "validation/score_mean": dict(enumerate(val)),
        "rewards/score_range": {i + 1: r for i, r in enumerate(ranges)},
    }
    if val_range is not None:
        rows["validation/score_range"] = dict.fromkeys(range(len(val)), val_range)
    if train_sem is not None:
        rows["rewards/score_sem"] = {i + 1: s for i, s in enumerate(train_sem)}
    if val_sem is not None:
        rows["validation/score_sem"] = dict(enumerate(val_sem))
    return RunData({"critic/score/mean": {i + 1: v for i, v in enumerate(train)}}, rows, {})


def test_validation_vs_reward_is_quiet_on_the_healthy_smoke_runs_noise():
    # The 3-step smoke run (32 training responses per iteration, 100 validation prompts): both
    # trends are within about one standard error, so nothing diverges.
    smoke = diverging(
        [0.465625, 0.409375, 0.521875],
        [0.64, 0.622, 0.622, 0.577],
        train_sem=[0.0794, 0.0768, 0.0807],
        val_sem=[0.0443, 0.0446, 0.0446, 0.0451],
        score_range=0.9,
    )
    assert fitted_change(smoke.series("validation/score_mean")) == pytest.approx(-0.0567)
    assert check_validation_vs_reward(smoke) == []
    # The same series without their standard errors was the false positive.
    noiseless = diverging([0.465625, 0.409375, 0.521875], [0.64, 0.622, 0.622, 0.577], score_range=0.9)
    assert "validation falls" in check_validation_vs_reward(noiseless)[0].title


def test_validation_vs_reward_noise_edges():
    # Validation falls 0.3 (fitted): beyond 2 × 0.149, not beyond 2 × 0.151.
    falling, rising = [0.3, 0.2, 0.1, 0.0], [0.0, 0.5, 1.0]
    (finding,) = check_validation_vs_reward(
        diverging(rising, falling, train_sem=[0.1] * 3, val_sem=[0.149] * 4)
    )
    assert "validation falls (fitted -0.3, standard error 0.15)" in finding.title
    assert evidence(finding, "validation/score_sem") == (0.149,) * 4
    assert (
        check_validation_vs_reward(diverging(rising, falling, train_sem=[0.1] * 3, val_sem=[0.151] * 4)) == []
    )
    # A flat validation: the training rise (0.2) must exceed 2 standard errors on its own.
    flat = [0.5] * 4
    (flat_finding,) = check_validation_vs_reward(
        diverging([0.0, 0.1, 0.2], flat, train_sem=[0.099] * 3, val_sem=[0.0] * 4)
    )
    assert "stays flat" in flat_finding.title
    assert check_validation_vs_reward(diverging([0.0, 0.1, 0.2], flat, train_sem=[0.101] * 3)) == []
    # A validation fall beyond its noise makes the gap: a training rise (+0.12) within its own
    # noise (2 × 0.08) is enough, as in the 32-prompt run below.
    (gap,) = check_validation_vs_reward(
        diverging([0.4, 0.48, 0.52], [0.64, 0.5, 0.45, 0.43, 0.43], train_sem=[0.08] * 3, val_sem=[0.044] * 5)
    )
    assert "the gap widens by" in gap.title
    # Three validation points are too few, however clear the fall.
    assert check_validation_vs_reward(diverging(rising, [0.9, 0.5, 0.1])) == []


def test_validation_vs_reward_reads_a_reward_models_scores_on_their_own_scale():
    # Training scored by a reward model alone (scores span ~7 units an iteration, 11 in one), validation
    # by the rule reward (0 to 1): the docs/MODELS.md run, validation 0.78 → 0.41 over 40 steps while
    # the mean reward-model score rose 0.40 → 0.89. 5% of the training range (0.55) asks more than
    # that rise (+0.36), but validation falls far beyond its noise and the rise is beyond its own.
    train = [0.40 + 0.36 * i / 39 for i in range(40)]
    val = [0.78 - 0.26 * i / 40 for i in range(41)]
    ranges = [6.7] * 39 + [11.0]
    (finding,) = check_validation_vs_reward(
        diverging(train, val, train_sem=[0.058] * 40, val_sem=[0.045] * 41, score_range=ranges, val_range=1.0)
    )
    assert "validation falls (fitted -0.26" in finding.title and "rises (fitted +0.36" in finding.title
    # A rise within its own noise (2 × 0.058) and under 5% of the range is no divergence.
    slow = [0.40 + 0.11 * i / 39 for i in range(40)]
    assert (
        check_validation_vs_reward(
            diverging(
                slow, val, train_sem=[0.058] * 40, val_sem=[0.045] * 41, score_range=ranges, val_range=1.0
            )
        )
        == []
    )
    # Without its standard errors the training rise must reach 5% of its range, as before.
    assert check_validation_vs_reward(diverging(train, val, score_range=ranges, val_range=1.0)) == []
    # A run scored by a reward model is pointed at the reward model, a rule-scored one at its reward.
    assert "custom_reward_function.path" in finding.config_keys
    scored = diverging(
        train, val, train_sem=[0.058] * 40, val_sem=[0.045] * 41, score_range=ranges, val_range=1.0
    )
    scored.config["reward_model"] = {"enable": True, "model": {"path": "models/addition-rm"}}
    (by_model,) = check_validation_vs_reward(scored)
    assert by_model.config_keys["reward_model.model.path"].startswith("models/addition-rm → ")
    assert "reward.weights.rm_score" in by_model.config_keys
    assert "custom_reward_function.path" not in by_model.config_keys


def test_the_training_score_standard_error_counts_prompts_not_responses():
    # Two prompts, two responses each: prompt a scores 1 and 1, prompt b 0 and 0. A prompt's responses
    # share it, so the mean's standard error is that of two per-prompt means (1 and 0): 0.7071 / √2 =
    # 0.5; counted as four independent responses it would be 0.5774 / 2 = 0.2887.
    connection = duckdb.connect()
    connection.execute("CREATE TABLE rewards (iter INT, prompt_id VARCHAR, sample_idx INT, score DOUBLE)")
    connection.executemany(
        "INSERT INTO rewards VALUES (?, ?, ?, ?)",
        [
            (1, "a", 0, 1.0),
            (1, "a", 1, 1.0),
            (1, "b", 0, 0.0),
            (1, "b", 1, 0.0),
            (2, "a", 0, 1.0),
            (2, "b", 0, 0.0),
        ],
    )
    rows = sorted(connection.execute(ROW_STATS["rewards/score_sem"]).fetchall())
    assert rows == [(1, pytest.approx(0.5)), (2, pytest.approx(0.5))]
    # Validation likewise (val_kwargs.n samples of a prompt).
    connection.execute("CREATE TABLE validation AS SELECT * FROM rewards")
    rows = sorted(connection.execute(ROW_STATS["validation/score_sem"]).fetchall())
    assert rows == [(1, pytest.approx(0.5)), (2, pytest.approx(0.5))]


def test_validation_flat_band_is_a_share_of_the_validation_range():
    # Training on a 0..5 scale rising +0.5; validation (0..1) falls 0.03: flat on the training
    # scale (±0.05), a fall on its own (±0.01).
    train, val = [0.0, 0.25, 0.5], [0.5, 0.49, 0.48, 0.47]
    assert "stays flat" in check_validation_vs_reward(diverging(train, val, score_range=5.0))[0].title
    (fall,) = check_validation_vs_reward(diverging(train, val, score_range=5.0, val_range=1.0))
    assert "validation falls (fitted -0.03)" in fall.title


def test_group_spread_edges():
    grpo = {"algorithm__adv_estimator": "grpo", "actor_rollout_ref__rollout__n": 4}
    half = {"critic/score/zero_spread_group_ratio": [0.5, 0.5]}
    assert check_group_spread(hand(half, **grpo)) == []
    (most,) = check_group_spread(hand({"critic/score/zero_spread_group_ratio": [0.75, 0.5]}, **grpo))
    assert most.severity == "warning" and "62%" in most.title
    every = {"critic/score/zero_spread_group_ratio": [1.0, 1.0]}
    assert check_group_spread(hand(every, **grpo))[0].severity == "critical"
    assert check_group_spread(hand(every, **grpo | {"algorithm__adv_estimator": "gae"})) == []
    assert check_group_spread(hand(every, **grpo | {"actor_rollout_ref__rollout__n": 1})) == []


def test_exit_code_counts_warnings_not_infos():
    info = Finding("x", "info", "t", (), ())
    assert exit_code([]) == 0 and exit_code([info]) == 0
    assert exit_code([info, Finding("y", "warning", "t", (), ())]) == 1
    assert exit_code([Finding("z", "critical", "t", (), ())]) == 1


def test_every_check_is_quiet_on_an_empty_run():
    assert [f for check in CHECKS for f in check(hand())] == []


def test_a_constant_reward_points_at_the_weights_only_when_they_are_all_zero():
    flat = {"rewards/score_std": [0, 0], "rewards/score_mean": [0, 0]}
    (zeroed,) = check_reward_signal(hand(rows=flat, reward__weights={"correctness": 0.0, "format": 0.0}))
    assert "reward.weights" in zeroed.config_keys
    (weighted,) = check_reward_signal(hand(rows=flat, reward__weights={"correctness": 0.9, "format": 0.1}))
    assert (
        "reward.weights" not in weighted.config_keys and "custom_reward_function.path" in weighted.config_keys
    )


def test_tool_errors_fire_above_a_fifth_of_the_calls_and_name_the_keys():
    from ppoflow.tasks.observe.diagnose_tools import check_tool_errors

    assert check_tool_errors(hand(rows={"turns/tool_error_rate": [0.5, 0.2, 0.0]})) != []
    assert check_tool_errors(hand(rows={"turns/tool_error_rate": [0.2, 0.2, 0.0]})) == []
    assert check_tool_errors(hand()) == []  # a single-turn run has no turns
    (finding,) = check_tool_errors(hand(rows={"turns/tool_error_rate": [0.05, 0.3]}))
    assert "30% of tool calls failed" in finding.title and "iteration(s) [2]" in finding.title
    assert "actor_rollout_ref.rollout.multi_turn.tool_timeout_s" in finding.config_keys


def test_conversations_cut_by_a_turn_limit_or_an_unread_tool_result():
    from ppoflow.tasks.observe.diagnose_tools import check_conversations_cut

    assert check_conversations_cut(hand(rows={"turns/turn_limit_rate": [0.1, 0.0]})) == []
    (limit,) = check_conversations_cut(
        hand(
            rows={"turns/turn_limit_rate": [0.0, 0.4]},
            **{"actor_rollout_ref__rollout__multi_turn__max_assistant_turns": 2},
        )
    )
    assert "40% of responses end inside the conversation" in limit.title
    assert limit.config_keys["actor_rollout_ref.rollout.multi_turn.max_assistant_turns"] == "2 → raise it"
    (unread,) = check_conversations_cut(hand(rows={"turns/unread_tool_turn_rate": [0.25]}))
    assert "25%" in unread.title and "iteration(s) [1]" in unread.title
