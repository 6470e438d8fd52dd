"""Cache keys of stages (stages are called through `results.run_stage`).

A stage's cache key = stage name + the settings it reads + the identities of its inputs + a hash of
the code the stage runs (Prefect's TASK_SOURCE sees only the task's own lines, which would miss the
helpers it calls). That code is found by reading imports (`StageCode`): the stage module and every
ppoflow module it imports, transitively (its import closure), plus where the models live: the
placements' own files (`PLACEMENTS`, whose questions are methods of `ModelPlacement`) and, for each
question the stage asks (`run.models.<question>(...)` anywhere in its closure), the code that
answers it (`ANSWERS`). So editing the critic update recomputes the critic update and what follows
it, and leaves rollouts, rewards and advantages cached. Imports under `if TYPE_CHECKING:` are types,
not code that runs, and reporting (`NOT_COMPUTING`) prints what stages computed: neither is hashed.

Identities are content digests for parquet and lineages for model states, so timings and absolute
paths never enter a key and a moved run directory still hits its cache.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import importlib
import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ppoflow.tasks.pipeline.states import ModelState, StageResult
from ppoflow.tasks.storage.tables import ArtifactRef

PACKAGES = ("ppoflow", "ppoflow.engine", "ppoflow.tasks", "ppoflow.flows", "ppoflow.conf")
"""ppoflow's packages; each may live in a folder of its own (pyproject's package-dir)."""
PLACEMENTS = ("ppoflow.tasks.models.host", "ppoflow.tasks.models.workers", "ppoflow.tasks.models.worker")
"""The two placements (and a worker group's rank): their own files are in every stage's code."""
ANSWERS: Mapping[str, tuple[str, ...]] = {
    "rollouts": ("ppoflow.tasks.models.generation",),
    "generate": ("ppoflow.tasks.models.generation",),
    "values": ("ppoflow.engine.forward",),
    "reward_scores": ("ppoflow.engine.forward",),
    "train": ("ppoflow.tasks.models.replay",),
}
"""ModelPlacement question → the modules that compute its answer (with their import closures)."""
NOT_COMPUTING = ("ppoflow.tasks.observe",)
"""Progress bars, console lines, diagnose and reports: what a stage prints, not what it computes."""


class StageCode:
    """The source files a stage's outputs depend on, read from the package folders in `roots`
    (package name → folder; by default where ppoflow is installed)."""

    def __init__(self, roots: Mapping[str, Path] | None = None):
        self.roots = dict(roots) if roots is not None else _installed_roots()

    def locate(self, module: str) -> Path | None:
        """The file of a ppoflow module (None for anything else, or a name inside a module)."""
        package = max((p for p in self.roots if _under(module, (p,))), key=len, default=None)
        if package is None:
            return None
        folder = self.roots[package].joinpath(*module[len(package) :].split(".")[1:])
        for candidate in (folder.with_suffix(".py"), folder / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    def module_of(self, path: Path) -> str | None:
        """The dotted name of a file inside one of the package folders (None elsewhere)."""
        for package, folder in sorted(self.roots.items(), key=lambda item: -len(str(item[1]))):
            if path.is_relative_to(folder):
                parts = path.relative_to(folder).with_suffix("").parts
                return ".".join((package, *parts))
        return None

    def closure(self, files: list[Path], stop: tuple[str, ...] = ()) -> dict[str, Path]:
        """Module → file of every ppoflow module `files` import, transitively, the files themselves
        included; modules under `stop` and NOT_COMPUTING are left out (and not followed)."""
        found: dict[str, Path] = {str(path): path for path in files}
        pending = [name for path in files for name in imported_modules(path, self.module_of(path))]
        while pending:
            name = pending.pop()
            if name in found or _under(name, (*stop, *NOT_COMPUTING)):
                continue
            path = self.locate(name)
            if path is None or str(path) in found:
                continue
            found[name] = path
            pending.extend(imported_modules(path, name))
        return found

    def stage_files(self, stage_file: Path) -> list[Path]:
        """Every file whose edit can change what the stage in `stage_file` computes."""
        own = self.closure([stage_file])
        asked = {q for path in own.values() for q in placement_questions(path)}
        answering = tuple(sorted({m for q in asked for m in ANSWERS.get(q, ())}))
        every_answer = tuple(m for modules in ANSWERS.values() for m in modules)
        placements = self.closure(self._files(PLACEMENTS), stop=every_answer)
        answers = self.closure(self._files(answering))
        return sorted({*own.values(), *placements.values(), *answers.values()}, key=str)

    def _files(self, modules: tuple[str, ...]) -> list[Path]:
        return [path for path in map(self.locate, modules) if path is not None]


def _installed_roots() -> dict[str, Path]:
    return {name: Path(importlib.import_module(name).__file__).parent for name in PACKAGES}


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def imported_modules(path: Path, module: str | None = None) -> frozenset[str]:
    """The imports of a file, at any depth (a function's lazy import runs too), except those under
    `if TYPE_CHECKING:`; `from a import b` names both a and a.b (b may be a module). Relative imports
    (`from .losses import …`, as engine/ writes them) are resolved against `module`, the file's
    dotted name (without it they are left out)."""
    package = module if module is None or path.name == "__init__.py" else module.rpartition(".")[0]
    return _imports_in(path.read_text(), str(path), package)


@functools.lru_cache(maxsize=1024)
def _imports_in(source: str, filename: str, package: str | None) -> frozenset[str]:
    names: set[str] = set()

    def absolute(node: ast.ImportFrom) -> str | None:
        if node.level == 0:
            return node.module
        if not package:
            return None
        parts = package.split(".")
        if node.level - 1 >= len(parts):
            return None
        anchor = ".".join(parts[: len(parts) - (node.level - 1)])
        return f"{anchor}.{node.module}" if node.module else anchor

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for other in node.orelse:
                visit(other)
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (base := absolute(node)) is not None:
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source, filename=filename))
    return frozenset(names)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def placement_questions(path: Path) -> frozenset[str]:
    """The ModelPlacement methods a file calls as `<something>.models.<question>(...)`."""
    return _questions_in(path.read_text(), str(path))


@functools.lru_cache(maxsize=1024)
def _questions_in(source: str, filename: str) -> frozenset[str]:
    questions = set()
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and owner.attr == "models":
                questions.add(node.func.attr)
    return frozenset(questions)


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
def code_hash(stage_file: str) -> str:
    """Hash of the code the stage defined in `stage_file` runs (`StageCode.stage_files`)."""
    return files_hash(StageCode().stage_files(Path(stage_file).resolve()))


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
