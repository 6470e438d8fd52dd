"""Run a user's verl-style `compute_score(data_source, solution_str, ground_truth, extra_info=None)`
in a separate "spawn" worker process, so that a call that raises, returns garbage or hangs costs one
row, never the run.

The worker imports the user's file once and scores its rows in order, one message per row. A call
longer than `timeout_s` is interrupted inside the worker by SIGALRM; a call stuck in C code (which
never sees the signal) is caught by the parent's per-row deadline: the worker is killed, the row
marked timed out, and a fresh worker scores the rest. Every limit counts the worker's own time (see
`OwnTime`): seconds it spent waiting for a CPU that other processes held are given back, so a busy
machine does not time out a call that would finish, while a call that blocks or computes is still
stopped. Kept free of torch/prefect/pyarrow imports so the worker starts fast.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import signal
import sys
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ppoflow.engine.rewards import InvalidRewardError, answer_of_result, score_of_result
from ppoflow.tasks.models.processes import (
    CallTimeout,
    alarm_after,
    end_descendants,
    end_descendants_when_stopped,
    exit_with_parent,
    receive,
    stop_process,
)
from ppoflow.tasks.pipeline.settings import CustomRewardFunction, RewardFunctionError

LOAD_TIMEOUT_S = 120.0
"""Longest the worker may take to start and import the user's file (its own time, as every limit here)."""


@dataclass(frozen=True)
class RewardCall:
    """The arguments of one verl `compute_score` call."""

    data_source: str
    solution_str: str
    ground_truth: str
    extra_info: Any = None


@dataclass(frozen=True)
class Scored:
    """One row's reward, or why there is none (`error`; score 0.0 and no components then), and the
    answer the response gives (`pred`, for majority voting; None when unknown)."""

    score: float
    components: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    timed_out: bool = False
    pred: str | None = None

    @classmethod
    def failed(cls, error: str, *, timed_out: bool = False) -> Scored:
        return cls(0.0, {}, error, timed_out)


def run_custom_reward(
    function: CustomRewardFunction,
    calls: list[RewardCall],
    timeout_s: float,
    *,
    stop_at_timeout: bool = False,
) -> list[Scored | None]:
    """Score every call with `function` (custom_reward_function.*) in worker processes.
    With `stop_at_timeout`, rows after the first timed-out one are left unscored (None)."""
    if not Path(function.path).is_file():
        raise RewardFunctionError(f"custom_reward_function.path={function.path}: no such file")
    outcomes: list[Scored | None] = [None] * len(calls)
    start = 0
    while start < len(calls):
        start = _run_worker(function, calls, start, timeout_s, outcomes, stop_at_timeout)
    return outcomes


def check_custom_reward(function: CustomRewardFunction | None, timeout_s: float) -> None:
    """Load the custom reward function (custom_reward_function.*) once in a worker, as scoring
    will: a RewardFunctionError now, before any generation, for a file that does not import or has
    no such function (verl loads it when its trainer starts, too)."""
    if function is not None:
        _run_worker(function, [], 0, timeout_s, [], stop_at_timeout=False)


