"""RUN_DIR/flow_runs.json: the Prefect flow runs that trained the run, newest last, so that a reader
(`ppoflow explore`) can link a run to its flow run in Prefect's UI. Written at each start of a flow
on the run, under the run's lock; read as untrusted data (a planted or damaged file gives nothing)."""

from __future__ import annotations

import json
from pathlib import Path

from ppoflow.tasks.storage.tables import write_json_atomic

__all__ = ["FLOW_RUNS_FILE", "KEPT_FLOW_RUNS", "TEMPORARY_SERVER_ENV", "read_flow_runs", "record_flow_run"]

FLOW_RUNS_FILE = "flow_runs.json"
TEMPORARY_SERVER_ENV = "PPOFLOW_TEMPORARY_PREFECT_SERVER"
"""Set while `ppoflow train` reports to a temporary Prefect server of its own (no UI, gone after)."""
KEPT_FLOW_RUNS = 50
FIELDS = ("id", "name", "flow", "started", "ui_url", "temporary_server")
MAX_FILE_BYTES = 2**20
MAX_FIELD_CHARS = 2_000


def record_flow_run(run_dir: str | Path, entry: dict) -> None:
    """Append `entry` (FIELDS) to the run's record, keeping the newest KEPT_FLOW_RUNS."""
    path = Path(run_dir) / FLOW_RUNS_FILE
    kept = read_flow_runs(path.parent)
    kept.append({k: entry.get(k) for k in FIELDS})
    write_json_atomic(path, kept[-KEPT_FLOW_RUNS:])


def read_flow_runs(run_dir: str | Path) -> list[dict]:
    """The recorded flow runs, each with the FIELDS as strings (of at most MAX_FIELD_CHARS), booleans
    or null; an entry of another shape is left out, a URL that is not http(s) is dropped (it becomes a
    link on a page), and a file larger than MAX_FILE_BYTES or nested too deep reads as none."""
    path = Path(run_dir) / FLOW_RUNS_FILE
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return []
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return []
    if not isinstance(entries, list):
        return []
    kept = []
    for entry in entries[-KEPT_FLOW_RUNS:]:
        if not isinstance(entry, dict):
            continue
        record = {k: entry.get(k) for k in FIELDS}
        if not all(v is None or isinstance(v, bool) or _short_text(v) for v in record.values()):
            continue
        if not str(record["ui_url"] or "").startswith(("http://", "https://")):
            record["ui_url"] = None
        kept.append(record)
    return kept


def _short_text(value) -> bool:
    return isinstance(value, str) and len(value) <= MAX_FIELD_CHARS
