"""Fault injection for resume tests: PPOFLOW_FAULT="<stage>@<step>" kills this process with
SIGKILL at that point of that stage (after its compute, before its output is written)."""

from __future__ import annotations

import os
import signal

FAULT_ENV = "PPOFLOW_FAULT"


def inject_fault(stage: str, step: int) -> None:
    if os.environ.get(FAULT_ENV) == f"{stage}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)
