"""Opening a file in a run directory, which holds data anyone may have put there: never through a
planted link (O_NOFOLLOW: writing through it would clobber another file), never blocking on a
planted FIFO (O_NONBLOCK), and only ever a regular file; and telling whether a path goes through
a link (`leads_outside`), before anything is deleted or replaced, or any folder is written into
(`refuse_links_below`); making the run directory, deleting below it (`remove_from_run`) and
clearing what killed writes left behind (`remove_stale_temp_files`)."""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
from pathlib import Path


def open_regular_file(path: str | Path, flags: int, mode: int = 0o644, *, follow_links: bool = False) -> int:
    """`os.open(path, flags)` with O_NONBLOCK and (unless `follow_links`, for a reader of files a
    link may rightly name) O_NOFOLLOW; OSError (its `strerror` says why in words) when it cannot be
    opened or is not a regular file."""
    nofollow = 0 if follow_links else os.O_NOFOLLOW
    descriptor = os.open(path, flags | nofollow | os.O_NONBLOCK, mode)
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return descriptor


def refuse_links_below(root: str | Path, folder: str | Path) -> None:
    """An OSError naming the link, before anything is written into `folder` (below `root`), when a
    folder on the way from `root` is a link: what a planted link points at is not the run's, and a
    write through it would land outside. `root` itself may be a link (a checkpoints folder moved to a
    larger disk). Folders that do not exist yet are made by the caller, as real folders. Not
    `leads_outside`: it says which folder is the link, and it looks only at the folders below
    `root` (an lstat each) where a realpath walks the whole path, before every table a stage writes."""
    current = Path(root)
    for part in Path(folder).relative_to(root).parts:
        current = current / part
        try:
            mode = os.lstat(current).st_mode
        except FileNotFoundError:
            return
        if stat.S_ISLNK(mode):
            raise OSError(
                errno.EPERM, "refusing to write through a link inside the run; remove it", str(current)
            )


def leads_outside(root: str | Path, path: str | Path) -> bool:
    """Whether `path`, below `root`, goes through a link on the way (so that it is not root's own):
    what ppoflow deletes or replaces must not be what a planted link points at. `root` itself may be
    a link (a checkpoints folder moved to a larger disk)."""
    root = Path(root)
    expected = os.path.join(os.path.realpath(root), os.path.relpath(path, root))
    return os.path.realpath(path) != os.path.normpath(expected)


def remove_from_run(root: str | Path, path: str | Path) -> None:
    """Delete a file or folder below `root` (nothing if it is gone); an OSError, deleting nothing,
    when the path goes through a link below `root`."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    if leads_outside(root, path):
        raise OSError(errno.EPERM, "refusing to delete through a link inside the run", str(path))
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


_TEMP_FILE = re.compile(r"^\..+\.tmp(\.wal)?$")
_STAGING_DIRS = ("checkpoints/iter=*/.*", "model/.*")


def remove_stale_temp_files(run_dir: str | Path) -> int:
    """Delete what writes killed before their rename left behind: temp files of atomic writes and
    catalog rebuilds (`.<name>.<hex>.tmp`, and a DuckDB `.tmp.wal`) and checkpoint or model staging
    folders. Call it only while holding the run's lock: then no live writer owns any of them.
    Returns how many were removed."""
    run_dir = Path(run_dir).resolve()
    stale = [p for p in run_dir.rglob(".*") if p.is_file() and _TEMP_FILE.match(p.name)]
    stale += [p for pattern in _STAGING_DIRS for p in run_dir.glob(pattern) if p.is_dir()]
    for path in stale:
        if not leads_outside(run_dir, path):  # what a planted link points at is not the run's
            remove_from_run(run_dir, path)
    return len(stale)


def make_run_directory(path: Path) -> None:
    """The run directory, made if need be; an OSError that names the keys that chose it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OSError(
            error.errno,
            f"{error.strerror}; cannot make the run directory (trainer.default_local_dir, or "
            "trainer.experiment_name under runs/)",
            str(path),
        ) from None
