"""Child processes that never outlive the process that started them."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def exit_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies, even by SIGKILL (Linux's
    PR_SET_PDEATHSIG; elsewhere nothing is set and the child relies on its parent stopping it).
    Exits at once when the parent is already gone. Safe in a `preexec_fn` and in a worker's body."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def end_descendants_when_stopped() -> None:
    """In a worker that runs a user's code (tools, reward functions): whatever that code starts stays
    below this process, and ends with it. The worker becomes the reaper of its descendants (Linux's
    PR_SET_CHILD_SUBREAPER: a child whose parent exits, or that starts a session of its own and forks
    again, is re-parented to it, not to init), and SIGTERM (its stop, or the parent-death signal of a
    trainer that was killed) kills every one of them before the worker exits. Elsewhere only the
    worker's process group is ended (by its parent)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    signal.signal(signal.SIGTERM, _end_descendants_and_exit)
    # A worker that returns (its parent closed the pipe) calls end_descendants on its way out.


def _end_descendants_and_exit(signum, frame) -> None:
    end_descendants()
    os._exit(128 + signum)


def end_descendants(rounds: int = 20) -> None:
    """SIGKILL every process below this one, and again until none is left (one may have forked
    meanwhile); their zombies, re-parented here, are reaped."""
    for _ in range(rounds):
        alive = [pid for pid in descendants(os.getpid()) if not _zombie(pid)]
        for pid in alive:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        if not alive:
            return
        time.sleep(0.01)


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


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return True  # gone


def stop_process(worker: multiprocessing.process.BaseProcess) -> None:
    if worker.is_alive():
        worker.terminate()
        worker.join(2.0)
    if worker.is_alive():
        worker.kill()
    worker.join()


class CallTimeout(BaseException):
    """Raised by SIGALRM in the worker; a BaseException so `except Exception` in user code can't eat it."""


class OwnTime:
    """Seconds since it was made that a process (`pid`; by default the calling thread) did not spend
    waiting for a CPU: the clock's time less the run-queue wait Linux counts in /proc/<pid>/schedstat.
    Time spent computing or blocked (a sleep, a lock, the network) counts; where schedstat cannot be
    read it is the clock's time."""

    def __init__(self, pid: int | str = "thread-self"):
        self.pid = pid
        self.started, self.waited = time.monotonic(), cpu_wait_s(pid)

    def seconds(self) -> float:
        return time.monotonic() - self.started - max(cpu_wait_s(self.pid) - self.waited, 0.0)


def cpu_wait_s(pid: int | str) -> float:
    """Seconds task `pid` has waited on a run queue (the second field of /proc/<pid>/schedstat; 0.0
    when it cannot be read, so that the time counted is the clock's)."""
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as stats:
            return int(stats.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def alarm_after(timeout_s: float):
    """A SIGALRM handler that ends the call at `timeout_s` of this thread's own time: at each alarm
    the call gets back the time it waited for a CPU (the timer is set again for what is left)."""
    clock = OwnTime()

    def on_alarm(signum, frame):
        left = timeout_s - clock.seconds()
        if left > 0.001:
            signal.setitimer(signal.ITIMER_REAL, left)
            return
        raise CallTimeout

    return on_alarm


POLL_S = 0.5
"""How often a parent looks at a waiting worker's own time."""


def receive(conn, seconds: float, worker: multiprocessing.process.BaseProcess, what: str) -> tuple:
    """A worker's next message, ("timeout", None) after `seconds` of the worker's own time
    (`OwnTime`), or ("died", why) once it is gone and sent nothing (a child it forked may still hold
    the pipe open: the pipe is not waited on once the worker is dead). `what` names the worker."""
    clock = OwnTime(worker.pid)
    while not conn.poll(min(max(seconds - clock.seconds(), 0.0), POLL_S)):
        if clock.seconds() >= seconds:
            return "timeout", None
        if not worker.is_alive() and not conn.poll(0):
            break
    try:
        if conn.poll(0) or worker.is_alive():
            return conn.recv()
    except (EOFError, OSError):
        pass
    worker.join(1.0)
    return "died", f"the {what} worker process exited (exit code {worker.exitcode})"
