"""Imports point inward only: engine ← tasks ← flows (STYLE.md rule 1)."""

import ast
from pathlib import Path

import pytest

from ppoflow.tasks.pipeline.cache_keys import imported_modules as runtime_imports

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "engine": {"prefect", "pyarrow", "duckdb", "wandb", "ppoflow.tasks", "ppoflow.flows", "ppoflow.cli"},
    "conf": {"torch", "prefect", "pyarrow", "duckdb", "ppoflow.engine", "ppoflow.tasks", "ppoflow.flows"},
    "tasks": {"ppoflow.flows", "ppoflow.cli"},
    "flows": {"torch", "pyarrow", "ppoflow.cli"},
}
ALLOWED = {
    "conf": {"ppoflow.engine.names"},  # the vocabularies config values are checked against (no torch)
}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_point_inward(layer):
    violations = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        for module in imported_modules(path):
            if module in ALLOWED.get(layer, ()):
                continue
            for banned in FORBIDDEN[layer]:
                if module == banned or module.startswith(banned + "."):
                    violations.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not violations, "\n".join(violations)


def test_the_check_itself_sees_imports(tmp_path):
    sample = tmp_path / "x.py"
    sample.write_text(
        "import prefect\nfrom ppoflow.tasks.storage.tables import write\nfrom .local import y\n"
    )
    assert imported_modules(sample) == {"prefect", "ppoflow.tasks.storage.tables"}


PACKAGES = {
    "ppoflow": "ppoflow",
    "ppoflow.engine": "engine",
    "ppoflow.tasks": "tasks",
    "ppoflow.flows": "flows",
    "ppoflow.conf": "conf",
}


def module_files() -> dict[str, Path]:
    """Every ppoflow module by its import name (packages by their __init__)."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((package, *parts))] = path
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The ppoflow modules `name` imports when it runs, at any depth of its code (a lazy import is a
    dependency; an import for type annotations only is not), read as the cache keys read them."""
    return {target for target in runtime_imports(path, name) if target in modules and target != name}


def test_no_import_cycles():
    """Modules form a DAG: a cycle makes import order matter and hides which layer owns what."""
    modules = module_files()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycle = path[path.index(name) :] + [name]
            pytest.fail("import cycle: " + " → ".join(cycle))
        if name in done:
            return
        for target in sorted(graph[name]):
            visit(target, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_the_cycle_check_resolves_relative_and_package_imports(tmp_path):
    modules = {
        "ppoflow.engine.a": tmp_path / "a.py",
        "ppoflow.engine.b": tmp_path / "b.py",
        "ppoflow.engine": tmp_path / "__init__.py",
        "ppoflow.engine.c": tmp_path / "c.py",
    }
    types_only = "if TYPE_CHECKING:\n    import ppoflow.engine.c\n"
    source = "from .b import x\nfrom ppoflow.engine import a\nimport json\n" + types_only
    (tmp_path / "a.py").write_text(source)
    assert imports_of("ppoflow.engine.a", tmp_path / "a.py", modules) == {
        "ppoflow.engine.b",
        "ppoflow.engine",
    }


def test_every_closed_vocabulary_is_defined_once():
    """A Literal of allowed values lives in one place (engine/names.py), so the config cannot accept
    a value the engine does not know."""
    defined: dict[str, list[str]] = {}
    for layer in ("engine", "conf"):
        for path in sorted((ROOT / layer).rglob("*.py")):
            for node in ast.parse(path.read_text()).body:
                value = node.value if isinstance(node, ast.Assign) else None
                if isinstance(value, ast.Subscript) and ast.unparse(value.value) == "Literal":
                    where = f"{path.relative_to(ROOT)}:{node.lineno}"
                    defined.setdefault(ast.unparse(value.slice), []).append(where)
    assert {values: where for values, where in defined.items() if len(where) > 1} == {}
    names = ROOT / "engine" / "names.py"
    assert imported_modules(names) == {"typing"}, "engine/names.py must import nothing but typing"


def test_each_registry_holds_exactly_its_vocabularys_names():
    """The policy-loss and estimator registries (STYLE.md rule 9) have one entry per name of their
    Literal, the names the config accepts, and each entry's settings type is a dataclass."""
    import dataclasses
    from typing import get_args

    from ppoflow.engine.advantages import ADVANTAGE_ESTIMATORS
    from ppoflow.engine.names import AdvEstimator, PolicyLossMode
    from ppoflow.engine.policy_losses import POLICY_LOSSES

    assert list(POLICY_LOSSES) == list(get_args(PolicyLossMode))
    assert list(ADVANTAGE_ESTIMATORS) == list(get_args(AdvEstimator))
    for entry in (*POLICY_LOSSES.values(), *ADVANTAGE_ESTIMATORS.values()):
        assert dataclasses.is_dataclass(entry.settings), entry


TASKS_ORDER = ["faults", "storage", "pipeline", "observe", "models", "retraining", "stages"]
"""tasks/'s parts, each importing only those before it: the run's storage knows nothing of how stages
run, the pipeline knows where models live only as a protocol, and where models live knows nothing of
the stages."""


def test_the_parts_of_tasks_import_only_the_parts_below_them():
    modules = module_files()
    wrong = []
    for name, path in modules.items():
        if not name.startswith("ppoflow.tasks."):
            continue
        part = name.split(".")[2]
        for target in imports_of(name, path, modules):
            other = target.split(".")[2] if target.startswith("ppoflow.tasks.") else part
            if TASKS_ORDER.index(other) > TASKS_ORDER.index(part):
                wrong.append(f"{name} imports {target}")
    assert wrong == []


@pytest.mark.parametrize("folder", ["storage", "pipeline"])
def test_storage_and_the_pipeline_name_no_type_from_above_them(folder):
    """Not even for annotations: storage/ never imports the Run back, pipeline/ no placement."""
    above = [f"ppoflow.tasks.{part}" for part in TASKS_ORDER[TASKS_ORDER.index(folder) + 1 :]]
    violations = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sorted((ROOT / "tasks" / folder).rglob("*.py"))
        for module in imported_modules(path)
        if any(module == a or module.startswith(a + ".") for a in above)
    ]
    assert not violations, "\n".join(violations)
