"""One writer per run directory: an OS lock on `<run>/.lock`, held while the run is open.

The guarantee comes from the kernel, not from the file's contents: `flock(LOCK_EX | LOCK_NB)` on an
open descriptor of `.lock` succeeds for exactly one open file description at a time, and the kernel
drops it when that description is closed, which includes the holder dying (even by SIGKILL). So there
is no stale lock to detect or take over, and no check-then-act: deciding who holds it and taking it
are one system call. The file itself is created once and never deleted, because deleting it while
another process has it open would let a newcomer lock a fresh file beside the old one (two holders).
Do not delete it by hand while a run may be open. A folder that holds files but no lock file is
refused: someone else's folder, or a run whose lock was deleted and which may still be open (the
refusal of a folder with ppoflow's own files says so and gives the command that restores its lock;
only the user knows that no run of it is still going).

What the file contains is only for messages, and only the holder writes it: once it has the lock it
truncates the file and writes its pid, host and start time through the locked descriptor, and clears
it again on release. A refused process reads it to say who holds the lock. The holder may not have
written it yet, or the record may be a killed holder's, not yet replaced; then the message says the
holder is not recorded rather than naming a process that does not have the lock.

Within one process the lock is re-entrant (a second `open()` + `flock` of the same file would
conflict with the first): each run directory, by resolved path, is opened once and counted, and only
the last matching release unlocks it. Threads of one process count as one writer.

Children: the descriptor is not inheritable, so a program started with exec never holds the lock. A
fork()ed child shares the parent's open file description, so the lock stays held as long as either
still has it open: a forked child outliving a killed parent keeps the run locked until it exits or
execs. Such a child is not the writer: on its first acquire or release of that directory it closes
its inherited copy (which leaves the parent's lock held) and from then on competes like any other
process.

Other hosts: the holder's host is recorded, but whether a lock taken on one host excludes a process on
another depends on the filesystem (Linux NFS clients map flock to NFS byte-range locks; some network
and FUSE filesystems keep flock local to one machine). Linux and macOS only (fcntl).
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ppoflow.tasks.storage.regular_files import open_regular_file

LOCK_NAME = ".lock"


class RunLocked(RuntimeError):
    """Another live process is writing this run directory."""


class NotARunDirectory(RunLocked):
    """A folder that holds files and was never a run directory: ppoflow writes, replaces and deletes
    files in its run directories (data/, model/, checkpoints/, temp files), so it takes no such folder."""


@dataclass
class _Held:
    fd: int
    pid: int  # the process that took it: a forked child inherits this entry but is not the holder
    count: int = 1


_held: dict[Path, _Held] = {}
_guard = threading.Lock()


def _new_guard() -> None:
    global _guard
    _guard = threading.Lock()  # another thread of the parent may have held it at fork()


os.register_at_fork(after_in_child=_new_guard)


def acquire_run_lock(run_dir: Path) -> Path:
    """Take the run's lock (again, if this process holds it), or raise RunLocked naming the holder."""
    key = Path(run_dir).resolve()
    path = key / LOCK_NAME
    with _guard:
        held = _own(key)
        if held:
            held.count += 1
            return path
        _refuse_a_folder_of_other_files(key)
        fd = _open_lock_file(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, 0)
            os.pwrite(fd, _record(), 0)
        except BlockingIOError:
            os.close(fd)
            message = f"run directory {run_dir} is being written by {_holder(path)}"
            raise RunLocked(f"{message}; wait for it to finish or stop it") from None
        except BaseException:
            os.close(fd)
            raise
        _held[key] = _Held(fd, os.getpid())
        return path


def _refuse_a_folder_of_other_files(run_dir: Path) -> None:
    """NotARunDirectory when `run_dir` holds anything but has no lock file: every run directory has
    had one since its first writer (it is never deleted), so this is someone's folder, not a run."""
    if os.path.lexists(run_dir / LOCK_NAME):
        return
    try:
        with os.scandir(run_dir) as entries:  # a process racing this one may have made the lock
            held = next((entry for entry in entries if entry.name != LOCK_NAME), None)
    except FileNotFoundError:
        return
    if held is None:
        return
    if found := ppoflow_files(run_dir):
        raise NotARunDirectory(
            f"{run_dir} is a ppoflow run ({', '.join(found)}) whose lock file {LOCK_NAME} was deleted: if "
            "no ppoflow process is using it, restore the lock with "
            f"`touch {shlex.quote(str(run_dir / LOCK_NAME))}` and run again (a run still open holds the "
            "deleted one, and two writers would mix their files)"
        )
    raise NotARunDirectory(
        f"{run_dir} holds files ({held.name!r} among them) and is not a ppoflow run directory: a "
        "run writes, replaces and deletes files in its folder; choose a new or empty one "
        "(trainer.default_local_dir, or trainer.experiment_name under runs/; the retrain flow's run_dir)"
    )


