"""Committing a training step: once every stage of step k has written its files, its manifest
(iter=k/_manifest.json: per stage its files with digests, rows, cache key and seconds) is written,
last, and the DuckDB catalog picks up tables that appeared. A step without a manifest was not
committed: readers and resume ignore its files."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from ppoflow.tasks.storage.catalog import refresh_catalog_if_stale
from ppoflow.tasks.storage.states import TIMING_PREFIX, StageResult
from ppoflow.tasks.storage.tables import manifest_document, read_manifest, write_manifest

if TYPE_CHECKING:
    from ppoflow.tasks.run import Run


def commit_step(run: Run, step: int, results: list[StageResult]) -> None:
    """Write step `step`'s manifest from its stages' results (unless the one on disk already says
    exactly that: a step served from cache leaves its files as they are), then refresh the catalog."""
    stages = {r.stage: _entry(r) for r in results}
    try:
        current = read_manifest(run.path, step)
    except (OSError, ValueError):
        current = None
    if current != json.loads(json.dumps(manifest_document(step, stages))):
        write_manifest(run.path, step, stages, clock=run.io)
    refresh_catalog_if_stale(run.path, clock=run.io)


def _entry(result: StageResult) -> dict:
    """A stage's manifest entry: its files, rows, cache key, seconds, and verl's timers it measured
    (timing_s/gen, …), from which the step's timing metrics are computed."""
    timers = {
        name.removeprefix(TIMING_PREFIX): v for name, v in result.values if name.startswith(TIMING_PREFIX)
    }
    entry = {
        "refs": list(result.refs),
        "rows": sum(ref.rows for ref in result.refs),
        "cache_key": result.cache_key,
        "seconds": result.seconds,
    }
    return entry | ({"timers": timers} if timers else {})
