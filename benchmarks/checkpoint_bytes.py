"""Benchmark: the bytes a run's checkpoints take on disk, by step, role and kind.

    python benchmarks/checkpoint_bytes.py                       # GSM8K, SmolLM2-135M, 2 steps
    python benchmarks/checkpoint_bytes.py -- trainer.save_freq=1
    python benchmarks/checkpoint_bytes.py --measure RUN_DIR     # an existing run directory

It runs `ppoflow train --config conf/gsm8k_cpu.yaml` (PPO with a critic) with short answers (the
bytes depend on the model, not on what it generates), then sums checkpoints/iter=*/: the model
directories (weights, config, tokenizer) and the optimizer states (`<role>.optim/`, or the single
`<role>.optim.pt` file of ppoflow before sharded optimizer states). Extra arguments after `--` are
config overrides.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAST = [
    "data.max_response_length=8",
    "data.val_max_samples=2",
    "trainer.test_freq=-1",
    "actor_rollout_ref.actor.ppo_epochs=1",
    "critic.ppo_epochs=1",
]
MB = 10**6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure", type=Path, help="only measure this run directory")
    parser.add_argument("overrides", nargs="*", help="config overrides (after --)")
    args = parser.parse_args()
    if args.measure is not None:
        report(args.measure)
        return
    with tempfile.TemporaryDirectory(prefix="ppoflow-ckpt-bytes-") as run_dir:
        command = [
            sys.executable,
            "-m",
            "ppoflow",
            "train",
            "--config",
            str(ROOT / "conf/gsm8k_cpu.yaml"),
            *FAST,
            f"trainer.default_local_dir={run_dir}",
            *args.overrides,
        ]
        print("$", " ".join(command[2:]), flush=True)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        report(Path(run_dir))


def report(run_dir: Path) -> None:
    rows = []
    for step_dir in sorted((run_dir / "checkpoints").glob("iter=*")):
        for entry in sorted(step_dir.iterdir()):
            if entry.name.startswith("."):
                continue
            kind = "optimizer" if ".optim" in entry.name else "model" if entry.is_dir() else "other"
            rows.append((step_dir.name, entry.name, kind, _size(entry)))
    print(f"{'step':<12} {'entry':<16} {'kind':<10} {'MB':>10}")
    for step, name, kind, size in rows:
        print(f"{step:<12} {name:<16} {kind:<10} {size / MB:>10.1f}")
    for kind in ("model", "optimizer", "other"):
        total = sum(size for *_, k, size in rows if k == kind)
        print(f"{'total':<12} {'':<16} {kind:<10} {total / MB:>10.1f}")
    print(f"{'total':<12} {'':<16} {'all':<10} {sum(r[3] for r in rows) / MB:>10.1f}")


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


if __name__ == "__main__":
    main()
