"""Benchmark: what one Prefect task run costs by itself, the floor under each ppoflow stage.

    python benchmarks/prefect_task_cost.py --calls 100

Calls a task that does nothing, inside a flow on a temporary Prefect server, the way ppoflow calls a
stage (a cache key function, its result persisted with ppoflow's JSON serializer, return_state), and
prints the median seconds per call:
  - back to back (Prefect's code stays in the CPU caches);
  - with torch compute between the calls (`--compute-ms` of matrix products, as a stage's compute
    comes between two task runs in a training step), which evicts it;
  - with its result persisted into a storage block saved on the server instead of a folder;
  - with a task that persists nothing (no cache key, no result file), for comparison;
and the CPU the temporary server (a process of its own) spends per task run, beyond its idle CPU.
Not a test: numbers depend on the machine and on what else it is doing.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
import time
from pathlib import Path

from process_cpu import children_cpu_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--compute-ms", type=float, default=100.0, help="torch compute between calls")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args()
    for key, value in {
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
    }.items():
        os.environ.setdefault(key, value)

    from ppoflow.prefect_server import prefect_api

    with tempfile.TemporaryDirectory() as results, prefect_api():
        import torch

        torch.set_num_threads(args.threads)
        tasks = _stage_tasks(Path(results))
        matrix = torch.randn(512, 512)
        start = time.perf_counter()
        _products(matrix, 20)
        per_product = (time.perf_counter() - start) / 20
        products = max(1, round(args.compute_ms / 1000 / per_product))

        time.sleep(SETTLE_S)  # the server's start-up work is done
        cpu_before, started = children_cpu_seconds(), time.perf_counter()
        seconds = _measure(tasks, lambda: _products(matrix, products), args.calls)
        medians = {name: statistics.median(values) for name, values in seconds.items()}
        time.sleep(SETTLE_S)  # the server records the last task runs' events
        elapsed = time.perf_counter() - started
        server_cpu = children_cpu_seconds() - cpu_before
        idle = _server_cpu_per_second(IDLE_S)
        server_cpu -= idle * elapsed
    print(
        f"{args.calls} calls each; compute between calls: {products} products of 512x512, "
        f"~{products * per_product * 1000:.0f} ms, {args.threads} torch threads"
    )
    for name, median in medians.items():
        print(f"  {name:32s} {median * 1000:6.2f} ms per task run")
    runs = len(medians) * (args.calls + WARM_UP)
    print(
        f"Prefect server: {server_cpu / runs * 1000:.2f} ms CPU per task run "
        f"(beyond its idle {idle * 1000:.0f} ms CPU per second)"
    )


def _stage_tasks(results: Path) -> dict:
    """Tasks that do nothing: called as ppoflow calls a stage (a cache key function, the result
    persisted with ppoflow's JSON serializer into a folder), the same into a storage block saved on
    the server (Prefect then leaves the stored keys relative and builds no block per task run; not
    what ppoflow does), and one that persists nothing."""
    from prefect import task
    from prefect.cache_policies import NONE
    from prefect.filesystems import LocalFileSystem

    from ppoflow.tasks.pipeline.results import ResultSerializer

    @task(
        name="stage",
        task_run_name="stage-{i}",
        cache_key_fn=lambda context, parameters: f"stage-{parameters['i']}",
        persist_result=True,
        result_storage=results,
        result_serializer=ResultSerializer(),
    )
    def persisted(i: int, settings: dict) -> dict:
        return {"i": i}

    @task(name="plain", task_run_name="plain-{i}", cache_policy=NONE, persist_result=False)
    def plain(i: int, settings: dict) -> dict:
        return {"i": i}

    saved_block = LocalFileSystem(basepath=str(results / "block"))
    start = time.perf_counter()
    saved_block.save("prefect-task-cost-results", overwrite=True)
    print(f"saving the storage block on the server: {time.perf_counter() - start:.3f} s")
    in_saved_block = persisted.with_options(name="stage-block", result_storage=saved_block)
    return {"persisted": persisted, "saved block": in_saved_block, "not persisted": plain}


def _measure(tasks: dict, compute, calls: int) -> dict[str, list[float]]:
    """Seconds of each call, by variant, in one flow run: back to back, then with `compute` before
    each call, the variants taking turns (a drift of the machine is shared by all of them)."""
    from prefect import flow
    from prefect.utilities.annotations import quote

    numbers = itertools.count()
    seconds: dict[str, list[float]] = {}

    def timed(name: str, task, n: int) -> None:
        start = time.perf_counter()
        task(next(numbers), quote({"lr": 1e-6}), return_state=True)
        if n >= WARM_UP:
            seconds.setdefault(name, []).append(time.perf_counter() - start)

    @flow(name="prefect-task-cost")
    def measure() -> None:
        for kind in ("persisted", "not persisted"):
            for n in range(calls + WARM_UP):
                timed(f"{kind}, back to back", tasks[kind], n)
        for n in range(calls + WARM_UP):
            for kind in ("persisted", "saved block", "not persisted"):
                compute()
                timed(f"{kind}, compute between", tasks[kind], n)

    measure()
    return seconds


WARM_UP = 10
"""Calls of each variant left out first: Prefect's and the server's caches warm up."""
IDLE_S = 10.0
"""Seconds over which the server's idle CPU (its periodic services) is measured."""
SETTLE_S = 6.0
"""Seconds the server is given after the last call: its services flush at most every 5 s."""


def _server_cpu_per_second(seconds: float) -> float:
    before = children_cpu_seconds()
    time.sleep(seconds)
    return (children_cpu_seconds() - before) / seconds


def _products(matrix, n: int) -> None:
    """`n` matrix products of `matrix` (torch compute, as a stage's)."""
    import torch

    x = matrix
    for _ in range(n):
        x = torch.tanh(x @ matrix)


if __name__ == "__main__":
    main()
