"""Cache keys hash the code each stage runs, and nothing else: its import closure, the placements'
own files, and the code that answers the placement questions it asks. Editing the critic update
recomputes the updates and leaves rollouts, rewards and advantages cached; editing how a run is
reported leaves every stage cached; editing the storage format or a placement recomputes all."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ppoflow.tasks.pipeline.cache_keys import PACKAGES, StageCode, files_hash, imported_modules

ROOT = Path(__file__).resolve().parents[3]
FOLDERS = {"ppoflow": "ppoflow", "ppoflow.engine": "engine", "ppoflow.tasks": "tasks", "ppoflow.conf": "conf"}
STAGES = ("rollouts", "rewards", "advantages", "critic_update", "actor_update", "validation", "metrics")
ALL_STAGES = (*STAGES, "prompts", "prepare_model", "reward_model")


@pytest.fixture
def source_copy(tmp_path) -> StageCode:
    """ppoflow's package folders copied, so that a test can edit them."""
    for folder in FOLDERS.values():
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return StageCode({package: tmp_path / folder for package, folder in FOLDERS.items()})


def stage_hashes(code: StageCode) -> dict[str, str]:
    return {
        stage: files_hash(code.stage_files(code.locate(f"ppoflow.tasks.stages.{stage}"))) for stage in STAGES
    }


def edit(code: StageCode, relative: str, old: str | None = None, new: str = "") -> None:
    path = code.roots["ppoflow.engine"].parent / relative
    text = path.read_text()
    if old is None:
        path.write_text(text + "\n# an edit\n")
        return
    assert text.count(old) == 1, f"{relative} no longer holds {old!r}"
    path.write_text(text.replace(old, new))


def changed(code: StageCode, *edits: tuple) -> set[str]:
    before = stage_hashes(code)
    for one in edits:
        edit(code, *one)
    after = stage_hashes(code)
    return {stage for stage in STAGES if before[stage] != after[stage]}


def test_editing_the_critic_update_leaves_rollouts_rewards_and_advantages_cached(source_copy):
    critic_loss = ("engine/update.py", "def update_critic(", "def update_critic(  # value clipping, edited\n")
    assert changed(source_copy, critic_loss) == {"critic_update", "actor_update"}
    assert changed(source_copy, ("tasks/stages/critic_update.py",)) == {"critic_update"}
    assert changed(source_copy, ("tasks/models/replay.py",)) == {"critic_update", "actor_update"}


def test_editing_generation_recomputes_rollouts_and_validation_only(source_copy):
    assert changed(source_copy, ("tasks/models/generation.py",)) == {"rollouts", "validation"}


def test_code_reached_by_relative_imports_is_in_the_keys(source_copy):
    """engine/ imports its own modules relatively (`from .losses import …`)."""
    assert changed(source_copy, ("engine/losses.py",)) == {"critic_update", "actor_update", "metrics"}
    assert changed(source_copy, ("engine/advantages.py",)) == set(STAGES)  # via engine/ppo.py
    assert {"critic_update", "actor_update"} <= changed(source_copy, ("engine/kl.py",))


@pytest.mark.parametrize(
    "relative",
    [
        "tasks/observe/report.py",
        "tasks/observe/diagnose_rewards.py",
        "tasks/observe/console.py",
        "tasks/observe/tracking.py",
        "tasks/retraining/rounds.py",
        "tasks/pipeline/plan.py",  # builds settings; the settings themselves are in the key
    ],
)
def test_editing_reporting_or_retraining_keeps_every_key(source_copy, relative):
    assert changed(source_copy, (relative,)) == set()


@pytest.mark.parametrize(
    "relative",
    [
        "tasks/storage/schemas.py",
        "tasks/storage/tables.py",
        "tasks/storage/metric_docs.py",  # column docs are written into the metrics parquet
        "tasks/models/host.py",
        "tasks/pipeline/states.py",
        "engine/models.py",  # loading a model
    ],
)
def test_editing_the_storage_format_or_a_placement_changes_every_key(source_copy, relative):
    assert changed(source_copy, (relative,)) == set(STAGES)


def test_type_only_imports_are_not_code_but_lazy_and_relative_imports_are(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from typing import TYPE_CHECKING\n"
        "import ppoflow.engine.kl\n"
        "from .losses import compute_policy_loss\n"
        "from . import masking\n"
        "if TYPE_CHECKING:\n    from ppoflow.engine.update import UpdateResult\n"
        "else:\n    from ppoflow.engine.names import RM_SCORE\n"
        "def f():\n    from ppoflow.engine.rollout import pad_flat\n"
    )
    assert {m for m in imported_modules(sample, "ppoflow.engine.sample") if m.startswith("ppoflow")} == {
        "ppoflow.engine.kl",
        "ppoflow.engine.losses",
        "ppoflow.engine.losses.compute_policy_loss",
        "ppoflow.engine",
        "ppoflow.engine.masking",
        "ppoflow.engine.names",
        "ppoflow.engine.names.RM_SCORE",
        "ppoflow.engine.rollout",
        "ppoflow.engine.rollout.pad_flat",
    }
    assert "ppoflow.engine.losses" not in imported_modules(sample)  # no package to resolve it against


def test_every_engine_module_a_stage_runs_is_in_a_key():
    code = StageCode()
    hashed = {
        path
        for stage in ALL_STAGES
        for path in code.stage_files(code.locate(f"ppoflow.tasks.stages.{stage}"))
    }
    engine = set((ROOT / "engine").glob("*.py"))
    assert engine - hashed == {
        ROOT / "engine/reward_model.py"
    }  # `ppoflow reward-model`'s training, no stage's


def test_the_running_code_is_the_repositorys():
    installed = StageCode()
    assert set(installed.roots) == set(PACKAGES)
    assert all(installed.roots[package] == ROOT / folder for package, folder in FOLDERS.items())
    files = installed.stage_files(installed.locate("ppoflow.tasks.stages.rollouts"))
    assert ROOT / "tasks/stages/rollouts.py" in files and all(path.is_file() for path in files)
