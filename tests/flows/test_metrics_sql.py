"""Every metric of the metrics table, recomputed from the run's rows with SQL (DESIGN.md: "Metrics in
the metrics table can be recomputed from these rows with SQL, and a test checks that").

A few metrics are not a function of the rows; NOT_FROM_ROWS says which and why. Stage timings are not
in the rows either, but in each iteration's manifest: they and the metrics derived from them are checked
against it.
"""

from __future__ import annotations

import math

import pytest
import yaml

from ppoflow.tasks.storage.confined_query import query
from ppoflow.tasks.storage.manifests import read_manifest
from ppoflow.tasks.storage.schemas import SCHEMAS, metric_doc
from tests.verl_validation import verl_validation_metrics

NOT_FROM_ROWS = {
    "perf/max_memory_allocated_gb": "peak memory of the training process when the step ended",
    "perf/max_memory_reserved_gb": "peak memory of the training process when the step ended",
    "perf/cpu_memory_used_gb": "memory in use on the host when the step ended",
    "actor/reward_kl_penalty_coeff": "β is the KL controller's state, carried between iterations "
    "(trainer_state.json), not a function of one iteration's rows; step 1 is checked against the config",
}
FROM_MANIFEST = ("timing_s/", "timing_per_token_ms/", "perf/time_per_step", "perf/throughput")
"""Wall-clock metrics: checked against the stage seconds in iter=N/_manifest.json and the token counts
of the rows."""


def token_stats(prefix: str, col: str) -> str:
    """mean, max, min over the response tokens of an advantages list column."""
    tokens = f"SELECT iter, unnest({col}::DOUBLE[]) x FROM advantages WHERE {col} IS NOT NULL"
    return (
        f'SELECT iter, avg(x) "{prefix}/mean", max(x) "{prefix}/max", min(x) "{prefix}/min" '
        f"FROM ({tokens}) GROUP BY iter"
    )


def length_stats(prefix: str, col: str, limit: int, where: str = "true") -> str:
    return (
        f'SELECT iter, avg({col}) "{prefix}/mean", max({col}) "{prefix}/max", min({col}) "{prefix}/min", '
        f'avg(({col} = {limit})::DOUBLE) "{prefix}/clip_ratio" FROM rollouts WHERE {where} GROUP BY iter'
    )


