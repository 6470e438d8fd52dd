"""Committing a training step: once every stage of step k has written its files, and they are
fsynced, its manifest (iter=k/_manifest.json: per stage its files with digests, rows, cache key and
seconds) is written, last, and the DuckDB catalog picks up tables that appeared. A step without a
manifest was not committed: readers and resume ignore its files."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from ppoflow.tasks.pipeline.states import TIMING_PREFIX, StageResult
from ppoflow.tasks.storage.catalog import refresh_catalog_if_stale
from ppoflow.tasks.storage.durability import wait_durable
from ppoflow.tasks.storage.manifests import manifest_document, read_manifest, write_manifest

if TYPE_CHECKING:
    from ppoflow.tasks.pipeline.run import RunFiles


def commit_step(run: RunFiles, step: int, results: list[StageResult], states: dict | None = None) -> None:
    """Write step `step`'s manifest from its stages' results (and the model states it started from
    and ended with: see `manifest_document`), then refresh the catalog. A manifest on disk that names
    the same files, cache keys and states is kept as it is: a step served from cache leaves its files
    alone, and a stage recomputed to the same output keeps the seconds the step's (cached) metrics
    were computed from."""
    stages = {r.stage: _entry(r) for r in results}
    try:
        current = read_manifest(run.path, step)
    except (OSError, ValueError):
        current = None
    wanted = json.loads(json.dumps(manifest_document(step, stages, states)))
    with run.io.timing("sync"):  # the stages' files and checkpoints are on disk before a manifest names them
        wait_durable(run.path)
    if _outputs(current) is None or _outputs(current) != _outputs(wanted):
        write_manifest(run.path, step, stages, states, clock=run.io)
    refresh_catalog_if_stale(run.path, step, clock=run.io)


def _outputs(manifest: object) -> dict | None:
    """A manifest without its wall-clock fields; None for a file that is not a manifest (a damaged
    or planted one, which is then written again)."""
    stages = manifest.get("stages") if isinstance(manifest, dict) else None
    if not isinstance(stages, dict) or not all(isinstance(e, dict) for e in stages.values()):
        return None
    return {
        name: {k: v for k, v in entry.items() if k not in ("seconds", "timers")}
        for name, entry in stages.items()
    } | {key: manifest.get(key) for key in ("started_from", "ended_with")}


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
