"""Cache keys hash the code that computes a stage's outputs, and nothing else: editing how a run is
reported or diagnosed leaves every finished stage cached; editing the engine or a stage recomputes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ppoflow.tasks.storage.cache_keys import COMPUTING_CODE, computing_code, files_hash

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def source_copy(tmp_path) -> Path:
    """engine/ and tasks/ copied, so that a test can edit them."""
    for folder in ("engine", "tasks"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "tasks"


def _edited(tasks_dir: Path, relative: str) -> str:
    path = tasks_dir.parent / relative
    before = files_hash(list(computing_code(tasks_dir)))
    path.write_text(path.read_text() + "\n# an edit\n")
    return before, files_hash(list(computing_code(tasks_dir)))


@pytest.mark.parametrize(
    "relative",
    [
        "tasks/observe/report.py",
        "tasks/observe/diagnose_rewards.py",
        "tasks/observe/console.py",
        "tasks/observe/tracking.py",
        "tasks/storage/catalog.py",
        "tasks/storage/lock.py",
        "tasks/retraining/rounds.py",
    ],
)
def test_editing_reporting_diagnose_or_the_catalog_keeps_every_key(source_copy, relative):
    before, after = _edited(source_copy, relative)
    assert before == after


@pytest.mark.parametrize(
    "relative",
    [
        "engine/losses.py",
        "engine/advantages.py",
        "tasks/stages/rollouts.py",
        "tasks/stages/model_update.py",
        "tasks/models/replay.py",
        "tasks/storage/schemas.py",
        "tasks/storage/metric_docs.py",  # column docs are written into the metrics parquet
    ],
)
def test_editing_the_engine_a_stage_or_the_storage_format_changes_every_key(source_copy, relative):
    before, after = _edited(source_copy, relative)
    assert before != after


def test_the_running_code_is_the_repositorys():
    assert computing_code(ROOT / "tasks") == COMPUTING_CODE
    assert all(path.is_file() for path in COMPUTING_CODE)
