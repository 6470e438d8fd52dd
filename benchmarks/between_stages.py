"""Benchmark: where the time between an embedded-default step's stages goes.

    python benchmarks/between_stages.py --iterations 20 --threads 2

Runs the embedded default through the real Prefect flow (as `benchmarks/iteration.py` does) with
clocks around the parts of Prefect's task engine and of ppoflow's own code that run between stage
bodies, and prints each as milliseconds per step (means over steps 2 on: the first step carries
one-time imports; a step runs from the start of its first stage to the end of its console line).
The engine's total is the task runs' wall time less the stage functions' and less ppoflow's code
that the engine calls (the cache key, the result's JSON). Its parts overlap and leave some of it
unnamed: the task-run start sets the Running state, and the result folder's path is resolved in the
lookup, in the persistence and in the result record made between them. Also printed: how much of
each the main thread spent on the CPU (the rest it waited: for the GIL, the disk or the server), and
the CPU the process's other threads took per step (Prefect's event loop sends the task runs'
events; ppoflow's fsync thread syncs written files).
Instruments Prefect 3's task engine by its internal names; stops with a message where they differ.
Not a test: numbers depend on the machine and on what else it is doing.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import sys
import tempfile
import threading
import time
from pathlib import Path

from embedded_setup import prepare

PARTS = (
    ("engine", "Prefect task engine, all (less stage functions and ppoflow's code)"),
    ("start", "  task-run start (initialize_run, begin_run with the Running state)"),
    ("lookup", "  cache lookup (the stored result is looked for)"),
    ("persist", "  result persistence (transaction commit)"),
    ("states", "  state changes (Running, Completed) and their events"),
    ("resolve", "  result-folder path resolution (realpath, five times a task run)"),
    ("callbacks", "ppoflow's code the engine calls (cache key, result JSON)"),
    ("run_stage", "ppoflow run_stage around the task run (stored-result check, links)"),
    ("commit", "the step's commit (fsync wait, manifest, catalog)"),
    ("after", "trainer state, console line, trackers"),
)
BETWEEN = ("engine", "callbacks", "run_stage", "commit", "after")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (trainer.num_threads)")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides (e.g. trainer.save_freq=5)")
    args = parser.parse_args()
    prepare(PPOFLOW_PROGRESS="0")  # the base model is built outside the timing
    from ppoflow.prefect_server import prefect_api

    with tempfile.TemporaryDirectory(prefix="ppoflow-bench-") as scratch, prefect_api():
        clocks = Clocks()
        _instrument(clocks)
        from ppoflow.flows import train

        overrides = [
            f"trainer.total_training_steps={args.iterations}",
            f"trainer.default_local_dir={Path(scratch) / 'run'}",
            f"trainer.num_threads={args.threads}",
            *args.overrides,
        ]
        train.ppo_train(None, overrides)
    report(args, clocks)


class Clocks:
    """Wall and main-thread CPU seconds by part, from the second step on."""

    def __init__(self) -> None:
        self.wall: collections.Counter[str] = collections.Counter()
        self.cpu: collections.Counter[str] = collections.Counter()
        self.steps: list[int] = []  # the steps started, in order
        self.step_started = 0.0
        self.step_walls: list[float] = []
        self.in_engine = False  # inside a task run, outside its stage function
        self.threads_at_start: dict[int, tuple[str, float]] = {}
        self.threads_at_end: dict[int, tuple[str, float]] = {}

    @property
    def counting(self) -> bool:
        return len(self.steps) >= 2

    @contextlib.contextmanager
    def part(self, name: str):
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            if self.counting:
                self.wall[name] += time.perf_counter() - wall
                self.cpu[name] += time.thread_time() - cpu

    @contextlib.contextmanager
    def engine(self, active: bool):
        """The main thread is in Prefect's engine (True) or in a stage function (False) meanwhile."""
        before, self.in_engine = self.in_engine, active
        try:
            yield
        finally:
            self.in_engine = before


def _timed(clocks: Clocks, name: str, fn, *, engine_only: bool = False):
    """`fn` timed as `name` (with `engine_only`, only where Prefect's engine calls it)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if engine_only and not clocks.in_engine:
            return fn(*args, **kwargs)
        with clocks.part(name):
            return fn(*args, **kwargs)

    return wrapper


def _timed_context(clocks: Clocks, name: str, fn):
    """A context manager's entry and exit timed as `name`, not the body it wraps."""

    @functools.wraps(fn)
    @contextlib.contextmanager
    def wrapper(*args, **kwargs):
        manager = fn(*args, **kwargs)
        with clocks.part(name):
            value = manager.__enter__()
        try:
            yield value
        except BaseException:
            with clocks.part(name):
                if not manager.__exit__(*sys.exc_info()):
                    raise
        else:
            with clocks.part(name):
                manager.__exit__(None, None, None)

    return wrapper


def _require(owner, *names: str) -> None:
    import prefect

    missing = [name for name in names if not hasattr(owner, name)]
    if missing:
        raise SystemExit(
            f"between_stages.py times Prefect 3's task engine by its internal names; Prefect "
            f"{prefect.__version__} has no {getattr(owner, '__name__', owner)}.{missing[0]}"
        )


