"""Scheduled retraining: new data files → a round of PPO from the champion → promote only if better.

A retraining directory (the `run_dir` of the retrain flow) holds:

    promotions.parquet      one row per round: the decision (promoted or kept), both scores, the
                            reason, and the data files it took in (the only record: one write)
    champion.json           the champion: its checkpoint folder, actor directory, score and round
    champion -> rounds/round=000001/checkpoints/iter=000005   (a symlink to the same folder)
    rounds/round=NNNNNN/    one ppoflow run directory per round, with its own catalog
    evaluations/            validation-only runs of the evaluate flow
    unusable_files.parquet  files of the data folder that cannot be read as data, with the reason:
                            set aside, so that one broken file does not fail every round
    catalog.duckdb          views promotions, dataset_files (one row per file taken in),
                            round_metrics (every round's metrics rows) and unusable_files

Files are content-addressed: a file whose bytes were taken in before (under any name) is not taken
in again. The promotions table is the record; champion.json and the symlink are derived from its last
promoted row (and rewritten from it, under the retraining lock, if a crash left them behind).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ppoflow.tasks.storage.catalog import write_catalog
from ppoflow.tasks.storage.regular_files import refuse_links_below
from ppoflow.tasks.storage.retrain_tables import (
    PROMOTIONS,
    PROMOTIONS_SCHEMA,
    ROUNDS,
    UNUSABLE,
    UNUSABLE_SCHEMA,
    define_retrain_views,
)
from ppoflow.tasks.storage.tables import read_json, write_json_atomic, write_table

DATA_SUFFIXES = (".json", ".jsonl")
CHAMPION = "champion.json"
CHAMPION_LINK = "champion"
BASE = "base"
"""The incumbent of the first round: the configured base model, not a checkpoint."""
SCORE_TOLERANCE = 1e-9
"""Scores this close are a tie: the same accuracy summed in another order differs in its last bits."""


@dataclass(frozen=True)
class DataFile:
    path: str
    sha256: str
    bytes: int


@dataclass(frozen=True)
class Champion:
    """The model that scheduled retraining continues from and that `evaluate` validates."""

    round: int
    step: int
    checkpoint: str
    score: float

    @property
    def actor(self) -> str:
        """Hugging Face directory of the champion's weights (loads in plain transformers)."""
        return str(Path(self.checkpoint) / "actor")

    def describe(self) -> str:
        return f"round {self.round} (step {self.step}, score {self.score:.4f})"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _stored(root: Path, name: str, schema: pa.Schema) -> pa.Table:
    """The retraining directory's table `name`, or an empty one of `schema` while there is none."""
    path = root / name
    return pq.read_table(path, schema=schema) if path.is_file() else schema.empty_table()


def _promotions(root: Path) -> pa.Table:
    return _stored(root, PROMOTIONS, PROMOTIONS_SCHEMA)


def find_new_data(data_dir: str | Path, root: Path) -> tuple[list[DataFile], int]:
    """The .json/.jsonl files directly in `data_dir` whose content was never taken in nor set aside
    (sorted by name; hidden files are skipped, so write a file under a dot-name and rename it when
    complete), and how many files were skipped as seen before."""
    folder = Path(data_dir).resolve()
    if not folder.is_dir():
        raise FileNotFoundError(
            f"retraining data folder {folder} does not exist; create it and drop .json/.jsonl files there"
        )
    seen = {f["sha256"] for files in _promotions(root)["files"].to_pylist() for f in files}
    seen |= set(_unusable(root)["sha256"].to_pylist())
    new: list[DataFile] = []
    skipped = 0
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or not path.is_file() or path.suffix.lower() not in DATA_SUFFIXES:
            continue
        digest = file_sha256(path)
        if digest in seen:
            skipped += 1
            continue
        seen.add(digest)
        new.append(DataFile(str(path), digest, path.stat().st_size))
    return new, skipped


def _unusable(root: Path) -> pa.Table:
    return _stored(root, UNUSABLE, UNUSABLE_SCHEMA)


