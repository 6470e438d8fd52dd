"""Background fsyncs: a table's and a checkpoint's files reach the disk before the step's manifest
names them; a failed fsync fails the commit, naming the file, and leaves no manifest; records are
fsynced before they are renamed into place, as before."""

from __future__ import annotations

import errno
import os
import signal
import threading

import pyarrow as pa
import pytest
import torch

from ppoflow.tasks.pipeline.commit import commit_step
from ppoflow.tasks.pipeline.run import RunFiles
from ppoflow.tasks.pipeline.states import StageResult
from ppoflow.tasks.storage.checkpoints import optimizer_dir
from ppoflow.tasks.storage.durability import sync_later, wait_durable
from ppoflow.tasks.storage.manifests import read_manifest
from ppoflow.tasks.storage.tables import (
    artifact_is_valid,
    stage_path,
    write_json_atomic,
    write_table,
)


@pytest.fixture
def synced(monkeypatch, tmp_path):
    """The (device, inode) of every file or folder fsynced from now on, by any thread."""
    seen: list[tuple[int, int]] = []
    real = os.fsync

    def fsync(descriptor):
        info = os.fstat(descriptor)
        seen.append((info.st_dev, info.st_ino))
        real(descriptor)

    wait_durable(tmp_path)  # nothing of an earlier test is still in the queue
    monkeypatch.setattr(os, "fsync", fsync)
    yield seen
    wait_durable(tmp_path)


def failing_with(error: BaseException):
    def fsync(descriptor):
        raise error

    return fsync


def identity(path) -> tuple[int, int]:
    info = os.stat(path)
    return info.st_dev, info.st_ino


def test_a_table_is_synced_in_the_background_and_waited_for(tmp_path, synced):
    gate = threading.Event()
    real = os.fsync
    os.fsync = lambda d: (gate.wait(30), real(d))  # the background thread waits here
    try:
        ref = write_table(pa.table({"x": [1, 2]}), tmp_path, stage_path(1, "rewards"))
        assert synced == []  # the write returned without waiting for the disk
        gate.set()
    finally:
        os.fsync = real
    wait_durable(tmp_path)
    path = tmp_path / ref.path
    assert synced.index(identity(path)) < synced.index(identity(path.parent))


def test_a_record_is_synced_before_the_write_returns(tmp_path, synced):
    write_json_atomic(tmp_path / "state.json", {"step": 1})
    assert synced == [identity(tmp_path / "state.json"), identity(tmp_path)]


def test_a_failed_fsync_fails_the_commit_removes_the_file_and_writes_no_manifest(tmp_path, monkeypatch):
    """The file's pages may hold what the disk does not, and a second fsync would succeed: it is
    removed, so that its stage is made again (its digest no longer matches), not committed."""
    run = RunFiles(str(tmp_path))
    wait_durable(tmp_path)

    monkeypatch.setattr(os, "fsync", failing_with(OSError(errno.EIO, "Input/output error")))
    ref = write_table(pa.table({"x": [1, 2]}), tmp_path, stage_path(1, "rewards"))
    with pytest.raises(OSError, match="part-00000.parquet") as raised:
        commit_step(run, 1, [StageResult("rewards", (ref,), "key", 0.1, ())])
    assert raised.value.errno == errno.EIO and "could not make durable" in str(raised.value)
    assert read_manifest(tmp_path, 1) is None
    assert not (tmp_path / ref.path).exists() and not artifact_is_valid(tmp_path, ref)
    assert (tmp_path / ref.path).parent.is_dir()  # a folder is never removed
    monkeypatch.undo()
    again = write_table(pa.table({"x": [1, 2]}), tmp_path, stage_path(1, "rewards"))  # the stage, made again
    commit_step(run, 1, [StageResult("rewards", (again,), "key", 0.1, ())])
    assert read_manifest(tmp_path, 1)["stages"]["rewards"]["cache_key"] == "key"


