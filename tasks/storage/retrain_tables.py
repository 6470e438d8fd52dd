"""A retraining directory's tables: promotions.parquet (one row per round, the only record of its
decision) and the views over it and over every round's metrics (`define_retrain_views`), for its
catalog.duckdb and for `ppoflow query` of the directory."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import duckdb
import pyarrow as pa

from ppoflow.tasks.storage.schemas import doc_field
from ppoflow.tasks.storage.step_files import sql_literal

PROMOTIONS = "promotions.parquet"
UNUSABLE = "unusable_files.parquet"
ROUNDS = "rounds"
RETRAIN_VIEWS = ("promotions", "dataset_files", "round_metrics", "unusable_files")

DATA_FILE = pa.struct(
    [
        doc_field("path", pa.string(), "Absolute path of the file when it was taken in."),
        doc_field("sha256", pa.string(), "Content digest: a file with a digest seen before is skipped."),
        doc_field("bytes", pa.int64(), "File size."),
    ]
)
PROMOTIONS_SCHEMA = pa.schema(
    [
        doc_field("round", pa.int32(), "Retraining round (rounds/round=NNNNNN); also the dataset version."),
        doc_field("decided_at", pa.timestamp("us", tz="UTC"), "When the decision was made."),
        doc_field("decision", pa.string(), "'promoted' (the candidate is the new champion) or 'kept'."),
        doc_field("reason", pa.string(), "Why, with both scores."),
        doc_field("candidate_score", pa.float64(), "Validation score of the candidate.", nullable=True),
        doc_field("champion_score", pa.float64(), "Validation score of the incumbent, same validation set."),
        doc_field("candidate_checkpoint", pa.string(), "checkpoints/iter=NNNNNN folder of the candidate."),
        doc_field("incumbent", pa.string(), "Checkpoint folder the round started from, or 'base'."),
        doc_field("first_step", pa.int32(), "First PPO iteration of the round (global step)."),
        doc_field("last_step", pa.int32(), "Last PPO iteration of the round (global step)."),
        doc_field("train_rows", pa.int64(), "Prompts ingested from the round's files."),
        doc_field(
            "rejected_rows", pa.int64(), "Rows of those files rejected at ingest (the round's rejects)."
        ),
        doc_field("files", pa.list_(DATA_FILE), "The data files the round took in: its dataset version."),
        doc_field("flow_run_id", pa.string(), "Prefect flow run that made the decision.", nullable=True),
    ]
)


UNUSABLE_SCHEMA = pa.schema(
    [
        doc_field("path", pa.string(), "Absolute path of the file when it was found."),
        doc_field("sha256", pa.string(), "Content digest: the same bytes are not tried again."),
        doc_field("bytes", pa.int64(), "File size."),
        doc_field("found_at", pa.timestamp("us", tz="UTC"), "When the retrain flow set it aside."),
        doc_field("reason", pa.string(), "Why it cannot be read as data (format, encoding, no rows)."),
    ]
)
"""Files of the data folder that could not be read as data at all, set aside so that the rounds go on
(an edited file is new content: it is tried again)."""


def is_retraining_directory(directory: Path) -> bool:
    """Whether `directory` is the run directory of the retrain flow (its promotions or its rounds)."""
    return (directory / PROMOTIONS).is_file() or (directory / ROUNDS).is_dir()


def define_retrain_views(
    con: duckdb.DuckDBPyConnection, root: Path, names: Collection[str] = RETRAIN_VIEWS
) -> None:
    """Create promotions, dataset_files (one row per file taken in, with its version), round_metrics
    (every round's metrics rows, with their round) and unusable_files on `con`: all four, whichever of
    `names` a query reads (dataset_files reads promotions; round_metrics alone costs anything)."""
    _define_table(con, root / PROMOTIONS, "promotions", PROMOTIONS_SCHEMA)
    con.execute(
        "CREATE VIEW dataset_files AS SELECT round AS version, unnest(files, recursive := true), "
        "decided_at AS taken_at FROM promotions"
    )
    _define_table(con, root / UNUSABLE, "unusable_files", UNUSABLE_SCHEMA)
    six = "[0-9]" * 6  # (a stray folder, `iter=000005'`, would fail every query of the view)
    metrics_files = f"{ROUNDS}/round={six}/iter={six}/metrics/*.parquet"
    if any(root.glob(metrics_files)):
        pattern = sql_literal(str(root / metrics_files))
        con.execute(
            "CREATE VIEW round_metrics AS SELECT "
            r"CAST(regexp_extract(filename, 'round=(\d+)', 1) AS INTEGER) AS round, "
            r"CAST(regexp_extract(filename, 'iter=(\d+)', 1) AS INTEGER) AS iter, * EXCLUDE (filename) "
            f"FROM read_parquet({pattern}, union_by_name=true, filename=true, hive_partitioning=false)"
        )
    else:
        con.execute("CREATE TABLE round_metrics (round INTEGER, iter INTEGER, step INTEGER)")


def _define_table(con: duckdb.DuckDBPyConnection, path: Path, name: str, schema: pa.Schema) -> None:
    """A view of the parquet file at `path`, or an empty table of `schema` while there is none."""
    if path.is_file():
        con.execute(f"CREATE VIEW {name} AS SELECT * FROM read_parquet({sql_literal(str(path))})")
    else:
        con.register("_empty", schema.empty_table())
        con.execute(f"CREATE TABLE {name} AS SELECT * FROM _empty")
        con.unregister("_empty")
