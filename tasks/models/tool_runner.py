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

What a tool prints (its stdout and stderr, and its children's) is not the terminal's: it goes to the
run's log, with the tool's name and the call's arguments. Whatever a tool starts stays below the
worker and ends with it, also when the trainer is killed (processes.end_descendants_when_stopped).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path

from ppoflow.engine.tool_calls import ToolCall
from ppoflow.engine.tools import BUILTIN_TOOLS, ArgumentError, ToolContext, ToolResult
from ppoflow.tasks.models.processes import (
    CallTimeout,
    alarm_after,
    end_descendants,
    end_descendants_when_stopped,
    exit_with_parent,
    receive,
    stop_process,
)
from ppoflow.tasks.pipeline.placement import ToolSpec

LOAD_TIMEOUT_S = 120.0
"""Longest the tool worker may take to import a user's tool file and build its tool (its own time)."""
MAX_PRINTED_CHARS = 4096
"""The end of what a call printed that goes to the run's log."""
logger = logging.getLogger(__name__)
MAX_RESULT_CHARS = 1 << 20
"""Longest result text a user's tool may return (a longer one is an error, before truncation)."""


class ToolLoadError(RuntimeError):
    """A user's tool file does not import, or its class cannot be made."""


class ProcessToolRunner:
    """Runs calls by tool name: built-ins here, a user's tools in the worker."""

    def __init__(self, specs: Sequence[ToolSpec], timeout_s: float, load_timeout_s: float = LOAD_TIMEOUT_S):
        self.timeout_s = timeout_s
        self.load_timeout_s = load_timeout_s
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
            text, reward, error, printed = payload
            _log_printed(printed, f"tool {call.name!r}, called with {json.dumps(call.arguments)[:200]}")
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
        loading = None
        kind, payload = receive(parent, self.load_timeout_s, worker, "tool")
        while kind == "loading":  # each tool gets load_timeout_s to import and build
            loading = next(spec for spec in self._user if spec.name == payload)
            kind, payload = receive(parent, self.load_timeout_s, worker, "tool")
        if kind == "ready":
            _log_printed(payload, "the tools, while they were imported and built")
            return parent, worker
        self.close()
        if kind == "load_error" or loading is None:
            raise ToolLoadError(
                payload if kind == "load_error" else f"the tool worker did not start: {payload}"
            )
        where = f"tool {loading.name!r} ({loading.class_name})"
        if kind == "timeout":
            raise ToolLoadError(
                f"{where}: importing {loading.module_file} and building the tool took longer than "
                f"{self.load_timeout_s:g} s; stopped (does the file wait for something when imported?)"
            )
        raise ToolLoadError(f"{where}: the tool worker stopped while importing it: {payload}")

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


def check_tools(specs: Sequence[ToolSpec], timeout_s: float, load_timeout_s: float = LOAD_TIMEOUT_S) -> None:
    """Import and build every user tool once, as a rollout will: a ToolLoadError now, before any
    generation, for a file that does not import (or hangs importing) or a class that cannot be made."""
    runner = ProcessToolRunner(specs, timeout_s, load_timeout_s)
    try:
        if runner._user:
            runner._started()
    finally:
        runner.close()


def _error(message: str) -> ToolResult:
    return ToolResult(f"Error when executing tool: {message}", error=message)


def _stop_group(worker: multiprocessing.process.BaseProcess) -> None:
    """Stop the worker and every process its tools started: SIGTERM, on which it kills all of them
    (those in sessions of their own too) and exits; then its process group, for a worker stuck where
    no signal handler runs."""
    if worker.is_alive():
        worker.terminate()
        worker.join(2.0)
    if worker.pid is not None:
        with contextlib.suppress(OSError):  # already gone, or not (yet) the leader of its group
            os.killpg(worker.pid, signal.SIGKILL)
    stop_process(worker)


def _log_printed(printed: str, what: str) -> None:
    if printed:
        logger.info("%s printed:\n%s", what, printed)


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
    """The worker's body: build each tool (("loading", name) first), then answer ("result", (text,
    reward, error, printed)) per call. It leads a process group of its own and ends whatever its
    tools started when it stops (or its parent dies); what they print is sent back, not shown."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    end_descendants_when_stopped()
    exit_with_parent(parent_pid)
    try:
        _answer(conn, specs, timeout_s)
    finally:  # the trainer closed the pipe (it died, say): what the tools started ends here too
        end_descendants()


def _answer(conn: Connection, specs: list[ToolSpec], timeout_s: float) -> None:
    printed = _Printed()
    tools = {}
    for spec in specs:
        conn.send(("loading", spec.name))
        try:
            tools[spec.name] = load_tool_class(spec)(dict(spec.config), dict(spec.schema))
        except ToolLoadError as exc:
            conn.send(("load_error", str(exc)))
            return
        except BaseException as exc:  # a KeyboardInterrupt or SystemExit of the user's class too
            message = (
                f"tool {spec.name!r} ({spec.class_name}): building it failed: {type(exc).__name__}: {exc}"
            )
            conn.send(("load_error", message))
            return
    conn.send(("ready", printed.take()))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        _, name, arguments, ground_truth, extra_info = message
        result = _call(tools[name], arguments, ground_truth, extra_info, timeout_s)
        conn.send(("result", (*result, printed.take())))


class _Printed:
    """This process's stdout and stderr (and its children's), sent to a file of its own: what the tools
    print is taken after each call, not shown on the trainer's terminal."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile()  # noqa: SIM115 - kept open for the worker's life
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        for descriptor in (1, 2):
            os.dup2(self._file.fileno(), descriptor)

    def take(self) -> str:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                if stream is not None:
                    stream.flush()
        size = os.fstat(self._file.fileno()).st_size
        if not size:
            return ""
        self._file.seek(max(size - MAX_PRINTED_CHARS, 0))
        text = self._file.read().decode("utf-8", errors="replace")
        self._file.seek(0)
        self._file.truncate()
        return text if size <= MAX_PRINTED_CHARS else f"…{text}"


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
    except BaseException as exc:  # a KeyboardInterrupt or SystemExit raised in a tool is the call's
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
