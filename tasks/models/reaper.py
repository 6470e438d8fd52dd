"""The Ray instance a run starts for itself (no RAY_ADDRESS): where its files go, and how its
processes and files end however the run ends.

Its session files (sockets, logs, spilled objects) go to a folder of the run's own,
`$TMPDIR/ppoflow-ray-XXXXXXXX` (`private_ray_dir`), removed when the run closes its worker group.
`python -m ppoflow.tasks.models.reaper DRIVER_PID [--files DIR] PID...` covers a driver that is
killed (SIGKILL included): Ray stops its raylet, GCS and workers with the driver, but its dashboard
and runtime-env agents would be left running, and the folder left behind. Only a process that is
still the one it was when the reaper started (same start time, command line naming Ray) is
signalled: pids are recycled. A driver starts it with `reap_after_exit`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ppoflow.tasks.models.processes import descendants
from ppoflow.tasks.storage.lock import process_exists

RAY_DIR_PREFIX = "ppoflow-ray-"
SOCKET_PATH_MAX = 107
"""Bytes in an AF_UNIX socket path on Linux (108 with the terminating NUL)."""
RAY_SOCKET_SUFFIX = len("/session_2026-01-01_00-00-00_000000_4194304/sockets/plasma_store")
"""What Ray appends to its folder for its longest socket (a 7-digit pid at most)."""


def private_ray_dir() -> str:
    """A new folder, this user's only, for the session files of a run's own Ray: in $TMPDIR, or in
    /tmp when $TMPDIR is too long a path for Ray's sockets (a run directory usually is)."""
    root = tempfile.gettempdir()
    if len(os.fsencode(root)) + len(RAY_DIR_PREFIX) + 9 + RAY_SOCKET_SUFFIX > SOCKET_PATH_MAX:
        root = "/tmp"
    return tempfile.mkdtemp(prefix=RAY_DIR_PREFIX, dir=root)


def names_ray(pid: int) -> bool:
    """Whether process `pid`'s command line mentions Ray (raylet, gcs_server, ray::… workers)."""
    try:
        return b"ray" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def started_at(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot; None: no such process)."""
    try:
        return int((Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split())[19])
    except (OSError, IndexError, ValueError):
        return None


def ray_processes_below(driver: int) -> dict[int, int]:
    """The Ray processes below `driver`, each with its start time."""
    found = {pid: started_at(pid) for pid in descendants(driver) if names_ray(pid)}
    return {pid: start for pid, start in found.items() if start is not None}


def stop_processes(processes: dict[int, int], grace_s: float = 0.0) -> None:
    """SIGKILL each process still the one recorded (same start time, naming Ray), after giving them
    `grace_s` seconds to end on their own."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_same(pid, start) for pid, start in processes.items()):
        time.sleep(0.1)
    for pid, start in processes.items():
        if _same(pid, start):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _same(pid: int, start: int) -> bool:
    return started_at(pid) == start and names_ray(pid)


def remove_ray_dir(directory: str) -> None:
    """Remove a folder `private_ray_dir` made (any other path is left alone)."""
    path = Path(directory)
    if path.name.startswith(RAY_DIR_PREFIX) and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)


def reap_after_exit(driver: int, directory: str) -> dict[int, int]:
    """Start this module in a process of its own, which stops the Ray processes below `driver` and
    removes `directory` (Ray's files) once the driver is gone, even killed; it leaves without doing
    anything once `directory` is gone (the run closed its Ray itself). Returns those processes."""
    processes = ray_processes_below(driver)
    subprocess.Popen(
        [sys.executable, "-m", "ppoflow.tasks.models.reaper", str(driver), "--files", directory]
        + [str(pid) for pid in processes],
        start_new_session=True,  # a Ctrl-C to the terminal's group must not stop it first
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return processes


def main(argv: list[str]) -> None:
    directory = None
    if "--files" in argv:
        at = argv.index("--files")
        directory, argv = argv[at + 1], argv[:at] + argv[at + 2 :]
    driver, *pids = (int(a) for a in argv)
    processes = {pid: start for pid in pids if (start := started_at(pid)) is not None}  # as they are now
    while process_exists(driver):
        if directory is not None and not os.path.isdir(directory):
            return  # the run stopped its Ray and removed its files itself
        time.sleep(0.5)
    stop_processes(processes)
    if directory is not None:
        remove_ray_dir(directory)


if __name__ == "__main__":
    main(sys.argv[1:])
