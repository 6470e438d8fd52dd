"""`ppoflow train`: the flow run, with one line for whatever stops it and the log kept in the run.

Prefect's tracebacks go to RUN_DIR/logs/train.log (and to the terminal only with -v): a failed
stage ends in one line that says what failed, where the full log is, and that running the same
command again resumes. Without PREFECT_API_URL, the flow reports to a temporary server of its own
(ppoflow.prefect_server) that Ctrl-C does not reach, so one Ctrl-C stops training in seconds; what
that server prints goes to RUN_DIR/logs/prefect-server.log.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ppoflow.prefect_server import ServerDidNotStart, deliver_prefect_logs_and_events, prefect_api
from ppoflow.tasks.observe.invocation import ppoflow_command
from ppoflow.tasks.storage.lock import RunLocked, acquire_run_lock, release_run_lock
from ppoflow.tasks.storage.regular_files import make_run_directory, open_regular_file

if TYPE_CHECKING:
    from ppoflow.tasks.pipeline.settings import RunPlan

LOG_NAME = "logs/train.log"
SERVER_LOG_NAME = "logs/prefect-server.log"
EXIT_FAILED, EXIT_LOCKED = 1, 3


def train_configured(cfg, verbose: bool, *, program: bool = False) -> int:
    """`ppoflow train` once its config is loaded: refused at once when another process trains the run;
    then the checks that write nothing (the machine, another run's steps, the user's reward function
    and tools), then training. Returns the exit code (2: refused by a check)."""
    try:
        with held_if_a_run(cfg.run_dir):  # a run in progress is refused now, not after the checks
            return _checked_and_trained(cfg, verbose, program)
    except RunLocked as error:
        _say(f"ppoflow: {error}")
        return EXIT_LOCKED


def _checked_and_trained(cfg, verbose: bool, program: bool) -> int:
    from ppoflow.engine.models import ModelLoadError
    from ppoflow.tasks.models.machine import machine_problem
    from ppoflow.tasks.models.tool_runner import ToolLoadError
    from ppoflow.tasks.pipeline.plan import run_plan
    from ppoflow.tasks.pipeline.settings import RewardFunctionError
    from ppoflow.tasks.stages.user_code import check_user_code
    from ppoflow.tasks.storage.run_config import AnotherRun, require_same_run

    if (problem := machine_problem(cfg.trainer.device, cfg.actor_rollout_ref.rollout.name)) is not None:
        _say(f"ppoflow: {problem}")
        return 2
    try:  # before the run's logs or server: a refused start changes nothing in the run
        plan = run_plan(cfg)  # the config is read once: the flow is given this plan
        require_same_run(cfg.run_dir.resolve(), plan.config_yaml)
        check_user_code(plan)  # imports the user's reward function and tools, each in a worker
    except (AnotherRun, RewardFunctionError, ModelLoadError, ToolLoadError) as error:
        _say(f"ppoflow: {error}")
        return 2
    with _warnings_on_stderr("ppoflow.tasks.pipeline.results"):
        return run_training(plan, verbose, program=program)


@contextlib.contextmanager
def _warnings_on_stderr(*loggers: str) -> Iterator[None]:
    """The warnings of these loggers on stderr as `ppoflow: …` lines, beside the run's log file that
    `ppoflow train` sends every ppoflow logger to: what a start discarded is said where it is seen."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("ppoflow: %(message)s"))
    for name in loggers:
        logging.getLogger(name).addHandler(handler)
    try:
        yield
    finally:
        for name in loggers:
            logging.getLogger(name).removeHandler(handler)


def run_training(plan: RunPlan, verbose: bool, *, program: bool = False) -> int:
    """Train as configured; returns the exit code (0 done, 1 failed, 3 locked or no usable state,
    130 interrupted). As the `ppoflow` program, what the interpreter still prints on its way out
    after ppoflow's last line (a library's thread or exit hook) goes to the run's log, not under
    that line (a Python caller keeps its stderr)."""
    run_dir = Path(plan.run_dir)
    log_file = run_dir.resolve() / LOG_NAME
    code, logs_ours = _run_training(plan, run_dir, log_file, verbose)
    if program and logs_ours:  # (a run that another process trains: its log is that process's)
        _send_the_rest_to(log_file)
    return code


def _run_training(plan: RunPlan, run_dir: Path, log_file: Path, verbose: bool) -> tuple[int, bool]:
    """(the exit code, whether the run's logs are this process's: not when another one trains it)."""
    program = ppoflow_command()
    resume = f"{program} {shlex.join(sys.argv[1:])}" if sys.argv[1:2] == ["train"] else f"{program} train …"
    interrupt = _Interrupt()
    try:
        server = prefect_api(deliver_on_exit=False, server_log=run_dir.resolve() / SERVER_LOG_NAME)
        with interrupt, _run_lock(run_dir), server, _logging_to(log_file, verbose, interrupt):
            try:
                return _train(plan, log_file, resume, interrupt), True
            finally:
                deliver_prefect_logs_and_events()  # while the server is up, Prefect's notes to the log
    except KeyboardInterrupt:
        pass
    except RunLocked as error:  # another process trains this run: its logs are left alone
        _say(f"ppoflow: {error}")
        return EXIT_LOCKED, False
    except BrokenPipeError:  # the reader of the output left: main's exit 141
        raise
    except (ServerDidNotStart, OSError) as error:  # no server, or no writable run directory
        if not interrupt.by:
            _say(f"ppoflow: {error}")
            return EXIT_FAILED, True
    _say(f"\nppoflow: {interrupt.said()}; {_finished(run_dir)}; resume with: {resume}")
    return interrupt.exit_code(), True


