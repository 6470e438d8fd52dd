"""Benchmark: where the time between an embedded-default step's stages goes.

    python benchmarks/between_stages.py --iterations 20 --threads 2

Runs the embedded default through the real Prefect flow (as `benchmarks/iteration.py` does) with
clocks around the parts of Prefect's task engine and of ppoflow's own code that run between stage
bodies, and prints each as milliseconds per step (means over steps 2 on: the first step carries
one-time imports). The parts of Prefect's engine overlap (a state change happens inside a
transaction); their total is the task runs' wall time less the stage functions'. Also printed: how
much of that total the main thread spent on the CPU (the rest it waited, for the GIL or the disk),
and the CPU the process's other threads took per step (Prefect's event loop sends the task runs'
events; ppoflow's fsync thread syncs written files).
Not a test: numbers depend on the machine and on what else it is doing.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PARTS = (
    ("engine", "Prefect task engine, all (task runs less their stage functions)"),
    ("start", "  task-run start (initialize_run, begin_run)"),
    ("lookup", "  cache lookup (the stored result is looked for)"),
    ("persist", "  result persistence (transaction commit)"),
    ("states", "  state changes (Running, Completed) and their events"),
    ("resolve", "  result-folder path resolution (realpath, in lookup and persistence)"),
    ("run_stage", "ppoflow run_stage around the task run (stored-result check, links)"),
    ("commit", "the step's commit (fsync wait, manifest, catalog)"),
    ("after", "trainer state, console line, trackers"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (trainer.num_threads)")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides (e.g. trainer.save_freq=5)")
    args = parser.parse_args()
    for key, value in {
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "TRANSFORMERS_VERBOSITY": "error",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PPOFLOW_PROGRESS": "0",
    }.items():
        os.environ.setdefault(key, value)
    import ppoflow.engine.models  # noqa: F401  (torch and transformers: imported before the clock)

    # the base model is built in a process of its own: this one must not import prefect before
    # prefect_api() has set PREFECT_API_URL
    build = "from ppoflow.tasks.stages.prepare_model import build_tiny_base; build_tiny_base(seed=1)"
    subprocess.run([sys.executable, "-c", build], check=True)
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
        self.steps = 0
        self.step_walls: list[float] = []
        self.threads_at_start: dict[str, float] = {}
        self.threads_at_end: dict[str, float] = {}

    @contextlib.contextmanager
    def part(self, name: str):
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            if self.steps >= 2:
                self.wall[name] += time.perf_counter() - wall
                self.cpu[name] += time.thread_time() - cpu


def _timed(clocks: Clocks, name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
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


def _instrument(clocks: Clocks) -> None:
    import prefect.filesystems
    import prefect.task_engine
    import prefect.tasks
    import prefect.transactions

    from ppoflow.flows import iteration, train
    from ppoflow.tasks.storage import results

    engine = prefect.task_engine.SyncTaskRunEngine
    transaction = prefect.transactions.Transaction
    call_stage = prefect.task_engine.call_with_parameters

    def stage_function(fn, parameters):  # its time is taken back out of the engine's
        with clocks.part("stage functions"):
            return call_stage(fn, parameters)

    prefect.task_engine.call_with_parameters = stage_function
    prefect.tasks.Task.__call__ = _timed(clocks, "task runs", prefect.tasks.Task.__call__)
    engine.initialize_run = _timed_context(clocks, "start", engine.initialize_run)
    engine.begin_run = _timed(clocks, "start", engine.begin_run)
    engine.set_state = _timed(clocks, "states", engine.set_state)
    transaction.__enter__ = _timed(clocks, "lookup", transaction.__enter__)
    transaction.commit = _timed(clocks, "persist", transaction.commit)
    filesystem = prefect.filesystems.LocalFileSystem
    filesystem._resolve_path = _timed(clocks, "resolve", filesystem._resolve_path)
    iteration.run_stage = _timed(clocks, "run_stage calls", results.run_stage)
    iteration.commit_step = _timed(clocks, "commit", iteration.commit_step)
    train.record_trainer_state = _timed(clocks, "after", train.record_trainer_state)
    train.report_iteration = _timed(clocks, "after", train.report_iteration)
    train.Tracking.log = _timed(clocks, "after", train.Tracking.log)
    ppo_iteration = train.ppo_iteration

    def counted_step(*args, **kwargs):
        clocks.steps += 1
        if clocks.steps == 2:
            clocks.threads_at_start = _thread_cpu()
        started = time.perf_counter()
        try:
            return ppo_iteration(*args, **kwargs)
        finally:
            if clocks.steps >= 2:
                clocks.step_walls.append(time.perf_counter() - started)
                clocks.threads_at_end = _thread_cpu()

    train.ppo_iteration = counted_step


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of each thread of this process, by name (the torch worker threads, which never
    hold the GIL, are left out: they are named like the process)."""
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for tid in os.listdir("/proc/self/task"):
        if int(tid) not in names:
            continue
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seconds[names[int(tid)]] = (int(fields[11]) + int(fields[12])) / tick
    return seconds


def report(args, clocks: Clocks) -> None:
    steps = len(clocks.step_walls)
    if steps == 0:
        print("fewer than 2 steps: nothing measured")
        return
    step_ms = 1000 * sum(clocks.step_walls) / steps

    def ms(name: str, table=None) -> float:
        return 1000 * (table or clocks.wall)[name] / steps

    wall, cpu = clocks.wall, clocks.cpu
    for table in (wall, cpu):
        table["engine"] = table["task runs"] - table["stage functions"]
        table["run_stage"] = table["run_stage calls"] - table["task runs"]
    print(f"{steps} steps (2 to {steps + 1}), {args.threads} torch threads: {step_ms:.0f} ms per step\n")
    print(f"  {'ms per step':<70}{'wall':>6}  main-thread CPU")
    for name, label in PARTS:
        print(f"  {label:<70}{ms(name):6.1f}  {ms(name, cpu):6.1f}")
    between = ms("engine") + ms("run_stage") + ms("commit") + ms("after")
    label = "between stages: the engine, run_stage, commit and after"
    print(f"  {label:<70}{between:6.1f}  ({between / step_ms:.1%} of a step)")
    print("\nother threads' CPU, ms per step:")
    for name, seconds in sorted(clocks.threads_at_end.items()):
        used = seconds - clocks.threads_at_start.get(name, 0.0)
        if name != "MainThread" and used > 0:
            print(f"  {name:<70}{1000 * used / steps:6.1f}")


if __name__ == "__main__":
    main()
