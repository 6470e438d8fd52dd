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
        from prefect import flow, task
        from prefect.cache_policies import NONE
        from prefect.filesystems import LocalFileSystem
        from prefect.utilities.annotations import quote

        from ppoflow.tasks.storage.results import ResultSerializer

        torch.set_num_threads(args.threads)

        @task(
            name="stage",
            task_run_name="stage-{i}",
            cache_key_fn=lambda context, parameters: f"stage-{parameters['i']}",
            persist_result=True,
            result_storage=Path(results),
            result_serializer=ResultSerializer(),
        )
        def persisted(i: int, settings: dict) -> dict:
            return {"i": i}

        # the same, into a storage block saved on the server (Prefect then leaves the stored keys
        # relative and builds no block per task run), which ppoflow does not use
        saved_block = LocalFileSystem(basepath=str(Path(results) / "block"))
        saved_block.save("prefect-task-cost-results", overwrite=True)
        in_saved_block = persisted.with_options(name="stage-block", result_storage=saved_block)

        @task(name="plain", task_run_name="plain-{i}", cache_policy=NONE, persist_result=False)
        def plain(i: int, settings: dict) -> dict:
            return {"i": i}

        matrix = torch.randn(512, 512)
        start = time.perf_counter()
        _products(matrix, 20)
        per_product = (time.perf_counter() - start) / 20
        products = max(1, round(args.compute_ms / 1000 / per_product))

        def compute() -> None:
            _products(matrix, products)

        @flow(name="prefect-task-cost")
        def measure() -> dict[str, float]:
            calls = itertools.count()
            medians = {}
            for name, fn, between in (
                ("persisted, back to back", persisted, None),
                ("persisted, compute between", persisted, compute),
                ("saved block, compute between", in_saved_block, compute),
                ("not persisted, back to back", plain, None),
                ("not persisted, compute between", plain, compute),
            ):
                seconds = []
                for n in range(args.calls + 10):
                    if between is not None:
                        between()
                    start = time.perf_counter()
                    fn(next(calls), quote({"lr": 1e-6}), return_state=True)
                    if n >= 10:  # the first calls warm up
                        seconds.append(time.perf_counter() - start)
                medians[name] = statistics.median(seconds)
            return medians

        time.sleep(SETTLE_S)  # the server's start-up work is done
        cpu_before, started = children_cpu_seconds(), time.perf_counter()
        medians = measure()
        time.sleep(SETTLE_S)  # the server records the last task runs' events
        elapsed = time.perf_counter() - started
        server_cpu = children_cpu_seconds() - cpu_before
        idle = _server_cpu_per_second(IDLE_S)
        server_cpu -= idle * elapsed
    print(
        f"{args.calls} calls each; compute between calls: {products} products of 512x512, "
        f"~{products * per_product * 1000:.0f} ms, {args.threads} torch threads"
    )
    for name, seconds in medians.items():
        print(f"  {name:32s} {seconds * 1000:6.2f} ms per task run")
    runs = len(medians) * (args.calls + 10)
    print(
        f"Prefect server: {server_cpu / runs * 1000:.2f} ms CPU per task run "
        f"(beyond its idle {idle * 1000:.0f} ms CPU per second)"
    )


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
