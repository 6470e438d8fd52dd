"""DAPO's dynamic sampling (algorithm.filter_groups, arXiv:2503.14476) inside the rollouts stage: a
step's batch is generated and scored; groups whose responses all have the same metric give GRPO-style
estimators no signal and are dropped; further batches of prompts the step has not drawn are generated
until data.train_batch_size groups remain (verl's DAPO trainer and its metrics).

Each generation batch is kept under iter=N/rollouts/.generation/<key>/ as soon as it is generated,
so a stage killed in the middle resumes from the batches it had (the same tables as an unkilled
run: every batch is sampled from its own seed). The stage's tables: rollouts (the kept groups'
rows, group_id renumbered 0…B−1 in the order kept) and filter_groups (one row per generated group).
"""

from __future__ import annotations

import dataclasses
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from ppoflow.tasks.faults import inject_fault
from ppoflow.tasks.observe.console import say
from ppoflow.tasks.pipeline.cache_keys import code_hash, digest_of
from ppoflow.tasks.pipeline.run import Run
from ppoflow.tasks.pipeline.settings import DataSettings, RolloutSettings
from ppoflow.tasks.pipeline.states import ModelState
from ppoflow.tasks.stages.rewards import score_rows
from ppoflow.tasks.storage.schemas import SCHEMAS
from ppoflow.tasks.storage.tables import (
    ArtifactCorrupt,
    ArtifactRef,
    iteration_dir,
    read_json,
    read_table,
    write_json_atomic,
    write_table,
)

SCORE_METRICS = ("reward", "score", "seq_reward", "seq_final_reward")
"""filter_groups.metric names of the response's score (verl: the reward, and the DAPO trainer's
sums of token-level scores and rewards; ppoflow compares the score before any in-reward KL)."""
STAGING = ".generation"


@dataclass
class GeneratedBatch:
    """The rows of one generation batch: its rollouts table, its turns table (multi-turn) and the
    seconds of verl's timers (gen, old_log_prob, ref)."""

    rollouts: pa.Table
    turns: pa.Table | None
    seconds: dict[str, float]


@dataclass(frozen=True)
class SamplingRequest:
    """What the rollouts stage was asked for (its parameters; the staging key is made of them)."""

    step: int
    actor: ModelState
    reference: ModelState | None
    prompts: ArtifactRef
    data: DataSettings
    settings: RolloutSettings
    seed: int


class DynamicSamplingError(RuntimeError):
    """The generation limit was reached, or the training set ran out, before the batch was full."""


Generate = Callable[..., GeneratedBatch]


def sample_dynamically(
    run: Run, request: SamplingRequest, prompts: pa.Table, first_rows: list[int], generate: Generate
) -> tuple[GeneratedBatch, pa.Table, dict[str, float]]:
    """Generate and score batches of data.gen_batch_size prompts (the first: the step's own
    `first_rows`, cut or topped up from the draws) until data.train_batch_size groups have a spread
    of the metric.
    Returns the kept rows, the filter_groups table and verl's metrics (train/num_gen_batches,
    training/filter_groups/evicted_samples and discarded_surplus_samples)."""
    filter_groups = request.settings.filter_groups
    assert filter_groups is not None, "dynamic sampling needs settings.filter_groups"
    wanted = request.data.train_batch_size
    references = prompts.select(["prompt_id", "ground_truth", "extra_info"]).to_pylist()
    by_id = {row["prompt_id"]: row for row in references}
    staging = _staging_dir(run, request)
    row_of = {prompt_id: i for i, prompt_id in enumerate(prompts["prompt_id"].to_pylist())}
    size = filter_groups.gen_batch_size
    draws = PromptDraws(prompts.num_rows, first_rows[:size], request.data.seed, request.step)
    top_up = draws.next(size - len(first_rows), set()) if size > len(first_rows) else []
    rows_ids = first_rows[:size] + top_up
    kept: list[GeneratedBatch] = []
    groups: list[dict] = []
    seconds: dict[str, float] = {}
    number = 0
    while True:
        seed = request.seed if number == 0 else (request.seed * 1_000_003 + number) % 2**62
        batch = _staged(run, staging, number)
        if batch is not None:
            say(f"step {request.step} generation batch {number + 1}: kept from an earlier attempt")
        else:
            rows = prompts.take(rows_ids).to_pylist()
            label = "generate" if number == 0 else f"generate (batch {number + 1})"
            batch = generate(
                run, request.step, request.actor, request.reference, rows, request.settings, seed, label
            )
            _stage(run, staging, number, batch)
            if number == 1:  # PPOFLOW_FAULT=filter_groups@<step>: a kill between generation batches
                inject_fault("filter_groups", request.step)
        for phase, value in batch.seconds.items():
            seconds[phase] = seconds.get(phase, 0.0) + value
        room = wanted - _count(kept)
        decided = _decide(batch.rollouts, by_id, filter_groups.reward, filter_groups.metric, room)
        groups += [g | {"gen_batch": number} for g in decided]
        kept.append(_take(batch, [g["prompt_id"] for g in decided if g["kept"]]))
        number += 1
        if _count(kept) >= wanted:
            break
        limit = filter_groups.max_num_gen_batches
        if 0 < limit <= number:
            raise DynamicSamplingError(
                f"algorithm.filter_groups.max_num_gen_batches={limit} reached at step {request.step}: only "
                f"{_count(kept)} of data.train_batch_size={wanted} prompts had responses whose "
                f"{filter_groups.metric!r} differs. The data may be too hard or too easy for the model; set "
                "max_num_gen_batches=0 for no limit (the batches generated so far are kept and reused)"
            )
        kept_rows = {row_of[g["prompt_id"]] for g in groups if g["kept"]}
        rows_ids = draws.next(size, kept_rows)
        if not rows_ids:
            raise DynamicSamplingError(
                f"step {request.step} drew every training prompt not kept yet (pass {draws.pass_number + 1}) "
                f"and none had responses whose {filter_groups.metric!r} differs; {_count(kept)} of "
                f"data.train_batch_size={wanted} were kept: use more data, a smaller data.train_batch_size, "
                "or another filter_groups.metric"
            )
    joined = _joined(kept, request.settings.n)
    table = pa.Table.from_pylist(groups, schema=SCHEMAS["filter_groups"])
    reasons = [g["reason"] for g in groups]
    metrics = {
        "train/num_gen_batches": float(number),
        "training/filter_groups/evicted_samples": float(reasons.count("no spread")),
        "training/filter_groups/discarded_surplus_samples": float(reasons.count("surplus")),
    }
    return dataclasses.replace(joined, seconds=seconds), table, metrics


