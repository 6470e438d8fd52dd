"""The model cache ($PPOFLOW_CACHE): models that ppoflow builds or converts once per machine (the
warm-started tiny model, a GGUF file converted to a Hugging Face directory), shared by every run and
every process.

Beside each cached folder NAME:
    .NAME.lock   held (flock) while NAME is built, so that processes asking at once build it once
    .NAME.tmp/   the folders a build fills before renaming one into place, and a damaged copy moved
                 aside; a killed build leaves its folder here, and a later call removes it once it
                 is stale, while holding the lock (never where the filesystem has no flock)

A run installs its copy of a base model (run/model/base) with the same `replace_directory`; opening
the run removes what a killed copy left (regular_files.remove_stale_temp_files).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ppoflow.tasks.storage.checkpoints import directory_digest, readable_as_the_umask_allows
from ppoflow.tasks.storage.regular_files import open_regular_file

CACHE_DIGEST = ".ppoflow-digest"
"""A cached model directory's digest (directory_digest) as written, checked at every reuse."""
STALE_AFTER_S = 3600.0
"""A staging folder that nothing in it has changed for this long is a killed build's, even where
flock excludes only the processes of one host (an NFS mount with local_lock=flock)."""


def cached_model_dir(target: Path, build: Callable[[Path], None]) -> Path:
    """`target`, built by `build(staging folder)` and renamed into place unless an intact copy is
    there already; a damaged copy (its files no longer match the digest recorded at build) is
    rebuilt. Processes sharing the cache build it once: the others wait for the first, then reuse
    its copy (an intact copy is never replaced). Staging folders of killed builds are removed once
    stale (STALE_AFTER_S), by a process that holds the lock."""
    if _intact(target):
        if _stale_staging(target):  # removed only while no process builds
            with contextlib.suppress(OSError), _building(target, wait=False) as locked:
                if locked:
                    _remove(_stale_staging(target))
        return target

    def fill(staging: Path) -> None:
        build(staging)
        (staging / CACHE_DIGEST).write_text(directory_digest(staging))

    with _building(target) as locked:
        if locked:
            _remove(_stale_staging(target))
        if _intact(target):  # built by another process while this one waited
            return target
        try:
            return replace_directory(target, fill)
        except OSError as error:  # unlocked (no flock): another build renamed its copy in first
            if error.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT) and _intact(target):
                return target
            raise


def _intact(directory: Path) -> bool:
    try:
        return (directory / CACHE_DIGEST).read_text() == directory_digest(directory)
    except OSError:
        return False


def _lock_path(target: Path) -> Path:
    return target.parent / f".{target.name}.lock"


def _staging_root(target: Path) -> Path:
    return target.parent / f".{target.name}.tmp"


@contextlib.contextmanager
def _building(target: Path, *, wait: bool = True):
    """An exclusive lock on building `target`, held by the kernel until the block ends or the
    process dies (flock on a hidden file beside it, as writable as the umask allows, so a cache
    shared by a group stays usable by all of it). Yields whether it holds the lock: False where
    the filesystem has no flock (some network and FUSE mounts; building goes on, and a build that
    finds another's copy renamed in first takes that one), or, without `wait`, while another
    process holds it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    path = _lock_path(target)
    try:
        fd = open_regular_file(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as error:
        raise OSError(
            f"{path} cannot be the model cache's lock file ({error.strerror}); remove it"
        ) from error
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EWOULDBLOCK):
                raise
            yield False
        else:
            yield True
    finally:
        os.close(fd)


def _stale_staging(target: Path) -> list[Path]:
    """The entries of `target`'s staging folder (`.NAME.tmp/`) in which nothing has changed for
    STALE_AFTER_S: neither the entry nor what it holds directly, such as a file being written
    (none when that folder is missing or is not a folder: a link there is never looked through)."""
    root = _staging_root(target)
    if root.is_symlink() or not root.is_dir():
        return []
    cutoff = time.time() - STALE_AFTER_S
    return [entry for entry in root.iterdir() if _last_change(entry) < cutoff]


def _last_change(entry: Path) -> float:
    """The newest modification time of `entry` and of what it holds directly (now if it is gone)."""
    try:
        times = [entry.lstat().st_mtime]
        if entry.is_dir() and not entry.is_symlink():
            times += [child.lstat().st_mtime for child in entry.iterdir()]
    except FileNotFoundError:
        return time.time()
    return max(times)


def _remove(entries: list[Path]) -> None:
    """Delete each entry as far as this process may: a folder with what it holds (rmtree unlinks
    the links inside without following them), anything else (a link included) by unlinking it.
    What cannot be deleted (another user's folder) is left, without an error."""
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                entry.unlink()


def replace_directory(target: Path, fill: Callable[[Path], None]) -> Path:
    """Make `target` anew: `fill` a folder staged in `.NAME.tmp/`, then swap it in by rename, so a
    crash leaves the old folder or none, never a part of one."""
    root = _staging_root(target)
    with contextlib.suppress(FileExistsError):
        root.mkdir(parents=True)
    if root.is_symlink() or not root.is_dir():
        raise OSError(f"{root} cannot be a staging folder (not a folder); remove it")
    staging = Path(tempfile.mkdtemp(prefix=f"{target.name}.", dir=root))
    try:
        fill(staging)
        readable_as_the_umask_allows(staging)
        if target.exists():  # moved aside, then deleted: missing only between two renames
            old = Path(tempfile.mkdtemp(prefix=f"{target.name}.old.", dir=root))
            os.replace(target, old / target.name)
            os.replace(staging, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
