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

from ppoflow.tasks.run import Run
from ppoflow.tasks.storage import durability
from ppoflow.tasks.storage.commit import commit_step
from ppoflow.tasks.storage.durability import sync_later, wait_durable
from ppoflow.tasks.storage.states import StageResult
from ppoflow.tasks.storage.tables import read_manifest, stage_path, write_json_atomic, write_table


@pytest.fixture
def synced(monkeypatch):
    """The (device, inode) of every file or folder fsynced from now on, by any thread."""
    seen: list[tuple[int, int]] = []
    real = os.fsync

    def fsync(descriptor):
        info = os.fstat(descriptor)
        seen.append((info.st_dev, info.st_ino))
        real(descriptor)

    wait_durable()  # nothing of an earlier test is still in the queue
    monkeypatch.setattr(os, "fsync", fsync)
    yield seen
    wait_durable()


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
    wait_durable()
    path = tmp_path / ref.path
    assert synced.index(identity(path)) < synced.index(identity(path.parent))


def test_a_record_is_synced_before_the_write_returns(tmp_path, synced):
    write_json_atomic(tmp_path / "state.json", {"step": 1})
    assert synced == [identity(tmp_path / "state.json"), identity(tmp_path)]


def test_a_failed_fsync_fails_the_commit_and_writes_no_manifest(tmp_path, monkeypatch):
    run = Run(str(tmp_path))
    wait_durable()

    def failing(descriptor):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing)
    ref = write_table(pa.table({"x": [1, 2]}), tmp_path, stage_path(1, "rewards"))
    with pytest.raises(OSError, match="part-00000.parquet") as raised:
        commit_step(run, 1, [StageResult("rewards", (ref,), "key", 0.1, ())])
    assert raised.value.errno == errno.EIO and "could not make durable" in str(raised.value)
    assert read_manifest(tmp_path, 1) is None
    monkeypatch.undo()
    commit_step(run, 1, [StageResult("rewards", (ref,), "key", 0.1, ())])  # reported once, then clean
    assert read_manifest(tmp_path, 1)["stages"]["rewards"]["cache_key"] == "key"


def test_a_path_gone_before_its_fsync_is_not_a_failure(tmp_path):
    wait_durable()
    sync_later([tmp_path / "never-written.parquet"])
    wait_durable()


def test_a_fifo_under_a_files_name_fails_the_wait_instead_of_blocking_it(tmp_path):
    fifo = tmp_path / "part-00000.parquet"
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def wait() -> None:
        try:
            sync_later([fifo])
            wait_durable()
            outcome.append(None)
        except OSError as error:
            outcome.append(error)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(60)
    assert not waiter.is_alive(), "a FIFO blocked the fsync thread"
    [error] = outcome
    assert isinstance(error, OSError) and str(fifo) in str(error)


def test_a_checkpoints_files_are_synced_before_its_step_is_committed(tmp_path, tiny_model_dir, synced):
    from ppoflow.engine.models import load_actor, load_tokenizer
    from ppoflow.engine.optim import build_optimizer
    from ppoflow.tasks.storage.checkpoints import Trainable, optimizer_dir, save_checkpoint

    from ..engine.settings import optim_settings

    model = load_actor(tiny_model_dir)
    optimizer, scheduler = build_optimizer(model, optim_settings(lr=0.01))
    model(input_ids=torch.ones(1, 3, dtype=torch.long)).logits.sum().backward()
    optimizer.step()
    run = Run(str(tmp_path))
    relative, _, _ = save_checkpoint(
        run, "actor", 1, Trainable(model, optimizer, scheduler), load_tokenizer(tiny_model_dir)
    )
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
                wait_durable()  # returns at once: nothing of the parent's is the child's to wait for
                os._exit(0)
            except BaseException:
                os._exit(1)
        gate.set()
        _, status = os.waitpid(child, 0)
    finally:
        os.fsync = real
        gate.set()
    wait_durable()
    assert os.waitstatus_to_exitcode(status) == 0
    assert durability._syncer._thread is not None