def _instrument(clocks: Clocks) -> None:
    import prefect.cache_policies
    import prefect.filesystems
    import prefect.task_engine
    import prefect.tasks
    import prefect.transactions

    from ppoflow.flows import iteration, train
    from ppoflow.tasks.pipeline import results

    engine = prefect.task_engine.SyncTaskRunEngine
    transaction = prefect.transactions.Transaction
    filesystem = prefect.filesystems.LocalFileSystem
    key_policy = prefect.cache_policies.CacheKeyFnPolicy
    _require(prefect.task_engine, "call_with_parameters")
    _require(engine, "initialize_run", "begin_run", "set_state")
    _require(transaction, "__enter__", "commit")
    _require(filesystem, "_resolve_path")
    _require(key_policy, "compute_key")
    call_stage = prefect.task_engine.call_with_parameters
    task_call = prefect.tasks.Task.__call__

    def stage_function(fn, parameters):  # its time is taken back out of the engine's
        with clocks.engine(False), clocks.part("stage functions"):
            return call_stage(fn, parameters)

    def task_run(self, *args, **kwargs):
        with clocks.engine(True), clocks.part("task runs"):
            return task_call(self, *args, **kwargs)

    prefect.task_engine.call_with_parameters = stage_function
    prefect.tasks.Task.__call__ = functools.wraps(task_call)(task_run)
    engine.initialize_run = _timed_context(clocks, "start", engine.initialize_run)
    engine.begin_run = _timed(clocks, "start", engine.begin_run)
    engine.set_state = _timed(clocks, "states", engine.set_state)
    transaction.__enter__ = _timed(clocks, "lookup", transaction.__enter__)
    transaction.commit = _timed(clocks, "persist", transaction.commit)
    filesystem._resolve_path = _timed(clocks, "resolve", filesystem._resolve_path)
    key_policy.compute_key = _timed(clocks, "callbacks", key_policy.compute_key, engine_only=True)
    serializer = results.ResultSerializer
    serializer.dumps = _timed(clocks, "callbacks", serializer.dumps, engine_only=True)
    serializer.loads = _timed(clocks, "callbacks", serializer.loads, engine_only=True)
    iteration.run_stage = _timed(clocks, "run_stage calls", results.run_stage)
    iteration.commit_step = _timed(clocks, "commit", iteration.commit_step)
    train.record_trainer_state = _timed(clocks, "after", train.record_trainer_state)
    train.report_iteration = _timed(clocks, "after", train.report_iteration)
    ppo_iteration, log = train.ppo_iteration, train.Tracking.log

    def counted_step(run, settings, step, *args, **kwargs):
        clocks.steps.append(step)
        if len(clocks.steps) == 2:
            clocks.threads_at_start = _thread_cpu()
        clocks.step_started = time.perf_counter()
        return ppo_iteration(run, settings, step, *args, **kwargs)

    def logged(self, *args, **kwargs):  # the last thing a step does: its trackers
        try:
            with clocks.part("after"):
                return log(self, *args, **kwargs)
        finally:
            if clocks.counting:
                clocks.step_walls.append(time.perf_counter() - clocks.step_started)
                clocks.threads_at_end = _thread_cpu()

    train.ppo_iteration = counted_step
    train.Tracking.log = functools.wraps(log)(logged)


def _thread_cpu() -> dict[int, tuple[str, float]]:
    """(name, CPU seconds) of each Python thread of this process, by thread id (torch's worker
    threads, which never hold the GIL, are not Python threads)."""
    seconds = {}
    for thread in threading.enumerate():
        with contextlib.suppress(OSError, ProcessLookupError):  # gone meanwhile
            clock = time.pthread_getcpuclockid(thread.ident)
            seconds[thread.ident] = (thread.name, time.clock_gettime(clock))
    return seconds


def report(args, clocks: Clocks) -> None:
    steps = len(clocks.step_walls)
    if steps == 0:
        print("fewer than 2 steps: nothing measured")
        return
    step_ms = 1000 * sum(clocks.step_walls) / steps

    def ms(name: str, table=None) -> float:
        return 1000 * (clocks.wall if table is None else table)[name] / steps

    for table in (clocks.wall, clocks.cpu):
        table["engine"] = table["task runs"] - table["stage functions"] - table["callbacks"]
        table["run_stage"] = table["run_stage calls"] - table["task runs"]
    measured = clocks.steps[1 : 1 + steps]
    print(
        f"{steps} steps ({measured[0]} to {measured[-1]}), {args.threads} torch threads: "
        f"{step_ms:.0f} ms per step\n"
    )
    print(f"  {'ms per step':<70}{'wall':>6}  main-thread CPU")
    for name, label in PARTS:
        print(f"  {label:<70}{ms(name):6.1f}  {ms(name, clocks.cpu):6.1f}")
    between = sum(ms(name) for name in BETWEEN)
    label = "between stages: the unindented rows"
    print(f"  {label:<70}{between:6.1f}  ({between / step_ms:.1%} of a step)")
    used: collections.Counter[str] = collections.Counter()
    for ident, (name, seconds) in clocks.threads_at_end.items():
        if name != "MainThread":
            used[name] += seconds - clocks.threads_at_start.get(ident, (name, 0.0))[1]
    print("\nother threads' CPU, ms per step (threads that ended meanwhile are left out):")
    for name, seconds in sorted(used.items()):
        if seconds > 0:
            print(f"  {name:<70}{1000 * seconds / steps:6.1f}")


if __name__ == "__main__":
    main()
