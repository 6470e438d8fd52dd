"""`python -m ppoflow.tasks.models.reaper DRIVER_PID PID...`: stops the Ray processes a run started
once its driver is gone, however it ended (SIGKILL included). Ray stops its raylet, GCS and workers
with the driver, but its dashboard and runtime-env agents would be left running. Only processes
whose command line still names Ray are signalled (a recycled pid is left alone). A run's driver
starts it with `reap_after_exit`."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ppoflow.tasks.storage.lock import process_exists


def names_ray(pid: int) -> bool:
    """Whether process `pid`'s command line mentions Ray (raylet, gcs_server, ray::… workers)."""
    try:
        return b"ray" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def reap_after_exit(driver: int) -> None:
    """Start this module in a process of its own, which stops the Ray processes below `driver` once
    the driver is gone, even killed."""
    ray_processes = [pid for pid in descendants(driver) if names_ray(pid)]
    if ray_processes:
        subprocess.Popen(
            [sys.executable, "-m", "ppoflow.tasks.models.reaper", str(driver), *map(str, ray_processes)],
            start_new_session=True,  # a Ctrl-C to the terminal's group must not stop it first
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc; none elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def main(argv: list[str]) -> None:
    driver, *pids = (int(a) for a in argv)
    while process_exists(driver):
        time.sleep(0.5)
    for pid in pids:
        if names_ray(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1:])