def test_a_failure_of_another_runs_file_does_not_fail_this_runs_commit(tmp_path, monkeypatch, caplog):
    other, ours = tmp_path / "other", tmp_path / "ours"
    wait_durable(tmp_path)
    monkeypatch.setattr(os, "fsync", failing_with(OSError(errno.EIO, "Input/output error")))
    write_table(pa.table({"x": [1]}), other, stage_path(1, "rewards"))
    with caplog.at_level("WARNING"):
        wait_durable(ours)  # takes the other run's failure: logged, not raised
    monkeypatch.undo()
    assert str(other / stage_path(1, "rewards")) in caplog.text
    assert (other / stage_path(1, "rewards")).exists()  # not this run's to remove
    ref = write_table(pa.table({"x": [2]}), ours, stage_path(1, "rewards"))
    commit_step(RunFiles(str(ours)), 1, [StageResult("rewards", (ref,), "key", 0.1, ())])
    assert read_manifest(ours, 1) is not None


def test_an_open_error_fails_the_wait_but_removes_nothing(tmp_path, monkeypatch):
    """Only a failed fsync makes a file suspect; a file that could not be opened (too many open
    files, say) may be a committed step's good file, reused from cache."""
    wait_durable(tmp_path)
    ref = write_table(pa.table({"x": [1]}), tmp_path, stage_path(1, "rewards"))
    wait_durable(tmp_path)
    real_open = os.open

    def no_descriptors(path, flags, *args, **kwargs):
        if str(path).endswith(".parquet"):
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_descriptors)
    sync_later([tmp_path / ref.path])
    with pytest.raises(OSError, match="Too many open files; could not make durable"):
        wait_durable(tmp_path)
    monkeypatch.undo()
    assert artifact_is_valid(tmp_path, ref)


def test_a_failed_file_reached_through_a_planted_link_is_not_removed(tmp_path, monkeypatch):
    outside, run_dir = tmp_path / "outside", tmp_path / "run"
    outside.mkdir()
    (outside / "victim.safetensors").write_bytes(b"not the run's")
    (run_dir / "model").mkdir(parents=True)
    (run_dir / "model/base").symlink_to(outside)
    wait_durable(tmp_path)
    monkeypatch.setattr(os, "fsync", failing_with(OSError(errno.EIO, "Input/output error")))
    sync_later([run_dir / "model/base/victim.safetensors"])
    with pytest.raises(OSError, match="victim.safetensors"):
        wait_durable(run_dir)
    monkeypatch.undo()
    assert (outside / "victim.safetensors").read_bytes() == b"not the run's"


def test_a_cached_table_that_is_a_link_is_not_a_failure(tmp_path):
    target = tmp_path / "elsewhere.parquet"
    target.write_bytes(b"PAR1")
    (tmp_path / "iter=000001/rewards").mkdir(parents=True)
    (tmp_path / stage_path(1, "rewards")).symlink_to(target)
    wait_durable(tmp_path)
    sync_later([tmp_path / stage_path(1, "rewards")])
    wait_durable(tmp_path)


def test_an_unexpected_error_in_the_fsync_thread_fails_the_wait_instead_of_hanging_it(tmp_path, monkeypatch):
    wait_durable(tmp_path)
    monkeypatch.setattr(os, "fsync", failing_with(ValueError("odd")))
    ref = write_table(pa.table({"x": [1]}), tmp_path, stage_path(1, "rewards"))
    with pytest.raises(OSError, match="odd; could not make durable"):
        wait_durable(tmp_path)
    monkeypatch.undo()
    assert (tmp_path / ref.path).exists()  # removed only when fsync itself reports an OSError
    sync_later([tmp_path])
    wait_durable(tmp_path)  # the thread lives on


def test_a_table_read_without_its_digest_is_synced_before_the_write_returns(tmp_path, synced):
    ref = write_table(pa.table({"x": [1]}), tmp_path, "promotions.parquet", sync_now=True)
    assert synced == [identity(tmp_path / ref.path), identity(tmp_path)]


