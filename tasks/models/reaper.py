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

from ppoflow.tasks.storage.lock import process_exists


def names_ray(pid: int) -> bool:
    """Whether process `pid`'s command line mentions Ray (raylet, gcs_server, ray::… workers)."""
    try:
        return b"ray" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


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
