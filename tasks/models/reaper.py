"""`python -m ppoflow.tasks.models.reaper DRIVER_PID PID...`: stops the Ray processes a run started
once its driver is gone, however it ended (SIGKILL included). Ray stops its raylet, GCS and workers
with the driver, but its dashboard and runtime-env agents would be left running. Only processes
whose command line still names Ray are signalled (a recycled pid is left alone)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_ray(pid: int) -> bool:
    try:
        return b"ray" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def main(argv: list[str]) -> None:
    driver, *pids = (int(a) for a in argv)
    while _alive(driver):
        time.sleep(0.5)
    for pid in pids:
        if _is_ray(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1:])