def _run_worker(
    function: CustomRewardFunction,
    calls: list[RewardCall],
    start: int,
    timeout_s: float,
    outcomes: list[Scored | None],
    stop_at_timeout: bool,
) -> int:
    """Score calls[start:] in one fresh worker, filling `outcomes`; returns where the next worker
    starts (len(calls) when done, or when stopping at a timeout)."""
    context = multiprocessing.get_context("spawn")
    receive_end, send = context.Pipe(duplex=False)
    worker = context.Process(
        target=_serve,
        args=(send, function.path, function.name, calls[start:], timeout_s, os.getpid()),
        name="ppoflow-reward",
        daemon=True,
    )
    worker.start()
    send.close()
    where = f"custom_reward_function.path={function.path}"
    try:
        kind, payload = receive(receive_end, max(LOAD_TIMEOUT_S, timeout_s), worker, "reward")
        if kind == "load_error":  # load_function's message names the file already
            raise RewardFunctionError(payload)
        if kind != "ready":
            reason = {"timeout": f"importing took longer than {max(LOAD_TIMEOUT_S, timeout_s):g} s"}
            raise RewardFunctionError(f"{where}: {reason.get(kind, payload)}")
        # The worker interrupts a slow call itself at timeout_s; the margin is for it to report.
        deadline = timeout_s + 1.0 + 0.1 * timeout_s
        for index in range(start, len(calls)):
            kind, payload = receive(receive_end, deadline, worker, "reward")
            if kind == "row":
                outcome = payload
            elif kind == "timeout":
                outcome = Scored.failed(_timeout_message(timeout_s, killed=True), timed_out=True)
            else:
                outcome = Scored.failed(payload)
            outcomes[index] = outcome
            if stop_at_timeout and outcome.timed_out:
                return len(calls)
            if kind != "row":  # the worker is dead or stuck: a fresh one scores the rest
                return index + 1
        return len(calls)
    finally:
        stop_process(worker)
        receive_end.close()


def _timeout_message(timeout_s: float, *, killed: bool = False) -> str:
    how = "; the worker was killed" if killed else ""
    return f"TimeoutError: took longer than reward.timeout_s={timeout_s:g} s{how}"


def load_function(path: str, name: str):
    """Import the user's file as verl does (a module of its own) and return its function `name`."""
    where = f"custom_reward_function.path={path}"
    spec = importlib.util.spec_from_file_location("ppoflow_custom_reward", path)
    if spec is None or spec.loader is None:
        raise RewardFunctionError(f"{where}: not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    sys.path.insert(0, str(Path(path).parent))  # let the file import its neighbours, as a script can
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        raise RewardFunctionError(f"{where}: importing it failed: {type(exc).__name__}: {exc}") from exc
    function = getattr(module, name, None)
    if not callable(function):
        raise RewardFunctionError(f"{where}: no function '{name}' (custom_reward_function.name)")
    return function


def _serve(
    conn: Connection, path: str, name: str, calls: list[RewardCall], timeout_s: float, parent_pid: int
) -> None:
    """The worker's body: load the function, then send one ("row", Scored) per call, in order.
    Ctrl-C is the trainer's to handle (it stops the worker); a trainer that dies takes it along."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    end_descendants_when_stopped()  # what the function starts ends with the worker
    exit_with_parent(parent_pid)
    try:
        try:
            function = load_function(path, name)
        except RewardFunctionError as exc:
            conn.send(("load_error", str(exc)))
            return
        conn.send(("ready", None))
        for call in calls:
            conn.send(("row", score_call(function, call, timeout_s)))
        conn.close()
    finally:
        end_descendants()


def score_call(function, call: RewardCall, timeout_s: float | None = None) -> Scored:
    """One verl-style call (keyword arguments, as verl's reward managers pass them), interpreted by
    `score_of_result`. With `timeout_s` (of the worker's own time, `OwnTime`), SIGALRM interrupts
    it (main thread of a worker only)."""
    try:
        if timeout_s is not None:
            signal.signal(signal.SIGALRM, alarm_after(timeout_s))
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            result = function(
                data_source=call.data_source,
                solution_str=call.solution_str,
                ground_truth=call.ground_truth,
                extra_info=call.extra_info,
            )
        finally:
            if timeout_s is not None:
                signal.setitimer(signal.ITIMER_REAL, 0)
    except CallTimeout:
        return Scored.failed(_timeout_message(timeout_s or 0.0), timed_out=True)
    except Exception as exc:
        return Scored.failed(f"{type(exc).__name__}: {exc}")
    try:
        score, components = score_of_result(result)
    except InvalidRewardError as exc:
        return Scored.failed(str(exc))
    return Scored(score, components, pred=answer_of_result(result))
