"""Child processes that never outlive the process that started them."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def exit_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies, even by SIGKILL (Linux's
    PR_SET_PDEATHSIG; elsewhere nothing is set and the child relies on its parent stopping it).
    Exits at once when the parent is already gone. Safe in a `preexec_fn` and in a worker's body."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)
