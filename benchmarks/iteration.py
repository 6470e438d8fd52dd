"""Benchmark: N iterations of the embedded default through the real Prefect flow.

    python benchmarks/iteration.py --iterations 40 --threads 2

Prints, per stage, the median seconds; generation and training tokens/s; peak RSS; the share of
each iteration spent outside stage compute (Prefect task overhead between stages, parquet and
DuckDB work inside stages; as means over the run, then with each step's IO as a median over steps,
which leaves out what happens once in a run); the CPU the temporary Prefect server takes per
iteration (recording task runs beside training, on the same cores); and the wall time from launch
until greedy accuracy first reaches 90%.
Not a test: numbers depend on the machine and on what else it is doing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from embedded_setup import prepare
from process_cpu import child_pids, cpu_seconds

STAGES = ("rollouts", "rewards", "advantages", "critic_update", "actor_update", "validation", "metrics")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (trainer.num_threads)")
    parser.add_argument("--target", type=float, default=0.9, help="greedy accuracy to time")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides (e.g. trainer.save_freq=5)")
    args = parser.parse_args()
    prepare()  # the base model is built once per machine, not part of the timing
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="ppoflow-bench-") as scratch:  # the run is removed after
        run_and_report(args, Path(scratch) / "run")


def run_and_report(args, run_dir: Path) -> None:
    from ppoflow.prefect_server import prefect_api

    overrides = [f"trainer.total_training_steps={args.iterations}", f"trainer.default_local_dir={run_dir}"]
    if args.threads:
        overrides.append(f"trainer.num_threads={args.threads}")
    overrides += args.overrides
    launched = time.time()
    # the Prefect server `ppoflow train` runs with (its start is part of the time); prefect is
    # imported inside, once PREFECT_API_URL names it
    with prefect_api():
        from ppoflow.flows import iteration, train
        from ppoflow.tasks.storage.confined_query import query

        io_between = _count_io_between_stages(iteration, train)
        server_cpu = _sample_server_cpu_at_commits(iteration)
        io_at_commits = _sample_io_at_commits(iteration)
        summary = train.ppo_train(None, overrides)
    finished = time.time()
    trained = sorted(io_between["trainer state"])  # one a training step
    summary["io_between_stages"] = [io_between["commit"][k] + io_between["trainer state"][k] for k in trained]
    summary["io_per_step"] = [
        {kind: b.get(kind, 0.0) - a.get(kind, 0.0) for kind in b}
        for a, b in zip(io_at_commits, io_at_commits[1:], strict=False)
    ]
    # between the first step's commit and the last's (None: one step, or a server not ours)
    own_server = not os.environ.get("PREFECT_API_URL")
    summary["server_cpu_per_iteration"] = (
        (server_cpu[-1] - server_cpu[0]) / (len(server_cpu) - 1)
        if own_server and len(server_cpu) > 1
        else None
    )
    report(args, summary, run_dir, launched, finished, summary["io_seconds"], query)


def _count_io_between_stages(iteration, train) -> dict[str, dict[int, float]]:
    """The file IO of each step's commit (the fsync wait, the manifest, the catalog) and trainer
    state, by step: it happens between stages, and is counted once, as IO, not again in the time
    between stages. (Step 0, the validation before training, is committed too, with no trainer state.)"""
    seconds: dict[str, dict[int, float]] = {"commit": {}, "trainer state": {}}

    def counted(fn, what: str):
        def wrapper(run, step, *args, **kwargs):
            before = run.io.seconds
            try:
                return fn(run, step, *args, **kwargs)
            finally:
                seconds[what][step] = run.io.seconds - before

        return wrapper

    iteration.commit_step = counted(iteration.commit_step, "commit")
    train.record_trainer_state = counted(train.record_trainer_state, "trainer state")
    return seconds


def _sample_server_cpu_at_commits(iteration) -> list[float]:
    """The CPU seconds of this process's children (the temporary Prefect server; the base model's
    builder has exited) after each step's commit. The children are found once, at the first commit:
    later samples read their own /proc entries only, not every process's, inside the timed steps."""
    samples: list[float] = []
    children: list[int] = []

    def sample(run) -> None:
        if not samples:
            children.extend(child_pids())
        samples.append(cpu_seconds(children))

    _after_each_commit(iteration, sample)
    return samples


def _sample_io_at_commits(iteration) -> list[dict[str, float]]:
    """The run's file IO seconds by kind after each step's commit: the differences are each step's
    own IO (its stages', its commit's, the trainer state before it), whose medians leave out what
    happens once in a run (the first checkpoint's imports, the catalog's first build)."""
    samples: list[dict[str, float]] = []
    _after_each_commit(iteration, lambda run: samples.append(dict(run.io.by_kind)))
    return samples


def _after_each_commit(iteration, sample) -> None:
    """Have `sample(run)` called after each step's commit, whether or not the commit raised."""
    commit_step = iteration.commit_step

    def sampled(run, *args, **kwargs):
        try:
            return commit_step(run, *args, **kwargs)
        finally:
            sample(run)

    iteration.commit_step = sampled