class PromptDraws:
    """Which training rows each further generation batch of a step takes: rows the step has not
    drawn in this pass, in a permutation seeded by (data.seed, step, pass), so a step's batches are
    known without the steps before it. Once every row is drawn, a new pass over the rows not kept
    (as verl's DAPO trainer goes on into the dataloader's next epoch, a small data set does not run
    out while its groups still give signal); a pass that keeps no group ends the draws."""

    def __init__(self, n_rows: int, first_rows: list[int], seed: int, step: int):
        self.n_rows, self.seed, self.step = n_rows, seed, step
        self.pass_number = 0
        self.drawn = set(first_rows)
        self.kept_at_pass_start = 0

    def next(self, size: int, kept: set[int]) -> list[int]:
        """Up to `size` rows for the next batch (fewer at a pass's end), never a kept one; [] when the
        pass just ended kept no group."""
        rows = self._undrawn(kept)
        if not rows:
            if len(kept) == self.kept_at_pass_start:
                return []
            self.pass_number += 1
            self.drawn, self.kept_at_pass_start = set(), len(kept)
            rows = self._undrawn(kept)
        taken = rows[:size]
        self.drawn.update(taken)
        return taken

    def _undrawn(self, kept: set[int]) -> list[int]:
        order = list(range(self.n_rows))
        random.Random(f"{self.seed}/{self.step}/pass-{self.pass_number}").shuffle(order)
        return [row for row in order if row not in self.drawn and row not in kept]


def metric_values(scored: pa.Table, metric: str) -> list[float]:
    """Each scored row's filter_groups.metric: its score, its correctness (acc; the score when the
    reward has no such component), or the reward component of that name."""
    if metric in SCORE_METRICS:
        return [float(v) for v in scored["score"].to_pylist()]
    components = [dict(c) for c in scored["components"].to_pylist()]
    name = "correctness" if metric == "acc" and all("correctness" in c for c in components) else metric
    if metric == "acc" and name == metric:
        return [float(v) for v in scored["score"].to_pylist()]
    missing = [c for c in components if name not in c]
    if missing:
        names = sorted(missing[0])
        raise DynamicSamplingError(
            f"algorithm.filter_groups.metric={metric!r} is not a reward component of this run (its "
            f"components: {', '.join(names) or 'none'}); use one of them, or {', '.join(SCORE_METRICS)}, acc"
        )
    return [float(c[name]) for c in components]


def _decide(rollouts: pa.Table, by_id: dict, reward, metric: str, room: int) -> list[dict]:
    """One filter_groups row per prompt group of the batch, in order: kept while `room` lasts when
    its responses' metric differs (max ≠ min; verl compares np.std with 0, which a group of equal
    values not exactly representable can pass), else 'no spread' or 'surplus'."""
    columns = ["prompt_id", "sample_idx", "data_source", "response_text", "response_length"]
    columns += [c for c in ("tool_reward", "num_turns") if c in rollouts.column_names]
    rows = rollouts.select(columns).to_pylist()
    values = metric_values(score_rows(rows, by_id, reward), metric)
    grouped: dict[str, list[tuple[int, float, str, str]]] = {}
    for row, value in zip(rows, values, strict=True):
        grouped.setdefault(row["prompt_id"], []).append(
            (row["sample_idx"], value, row["response_text"], row["data_source"])
        )
    decided = []
    for prompt_id, members in grouped.items():
        members.sort()
        spread = max(v for _, v, _, _ in members) != min(v for _, v, _, _ in members)
        keep = spread and room > 0
        room -= keep
        decided.append(
            {
                "prompt_id": prompt_id,
                "data_source": members[0][3],
                "metric": metric,
                "metric_values": [v for _, v, _, _ in members],
                "response_texts": [t for _, _, t, _ in members],
                "kept": keep,
                "reason": "kept" if keep else "surplus" if spread else "no spread",
            }
        )
    return decided


