"""CPU seconds of a benchmark's child processes (the temporary Prefect server), for the benchmarks
that report what the server costs beside training. Imported by the scripts in this folder."""

from __future__ import annotations

import os
from pathlib import Path


def children_cpu_seconds() -> float:
    """User and system CPU seconds of the live children of this process, from /proc."""
    ticks = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[1]) == os.getpid():
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")