def report(args, summary, run_dir, launched, finished, io_seconds, query) -> None:
    walls = summary["wall_times"]  # when each reported step ended: step 0 (validation before training) first
    first_step = args.iterations + 1 - len(walls)  # 1 without validation before training
    wall_at = {first_step + i: wall for i, wall in enumerate(walls)}  # step → when it ended
    iteration_walls = [b - a for a, b in zip(walls, walls[1:], strict=False)]  # steps first_step + 1 on
    manifests = [
        json.loads((run_dir / f"iter={i:06d}/_manifest.json").read_text())["stages"]
        for i in range(1, args.iterations + 1)
    ]
    # the DAG the overrides give: GRPO has no critic, validation runs every test_freq steps
    present = set().union(*manifests)
    stages = [s for s in STAGES if s in present] + sorted(present - set(STAGES))
    timing = {s: [m[s]["seconds"] if s in m else 0.0 for m in manifests] for s in stages}
    tokens = [
        r[0]
        for r in query(run_dir, "SELECT sum(response_length) FROM rollouts GROUP BY iter ORDER BY iter")[1]
    ]
    accuracy = query(
        run_dir, "SELECT iter, avg(components['correctness']) FROM validation GROUP BY iter ORDER BY iter"
    )[1]
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, python {sys.version.split()[0]}, "
        f"torch threads {args.threads or 'default'}"
    )
    print(
        f"iterations: {args.iterations}   wall total: {finished - launched:.1f} s   "
        f"first step after launch: {walls[0] - launched:.1f} s (Prefect server start, model and data"
        + (")" if first_step == 0 else ", and step 1)")
    )
    print("\nstage            median s   share of iteration")
    median_wall = statistics.median(iteration_walls)
    for stage in stages:
        ran = [t for t, m in zip(timing[stage], manifests, strict=True) if stage in m]
        median = statistics.median(ran)
        some = "" if len(ran) == len(manifests) else f"   (in {len(ran)} of {len(manifests)} steps)"
        print(f"  {stage:<15}{median:>8.3f}   {median / median_wall:>6.1%}{some}")
    # without validation before training there is no step 0: the walls then time steps 2 on
    timed = range(args.iterations - len(iteration_walls), args.iterations)  # manifests' indexes
    stage_total = [sum(timing[s][i] for s in stages) for i in timed]
    io_between = summary["io_between_stages"][-len(iteration_walls) :]  # one a step
    outside = [w - s - io for w, s, io in zip(iteration_walls, stage_total, io_between, strict=True)]
    io_per_iteration = io_seconds / max(1, args.iterations)
    print(f"  {'iteration':<15}{median_wall:>8.3f}")
    print(
        f"\nbetween stages (Prefect task runs, the flow; their file IO below): median "
        f"{statistics.median(outside):.3f} s ({statistics.median(outside) / median_wall:.1%})"
    )
    print(
        f"parquet, checkpoints, DuckDB, in stages and commits: {io_per_iteration:.3f} s per iteration "
        f"({io_per_iteration / median_wall:.1%})"
    )
    for kind, label in (
        ("tables", "parquet tables, manifests"),
        ("checkpoints", "checkpoints"),
        ("sync", "fsync wait at commit"),
        ("catalog", "DuckDB catalog"),
    ):
        seconds = summary["io_seconds_by_kind"].get(kind, 0.0) / max(1, args.iterations)
        print(f"  {label:<27}{seconds:.3f} s ({seconds / median_wall:.1%})")
    share = (statistics.median(outside) + io_per_iteration) / median_wall
    print(f"outside engine compute: {share:.1%} of an iteration")
    _report_steady_io(summary["io_per_step"], statistics.median(outside), median_wall)
    if (server := summary["server_cpu_per_iteration"]) is not None:
        print(
            f"Prefect server (a process of its own, beside training): {server:.3f} s CPU per iteration "
            f"({server / median_wall:.0%} of one core)"
        )
    gen = sum(tokens) / sum(timing["rollouts"])
    from ppoflow.conf import load_config

    epochs = load_config(None, args.overrides).actor_rollout_ref.actor.ppo_epochs
    train = sum(tokens) * epochs / sum(timing["actor_update"])
    print(f"\ngeneration: {gen:,.0f} response tokens/s (sampling + old/ref log-probs)")
    print(f"actor training: {train:,.0f} tokens/s ({epochs} PPO epochs over each batch)")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(f"peak RSS: {rss:.0f} MB (trainer process), {children:.0f} MB (largest child: Prefect server)")
    if not accuracy:
        print("\nno validation (trainer.test_freq)")
        return
    # the base model's accuracy, or the first validated step's without validation before training
    first, first_accuracy = accuracy[0]
    base = f"{first_accuracy:.2f}" + (f" (step {first})" if first else "")
    reached = next(((i, a) for i, a in accuracy if a >= args.target), None)
    if reached:
        step, value = reached
        print(
            f"\ngreedy accuracy {base} → {value:.2f} at step {step}: "
            f"{wall_at[step] - launched:.1f} s after launch"
        )
    else:
        print(
            f"\ngreedy accuracy {base} → best {max(a for _, a in accuracy):.2f}; "
            f"{args.target:.0%} not reached in {args.iterations} steps"
        )


def _report_steady_io(per_step: list[dict[str, float]], between: float, median_wall: float) -> None:
    """The same shares with each step's IO as a median over steps (steps 2 on): the figures above are
    means over the run, which carry its one-time IO."""
    if not per_step:
        return
    totals = [sum(step.values()) for step in per_step]
    median_io = statistics.median(totals)
    print(
        f"  per step, median over {len(totals)} steps: {median_io:.3f} s ({median_io / median_wall:.1%}; "
        + ", ".join(
            f"{kind} {statistics.median(step.get(kind, 0.0) for step in per_step):.3f} s"
            for kind in sorted({kind for step in per_step for kind in step})
        )
        + ")"
    )
    print(f"outside engine compute, medians: {(between + median_io) / median_wall:.1%} of an iteration")


if __name__ == "__main__":
    main()
