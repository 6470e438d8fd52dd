"""Does the embedded default learn, whatever the seed? Runs the README's `ppoflow train` for several
`trainer.seed` values (each seed warm-starts its own tiny model and samples its own rollouts) and
prints each run's validation curve, its final greedy accuracy and when it first reached a target.

    .venv/bin/python benchmarks/learning.py                     # seeds 1 2 3, the embedded default
    .venv/bin/python benchmarks/learning.py --seeds 1 2 3 4 5 -- trainer.total_training_steps=20

Each run is the real command in a process of its own (its own temporary Prefect server), one after
another; seconds are from launch to the moment the step's line was printed. Exits 1 when a seed's
final correctness is below --final or its step-20 correctness below --at-20.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEP_LINE = re.compile(r"^step\s+(\d+)/(\d+) · val ([0-9.]+) \(correct ([0-9.]+)\)")


def run_seed(seed: int, run_dir: Path, overrides: list[str]) -> list[tuple[int, float, float, float]]:
    """(step, val score, correct, seconds since launch) of each validated step of one run."""
    command = [sys.executable, "-m", "ppoflow", "train", f"trainer.seed={seed}"]
    command += [f"trainer.default_local_dir={run_dir}", *overrides]
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PPOFLOW_PROGRESS": "0"}
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    curve = []
    for line in process.stdout:
        if match := STEP_LINE.match(line):
            step, score, correct = int(match[1]), float(match[3]), float(match[4])
            curve.append((step, score, correct, time.perf_counter() - started))
    error = process.stderr.read()
    if process.wait() != 0:
        raise SystemExit(f"seed {seed} failed (exit {process.returncode}): {error.strip()[-2000:]}")
    return curve


def first_reaching(curve, target: float) -> str:
    for step, _, correct, seconds in curve:
        if correct >= target:
            return f"step {step} ({seconds:.0f} s)"
    return "never"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--final", type=float, default=0.95, help="correctness every seed must end at")
    parser.add_argument("--at-20", type=float, default=0.90, help="correctness every seed needs at step 20")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every run (after --)")
    args = parser.parse_args()
    failed = []
    with tempfile.TemporaryDirectory(prefix="ppoflow-learning-") as scratch:
        for seed in args.seeds:
            curve = run_seed(seed, Path(scratch) / f"seed-{seed}", args.overrides)
            points = " ".join(f"{step}:{correct:.2f}" for step, _, correct, _ in curve)
            final_step, final_score, final_correct, seconds = curve[-1]
            at_20 = next((c for s, _, c, _ in curve if s == 20), None)
            print(f"seed {seed}: correct by step  {points}")
            print(
                f"seed {seed}: final (step {final_step}) val {final_score:.3f} correct {final_correct:.2f}, "
                f"{seconds:.0f} s; reached 0.95 at {first_reaching(curve, 0.95)}, "
                f"0.90 at {first_reaching(curve, 0.90)}"
            )
            if final_correct < args.final or (at_20 is not None and at_20 < args.at_20):
                failed.append(seed)
    finals = "all seeds" if not failed else f"seeds {failed} fell short"
    print(f"{finals}: final correct ≥ {args.final}, step-20 correct ≥ {args.at_20}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