def row_queries(config: dict) -> list[str]:
    """Queries returning `iter` and columns named like the metrics they recompute."""
    limits = config["data"]["max_prompt_length"], config["data"]["max_response_length"]
    scored = "rewards JOIN rollouts USING (iter, prompt_id, sample_idx)"
    kept = "advantages JOIN rollouts USING (iter, prompt_id, sample_idx) WHERE response_length > 0"
    probs = (
        "SELECT iter, exp(unnest(rollout_log_probs::DOUBLE[])) r, exp(unnest(old_log_probs::DOUBLE[])) o "
        "FROM rollouts"
    )
    groups = (
        f"SELECT iter, group_id, (max(score) = min(score))::DOUBLE flat, "
        f"coalesce(stddev_samp(score), 0) sd, count(*) n FROM {scored} GROUP BY iter, group_id"
    )
    queries = [
        f'SELECT iter, avg(score) "critic/score/mean", max(score) "critic/score/max", '
        f'min(score) "critic/score/min" FROM {scored} WHERE response_length > 0 GROUP BY iter',
        'SELECT iter, avg(s) "critic/rewards/mean", max(s) "critic/rewards/max", min(s) "critic/rewards/min" '
        f"FROM (SELECT iter, list_sum(token_level_rewards::DOUBLE[]) s FROM {kept}) GROUP BY iter",
        token_stats("critic/advantages", "advantages"),
        token_stats("critic/returns", "returns"),
        token_stats("critic/values", '"values"'),
        'SELECT iter, 1 - var_samp(r - v) / (var_samp(r) + 1e-5) "critic/vf_explained_var" FROM '
        '(SELECT iter, unnest(returns::DOUBLE[]) r, unnest("values"::DOUBLE[]) v FROM advantages '
        'WHERE "values" IS NOT NULL) GROUP BY iter',
        'SELECT iter, avg(flat) "critic/score/zero_spread_group_ratio", '
        f'avg(sd) "critic/score/group_std_mean" FROM ({groups}) GROUP BY iter HAVING max(n) > 1',
        length_stats("response_length", "response_length", limits[1]),
        length_stats("response_length_non_aborted", "response_length", limits[1], "response_length > 0"),
        'SELECT iter, avg((response_length = 0)::DOUBLE) "response/aborted_ratio" '
        "FROM rollouts GROUP BY iter",
        length_stats("prompt_length", "prompt_length", limits[0]),
        'SELECT iter, avg((error IS NOT NULL)::DOUBLE) "reward/error_rate" FROM rewards GROUP BY iter',
        'SELECT iter, iter::DOUBLE "training/global_step", ((iter - 1) // '
        "((SELECT count(*) FROM prompts WHERE split = 'train') // count(DISTINCT prompt_id)))::DOUBLE "
        '"training/epoch", sum(prompt_length + response_length)::DOUBLE "perf/total_num_tokens" '
        "FROM rollouts GROUP BY iter",
        'SELECT iter, avg((error IS NOT NULL)::DOUBLE) "val-aux/reward/error_rate" '
        "FROM validation GROUP BY iter",
    ]
    if not config["algorithm"]["rollout_correction"]["bypass_mode"]:  # as verl: only with old log-probs
        queries += off_policy_queries() + [
            'SELECT iter, max(abs(r - o)) "training/rollout_probs_diff_max", '
            'avg(abs(r - o)) "training/rollout_probs_diff_mean", '
            'stddev_samp(abs(r - o)) "training/rollout_probs_diff_std", '
            'corr(o, r) "training/rollout_actor_probs_pearson_corr", '
            f'1.0 "training/rollout_probs_diff_valid" FROM ({probs}) GROUP BY iter'
        ]
    if config["algorithm"]["use_kl_in_reward"]:  # verl logs the in-reward KL only then
        queries.append(
            'SELECT iter, avg(list_avg(kl::DOUBLE[])) "actor/reward_kl_penalty" FROM advantages GROUP BY iter'
        )
    for role in ("actor", "critic"):
        for col in SCHEMAS[f"{role}_update"].names:
            if col not in ("epoch", "mini_batch", "other_metrics"):
                queries.append(
                    f'SELECT iter, avg({col}) "{role}/{col}" FROM {role}_update '
                    f"WHERE {col} IS NOT NULL GROUP BY iter"
                )
    return queries


def other_update_metrics(run_dir) -> dict[str, dict[int, float]]:
    """The actor's other_metrics map (named in full, such as rollout_corr/… of bypass mode): each
    entry's mean over the optimizer steps that logged it."""
    sql = (
        "SELECT iter, k, avg(v) FROM (SELECT iter, unnest(map_keys(other_metrics)) k, "
        "unnest(map_values(other_metrics)) v FROM actor_update) GROUP BY iter, k"
    )
    out: dict[str, dict[int, float]] = {}
    for step, name, value in query(run_dir, sql)[1]:
        out.setdefault(name, {})[step] = float(value)
    return out


def off_policy_queries() -> list[str]:
    """verl's compute_offpolicy_metrics of old against rollout log-probs: per response (every one,
    a response without tokens as mean log-prob 0) and per token, log ρ = old − rollout."""
    rows = (
        "SELECT iter, coalesce(list_avg(old_log_probs::DOUBLE[]), 0) mo, "
        "coalesce(list_avg(rollout_log_probs::DOUBLE[]), 0) mr, "
        "coalesce(list_sum(old_log_probs::DOUBLE[]) - list_sum(rollout_log_probs::DOUBLE[]), 0) s "
        "FROM rollouts"
    )
    tokens = (
        "SELECT iter, unnest(old_log_probs::DOUBLE[]) o, unnest(rollout_log_probs::DOUBLE[]) r FROM rollouts"
    )
    return [
        'SELECT iter, avg(exp(-mo)) "rollout_corr/training_ppl", avg(-mo) "rollout_corr/training_log_ppl", '
        'avg(exp(-mr)) "rollout_corr/rollout_ppl", avg(-mr) "rollout_corr/rollout_log_ppl", '
        'avg(mr - mo) "rollout_corr/log_ppl_diff", avg(abs(mr - mo)) "rollout_corr/log_ppl_abs_diff", '
        'max(mr - mo) "rollout_corr/log_ppl_diff_max", min(mr - mo) "rollout_corr/log_ppl_diff_min", '
        'avg(exp(mr - mo)) "rollout_corr/ppl_ratio", '
        f'avg(exp(2 * greatest(least(s, 20), -20))) - 1 "rollout_corr/chi2_seq" FROM ({rows}) GROUP BY iter',
        'SELECT iter, avg(r - o) "rollout_corr/kl", avg(exp(o - r) - (o - r) - 1) "rollout_corr/k3_kl", '
        'avg(exp(2 * greatest(least(o - r, 20), -20))) - 1 "rollout_corr/chi2_token" '
        f"FROM ({tokens}) GROUP BY iter",
    ]


