"""The per-iteration manifest, iter=NNNNNN/_manifest.json: the step's commit record, written last,
naming each stage's files (refs with digests), rows, cache key and seconds. An iteration without one
never finished; the stage files it names are what the catalog and a resume read.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ppoflow.tasks.storage.regular_files import refuse_links_below
from ppoflow.tasks.storage.tables import (
    ArtifactRef,
    iteration_dir,
    iteration_number,
    read_json,
    step_of,
    timed_io,
    write_json_atomic,
)

MANIFEST_NAME = "_manifest.json"
MANIFEST_STAGE_KEYS = ("refs", "rows", "cache_key", "seconds")


def manifest_document(
    iteration: int, stages: Mapping[str, Mapping[str, Any]], states: Mapping[str, Any] | None = None
) -> dict:
    """iter=NNNNNN/_manifest.json's content: per stage its refs, rows, cache_key and seconds (extra
    keys are kept), and, when given, `states`: what the step started from and ended with
    ("started_from", "ended_with": the model states' lineages and β)."""
    entries = {}
    for name, stage in sorted(stages.items()):
        missing = [k for k in MANIFEST_STAGE_KEYS if k not in stage]
        if missing:
            raise ValueError(f"manifest entry for stage {name!r} lacks {missing}")
        refs = [r if isinstance(r, ArtifactRef) else ArtifactRef.from_dict(r) for r in stage["refs"]]
        entries[name] = {**stage, "refs": [r.to_dict() for r in refs]}
    document = {"iteration": iteration_number(iteration), "stages": entries}
    return document | dict(states or {})


@timed_io("tables")
def write_manifest(
    run_dir: str | Path,
    iteration: int,
    stages: Mapping[str, Mapping[str, Any]],
    states: Mapping[str, Any] | None = None,
) -> ArtifactRef:
    """Write iter=NNNNNN/_manifest.json, the iteration's commit record (`manifest_document`). Call it
    after every stage's files are written. Returns its reference (rows: the number of stages)."""
    manifest = manifest_document(iteration, stages, states)
    path = iteration_dir(run_dir, iteration) / MANIFEST_NAME
    refuse_links_below(run_dir, path.parent)
    digest = write_json_atomic(path, manifest)
    return ArtifactRef(path=path.relative_to(run_dir).as_posix(), digest=digest, rows=len(manifest["stages"]))


def read_manifest(run_dir: str | Path, iteration: int) -> dict | None:
    """The iteration's manifest, or None when it was never committed."""
    path = iteration_dir(run_dir, iteration) / MANIFEST_NAME
    try:
        return read_json(path)
    except FileNotFoundError:
        return None


def committed_iterations(run_dir: str | Path) -> list[int]:
    """The iterations whose manifest is written (their stages all finished), in order."""
    found = (step_of(p.parent.name) for p in Path(run_dir).glob(f"iter=*/{MANIFEST_NAME}"))
    return sorted(step for step in found if step is not None)


def trained_iterations(run_dir: str | Path) -> list[int]:
    """The committed iterations that trained, in order: their manifest names the rollouts stage (a
    step that only validates, before training or in a validation-only run, names validation and
    metrics alone). An unreadable manifest counts as not committed."""
    trained = []
    for step in committed_iterations(run_dir):
        try:
            stages = (read_manifest(run_dir, step) or {}).get("stages")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(stages, dict) and "rollouts" in stages:
            trained.append(step)
    return trained


def stage_refs(manifest: Mapping[str, Any], stage: str) -> list[ArtifactRef]:
    """The ArtifactRefs a manifest records for one stage."""
    return [ArtifactRef.from_dict(r) for r in manifest["stages"][stage]["refs"]]
