"""Imports point inward only: engine ← tasks ← flows (STYLE.md rule 1)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "engine": {"prefect", "pyarrow", "duckdb", "wandb", "ppoflow.tasks", "ppoflow.flows", "ppoflow.cli"},
    "conf": {"torch", "prefect", "pyarrow", "duckdb", "ppoflow.engine", "ppoflow.tasks", "ppoflow.flows"},
    "tasks": {"ppoflow.flows", "ppoflow.cli"},
    "flows": {"torch", "pyarrow", "ppoflow.cli"},
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
            for banned in FORBIDDEN[layer]:
                if module == banned or module.startswith(banned + "."):
                    violations.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not violations, "\n".join(violations)


def test_the_check_itself_sees_imports(tmp_path):
    sample = tmp_path / "x.py"
    sample.write_text("import prefect\nfrom ppoflow.tasks.storage import write\nfrom .local import y\n")
    assert imported_modules(sample) == {"prefect", "ppoflow.tasks.storage"}
