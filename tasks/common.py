"""What every stage shares: the run handle, model-state references and cache keys (stages are called
through `results.run_stage`).

A stage's cache key = stage name + the config section it reads + the identities of its inputs + a
hash of the code it runs (every engine and task module: Prefect's TASK_SOURCE sees only the task's
own lines). Identities are content digests for parquet and lineages for model states,
so timings and absolute paths never enter a key and a moved run directory still hits its cache.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .storage import ArtifactRef

TASKS_DIR = Path(__file__).resolve().parent
ENGINE_DIR = TASKS_DIR.parent / "engine"


@dataclass(frozen=True)
class Run:
    """The run directory (absolute). Not part of cache keys, so a moved run keeps its cache;
    `recompute` (trainer.resume_mode=disable) makes every stage run again instead of resuming."""

    run_dir: str
    recompute: bool = False

    @property
    def path(self) -> Path:
        return Path(self.run_dir)


ROLES = ("actor", "critic")


@dataclass(frozen=True)
class ModelState:
    """One version of a trained model. `lineage` hashes the parent state's lineage and what it was
    updated on (DESIGN.md "Identity"); `checkpoint` is its directory relative to the run (absolute for
    a base model used in place) and `checkpoint_digest` the digest of its weights and optimizer files,
    when saved; `origin` is the update that produced it, so a state that was not saved (or whose
    files were lost) can be rebuilt by replaying that update from its parent."""

    role: str
    lineage: str
    step: int
    checkpoint: str | None
    checkpoint_digest: str | None = None
    origin: UpdateInputs | None = None

    def __post_init__(self) -> None:
        # A state read back from a run directory names paths to write (checkpoints/iter=k/<role>):
        # nothing in it may lead out of the run.
        if self.role not in ROLES:
            raise ValueError(f"model state role must be one of {ROLES}, got {self.role!r}")
        if self.checkpoint is not None and ".." in Path(self.checkpoint).parts:
            raise ValueError(f"model state checkpoint {self.checkpoint!r} leads out of the run")

    def detached(self) -> ModelState:
        """This state without its replay history (a saved parent need not carry its own)."""
        return dataclasses.replace(self, origin=None)


@dataclass(frozen=True)
class UpdateInputs:
    """Everything an update stage consumed: enough to replay it bit for bit."""

    parent: ModelState
    step: int
    rollouts: ArtifactRef
    advantages: ArtifactRef
    config: dict
    batching: dict
    temperature: float
    total_steps: int


@dataclass(frozen=True)
class TrainState:
    """What one iteration hands the next: model states and the KL coefficient β."""

    actor: ModelState
    critic: ModelState | None
    reference: ModelState | None
    kl_coef: float


@dataclass(frozen=True)
class StageResult:
    """What a stage task returns through Prefect: references and small numbers, never data."""

    stage: str
    refs: tuple[ArtifactRef, ...]
    cache_key: str
    seconds: float
    values: tuple[tuple[str, float], ...] = ()

    def value(self, name: str) -> float:
        return dict(self.values)[name]

    @property
    def ref(self) -> ArtifactRef:
        return self.refs[0]


def identity(obj: Any) -> Any:
    """A JSON-able stand-in for `obj` that changes exactly when its content does."""
    if isinstance(obj, ArtifactRef):
        return obj.digest
    if isinstance(obj, StageResult):
        return [obj.stage, [r.digest for r in obj.refs]]
    if isinstance(obj, ModelState):
        return [obj.role, obj.lineage]
    if isinstance(obj, Run):
        return None
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return identity(dataclasses.asdict(obj))
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
    """Hash of every engine and task source file (a stage's code is its module and every helper it
    calls, which a per-module hash would miss), plus `module_file` when it lies elsewhere."""
    h = hashlib.sha256()
    files = sorted(ENGINE_DIR.rglob("*.py")) + sorted(TASKS_DIR.rglob("*.py"))
    for path in dict.fromkeys([*files, Path(module_file).resolve()]):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


NOT_IN_KEYS = ("run", "save", "trainer")
"""Parameters that change where results are kept (checkpoint saving and pruning), not what they are."""


def key_for(task, parameters: dict[str, Any]) -> str:
    """Task name + code hash + identities of every parameter that affects the result."""
    module_file = inspect.getsourcefile(task.fn) or ""
    relevant = {k: v for k, v in parameters.items() if k not in NOT_IN_KEYS}
    return f"{task.name}-{digest_of(code_hash(module_file), relevant)[:40]}"


def stage_cache_key(context, parameters: dict[str, Any]) -> str:
    """Prefect `cache_key_fn` for every stage task."""
    return key_for(context.task, parameters)


def current_cache_key() -> str:
    """The running task's cache key (empty when the body is called without Prefect, via `.fn`)."""
    from prefect.context import TaskRunContext

    context = TaskRunContext.get()
    return key_for(context.task, context.parameters) if context else ""


class StageTimer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start
