"""Opening a file in a run directory, which holds data anyone may have put there: never through a
planted link (O_NOFOLLOW: writing through it would clobber another file), never blocking on a
planted FIFO (O_NONBLOCK), and only ever a regular file."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


def open_regular_file(path: Path, flags: int, mode: int = 0o644) -> int:
    """`os.open(path, flags)` with O_NOFOLLOW and O_NONBLOCK; OSError (its `strerror` says why in
    words) when it cannot be opened or is not a regular file."""
    descriptor = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode)
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return descriptor