def score_is_acc(run_dir) -> bool:
    """verl records the score of a reward function that returns a number as `acc` too: the built-in
    rewards (no custom_reward_function.path in the run's config), or a custom one without components."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    if config["custom_reward_function"]["path"] is None:
        return True
    return query(run_dir, "SELECT count(*) FROM validation WHERE cardinality(components) > 0")[1] == [(0,)]


def validation_metrics(run_dir) -> dict[str, dict[int, float]]:
    """val-core / val-aux per data source and variable (the reward, acc when the reward function
    returns a number, each component): with SQL, each prompt's mean and std of its n answers, then the
    mean over prompts, core for acc when there is one (else the reward) at the source's largest n; the
    bootstrap statistics (best@k, worst@k, maj@k; numpy's draws, which SQL cannot make) with
    tests/verl_validation.py over the rows."""
    acc = score_is_acc(run_dir)
    score_as_acc = (
        "SELECT iter, data_source, prompt_id, 'acc', score FROM validation "
        "WHERE NOT list_contains(map_keys(components), 'acc') UNION ALL "
        if acc
        else ""
    )
    per_prompt = (
        "SELECT iter, data_source, prompt_id, name, count(*) n, avg(v) m, stddev_pop(v) sd FROM "
        "(SELECT iter, data_source, prompt_id, 'reward' AS name, score v FROM validation UNION ALL "
        f"{score_as_acc}"
        "SELECT iter, data_source, prompt_id, unnest(map_keys(components)), unnest(map_values(components)) "
        "FROM validation) GROUP BY ALL"
    )
    sql = (
        "SELECT iter, data_source, name, n, avg(m), avg(sd), max(n) OVER (PARTITION BY iter, data_source), "
        "bool_or(name = 'acc') OVER (PARTITION BY iter, data_source) "
        f"FROM ({per_prompt}) GROUP BY iter, data_source, name, n"
    )
    out: dict[str, dict[int, float]] = {}
    for step, source, name, n, mean, std, n_max, has_acc in query(run_dir, sql)[1]:
        section = "val-core" if name == ("acc" if has_acc else "reward") and n == n_max else "val-aux"
        out.setdefault(f"{section}/{source}/{name}/mean@{n}", {})[step] = mean
        if n > 1:
            out.setdefault(f"val-aux/{source}/{name}/std@{n}", {})[step] = std
    rows = "SELECT iter, data_source, prompt_id, score, components, pred FROM validation"
    by_step: dict[int, list[tuple]] = {}
    for row in query(run_dir, rows + " ORDER BY iter, prompt_id, sample_idx")[1]:
        by_step.setdefault(row[0], []).append(row[1:])
    for step, samples in by_step.items():
        sources, prompts, scores, components, preds = zip(*samples, strict=True)
        variables = {"reward": list(scores)} | ({"acc": list(scores)} if acc else {})
        variables |= {name: [dict(c)[name] for c in components] for name in dict(components[0])}
        for key, value in verl_validation_metrics(
            list(sources), list(prompts), variables, list(preds)
        ).items():
            if any(f"/{stat}@" in key for stat in ("best", "worst", "maj")):
                out.setdefault(key, {})[step] = value
    return out


def manifest_metrics(run_dir, steps, tokens: dict[int, tuple[float, float]]) -> dict[str, dict[int, float]]:
    """Timings from each iteration's manifest (verl's timers as each stage recorded them; the step is
    the sum of the stages' seconds); per-token and throughput with the rows' token counts (response
    tokens for gen; prompt + response tokens for ref, values, adv and the updates)."""
    out: dict[str, dict[int, float]] = {}
    for step in steps:
        stages = read_manifest(run_dir, step)["stages"]
        seconds: dict[str, float] = {}
        for stage, entry in stages.items():  # a timer two stages share (reward) is their sum
            for timer, s in entry.get("timers", {}).items() if stage != "metrics" else ():
                seconds[timer] = seconds.get(timer, 0.0) + s
        seconds["step"] = sum(entry["seconds"] for stage, entry in stages.items() if stage != "metrics")
        response, total = tokens[step]
        derived = {f"timing_s/{timer}": s for timer, s in seconds.items()}
        derived |= {"perf/time_per_step": seconds["step"], "perf/throughput": total / seconds["step"]}
        counts = {"gen": response} | dict.fromkeys(
            ("ref", "values", "adv", "update_critic", "update_actor"), total
        )
        for timer, count in counts.items():
            if timer in seconds:
                derived[f"timing_per_token_ms/{timer}"] = 1000 * seconds[timer] / count
        for name, value in derived.items():
            out.setdefault(name, {})[step] = value
    return out


def recompute(run_dir) -> dict[str, dict[int, float]]:
    """metric name -> {iter: value} from the rows (and the manifests), every iteration that has rows."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    out: dict[str, dict[int, float]] = {}
    for sql in row_queries(config):
        columns, rows = query(run_dir, sql)
        for row in rows:
            for name, value in zip(columns[1:], row[1:], strict=True):
                if value is not None:
                    out.setdefault(name, {})[row[0]] = float(value)
    out |= validation_metrics(run_dir) | other_update_metrics(run_dir)
    counts = "SELECT iter, sum(response_length), sum(prompt_length + response_length) FROM rollouts"
    tokens = {
        step: (response, total) for step, response, total in query(run_dir, counts + " GROUP BY iter")[1]
    }
    return out | manifest_metrics(run_dir, sorted(tokens), tokens)


def logged_metrics(run_dir) -> dict[str, dict[int, float]]:
    columns, rows = query(run_dir, "SELECT * FROM metrics ORDER BY iter")
    return {
        name: {row[0]: row[i] for row in rows if row[i] is not None}
        for i, name in enumerate(columns)
        if name not in ("iter", "step")
    }


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-5, abs=1e-6)


