"""Running a multi-turn rollout's tool calls (engine/multi_turn.py's `ToolRunner`).

Built-in tools (engine/tools.py) are pure functions and run here. A user's tool class runs in one
"spawn" worker process, started at the first call and kept for the stage: a call that raises, returns
something that is not text, or takes longer than `timeout_s` (the worker's own time, as the reward
worker counts it) gives an error result, and a worker that hangs or dies is killed and replaced at
the next call. Nothing a tool or the model sends is evaluated: arguments are JSON values, results
are strings and floats.

A user's tool is a class `Tool(config: dict, tool_schema: dict)` (verl's constructor) with
`execute(parameters: dict, *, ground_truth, extra_info) -> str | (str, float)`: the text the model
reads, and optionally the call's reward.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path

from ppoflow.engine.tool_calls import ToolCall
from ppoflow.engine.tools import BUILTIN_TOOLS, ArgumentError, ToolContext, ToolResult
from ppoflow.tasks.models.processes import (
    CallTimeout,
    alarm_after,
    exit_with_parent,
    receive,
    stop_process,
)
from ppoflow.tasks.pipeline.placement import ToolSpec

LOAD_TIMEOUT_S = 120.0
"""Longest the tool worker may take to start and import the user's tool files."""
MAX_RESULT_CHARS = 1 << 20
"""Longest result text a user's tool may return (a longer one is an error, before truncation)."""


class ToolLoadError(RuntimeError):
    """A user's tool file does not import, or its class cannot be made."""


class ProcessToolRunner:
    """Runs calls by tool name: built-ins here, a user's tools in the worker."""

    def __init__(self, specs: Sequence[ToolSpec], timeout_s: float):
        self.timeout_s = timeout_s
        self.names = [spec.name for spec in specs]
        self._builtin = {spec.name: BUILTIN_TOOLS[spec.class_name]() for spec in specs if spec.builtin}
        self._user = [spec for spec in specs if not spec.builtin]
        self._worker: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None

    def run(self, calls: Sequence[ToolCall], context: ToolContext) -> list[tuple[ToolResult, float]]:
        return [self._timed(call, context) for call in calls]

    def _timed(self, call: ToolCall, context: ToolContext) -> tuple[ToolResult, float]:
        started = time.perf_counter()
        result = self._one(call, context)
        return result, time.perf_counter() - started

    def _one(self, call: ToolCall, context: ToolContext) -> ToolResult:
        if call.name in self._builtin:
            try:
                return self._builtin[call.name].execute(call.arguments, context)
            except ArgumentError as error:
                return _error(str(error))
            except Exception as error:  # a built-in tool is pure: its failure is the call's, not the run's
                return _error(f"{type(error).__name__}: {error}")
        if not any(spec.name == call.name for spec in self._user):
            return _error(f"unknown tool '{call.name}' (tools: {', '.join(self.names) or 'none'})")
        return self._in_worker(call, context)

    def _in_worker(self, call: ToolCall, context: ToolContext) -> ToolResult:
        try:
            conn, worker = self._started()
        except ToolLoadError as error:  # it started when the run did: a failure now is this call's
            return _error(f"the tool worker could not be started again: {error}")
        conn.send(("call", call.name, call.arguments, context.ground_truth, context.extra_info))
        kind, payload = receive(conn, self.timeout_s + 1.0 + 0.1 * self.timeout_s, worker, "tool")
        if kind == "result":
            text, reward, error = payload
            return ToolResult(text, reward, error)
        self.close()  # stuck or dead: the next call starts a fresh worker
        if kind == "timeout":
            return _error(f"the tool took longer than multi_turn.tool_timeout_s={self.timeout_s:g} s")
        return _error(str(payload))

    def _started(self) -> tuple[Connection, multiprocessing.process.BaseProcess]:
        if self._worker is not None and self._worker.is_alive() and self._conn is not None:
            return self._conn, self._worker
        self.close()
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        worker = context.Process(
            target=_serve,
            args=(child, self._user, self.timeout_s, os.getpid()),
            name="ppoflow-tools",
            daemon=True,
        )
        worker.start()
        child.close()
        self._worker, self._conn = worker, parent
        kind, payload = receive(parent, LOAD_TIMEOUT_S, worker, "tool")
        if kind != "ready":
            self.close()
            raise ToolLoadError(
                payload if kind == "load_error" else f"the tool worker did not start: {payload}"
            )
        return parent, worker

    def close(self) -> None:
        worker, conn, self._worker, self._conn = self._worker, self._conn, None, None
        if worker is not None:
            _stop_group(worker)
        if conn is not None:
            conn.close()

    def __enter__(self) -> ProcessToolRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_tools(specs: Sequence[ToolSpec], timeout_s: float) -> None:
    """Import and build every user tool once, as a rollout will: a ToolLoadError now, before any
    generation, for a file that does not import or a class that cannot be made."""
    runner = ProcessToolRunner(specs, timeout_s)
    try:
        if runner._user:
            runner._started()
    finally:
        runner.close()


