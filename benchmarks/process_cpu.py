"""CPU seconds of a benchmark's child processes (the temporary Prefect server), for the benchmarks
that report what the server costs beside training. Imported by the scripts in this folder."""

from __future__ import annotations

import os
from pathlib import Path


def child_pids() -> list[int]:
    """The live children of this process, from /proc (one read per process on the machine)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if (
            entry.name.isdigit()
            and (fields := _stat_fields(int(entry.name)))
            and int(fields[1]) == os.getpid()
        ):
            pids.append(int(entry.name))
    return pids


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU seconds of these processes (those gone meanwhile count 0)."""
    ticks = sum(int(fields[11]) + int(fields[12]) for pid in pids if (fields := _stat_fields(pid)))
    return ticks / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """User and system CPU seconds of the live children of this process."""
    return cpu_seconds(child_pids())


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (field 4, the parent, first), or None."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None  # gone meanwhile