def set_aside_unusable(
    root: Path, files: list[DataFile], unusable: Callable[[Path], str | None]
) -> tuple[list[DataFile], list[dict], list[str]]:
    """(the files to train on, the rows of those that cannot be, why others cannot be read now).
    `unusable` says why a file cannot be taken in as data (None: it can), or raises OSError when it
    cannot be read now. The unusable ones are appended to unusable_files.parquet, so that one broken
    file does not fail every round from now on (their bytes are not tried again; an edited file is
    new content); a file that cannot be read now is left for the next run."""
    found_at = datetime.now(UTC)
    usable, rows, unreadable = [], [], []
    for file in files:
        try:
            reason = unusable(Path(file.path))
        except OSError as error:
            unreadable.append(f"{file.path}: {error.strerror or error}")
            continue
        if reason is None:
            usable.append(file)
        else:
            rows.append(dataclasses.asdict(file) | {"found_at": found_at, "reason": reason})
    if rows:
        table = pa.concat_tables([_unusable(root), pa.Table.from_pylist(rows, schema=UNUSABLE_SCHEMA)])
        write_table(table, root, UNUSABLE, UNUSABLE_SCHEMA, sync_now=True)
        refresh_retrain_catalog(root)
    return usable, rows, unreadable


def next_round(root: Path) -> int:
    return max(_promotions(root)["round"].to_pylist(), default=0) + 1


def round_dir(root: Path, number: int) -> Path:
    return root / ROUNDS / f"round={number:06d}"


def read_champion(root: Path) -> Champion | None:
    """The champion as the promotions table records it: its last promoted candidate (None before
    the first promotion)."""
    promoted = [r for r in _promotions(root).to_pylist() if r["decision"] == "promoted"]
    if not promoted:
        return None
    last = promoted[-1]
    checkpoint = checkpoint_here(root, last["candidate_checkpoint"])
    return Champion(last["round"], last["last_step"], checkpoint, last["candidate_score"])


def checkpoint_here(root: Path, recorded: str) -> str:
    """A round's checkpoint folder that the promotions table names (by its absolute path when it was
    decided), in this retraining directory: a moved or copied directory continues from its own
    rounds, not from the folder it was copied from."""
    parts = Path(recorded).parts
    starts = [i for i in range(len(parts) - 1) if parts[i] == ROUNDS and parts[i + 1].startswith("round=")]
    return str(root.joinpath(*parts[starts[-1] :])) if starts else recorded


def _pointed_at(pointer: Path) -> str | None:
    """The checkpoint champion.json names; None when it is missing or not such a record (it is
    rewritten from the promotions table then)."""
    try:
        record = read_json(pointer)
    except (OSError, ValueError):
        return None
    return record.get("checkpoint") if isinstance(record, dict) else None


def sync_champion_pointer(root: Path) -> Champion | None:
    """Make champion.json and the `champion` symlink match the promotions table (after a promotion,
    or when a crash left them behind). Call it only under the retraining lock."""
    champion = read_champion(root)
    pointer = root / CHAMPION
    if champion is not None and _pointed_at(pointer) != champion.checkpoint:
        write_json_atomic(
            pointer,
            {
                "round": champion.round,
                "step": champion.step,
                "checkpoint": champion.checkpoint,
                "actor": champion.actor,
                "score": champion.score,
            },
        )
        tmp = root / f".{CHAMPION_LINK}.{secrets.token_hex(6)}.tmp"
        os.symlink(os.path.relpath(champion.checkpoint, root), tmp)
        os.replace(tmp, root / CHAMPION_LINK)  # atomic: readers see the old champion or the new one
    return champion


def decide(candidate: float | None, incumbent: float, min_improvement: float) -> tuple[str, str]:
    """Promote only a candidate whose validation score beats the incumbent's by more than
    min_improvement; ties and regressions keep the champion."""
    if candidate is None or math.isnan(candidate):
        return "kept", "the candidate has no validation score"
    line = f"candidate {candidate:.4f} vs champion {incumbent:.4f}"
    if math.isclose(candidate, incumbent, rel_tol=SCORE_TOLERANCE, abs_tol=SCORE_TOLERANCE):
        return "kept", f"{line}: a tie keeps the champion"
    if candidate > incumbent + min_improvement:
        return "promoted", f"{line}: better by {candidate - incumbent:+.4f}"
    if candidate < incumbent:
        return "kept", f"{line}: a regression of {candidate - incumbent:+.4f}"
    return "kept", f"{line}: {candidate - incumbent:+.4f} is not more than min_improvement={min_improvement}"