def test_a_cached_results_files_are_synced_again(tmp_path, tiny_model_dir, synced):
    """A process killed before its fsyncs leaves files a resumed run reuses from cache."""
    from ppoflow.tasks.pipeline.results import sync_outputs_later
    from ppoflow.tasks.pipeline.states import ModelState

    run = RunFiles(str(tmp_path))
    ref = write_table(pa.table({"x": [1]}), tmp_path, stage_path(1, "rewards"))
    relative = _saved_checkpoint(run, tiny_model_dir)
    wait_durable(tmp_path)
    synced.clear()
    state = ModelState("actor", "lineage", 1, relative, "sha256:x", None, "sha256:y")
    sync_outputs_later(run, (StageResult("rewards", (ref,), "key", 0.1, ()), state))
    wait_durable(tmp_path)
    folder = tmp_path / relative
    for path in [tmp_path / ref.path, *folder.iterdir(), folder, *optimizer_dir(folder).iterdir()]:
        assert identity(path) in synced, path.name


def test_a_checkpoints_folder_that_is_a_link_to_another_disk_is_synced(tmp_path, tiny_model_dir, synced):
    elsewhere = tmp_path / "larger-disk"
    elsewhere.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run/checkpoints").symlink_to(elsewhere)
    run = RunFiles(str(tmp_path / "run"))
    relative = _saved_checkpoint(run, tiny_model_dir)
    commit_step(run, 1, [])
    assert identity(elsewhere) in synced
    assert identity(tmp_path / "run" / relative / "model.safetensors") in synced


def test_a_path_gone_before_its_fsync_is_not_a_failure(tmp_path):
    wait_durable(tmp_path)
    sync_later([tmp_path / "never-written.parquet"])
    wait_durable(tmp_path)


def test_a_fifo_under_a_files_name_fails_the_wait_instead_of_blocking_it(tmp_path):
    fifo = tmp_path / "part-00000.parquet"
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def wait() -> None:
        try:
            sync_later([fifo])
            wait_durable(tmp_path)
            outcome.append(None)
        except OSError as error:
            outcome.append(error)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(60)
    assert not waiter.is_alive(), "a FIFO blocked the fsync thread"
    [error] = outcome
    assert isinstance(error, OSError) and str(fifo) in str(error)


def _saved_checkpoint(run, tiny_model_dir) -> str:
    from ppoflow.engine.models import load_actor, load_tokenizer
    from ppoflow.engine.optim import build_optimizer
    from ppoflow.tasks.pipeline.model_files import save_checkpoint
    from ppoflow.tasks.storage.checkpoints import Trainable

    from ...engine.settings import optim_settings

    model = load_actor(tiny_model_dir)
    optimizer, scheduler = build_optimizer(model, optim_settings(lr=0.01))
    model(input_ids=torch.ones(1, 3, dtype=torch.long)).logits.sum().backward()
    optimizer.step()
    trainable = Trainable(model, optimizer, scheduler)
    return save_checkpoint(run, "actor", 1, trainable, load_tokenizer(tiny_model_dir))[0]


def test_a_checkpoints_files_are_synced_before_its_step_is_committed(tmp_path, tiny_model_dir, synced):
    run = RunFiles(str(tmp_path))
    relative = _saved_checkpoint(run, tiny_model_dir)
    commit_step(run, 1, [])
    folder = tmp_path / relative
    files = [*folder.iterdir(), *optimizer_dir(folder).iterdir()]
    assert {"model.safetensors", "model-00001-of-00001.safetensors"} <= {f.name for f in files}
    for path in [*files, folder, optimizer_dir(folder), folder.parent, tmp_path / "checkpoints"]:
        assert identity(path) in synced, f"{path.name} was not fsynced"
    for path in files:
        assert synced.index(identity(path)) < synced.index(identity(path.parent))


def test_a_forked_child_starts_with_an_empty_queue(tmp_path):
    gate = threading.Event()
    real = os.fsync
    os.fsync = lambda d: (gate.wait(30), real(d))
    try:
        sync_later([tmp_path])  # the parent's thread is busy with this one
        child = os.fork()
        if child == 0:  # pragma: no cover (the child's exit status is the assertion)
            os.fsync = real
            signal.alarm(30)  # a child stuck waiting on its parent's queue is killed, and fails
            try:
                wait_durable(tmp_path)  # returns at once: nothing of the parent's is the child's to wait for
                os._exit(0)
            except BaseException:
                os._exit(1)
        gate.set()
        _, status = os.waitpid(child, 0)
    finally:
        os.fsync = real
        gate.set()
    wait_durable(tmp_path)
    assert os.waitstatus_to_exitcode(status) == 0
