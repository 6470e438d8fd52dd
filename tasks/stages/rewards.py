"""The `rewards` stage: score each response → iter=N/rewards/part-00000.parquet (score, its
components, errors). With a reward model, its score (the reward_model stage) is the component
rm_score: score = rule score + reward.weights.rm_score · rm_score, or rm_score alone when that weight
is not set (verl's reward managers return the reward model's scores instead of the rule reward).

A row whose reward function raises, returns a non-number or NaN, or times out gets an `error`;
reward.on_error decides whether that fails the stage ("fail") or scores the row 0 ("zero").
"""

from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pyarrow.compute as pc
from prefect import task

from ppoflow.engine.gsm8k import GSM8K_DATA_SOURCE, Gsm8kMethod, extract_solution, gsm8k_components
from ppoflow.engine.names import OVERLONG_REWARD, RM_SCORE, TOOL_REWARD
from ppoflow.engine.rewards import (
    NO_ANSWER,
    addition_answer,
    addition_components,
    combine_components,
    error_rate,
    overlong_penalty,
)
from ppoflow.engine.tiny import ADDITION_DATA_SOURCE
from ppoflow.engine.tiny_tools import TOOL_ADDITION_DATA_SOURCE, final_answer, tool_addition_components
from ppoflow.tasks.faults import inject_fault
from ppoflow.tasks.pipeline.cache_keys import current_cache_key, stage_cache_key
from ppoflow.tasks.pipeline.run import Run
from ppoflow.tasks.pipeline.settings import RewardSettings
from ppoflow.tasks.pipeline.states import StageResult, StageTimer, timing_values
from ppoflow.tasks.stages.reward_functions import RewardCall, RewardFunctionError, Scored, run_custom_reward
from ppoflow.tasks.storage.schemas import SCHEMAS
from ppoflow.tasks.storage.tables import ArtifactRef, read_table, stage_path, write_table


def reward_components(
    data_source: str, response: str, ground_truth: str, gsm8k_method: Gsm8kMethod
) -> dict[str, float]:
    """The rule reward of `data_source` as named components in [0, 1] (verl selects by data_source)."""
    match data_source:
        case _ if data_source == ADDITION_DATA_SOURCE:
            return addition_components(response, ground_truth)
        case _ if data_source == GSM8K_DATA_SOURCE:
            return gsm8k_components(response, ground_truth, gsm8k_method)
        case _ if data_source == TOOL_ADDITION_DATA_SOURCE:
            return tool_addition_components(response, ground_truth)
        case _:
            raise ValueError(
                f"no built-in reward for data_source '{data_source}'; set custom_reward_function.path"
            )


BUILTIN_DATA_SOURCES = (ADDITION_DATA_SOURCE, GSM8K_DATA_SOURCE, TOOL_ADDITION_DATA_SOURCE)


def require_builtin_rewards(run: Run, reward: RewardSettings, prompts: dict[str, ArtifactRef]) -> None:
    """When the built-in rewards score the run (no custom_reward_function), every prompt they score
    must have a data_source they know: checked right after ingest (`prompts`: split → its prompts
    table), not when the first rewards stage fails after the first rollouts. Validation is always
    scored by them (as in verl); training not when the reward model's score is the reward alone."""
    if reward.custom_function is not None:
        return
    known = pa.array(BUILTIN_DATA_SOURCES)
    for split, ref in prompts.items():
        if split == "train" and not reward.rule_reward:  # the reward model's score alone
            continue
        table = read_table(run.path, ref, clock=run.io).select(["data_source", "row_index"])
        unknown = table.filter(pc.invert(pc.is_in(table["data_source"], value_set=known)))
        if unknown.num_rows:
            source, row = unknown["data_source"][0].as_py(), unknown["row_index"][0].as_py()
            named = reward.reward_fn_key
            field = "data_source" if named == "data_source" else f"{named} (data.reward_fn_key)"
            raise RewardFunctionError(
                f"{unknown.num_rows} {split} prompt(s) have a {field} with no built-in reward, the first "
                f"{source!r} (row {row} of data.{split}_files); the built-in rewards score "
                f"{', '.join(BUILTIN_DATA_SOURCES)}: set custom_reward_function.path to a file with verl's "
                "compute_score for the others"
            )


def reward_answer(data_source: str, response: str, gsm8k_method: Gsm8kMethod) -> str:
    """The answer a response gives under the built-in reward of `data_source` (`pred`, what maj@k
    votes on), NO_ANSWER when it gives none."""
    if data_source == GSM8K_DATA_SOURCE:
        return extract_solution(response, gsm8k_method) or NO_ANSWER
    if data_source == TOOL_ADDITION_DATA_SOURCE:
        return addition_answer(final_answer(response))
    return addition_answer(response)