def _train(plan: RunPlan, log_file: Path, resume: str, interrupt: _Interrupt) -> int:
    from ppoflow.flows.iteration import ValidatedOtherwise
    from ppoflow.flows.train import ppo_train_planned
    from ppoflow.tasks.storage.checkpoints import StateUnavailable
    from ppoflow.tasks.storage.lock import RunLocked

    try:
        ppo_train_planned(plan, user_code_checked=True)  # (by the command, before the run was touched)
    except (RunLocked, StateUnavailable) as error:
        _say(f"ppoflow: {error}")
        return EXIT_LOCKED
    except ValidatedOtherwise as error:  # refused: a validation-only start changes no step
        _say(f"ppoflow: {error}")
        return 2
    except BrokenPipeError:
        raise
    except Exception as error:  # a stage failed: bad data, a failing reward, a full disk, a bug
        if interrupt.arrived():  # the interrupt surfaced as another error: Prefect reports a crashed run
            raise KeyboardInterrupt from error
        logging.getLogger("ppoflow").exception("training stopped")
        _say(f"ppoflow: training stopped: {describe(error)}")
        _say(f"ppoflow: full log: {log_file}; after fixing the cause, resume with: {resume}")
        return EXIT_FAILED
    return 0


class _Interrupt:
    """Ctrl-C (SIGINT) and SIGTERM (`kill`, a service manager, a container stopping) both stop training
    as Ctrl-C does in Python, by raising KeyboardInterrupt; which one came is recorded, so an interrupt
    that surfaces as another error is still reported as one, and the exit code is the shell's 128 + the
    signal's number. Inside a flow run Prefect's own SIGTERM handler runs instead, raising its
    TerminationSignal, which a library can swallow (DuckDB turns it into "Query interrupted"): the
    signals that arrived are therefore also read from the interpreter's wakeup pipe (`arrived`)."""

    SAID = {signal.SIGINT: "interrupted", signal.SIGTERM: "stopped by SIGTERM"}
    LOGGED = {signal.SIGINT: "interrupted (Ctrl-C)", signal.SIGTERM: "stopped by SIGTERM"}

    def __init__(self) -> None:
        self.by: signal.Signals | None = None

    def __enter__(self) -> _Interrupt:
        self.previous = {signum: signal.signal(signum, self._on_signal) for signum in self.SAID}
        self._pipe = os.pipe()
        for descriptor in self._pipe:
            os.set_blocking(descriptor, False)
        self._previous_wakeup = signal.set_wakeup_fd(self._pipe[1], warn_on_full_buffer=False)
        return self

    def __exit__(self, *exc) -> None:
        signal.set_wakeup_fd(self._previous_wakeup)
        for descriptor in self._pipe:
            os.close(descriptor)
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def arrived(self) -> signal.Signals | None:
        """The stop signal that came (`by`), also when another handler than ours ran for it."""
        try:
            numbers = os.read(self._pipe[0], 4096)
        except (BlockingIOError, OSError):
            numbers = b""
        for number in numbers:
            if self.by is None and number in self.SAID:
                self.by = signal.Signals(number)
        return self.by

    def _on_signal(self, signum, frame) -> None:
        self.by = signal.Signals(signum)
        raise KeyboardInterrupt

    def said(self) -> str:
        return self.SAID[self.by or signal.SIGINT]

    def logged(self) -> str:
        return self.LOGGED[self.by or signal.SIGINT]

    def exit_code(self) -> int:
        return 128 + (self.by or signal.SIGINT)


MAX_MESSAGE = 400


def describe(error: BaseException) -> str:
    """The error's first line (at most MAX_MESSAGE characters), with the disk-full case said plainly
    (it surfaces from safetensors, torch and pyarrow in their own words)."""
    if isinstance(error, shutil.Error) and error.args and isinstance(error.args[0], list):
        failures = error.args[0]  # a copy of many files: (source, destination, why) each
        text = f"{failures[0][2]} (and {len(failures) - 1} more files)" if failures else str(error)
    else:
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if len(text) > MAX_MESSAGE:
        text = text[: MAX_MESSAGE - 1] + "…"
    if _disk_full(error):
        return f"the disk is full (no space left on device): {text}"
    return text