def assert_metrics_match_rows(run_dir) -> dict[str, dict[int, float]]:
    """Every metrics column equals its recomputation at every iteration, or is in NOT_FROM_ROWS; returns
    the recomputation."""
    logged, recomputed = logged_metrics(run_dir), recompute(run_dir)
    steps = {step for values in logged.values() for step in values}
    unexplained = set(logged) - set(recomputed) - set(NOT_FROM_ROWS)
    assert not unexplained, f"metrics nobody recomputes: {sorted(unexplained)}"
    for name, values in logged.items():
        if name in NOT_FROM_ROWS:
            continue
        expected = {step: v for step, v in recomputed[name].items() if step in steps}
        assert values.keys() == expected.keys(), name
        mismatched = {s: (v, expected[s]) for s, v in values.items() if not same(v, expected[s])}
        assert not mismatched, (name, mismatched)
    missing = {name for name, values in recomputed.items() if steps & values.keys()} - set(logged)
    assert not missing, f"recomputable but not logged: {sorted(missing)}"
    return recomputed


def assert_unrecomputable_are_plausible(run_dir) -> None:
    logged = logged_metrics(run_dir)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    for name in ("perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb", "perf/cpu_memory_used_gb"):
        assert all(0.01 < v < 4096 for v in logged[name].values()), name
    if config["algorithm"]["use_kl_in_reward"]:
        beta = logged["actor/reward_kl_penalty_coeff"]
        assert beta[1] == config["algorithm"]["kl_ctrl"]["kl_coef"]
    else:
        assert "actor/reward_kl_penalty_coeff" not in logged  # verl logs β only with KL in the reward


def test_every_metric_of_a_ppo_run_matches_sql_over_its_rows(small_run):
    run_dir, _, _ = small_run
    assert_metrics_match_rows(run_dir)
    assert_unrecomputable_are_plausible(run_dir)


def test_every_metric_column_is_documented(small_run):
    run_dir, _, _ = small_run
    undocumented = [name for name in logged_metrics(run_dir) if metric_doc(name) is None]
    assert not undocumented