def _error(message: str) -> ToolResult:
    return ToolResult(f"Error when executing tool: {message}", error=message)


def _stop_group(worker: multiprocessing.process.BaseProcess) -> None:
    """Stop the worker and every process its tools started (its own process group, `_serve`)."""
    if worker.pid is not None:
        with contextlib.suppress(OSError):  # already gone, or not (yet) the leader of its group
            os.killpg(worker.pid, signal.SIGKILL)
    stop_process(worker)


def load_tool_class(spec: ToolSpec):
    """The class `spec.attribute` of the file `spec.module_file`, imported as a module of its own."""
    where = f"tool {spec.name!r} ({spec.class_name})"
    module_name = f"ppoflow_tool_{spec.name}"
    loader_spec = importlib.util.spec_from_file_location(module_name, spec.module_file or "")
    if loader_spec is None or loader_spec.loader is None:
        raise ToolLoadError(f"{where}: {spec.module_file} is not an importable Python file")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module
    sys.path.insert(0, str(Path(spec.module_file or "").parent))
    try:
        loader_spec.loader.exec_module(module)
    except BaseException as exc:
        raise ToolLoadError(f"{where}: importing it failed: {type(exc).__name__}: {exc}") from exc
    cls = getattr(module, spec.attribute or "", None)
    if not isinstance(cls, type):
        raise ToolLoadError(f"{where}: {spec.module_file} has no class {spec.attribute!r}")
    return cls


def _serve(conn: Connection, specs: list[ToolSpec], timeout_s: float, parent_pid: int) -> None:
    """The worker's body: build each tool, then answer ("result", (text, reward, error)) per call.
    It leads a process group of its own, so that stopping it stops whatever its tools started."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent(parent_pid)
    try:
        tools = {spec.name: load_tool_class(spec)(dict(spec.config), dict(spec.schema)) for spec in specs}
    except ToolLoadError as exc:
        conn.send(("load_error", str(exc)))
        return
    except Exception as exc:
        conn.send(("load_error", f"building a tool failed: {type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        _, name, arguments, ground_truth, extra_info = message
        conn.send(("result", _call(tools[name], arguments, ground_truth, extra_info, timeout_s)))


MAX_ERROR_CHARS = 4096
"""Longest error message of a failed call that is kept (and shown to the model)."""


def _call(tool, arguments: dict, ground_truth, extra_info, timeout_s: float) -> tuple:
    """(text, reward, error) of one call: a plain str and float, whatever the tool returns or raises."""
    try:
        signal.signal(signal.SIGALRM, alarm_after(timeout_s))
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            out = tool.execute(arguments, ground_truth=ground_truth, extra_info=extra_info)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except CallTimeout:
        return _failed(f"the tool took longer than multi_turn.tool_timeout_s={timeout_s:g} s")
    except Exception as exc:
        return _failed(f"{type(exc).__name__}: {_describe(exc)}")
    text, reward = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
    if not isinstance(text, str) or len(text) > MAX_RESULT_CHARS:
        return _failed(f"returned {type(text).__name__}, not text of at most {MAX_RESULT_CHARS} characters")
    try:
        number = None if reward is None or isinstance(reward, bool) else float(reward)
    except (TypeError, ValueError, OverflowError):
        number = None
    if reward is not None and (number is None or not math.isfinite(number)):
        return _failed(f"returned a reward of type {type(reward).__name__} that is not a finite number")
    return str.__str__(text), number, None  # a plain str: a subclass would not unpickle in the trainer


def _failed(message: str) -> tuple:
    message = message[:MAX_ERROR_CHARS]
    return f"Error when executing tool: {message}", None, message


def _describe(exc: BaseException) -> str:
    try:
        return str(exc)[:MAX_ERROR_CHARS]
    except Exception:
        return "(its message cannot be printed)"
