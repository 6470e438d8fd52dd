"""One writer per run directory: `<run>/.lock` names the process that holds it."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

LOCK_NAME = ".lock"


class RunLocked(RuntimeError):
    """Another live process is writing this run directory."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def acquire_run_lock(run_dir: Path) -> Path:
    """Take the run's lock, or raise RunLocked naming the holder. A lock left by a process that no
    longer exists (on this host) is taken over."""
    path = Path(run_dir) / LOCK_NAME
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _holder(path)
            if holder and holder.get("pid") != me["pid"] and _held(holder, me["host"]):
                raise RunLocked(
                    f"run directory {run_dir} is being written by process {holder['pid']} on "
                    f"{holder['host']} (since {holder.get('started', '?')}); wait for it to finish or stop "
                    f"it (if that process is gone, delete {path})"
                ) from None
            path.unlink(missing_ok=True)  # stale: its process is gone (or unreadable)
            continue
        with os.fdopen(fd, "w") as handle:
            json.dump(me, handle)
        return path
    raise RunLocked(f"could not take the lock {path}")


def _held(holder: dict, host: str) -> bool:
    """Whether the lock's holder may still be running: alive on this host, or on another host
    (whose processes cannot be checked from here)."""
    return holder.get("host") != host or _alive(holder["pid"])


def release_run_lock(run_dir: Path) -> None:
    path = Path(run_dir) / LOCK_NAME
    holder = _holder(path)
    if holder and holder.get("pid") == os.getpid():
        path.unlink(missing_ok=True)


def _holder(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