def record_round(root: Path, number: int, files: list[DataFile], promotion: dict) -> dict:
    """Append the round's row (decision and the files it took in) to promotions.parquet in one
    atomic write, then point champion.json at the champion and refresh the catalog."""
    row = {
        "round": number,
        "decided_at": datetime.now(UTC),
        "files": [{"path": f.path, "sha256": f.sha256, "bytes": f.bytes} for f in files],
    } | promotion
    table = pa.concat_tables([_promotions(root), pa.Table.from_pylist([row], schema=PROMOTIONS_SCHEMA)])
    write_table(table, root, PROMOTIONS, PROMOTIONS_SCHEMA, sync_now=True)  # read without a digest
    sync_champion_pointer(root)
    refresh_retrain_catalog(root)
    return row


def start_promotions_table(root: Path) -> None:
    """Write the empty promotions table on a retraining directory's first run, so that the directory
    is one (for `ppoflow query` and its catalog) before any round has decided."""
    if not (root / PROMOTIONS).is_file():
        write_table(PROMOTIONS_SCHEMA.empty_table(), root, PROMOTIONS, PROMOTIONS_SCHEMA, sync_now=True)


def refresh_retrain_catalog(root: Path) -> Path:
    """root/catalog.duckdb: promotions, dataset_files (one row per file taken in, with its version)
    and round_metrics (every round's metrics rows, with their round)."""
    return write_catalog(root, lambda con: define_retrain_views(con, root))


def round_overrides(
    root: Path, number: int, files: list[DataFile], champion: Champion | None, iterations: int, test_freq: int
) -> list[str]:
    """The dotted overrides that turn the retraining config into this round's training run: train on
    the new files, from the champion (or from the base model), for `iterations` more steps,
    validating the incumbent first and the candidate last."""
    start = champion.step if champion else 0
    refuse_links_below(root, round_dir(root, number))  # a planted rounds/ link would take the run elsewhere
    overrides = [
        f"trainer.default_local_dir={round_dir(root, number)}",
        f"data.train_files={json.dumps([f.path for f in files])}",
        f"trainer.total_training_steps={start + iterations}",
        "trainer.val_before_train=true",
    ]
    if test_freq <= 0:  # the candidate must be validated: at least at the round's last step
        overrides.append(f"trainer.test_freq={iterations}")
    if champion:
        overrides += ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={champion.checkpoint}"]
    return overrides


def round_scores(summary: dict, first_step: int, last_step: int) -> tuple[float, float | None]:
    """(incumbent's score, candidate's score) from a round's validation curve."""
    scores = {int(step): score for step, score in summary["validation"]}
    if first_step - 1 not in scores:
        raise RuntimeError(f"the round did not validate the incumbent at step {first_step - 1}")
    return scores[first_step - 1], scores.get(last_step)


def decision_markdown(root: Path, row: dict, summary: dict) -> str:
    curve = " → ".join(f"{score:.3f}" for _, score in summary["validation"])
    files = "".join(f"  - `{f['path']}`\n" for f in row["files"])
    return (
        f"# Retraining round {row['round']}: {row['decision']}\n\n"
        f"{row['reason']}\n\n"
        f"- data: {len(row['files'])} new file(s), {row['train_rows']} prompts, "
        f"{row['rejected_rows']} rows rejected at ingest\n{files}"
        f"- validation curve of the round: {curve}\n"
        f"- candidate: `{row['candidate_checkpoint']}`\n"
        f"- champion now: `{root / CHAMPION}`\n"
        f'- every decision: `ppoflow query {root} "SELECT * FROM promotions ORDER BY round"`\n'
    )
