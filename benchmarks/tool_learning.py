"""Does the tiny model learn to call its calculator, whatever the seed? Runs
`ppoflow train --config conf/tool_calculator.yaml` for several `trainer.seed` values (each seed
warm-starts its own tiny calculator model and samples its own rollouts) and prints, per validated
step, the share of right answers and of answers that call the tool (greedy, 100 held-out sums), and
the training responses' calls per response, from the run's metrics table.

    .venv/bin/python benchmarks/tool_learning.py                # seeds 1 2 3
    .venv/bin/python benchmarks/tool_learning.py --seeds 4 5 -- trainer.total_training_steps=10

Each run is the real command in a process of its own (its own temporary Prefect server), one after
another. Exits 1 when a seed's final accuracy is below --final or its tool-call rate did not rise by
--rise.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "conf" / "tool_calculator.yaml"
ACC = "val-core/ppoflow/tool-addition/acc/mean@1"
CALLS = "val-aux/tool_call_counts/mean"
TRAIN_CALLS = "tool_call_counts/mean"


def run_seed(seed: int, run_dir: Path, overrides: list[str]) -> tuple[list[tuple], float]:
    """(iter, accuracy, calls, training calls) per step of one run, and its wall seconds."""
    from ppoflow.tasks.storage.confined_query import query

    command = [sys.executable, "-m", "ppoflow", "train", "--config", str(CONFIG), f"trainer.seed={seed}"]
    command += [f"trainer.default_local_dir={run_dir}", *overrides]
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PPOFLOW_PROGRESS": "0"}
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"seed {seed} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    _, rows = query(run_dir, f'SELECT iter, "{ACC}", "{CALLS}", "{TRAIN_CALLS}" FROM metrics ORDER BY iter')
    return rows, seconds


def cell(value) -> str:
    return "  —  " if value is None else f"{value:5.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--final", type=float, default=0.9, help="accuracy every seed must end at")
    parser.add_argument("--rise", type=float, default=0.5, help="rise of the tool-call rate every seed needs")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every run (after --)")
    args = parser.parse_args()
    failed = []
    with tempfile.TemporaryDirectory(prefix="ppoflow-tool-learning-") as scratch:
        for seed in args.seeds:
            rows, seconds = run_seed(seed, Path(scratch) / f"seed{seed}", args.overrides)
            validated = [r for r in rows if r[1] is not None]
            print(f"seed {seed} ({seconds:.0f} s, warm start included)")
            print("  step  right  calls  training calls/response")
            for step, acc, calls, train_calls in rows:
                if acc is not None or step % 4 == 0:
                    print(f"  {step:4d}  {cell(acc)}  {cell(calls)}  {cell(train_calls)}")
            first, last = validated[0], validated[-1]
            if last[1] < args.final or last[2] - first[2] < args.rise:
                failed.append(seed)
    if failed:
        print(f"FAILED seeds {failed}: final accuracy < {args.final} or tool-call rate rose < {args.rise}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
