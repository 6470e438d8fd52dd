"""A type checker holds both model placements (this process, a worker group) to the one protocol the
stages ask, `pipeline.placement.ModelPlacement`: a method either one lacks or answers with another
signature fails here, not at the first run on a cluster."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("engine", "tasks", "flows", "conf")
CHECKED = ("ppoflow/tasks/models/placement.py", "ppoflow/tasks/pipeline/placement.py")


def package_tree(tmp_path: Path) -> Path:
    """ppoflow laid out as it is installed (its package-dir folders inside ppoflow/), for mypy."""
    package = tmp_path / "ppoflow"
    shutil.copytree(ROOT / "ppoflow", package, ignore=shutil.ignore_patterns("__pycache__"))
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, package / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def mypy(tree: Path) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "mypy",
        "--config-file",
        str(ROOT / "pyproject.toml"),
        "--no-site-packages",
    ]
    command += ["--cache-dir", str(tree / ".mypy_cache"), *CHECKED]
    return subprocess.run(command, cwd=tree, capture_output=True, text=True, timeout=300)


def test_both_placements_answer_the_protocol(tmp_path):
    result = mypy(package_tree(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found in 2 source files" in result.stdout


def test_a_placement_that_answers_otherwise_is_caught(tmp_path):
    tree = package_tree(tmp_path)
    workers = tree / "ppoflow/tasks/models/workers.py"
    text = workers.read_text()
    assert text.count("    def drop(self, role: str) -> None:") == 1
    workers.write_text(
        text.replace("    def drop(self, role: str) -> None:", "    def drop(self, role: int) -> None:")
    )
    result = mypy(tree)
    assert result.returncode == 1
    assert '"WorkerGroupHost"' in result.stdout and "def drop(self, role: int) -> None" in result.stdout
