"""Fault injection for resume and retry tests.

PPOFLOW_FAULT="<stage>@<step>" kills this process with SIGKILL at that point of that stage (after its
compute, before its output is written); "<stage>@<step>:raise" raises InjectedFault there instead,
so the stage (and the flow run) fails the way a bug would. With PPOFLOW_FAULT_ONCE=<file>, the fault
fires only while that file does not exist and creates it, so a retry of the same run gets through.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

FAULT_ENV = "PPOFLOW_FAULT"
FAULT_ONCE_ENV = "PPOFLOW_FAULT_ONCE"


class InjectedFault(RuntimeError):
    """The failure PPOFLOW_FAULT asked for."""


def inject_fault(stage: str, step: int) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    where, _, how = spec.partition(":")
    if where != f"{stage}@{step}":
        return
    once = os.environ.get(FAULT_ONCE_ENV)
    if once:
        marker = Path(once)
        if marker.exists():
            return
        marker.write_text(f"{spec}\n")
    if how == "raise":
        raise InjectedFault(f"{FAULT_ENV}={spec}: injected failure in {stage} at step {step}")
    os.kill(os.getpid(), signal.SIGKILL)