def _disk_full(error: BaseException | None) -> bool:
    while error is not None:
        if getattr(error, "errno", None) == errno.ENOSPC or "No space left on device" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _finished(run_dir: Path) -> str:
    from ppoflow.tasks.storage.manifests import trained_iterations

    steps = trained_iterations(run_dir) if run_dir.is_dir() else []
    if not steps:
        return "no training step had finished"
    done = "step 1 is" if steps[-1] == 1 else f"steps 1–{steps[-1]} are"
    return f"{done} finished and kept in {run_dir}"


@contextlib.contextmanager
def held_if_a_run(run_dir: Path) -> Iterator[None]:
    """The lock of a run that exists (its `.lock` is there), taken as soon as the config names it: a
    second `ppoflow train` of a run in progress is refused (RunLocked) before the seconds that the
    checks and imports before training take. Nothing is made for a new run here."""
    path = run_dir.resolve()
    if not (path / ".lock").is_file():
        yield
        return
    acquire_run_lock(path)
    try:
        yield
    finally:
        release_run_lock(path)


@contextlib.contextmanager
def _run_lock(run_dir: Path) -> Iterator[None]:
    """The run's lock (tasks/storage/lock.py) for the whole command, taken before its logs are
    opened or its server started: a second `ppoflow train` of a run in progress writes nothing
    there. The flow takes it again (re-entrant) when it opens the run."""
    path = run_dir.resolve()
    make_run_directory(path)
    acquire_run_lock(path)
    try:
        _logs_folder(path / "logs")
        _LogFile.check(path / LOG_NAME)  # refused now, not after the server has started
        yield
    finally:
        release_run_lock(path)


def _logs_folder(folder: Path) -> None:
    """RUN_DIR/logs, made if need be: a folder of the run's own (a planted link would send the logs
    elsewhere; a file there says plainly that it is in the way)."""
    if folder.is_symlink():
        raise OSError(f"{folder} is a link, not the run's logs folder; remove it")
    if folder.exists() and not folder.is_dir():
        raise OSError(f"{folder} is not a folder (ppoflow keeps the run's logs there); remove it")
    folder.mkdir(parents=True, exist_ok=True)


@contextlib.contextmanager
def _logging_to(log_file: Path, verbose: bool, interrupt: _Interrupt) -> Iterator[None]:
    """Everything logged (Prefect's task and flow errors with their tracebacks, library warnings,
    ppoflow's step lines) is appended to `log_file`; Prefect's console output only with -v."""
    from prefect.logging.configuration import ensure_logging_setup
    from prefect.logging.handlers import PrefectConsoleHandler

    ensure_logging_setup()  # Prefect's own setup first: done later, it would leave out its console
    log_file.parent.mkdir(parents=True, exist_ok=True)
    handler = _LogFile(log_file, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root, ours = logging.getLogger(), logging.getLogger("ppoflow")
    quieted = [h for h in root.handlers if isinstance(h, PrefectConsoleHandler)] if not verbose else []
    levels = [h.level for h in quieted]
    for console in quieted:
        console.setLevel(logging.CRITICAL + 1)
    root.addHandler(handler)
    ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False  # the step lines are on stdout already; to the file only
    ours.info("ppoflow train %s (pid %d, %s)", shlex.join(sys.argv[2:]), os.getpid(), time.strftime("%c"))
    logging.captureWarnings(True)  # a library's warnings too (to the terminal only with -v)
    try:
        yield
    except KeyboardInterrupt:
        ours.warning(interrupt.logged())
        raise
    finally:
        logging.captureWarnings(False)
        root.removeHandler(handler)
        ours.removeHandler(handler)
        ours.propagate = True
        handler.close()
        for console, level in zip(quieted, levels, strict=True):
            console.setLevel(level)


class _LogFile(logging.FileHandler):
    """The run's log file, silent once it cannot be written (a full disk): the terminal still gets
    the one line that says why training stopped, not a traceback per log record."""

    failed = False

    @staticmethod
    def descriptor(path: Path) -> int:
        """The log file, opened for appending as every file a run directory holds (no link, no FIFO)."""
        try:
            return open_regular_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        except OSError as error:
            raise OSError(f"cannot write the run's log {path}: {error.strerror}") from error

    @classmethod
    def check(cls, path: Path) -> None:
        """Raise the error opening the log would raise (the file is made if need be)."""
        os.close(cls.descriptor(path))

    def _open(self):
        descriptor = self.descriptor(Path(self.baseFilename))
        return open(descriptor, self.mode, encoding=self.encoding, errors=self.errors)

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        self.failed = True

    def flush(self) -> None:
        try:
            super().flush()
        except OSError:  # what is still buffered when the disk fills
            self.failed = True

    def close(self) -> None:
        try:
            super().close()
        except OSError:
            self.failed = True


def _send_the_rest_to(log_file: Path) -> None:
    """Point this process's stderr at `log_file` when it is a regular file ppoflow can append to."""
    try:
        descriptor = open_regular_file(log_file, os.O_WRONLY | os.O_APPEND)
    except OSError:
        return
    try:
        sys.stderr.flush()
        os.dup2(descriptor, sys.stderr.fileno())
    finally:
        os.close(descriptor)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
