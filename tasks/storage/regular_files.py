"""Opening a file in a run directory, which holds data anyone may have put there: never through a
planted link (O_NOFOLLOW: writing through it would clobber another file), never blocking on a
planted FIFO (O_NONBLOCK), and only ever a regular file; and telling whether a path goes through
a link (`leads_outside`), before anything is deleted or replaced."""

from __future__ import annotations

import errno
import os
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


def leads_outside(root: str | Path, path: str | Path) -> bool:
    """Whether `path`, below `root`, goes through a link on the way (so that it is not root's own):
    what ppoflow deletes or replaces must not be what a planted link points at. `root` itself may be
    a link (a checkpoints folder moved to a larger disk)."""
    root = Path(root)
    expected = os.path.join(os.path.realpath(root), os.path.relpath(path, root))
    return os.path.realpath(path) != os.path.normpath(expected)
