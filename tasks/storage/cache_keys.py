"""Cache keys of stages (stages are called through `results.run_stage`).

A stage's cache key = stage name + the settings it reads + the identities of its inputs + a hash of
the code that computes its outputs: the engine, the stage modules and model handling, and the
storage format (Prefect's TASK_SOURCE sees only the task's own lines, which would miss the helpers it
calls). Reporting, diagnose, tracking, the catalog and the CLI are not in it: editing them leaves
every stage cached. Identities are content digests for parquet and lineages for model states, so
timings and absolute paths never enter a key and a moved run directory still hits its cache.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
from pathlib import Path
from typing import Any

from ppoflow.tasks.storage.states import ModelState, StageResult
from ppoflow.tasks.storage.tables import ArtifactRef

TASKS_DIR = Path(__file__).resolve().parents[1]
STORAGE_FORMAT = (
    "tables.py",
    "schemas.py",
    "metric_docs.py",
    "tensors.py",
    "states.py",
    "checkpoints.py",
    "pretrained_files.py",
    "safetensors_files.py",
    "optimizer_state.py",
    "deepspeed_optimizer_state.py",
)
"""The storage modules that shape what a stage writes (parquet layout, schemas and their column docs,
the tensors read back, result types, the checkpoint files of models and optimizer states)."""


def computing_code(tasks_dir: Path = TASKS_DIR) -> tuple[Path, ...]:
    """The source files whose edits can change a stage's outputs: the engine, the stages, model
    handling and the storage format; not reporting, diagnose, tracking, retraining, the catalog, the
    lock or the CLI."""
    return (
        *sorted((tasks_dir.parent / "engine").rglob("*.py")),
        *sorted((tasks_dir / "stages").rglob("*.py")),
        *sorted((tasks_dir / "models").rglob("*.py")),
        *(tasks_dir / "storage" / name for name in STORAGE_FORMAT),
    )


COMPUTING_CODE = computing_code()


def identity(obj: Any) -> Any:
    """A JSON-able stand-in for `obj` that changes exactly when its content does."""
    if isinstance(obj, ArtifactRef):
        return obj.digest
    if isinstance(obj, StageResult):
        return [obj.stage, [r.digest for r in obj.refs]]
    if isinstance(obj, ModelState):
        return [obj.role, obj.lineage]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            f.name: identity(getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if f.metadata.get("cache_key", True)
        }
    if isinstance(obj, dict):
        return {str(k): identity(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, list | tuple):
        return [identity(v) for v in obj]
    if obj is None or isinstance(obj, str | int | float | bool):
        return obj
    raise TypeError(f"no cache identity for {type(obj).__name__}")


def digest_of(*parts: Any) -> str:
    payload = json.dumps([identity(p) for p in parts], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()


@functools.cache
def code_hash(module_file: str) -> str:
    """Hash of COMPUTING_CODE (a stage's code is its module and every helper it calls, which a
    per-module hash would miss), plus `module_file` when it lies elsewhere."""
    return files_hash([*COMPUTING_CODE, Path(module_file).resolve()])


def files_hash(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for path in dict.fromkeys(paths):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


NOT_IN_KEYS = ("run", "save")
"""Parameters that change where results are kept (checkpoint saving and pruning), not what they are."""


def key_for(task, parameters: dict[str, Any]) -> str:
    """Task name + code hash + identities of every parameter that affects the result."""
    relevant = {k: v for k, v in parameters.items() if k not in NOT_IN_KEYS}
    return f"{task.name}-{digest_of(code_hash(_source_file(task.fn)), relevant)[:40]}"


@functools.cache
def _source_file(fn) -> str:
    """The file defining a stage's function (asked three times a stage: its stat calls cost ~2 ms
    of each step of the embedded default)."""
    return inspect.getsourcefile(fn) or ""


def stage_cache_key(context, parameters: dict[str, Any]) -> str:
    """Prefect `cache_key_fn` for every stage task."""
    return key_for(context.task, parameters)


def current_cache_key() -> str:
    """The running task's cache key (empty when the body is called without Prefect, via `.fn`)."""
    from prefect.context import TaskRunContext

    context = TaskRunContext.get()
    return key_for(context.task, context.parameters) if context else ""
