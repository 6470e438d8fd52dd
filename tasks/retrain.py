"""Scheduled retraining: new data files → a round of PPO from the champion → promote only if better.

A retraining directory (the `run_dir` of the retrain flow) holds:

    dataset_files.parquet   every data file ever taken in: its dataset version, path, sha256, size
    promotions.parquet      one row per decision (promoted or kept), both scores and the reason
    champion.json           the champion: its checkpoint folder, actor directory, score and round
    champion -> rounds/round=000001/checkpoints/iter=000005   (a symlink to the same folder)
    rounds/round=NNNNNN/    one ppoflow run directory per round, with its own catalog
    evaluations/            validation-only runs of the evaluate flow
    catalog.duckdb          views promotions, dataset_files and round_metrics (every round's metrics)

Files are content-addressed: a file whose bytes were taken in before (under any name) is not taken
in again. The promotions table is the record; champion.json and the symlink are derived from its last
promoted row (and rewritten from it if a crash left them behind).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from .catalog import write_catalog
from .storage import read_json, write_json_atomic, write_table

DATA_SUFFIXES = (".json", ".jsonl")
LEDGER = "dataset_files.parquet"
PROMOTIONS = "promotions.parquet"
CHAMPION = "champion.json"
CHAMPION_LINK = "champion"
BASE = "base"
"""The incumbent of the first round: the configured base model, not a checkpoint."""


def _f(name: str, type_: pa.DataType, doc: str, nullable: bool = False) -> pa.Field:
    return pa.field(name, type_, nullable=nullable, metadata={"doc": doc})


LEDGER_SCHEMA = pa.schema(
    [
        _f("version", pa.int32(), "Dataset version: the retraining round that took the file in."),
        _f("path", pa.string(), "Absolute path of the file when it was taken in."),
        _f("sha256", pa.string(), "Content digest; a file with a digest seen before is not taken in again."),
        _f("bytes", pa.int64(), "File size."),
        _f("taken_at", pa.timestamp("us", tz="UTC"), "When the round that trained on it finished."),
    ]
)
PROMOTIONS_SCHEMA = pa.schema(
    [
        _f("round", pa.int32(), "Retraining round (rounds/round=NNNNNN)."),
        _f("decided_at", pa.timestamp("us", tz="UTC"), "When the decision was made."),
        _f("decision", pa.string(), "'promoted' (the candidate is the new champion) or 'kept'."),
        _f("reason", pa.string(), "Why, with both scores."),
        _f("candidate_score", pa.float64(), "Validation score of the candidate (after the round).", True),
        _f("champion_score", pa.float64(), "Validation score of the incumbent, on the same validation set."),
        _f("candidate_checkpoint", pa.string(), "checkpoints/iter=NNNNNN folder of the candidate."),
        _f("incumbent", pa.string(), "Checkpoint folder of the champion the round started from, or 'base'."),
        _f("first_step", pa.int32(), "First PPO iteration of the round (global step)."),
        _f("last_step", pa.int32(), "Last PPO iteration of the round (global step)."),
        _f("dataset_version", pa.int32(), "Version of the data trained on (see dataset_files)."),
        _f("data_files", pa.int32(), "Number of new files in that version."),
        _f("flow_run_id", pa.string(), "Prefect flow run that made the decision.", True),
    ]
)


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


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _read(root: Path, name: str, schema: pa.Schema) -> pa.Table:
    path = root / name
    return pq.read_table(path, schema=schema) if path.is_file() else schema.empty_table()


def find_new_data(data_dir: str | Path, root: Path) -> tuple[list[DataFile], int]:
    """The .json/.jsonl files directly in `data_dir` whose content was never taken in (sorted by name;
    hidden files are skipped, so write a file under a dot-name and rename it when complete), and how
    many files were skipped as seen before."""
    folder = Path(data_dir).resolve()
    if not folder.is_dir():
        raise FileNotFoundError(
            f"retraining data folder {folder} does not exist; create it and drop .json/.jsonl files there"
        )
    seen = set(_read(root, LEDGER, LEDGER_SCHEMA)["sha256"].to_pylist())
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


def next_round(root: Path) -> int:
    rounds = _read(root, PROMOTIONS, PROMOTIONS_SCHEMA)["round"].to_pylist()
    return max(rounds, default=0) + 1


def round_dir(root: Path, number: int) -> Path:
    return root / "rounds" / f"round={number:06d}"


def read_champion(root: Path) -> Champion | None:
    """The champion as the promotions table records it (None before the first promotion); repairs
    champion.json and the symlink if a crash left them out of step with the table."""
    promoted = [
        r for r in _read(root, PROMOTIONS, PROMOTIONS_SCHEMA).to_pylist() if r["decision"] == "promoted"
    ]
    if not promoted:
        return None
    last = promoted[-1]
    champion = Champion(
        last["round"], last["last_step"], last["candidate_checkpoint"], last["candidate_score"]
    )
    pointer = root / CHAMPION
    if not pointer.is_file() or read_json(pointer).get("checkpoint") != champion.checkpoint:
        _write_pointer(root, champion)
    return champion


def _write_pointer(root: Path, champion: Champion) -> None:
    write_json_atomic(
        root / CHAMPION,
        {
            "round": champion.round,
            "step": champion.step,
            "checkpoint": champion.checkpoint,
            "actor": champion.actor,
            "score": champion.score,
        },
    )
    link = root / CHAMPION_LINK
    tmp = root / f".{CHAMPION_LINK}.tmp"
    tmp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(champion.checkpoint, root), tmp)
    os.replace(tmp, link)  # atomic: readers see the old champion or the new one


def decide(candidate: float | None, incumbent: float, min_improvement: float) -> tuple[str, str]:
    """Promote only a candidate whose validation score beats the incumbent's by more than
    min_improvement; ties and regressions keep the champion."""
    if candidate is None or math.isnan(candidate):
        return "kept", "the candidate has no validation score"
    line = f"candidate {candidate:.4f} vs champion {incumbent:.4f}"
    if candidate > incumbent + min_improvement:
        return "promoted", f"{line}: better by {candidate - incumbent:+.4f}"
    if candidate == incumbent:
        return "kept", f"{line}: a tie keeps the champion"
    if candidate < incumbent:
        return "kept", f"{line}: a regression of {candidate - incumbent:+.4f}"
    return "kept", f"{line}: {candidate - incumbent:+.4f} is not more than min_improvement={min_improvement}"


def record_round(
    root: Path,
    number: int,
    files: list[DataFile],
    promotion: dict,
) -> dict:
    """Append the decision to promotions.parquet (the record), then the files to dataset_files.parquet,
    then point champion.json at the champion; refresh the catalog."""
    now = datetime.now(UTC)
    row = {
        "round": number,
        "decided_at": now,
        "dataset_version": number,
        "data_files": len(files),
    } | promotion
    _append(root, PROMOTIONS, PROMOTIONS_SCHEMA, [row])
    ledger = [
        {"version": number, "path": f.path, "sha256": f.sha256, "bytes": f.bytes, "taken_at": now}
        for f in files
    ]
    _append(root, LEDGER, LEDGER_SCHEMA, ledger)
    read_champion(root)
    refresh_retrain_catalog(root)
    return row


def _append(root: Path, name: str, schema: pa.Schema, rows: list[dict]) -> None:
    table = pa.concat_tables([_read(root, name, schema), pa.Table.from_pylist(rows, schema=schema)])
    write_table(table, root, name, schema)


def refresh_retrain_catalog(root: Path) -> Path:
    """root/catalog.duckdb: promotions, dataset_files, and round_metrics (every round's metrics rows,
    with their round)."""

    def define(con: duckdb.DuckDBPyConnection) -> None:
        for view, name, schema in (
            ("promotions", PROMOTIONS, PROMOTIONS_SCHEMA),
            ("dataset_files", LEDGER, LEDGER_SCHEMA),
        ):
            path = root / name
            if path.is_file():
                con.execute(f"CREATE VIEW {view} AS SELECT * FROM read_parquet({_literal(str(path))})")
            else:
                con.register(f"_{view}", schema.empty_table())
                con.execute(f"CREATE TABLE {view} AS SELECT * FROM _{view}")
        pattern = root / "rounds" / "round=*" / "iter=*" / "metrics" / "*.parquet"
        if any(root.glob("rounds/round=*/iter=*/metrics/*.parquet")):
            con.execute(
                "CREATE VIEW round_metrics AS SELECT "
                r"CAST(regexp_extract(filename, 'round=(\d+)', 1) AS INTEGER) AS round, "
                r"CAST(regexp_extract(filename, 'iter=(\d+)', 1) AS INTEGER) AS iter, * EXCLUDE (filename) "
                f"FROM read_parquet({_literal(str(pattern))}, union_by_name=true, filename=true, "
                "hive_partitioning=false)"
            )
        else:
            con.execute("CREATE TABLE round_metrics (round INTEGER, iter INTEGER, step INTEGER)")

    return write_catalog(root, define)


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def round_overrides(
    root: Path, number: int, files: list[DataFile], champion: Champion | None, iterations: int, test_freq: int
) -> list[str]:
    """The dotted overrides that turn the retraining config into this round's training run: train on
    the new files, from the champion (or from the base model), for `iterations` more steps,
    validating the incumbent first and the candidate last."""
    start = champion.step if champion else 0
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
    scores = dict((int(step), score) for step, score in summary["validation"])
    if first_step - 1 not in scores:
        raise RuntimeError(f"the round did not validate the incumbent at step {first_step - 1}")
    return scores[first_step - 1], scores.get(last_step)
