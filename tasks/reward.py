"""Stage 2: score each response → iter=N/reward/part-00000.parquet (score and its components)."""

from __future__ import annotations

import math

import pyarrow as pa
from prefect import task

from ppoflow.engine.rewards import addition_components, combine_components
from ppoflow.engine.tiny import ADDITION_DATA_SOURCE

from .common import Run, StageResult, StageTimer, current_cache_key, stage_cache_key
from .schemas import SCHEMAS
from .storage import ArtifactRef, read_table, stage_path, write_table


def reward_components(data_source: str, response: str, ground_truth: str) -> dict[str, float]:
    """The rule reward of `data_source` as named components in [0, 1] (verl selects by data_source)."""
    match data_source:
        case _ if data_source == ADDITION_DATA_SOURCE:
            return addition_components(response, ground_truth)
        case _:
            raise ValueError(
                f"no built-in reward for data_source '{data_source}'; set custom_reward_function.path"
            )


def score_rows(rows: list[dict], ground_truths: dict[str, str], weights: dict[str, float]) -> pa.Table:
    """One reward row per response: score = Σ weight·component."""
    out = {
        name: []
        for name in ("prompt_id", "sample_idx", "data_source", "ground_truth", "score", "components", "error")
    }
    for row in rows:
        truth = ground_truths[row["prompt_id"]]
        components = reward_components(row["data_source"], row["response_text"], truth)
        score = combine_components(components, weights)
        if not math.isfinite(score):
            raise ValueError(f"reward of {row['prompt_id']}#{row['sample_idx']} is {score}")
        for name, value in (
            ("prompt_id", row["prompt_id"]),
            ("sample_idx", row["sample_idx"]),
            ("data_source", row["data_source"]),
            ("ground_truth", truth),
            ("score", score),
            ("components", list(components.items())),
            ("error", None),
        ):
            out[name].append(value)
    return pa.Table.from_pydict(out, schema=SCHEMAS["rewards"])


@task(name="score_rewards", cache_key_fn=stage_cache_key)
def reward_stage(
    run: Run, step: int, rollouts: ArtifactRef, prompts: ArtifactRef, reward: dict
) -> StageResult:
    """Score every rollout against its prompt's ground truth."""
    timer = StageTimer()
    rows = (
        read_table(run.path, rollouts)
        .select(["prompt_id", "sample_idx", "data_source", "response_text"])
        .to_pylist()
    )
    truths = _ground_truths(run, prompts)
    table = score_rows(rows, truths, reward["weights"])
    ref = write_table(table, run.path, stage_path(step, "reward"), SCHEMAS["rewards"])
    return StageResult("reward", (ref,), current_cache_key(), timer.seconds)


def _ground_truths(run: Run, prompts: ArtifactRef) -> dict[str, str]:
    table = read_table(run.path, prompts).select(["prompt_id", "ground_truth"])
    return dict(zip(table["prompt_id"].to_pylist(), table["ground_truth"].to_pylist(), strict=True))