def score_rows(
    rows: list[dict],
    prompts: dict[str, dict],
    reward: RewardSettings,
    baselines: list[float] | None = None,
    rm_scores: list[float] | None = None,
) -> pa.Table:
    """One reward row per response (rows: prompt_id, sample_idx, data_source, response_text), scored
    against its prompt (prompts: prompt_id → a prompts-table row with ground_truth and extra_info) by
    the custom reward function if one is configured, else by the data source's built-in reward
    weighted by reward.weights. Failing rows follow reward.on_error. `baselines`: ReMax's
    baseline score of each row (`remax_baselines`), else null. With `rm_scores` (one per row), the
    reward model's score is the component rm_score, added with weight reward.rm_weight (alone,
    without a rule reward, when reward.rule_reward is false). A multi-turn row's `tool_reward` (the
    sum of its tool calls' rewards) is the component `tool`, added with weight reward.tool_weight,
    and a custom function reads it as extra_info["tool_reward"] beside extra_info["num_turns"]. DAPO's
    overlong penalty of each row's response_length is the component `overlong` (reward.overlong)."""
    calls = [
        RewardCall(
            row["data_source"],
            row["response_text"],
            prompts[row["prompt_id"]]["ground_truth"],
            _extra_info(prompts[row["prompt_id"]].get("extra_info"), row),
        )
        for row in rows
    ]
    fail = reward.on_error == "fail"
    custom = reward.custom_function
    if rm_scores is not None and not reward.rule_reward:
        outcomes: list[Scored | None] = [Scored(0.0) for _ in calls]
    elif custom is not None:
        outcomes = run_custom_reward(custom, calls, reward.timeout_s, stop_at_timeout=fail)
    else:
        method = reward.gsm8k_method
        outcomes = [_builtin(call, reward.weights, method) for call in calls]
    if fail:
        _raise_on_failures(rows, outcomes)
    if rm_scores is not None:
        outcomes = [
            _with_component(o, RM_SCORE, s, reward.rm_weight)
            for o, s in zip(outcomes, rm_scores, strict=True)
        ]
    if rows and rows[0].get("tool_reward") is not None:
        outcomes = [
            _with_component(o, TOOL_REWARD, row["tool_reward"], reward.tool_weight)
            for o, row in zip(outcomes, rows, strict=True)
        ]
    if reward.overlong is not None:
        long = reward.overlong
        outcomes = [
            _with_component(o, OVERLONG_REWARD, overlong_penalty(row["response_length"], long), long.weight)
            for o, row in zip(outcomes, rows, strict=True)
        ]
    return pa.Table.from_pydict(
        {
            "prompt_id": [row["prompt_id"] for row in rows],
            "sample_idx": [row["sample_idx"] for row in rows],
            "data_source": [call.data_source for call in calls],
            "ground_truth": [call.ground_truth for call in calls],
            "score": [o.score for o in outcomes],
            "components": [list(o.components.items()) for o in outcomes],
            "error": [o.error for o in outcomes],
            "pred": [o.pred for o in outcomes],
            "baseline_score": baselines or [None] * len(rows),
        },
        schema=SCHEMAS["rewards"],
    )


def _with_component(outcome: Scored | None, name: str, value: float, weight: float) -> Scored:
    """The outcome (a failed one counts 0) with the component `name`, plus weight · value: the
    reward model's score (rm_score), a multi-turn response's tool rewards (tool)."""
    outcome = outcome if outcome is not None else Scored.failed("not scored")
    components = {**outcome.components, name: value}
    return dataclasses.replace(outcome, score=outcome.score + weight * value, components=components)


def reward_error_metrics(scored: pa.Table, prefix: str = "reward") -> dict[str, float]:
    """`{prefix}/error_rate`: the share of rows of a rewards (or validation) table with an error."""
    return {f"{prefix}/error_rate": error_rate(scored["error"].to_pylist())}


def aligned_components(scored: pa.Table) -> list[dict[str, float]]:
    """Each row's components restricted to the names every scored row has (a row with an error
    counts 0 for them), so per-component means compare like with like."""
    rows = [dict(c) for c in scored["components"].to_pylist()]
    ok = [c for c, error in zip(rows, scored["error"].to_pylist(), strict=True) if error is None]
    names = [n for n in (ok[0] if ok else {}) if all(n in c for c in ok)]
    return [{n: c.get(n, 0.0) for n in names} for c in rows]