def ppoflow_files(run_dir: Path) -> list[str]:
    """The files that make `run_dir` a ppoflow run beyond doubt (its config.yaml beside its catalog,
    stage results or a committed step; a retraining directory's promotions or rounds); empty for any
    other folder, which may well hold a config.yaml of its own ($HOME)."""
    from ppoflow.tasks.storage.manifests import MANIFEST_NAME
    from ppoflow.tasks.storage.retrain_tables import PROMOTIONS, ROUNDS
    from ppoflow.tasks.storage.tables import step_of

    rounds = run_dir / ROUNDS
    if (run_dir / PROMOTIONS).is_file() or (rounds.is_dir() and any(rounds.glob("round=*"))):
        return [name for name in (PROMOTIONS, ROUNDS) if os.path.lexists(run_dir / name)]
    if not (run_dir / "config.yaml").is_file():
        return []
    found = [name for name in ("catalog.duckdb", ".prefect-results") if os.path.lexists(run_dir / name)]
    with os.scandir(run_dir) as entries:
        steps = sorted(entry.name for entry in entries if step_of(entry.name) is not None)
    found += [name for name in steps if (run_dir / name / MANIFEST_NAME).is_file()][:1]
    return ["config.yaml", *found] if found else []


def _open_lock_file(path: Path) -> int:
    """The lock file, created if needed; never through a link, symbolic or hard (the holder truncates
    and writes it, which through a planted link would clobber another file) and never anything but a
    regular file (a FIFO would block)."""
    try:
        descriptor = open_regular_file(path, os.O_RDWR | os.O_CREAT)  # no O_TRUNC: only the holder writes
    except OSError as error:
        raise RunLocked(f"{path} cannot be the run's lock file ({error.strerror}); remove it") from error
    if os.fstat(descriptor).st_nlink > 1:  # a hard link to another file: writing it would clobber that
        os.close(descriptor)
        raise RunLocked(
            f"{path} cannot be the run's lock file (it has other names: a hard link, as in a run copied "
            "with cp -al); remove it"
        )
    return descriptor


def release_run_lock(run_dir: Path) -> None:
    """Undo one acquire; the last one clears the holder's record and unlocks. Does nothing in a
    process that does not hold the lock."""
    key = Path(run_dir).resolve()
    with _guard:
        held = _own(key)
        if not held:
            return
        held.count -= 1
        if held.count == 0:
            del _held[key]
            try:
                os.ftruncate(held.fd, 0)
            finally:
                os.close(held.fd)  # unlocks (once forked children have closed their copies too)


def _record() -> bytes:
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}).encode()


def _own(key: Path) -> _Held | None:
    """This process's hold on `key`; a copy inherited through fork() is closed and forgotten."""
    held = _held.get(key)
    if held and held.pid != os.getpid():
        os.close(held.fd)  # only this child's copy: no flock(LOCK_UN), which would unlock the parent
        del _held[key]
        return None
    return held


def _holder(path: Path) -> str:
    """Who the lock file says holds the lock, if it says so yet and that process still exists."""
    try:
        holder = json.loads(path.read_text())
        pid, host, started = int(holder["pid"]), str(holder["host"]), holder.get("started", "?")
    except (OSError, ValueError, TypeError, KeyError):
        return f"another process, not yet recorded in {path}"
    if host == socket.gethostname() and not process_exists(pid):  # a killed holder's record, not yet replaced
        return f"another process, not recorded in {path} (process {pid} recorded there has exited)"
    return f"process {pid} on {host} (since {started})"


def process_exists(pid: int) -> bool:
    """Whether process `pid` runs on this machine (whoever owns it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