def _take(batch: GeneratedBatch, prompt_ids: list[str]) -> GeneratedBatch:
    """The rows of `batch` whose prompt is one of `prompt_ids`."""
    wanted = pa.array(prompt_ids, pa.string())
    rows = batch.rollouts.filter(pc.is_in(batch.rollouts["prompt_id"], value_set=wanted))
    turns = None
    if batch.turns is not None:
        turns = batch.turns.filter(pc.is_in(batch.turns["prompt_id"], value_set=wanted))
    return GeneratedBatch(rows, turns, {})


def _count(kept: list[GeneratedBatch]) -> int:
    return sum(len(set(b.rollouts["prompt_id"].to_pylist())) for b in kept)


def _joined(kept: list[GeneratedBatch], n: int) -> GeneratedBatch:
    """The kept rows of every batch, one table, group_id 0…B−1 in the order the groups were kept."""
    rollouts = pa.concat_tables([b.rollouts for b in kept])
    order = list(dict.fromkeys(rollouts["prompt_id"].to_pylist()))
    position = {prompt_id: i for i, prompt_id in enumerate(order)}
    group_id = pa.array([position[p] for p in rollouts["prompt_id"].to_pylist()], pa.int32())
    rollouts = rollouts.set_column(rollouts.schema.get_field_index("group_id"), "group_id", group_id)
    turns = [b.turns for b in kept if b.turns is not None]
    return GeneratedBatch(rollouts, pa.concat_tables(turns) if turns else None, {})


def _staging_dir(run: Run, request: SamplingRequest) -> Path:
    """Where the step's generation batches wait for the stage to finish: named by everything that
    decides them (the stage's code and parameters) but the generation limit, so that a rerun with a
    higher max_num_gen_batches reuses them."""
    filter_groups = dataclasses.replace(request.settings.filter_groups, max_num_gen_batches=0)
    settings = dataclasses.replace(request.settings, filter_groups=filter_groups)
    key = digest_of(code_hash(__file__), dataclasses.replace(request, settings=settings))[:24]
    return iteration_dir(run.path, request.step) / "rollouts" / STAGING / key


def _stage(run: Run, staging: Path, number: int, batch: GeneratedBatch) -> None:
    """Keep generation batch `number` (its tables, and their references in batches.json)."""
    relative = staging.relative_to(run.path)
    refs = {"rollouts": write_table(batch.rollouts, run.path, f"{relative}/batch-{number:05d}.parquet")}
    if batch.turns is not None:
        refs["turns"] = write_table(batch.turns, run.path, f"{relative}/turns-{number:05d}.parquet")
    index = _index(staging)
    index[str(number)] = {"seconds": batch.seconds, **{k: dataclasses.asdict(r) for k, r in refs.items()}}
    write_json_atomic(staging / "batches.json", index)


def _staged(run: Run, staging: Path, number: int) -> GeneratedBatch | None:
    """Generation batch `number` as an earlier attempt kept it, or None (not kept, or damaged)."""
    entry = _index(staging).get(str(number))
    if not isinstance(entry, dict):
        return None
    try:
        refs = {name: ArtifactRef(**entry[name]) for name in ("rollouts", "turns") if name in entry}
        if any(_outside(run, staging, ref) for ref in refs.values()):
            return None  # a batch is a file of its own staging folder, never one named elsewhere
        rollouts = read_table(run.path, refs["rollouts"])
        turns = read_table(run.path, refs["turns"]) if "turns" in refs else None
        seconds = {str(k): float(v) for k, v in entry["seconds"].items()}
    except (ArtifactCorrupt, OSError, TypeError, KeyError, ValueError, AttributeError):
        return None
    if rollouts.schema != SCHEMAS["rollouts"]:
        return None
    return GeneratedBatch(rollouts, turns, seconds)


def _outside(run: Run, staging: Path, ref: ArtifactRef) -> bool:
    path = Path(run.path) / str(ref.path)
    return path.parent != staging or path.is_symlink()


def _index(staging: Path) -> dict:
    try:
        index = read_json(staging / "batches.json")
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


def discard_staging(run: Run, step: int) -> None:
    """Remove the step's kept generation batches (its tables are written)."""
    shutil.rmtree(iteration_dir(run.path, step) / "rollouts" / STAGING, ignore_errors=True)
