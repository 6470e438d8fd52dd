"""What anyone may have put into a run directory (links, hard links, FIFOs, files of the wrong kind)
is never written, moved or deleted through, and says what is wrong in one line."""

import json
import os

import pytest

from ppoflow.tasks.pipeline.run import RunFiles

REFUSED = "refusing to (write|delete) through a link inside the run"


@pytest.fixture
def outside(tmp_path):
    folder = tmp_path / "outside"
    (folder / "base").mkdir(parents=True)
    (folder / "base/keep.txt").write_text("precious")
    (folder / "rejects_train.parquet").write_text("precious")
    return folder


def _untouched(outside) -> None:
    assert sorted(p.name for p in outside.iterdir()) == ["base", "rejects_train.parquet"]
    assert [p.name for p in (outside / "base").iterdir()] == ["keep.txt"]
    assert (outside / "base/keep.txt").read_text() == "precious"


def test_a_linked_model_folder_is_refused_before_anything_moves(tmp_path, outside):
    from ppoflow.tasks.stages.prepare_model import _install_copy

    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text("{}")
    run = tmp_path / "run"
    run.mkdir()
    (run / "model").symlink_to(outside)  # outside/base would be moved aside and deleted
    with pytest.raises(OSError, match=REFUSED):
        _install_copy(source, RunFiles(str(run)), "model/base")
    _untouched(outside)


def test_stale_rejects_are_removed_but_not_through_a_linked_data_folder(tmp_path, outside):
    from ppoflow.tasks.stages.prompts import _write_rejects

    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    (run / "data/rejects_train.parquet").write_text("from an earlier ingest")
    assert _write_rejects(RunFiles(str(run)), "train", []) == ()
    assert not (run / "data/rejects_train.parquet").exists()
    (run / "data").rmdir()
    (run / "data").symlink_to(outside)
    with pytest.raises(OSError, match=REFUSED):
        _write_rejects(RunFiles(str(run)), "train", [])
    _untouched(outside)


def test_a_linked_rounds_or_wandb_folder_is_refused(tmp_path, outside):
    from ppoflow.tasks.observe.wandb_logger import WandbLogger
    from ppoflow.tasks.retraining.rounds import round_overrides

    root = tmp_path / "retrain"
    root.mkdir()
    (root / "rounds").symlink_to(outside)  # a whole round's run would be written there
    with pytest.raises(OSError, match=REFUSED):
        round_overrides(root, 2, [], None, iterations=3, test_freq=1)
    for name in ("wandb", ".wandb"):  # wandb writes into either
        run = tmp_path / f"run{name}"
        run.mkdir()
        (run / name).symlink_to(outside)
        with pytest.raises(OSError, match=REFUSED):
            WandbLogger(None, run)
    _untouched(outside)


def test_a_hard_linked_lock_file_is_refused_not_overwritten(tmp_path):
    from ppoflow.tasks.storage.lock import LOCK_NAME, RunLocked, acquire_run_lock

    other = tmp_path / "someone-elses.txt"
    other.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    os.link(other, run / LOCK_NAME)
    with pytest.raises(RunLocked, match="hard link"):
        acquire_run_lock(run)
    assert other.read_text() == "precious"


def test_a_config_that_is_not_a_run_config_is_said_in_one_line(tmp_path):
    from ppoflow.tasks.observe.diagnose import RunDirError, load_run

    for content in (b"\xff\xfe", b"trainer: [", b"- a list\n"):
        (tmp_path / "config.yaml").write_bytes(content)
        with pytest.raises(RunDirError, match=r"config.yaml (cannot be read as|is not) the run's config"):
            load_run(tmp_path)


def test_a_champion_record_of_the_wrong_kind_is_rewritten(tmp_path):
    from ppoflow.tasks.retraining.rounds import _pointed_at

    pointer = tmp_path / "champion.json"
    for content in ("[1, 2]", "not json", '"a string"'):
        pointer.write_text(content)
        assert _pointed_at(pointer) is None
    pointer.write_text(json.dumps({"checkpoint": "/runs/r/checkpoints/iter=000003"}))
    assert _pointed_at(pointer) == "/runs/r/checkpoints/iter=000003"


def test_checkpoints_are_ordered_by_step_and_planted_names_are_not_checkpoints(tmp_path):
    from ppoflow.tasks.storage.manifests import MANIFEST_NAME, committed_iterations
    from ppoflow.tasks.storage.tables import saved_folders

    for name in ("iter=1000000", "iter=999999", "iter=zzz", "iter=", "iter=5", "iter=00000²", "notes"):
        (tmp_path / name / "actor").mkdir(parents=True)
        (tmp_path / name / MANIFEST_NAME).write_text("{}")
    assert [p.parent.name for p in saved_folders(tmp_path, "actor")] == ["iter=999999", "iter=1000000"]
    assert committed_iterations(tmp_path) == [999999, 1000000]
