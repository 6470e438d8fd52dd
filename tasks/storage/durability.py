"""Data files made durable behind the run, waited for before a record names them.

A stage's parquet files and a checkpoint's files are named by digest wherever they are used: a file
that a crash of the machine left short is found out and made again, never read. What must not
happen is a committed step whose files never reached the disk. So their fsyncs run in a thread of
their own (`sync_later`) while the next stages compute, and `commit_step` waits for them
(`wait_durable`) before it writes the step's manifest, which, like every record ppoflow reads
without a digest, is fsynced before it is renamed into place (`tables._atomic_write`). A stage
served from cache queues its files again (`results.run_stage`): a process that crashed may have
left them unsynced.

One thread per process, started on first use. A path that is gone by the time its turn comes (a
run directory deleted meanwhile) has nothing to make durable and is not a failure. A file whose
fsync failed is removed by the `wait_durable` that reports it: its pages may hold data the disk
does not, and a second fsync would report success (Linux clears the error), so its stage is made
again rather than committed.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
from collections import deque
from collections.abc import Iterable
from pathlib import Path

from ppoflow.tasks.storage.regular_files import leads_outside

__all__ = ["sync_later", "sync_tree_later", "wait_durable"]

logger = logging.getLogger(__name__)


class _Syncer:
    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._queue: deque[str] = deque()
        self._syncing = 0  # paths taken from the queue and not yet synced
        self._failures: list[tuple[OSError, bool]] = []  # (error, whether fsync itself failed)
        self._thread: threading.Thread | None = None

    def add(self, paths: Iterable[str | Path]) -> None:
        with self._changed:
            self._queue.extend(os.fspath(p) for p in paths)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="ppoflow-fsync", daemon=True)
                self._thread.start()
            self._changed.notify_all()

    def wait(self) -> list[tuple[OSError, bool]]:
        with self._changed:
            while self._queue or self._syncing:
                self._changed.wait()
            failures, self._failures = self._failures, []
        return failures

    def _work(self) -> None:
        while True:
            with self._changed:
                while not self._queue:
                    self._changed.wait()
                path = self._queue.popleft()
                self._syncing += 1
            try:
                failure = _fsync(path)
            except Exception as error:  # never leave the count up: every wait would hang on it
                failure = (OSError(errno.EIO, f"{error}; could not make durable", path), False)
            with self._changed:
                self._syncing -= 1
                if failure is not None:
                    self._failures.append(failure)
                self._changed.notify_all()


def _fsync(path: str) -> tuple[OSError, bool] | None:
    """fsync a file or folder: None, or the error naming `path` and whether fsync itself failed (not
    the open). A path that is gone, or a link to a file (not one ppoflow wrote), is not a failure.
    Opened without blocking, so that a FIFO planted under a data file's name cannot stall the thread
    and every wait on it, and without following a link, except to a folder (a run's checkpoints/ may
    be a link to a larger disk)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        try:
            descriptor = os.open(path, flags | os.O_NOFOLLOW)
        except OSError as error:
            if error.errno != errno.ELOOP:
                raise
            if not os.path.isdir(path):
                return None
            descriptor = os.open(path, flags | os.O_DIRECTORY)
    except FileNotFoundError:
        return None
    except OSError as error:
        return OSError(error.errno, f"{error.strerror}; could not make durable", path), False
    try:
        os.fsync(descriptor)
    except OSError as error:
        return OSError(error.errno or errno.EIO, f"{error.strerror}; could not make durable", path), True
    finally:
        os.close(descriptor)
    return None


_syncer = _Syncer()


def _forget_after_fork() -> None:
    global _syncer
    _syncer = _Syncer()  # the parent's thread does not exist in the child


os.register_at_fork(after_in_child=_forget_after_fork)


def sync_later(paths: Iterable[str | Path]) -> None:
    """fsync these files and folders, in this order, in the background. Name a file before the
    folder that holds it, so that the folder's entry for it is synced after its data."""
    _syncer.add(paths)


def sync_tree_later(directory: Path) -> None:
    """fsync every file directly in `directory`, then `directory` itself, in the background (nothing
    when it is gone)."""
    try:
        files = [entry.path for entry in os.scandir(directory) if entry.is_file(follow_symlinks=False)]
    except FileNotFoundError:
        return
    sync_later([*files, directory])


def wait_durable(root: Path) -> None:
    """Return once every path queued so far is synced. A failure below `root` is raised (the first,
    an OSError naming its file) after every file below `root` whose fsync failed is removed; a
    failure elsewhere (a file of another run, which nothing of this one names) is logged."""
    failures = _syncer.wait()
    root = Path(os.path.abspath(root))
    ours = []
    for error, fsync_failed in failures:
        if not Path(os.path.abspath(error.filename)).is_relative_to(root):
            logger.warning("ppoflow: %s", error)
            continue
        ours.append(error)
        if fsync_failed:
            _remove_file(root, error.filename)
    if ours:
        raise ours[0]


def _remove_file(root: Path, path: str) -> None:
    """Remove a regular file of the run, never through a link (`leads_outside`) other than the run's
    checkpoints/ folder itself, which may be a link to another disk."""
    checkpoints = root / "checkpoints"
    folder = checkpoints if Path(path).is_relative_to(checkpoints) else root
    if leads_outside(folder, path):
        return
    with contextlib.suppress(OSError):  # already gone
        if stat.S_ISREG(os.lstat(path).st_mode):  # a folder, or a link, stays
            os.unlink(path)