@task(name="rewards", task_run_name="rewards-step{step}", cache_key_fn=stage_cache_key)
def rewards(
    run: Run,
    step: int,
    rollouts: ArtifactRef,
    prompts: ArtifactRef,
    reward: RewardSettings,
    reward_model: ArtifactRef | None = None,
) -> StageResult:
    """Score every rollout against its prompt's ground truth, with the reward model's scores (the
    reward_model stage's table) when there is one (verl's timer: reward)."""
    timer = StageTimer()
    table = read_table(run.path, rollouts, clock=run.io)
    columns = ["prompt_id", "sample_idx", "data_source", "response_text", "response_length"]
    columns += ["baseline_response_text", "baseline_response_ids"]
    columns += [c for c in ("tool_reward", "num_turns") if c in table.column_names]  # multi-turn
    rows = table.select(columns).to_pylist()
    references = read_table(run.path, prompts, clock=run.io).select(
        ["prompt_id", "ground_truth", "extra_info"]
    )
    by_id = {r["prompt_id"]: r for r in references.to_pylist()}
    rm_scores = baseline_rm_scores = None
    if reward_model is not None:
        scored = read_table(run.path, reward_model, clock=run.io).to_pylist()
        by_row = {(r["prompt_id"], r["sample_idx"]): r for r in scored}
        rm_scores = [by_row[(row["prompt_id"], row["sample_idx"])]["rm_score"] for row in rows]
        baseline_rm_scores = [
            by_row[(row["prompt_id"], row["sample_idx"])]["baseline_rm_score"] for row in rows
        ]
    baselines = remax_baselines(rows, by_id, reward, baseline_rm_scores)
    table = score_rows(rows, by_id, reward, baselines, rm_scores)
    inject_fault("rewards", step)
    ref = write_table(table, run.path, stage_path(step, "rewards"), SCHEMAS["rewards"], clock=run.io)
    seconds = timer.seconds
    return StageResult("rewards", (ref,), current_cache_key(), seconds, timing_values({"reward": seconds}))


def remax_baselines(
    rows: list[dict],
    prompts: dict[str, dict],
    reward: RewardSettings,
    rm_scores: list[float | None] | None = None,
) -> list[float] | None:
    """ReMax's reward baseline of each row: the score of its prompt's greedy response (the rollouts'
    baseline_response_text, scored once per prompt as responses are, with the reward model's score of
    it when `rm_scores` gives one per row); None when the rollouts have no greedy responses (every
    estimator but remax). A baseline whose reward fails counts 0 under reward.on_error=zero, as a
    failed response does."""
    if not rows or rows[0]["baseline_response_text"] is None:
        return None
    greedy, model = {}, {}
    for i, row in enumerate(rows):
        baseline = {"response_text": row["baseline_response_text"]}
        baseline["response_length"] = len(row.get("baseline_response_ids") or [])
        greedy.setdefault(row["prompt_id"], row | baseline)
        model.setdefault(row["prompt_id"], rm_scores[i] if rm_scores is not None else None)
    greedy_rm = list(model.values()) if rm_scores is not None else None
    try:
        scored = score_rows(list(greedy.values()), prompts, reward, rm_scores=greedy_rm)
    except RewardFunctionError as exc:
        raise RewardFunctionError(f"scoring ReMax's greedy baseline responses: {exc}") from None
    score = dict(zip(scored["prompt_id"].to_pylist(), scored["score"].to_pylist(), strict=True))
    return [score[row["prompt_id"]] for row in rows]


def _builtin(call: RewardCall, weights: dict[str, float], gsm8k_method: Gsm8kMethod) -> Scored:
    """The fast path, in process: the data source's components, weighted."""
    try:
        components = reward_components(call.data_source, call.solution_str, call.ground_truth, gsm8k_method)
        pred = reward_answer(call.data_source, call.solution_str, gsm8k_method)
        return Scored(combine_components(components, weights), components, pred=pred)
    except Exception as exc:
        return Scored.failed(f"{type(exc).__name__}: {exc}")


def _extra_info(text: str | None, row: dict | None = None):
    """The prompts table keeps extra_info as JSON text; verl passes the parsed value (a dict), with
    a multi-turn response's tool_reward (the sum of its calls' rewards) and num_turns added."""
    extra = json.loads(text) if text else {}
    if row is not None and row.get("tool_reward") is not None and isinstance(extra, dict):
        extra = {**extra, "tool_reward": row["tool_reward"], "num_turns": row["num_turns"]}
    return extra


def _raise_on_failures(rows: list[dict], outcomes: list[Scored | None]) -> None:
    failed = [(row, o) for row, o in zip(rows, outcomes, strict=True) if o is not None and o.error]
    if not failed:
        return
    row, first = failed[0]
    scored = sum(o is not None for o in outcomes)
    of = f"{len(rows)} rows" if scored == len(rows) else f"the first {scored} of {len(rows)} rows"
    stopped = "" if scored == len(rows) else " (scoring stops at the first timeout)"
    fix = "set reward.on_error=zero to score such rows 0 and continue (the table keeps each row's error)"
    if first.timed_out:
        fix = f"raise reward.timeout_s if the reward is only slow, or {fix}"
    raise RewardFunctionError(
        f"reward failed on {len(failed)} of {of}{stopped}; first: prompt_id={row['prompt_id']} "
        f"sample_idx={row['sample_idx']}: {first.error}. To go on, {fix}."
    )
