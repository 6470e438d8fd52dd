"""Several `ppoflow train` on one machine, started within the same second, each on a run directory of
its own and each with its own temporary Prefect server (as a sweep runs them), for several rounds:
does every run finish, with the actor that the same run trains alone?

    .venv/bin/python benchmarks/concurrent_runs.py                  # eight runs, five rounds
    .venv/bin/python benchmarks/concurrent_runs.py --runs 4 --rounds 2 --steps 1

All runs share one PREFECT_HOME (a fresh folder, as a user's ~/.prefect is shared by their runs) and
one torch thread each. Prints one line per round and exits 1 if any run failed or trained another
actor.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMALL = [
    "data.train_batch_size=32",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "critic.ppo_mini_batch_size=16",
    "critic.ppo_micro_batch_size_per_gpu=16",
    "trainer.num_threads=1",
]


def trainer(run_dir: Path, steps: int, env: dict[str, str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "ppoflow", "train", *SMALL, f"trainer.total_training_steps={steps}"]
    return subprocess.Popen(
        [*command, f"trainer.default_local_dir={run_dir}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def final_actor(run_dir: Path, steps: int) -> bytes | None:
    path = run_dir / f"checkpoints/iter={steps:06d}/actor/model.safetensors"
    return path.read_bytes() if path.is_file() else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ppoflow-concurrent-") as scratch:
        root = Path(scratch)
        env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PPOFLOW_FAULT")}
        env |= {"PREFECT_HOME": str(root / "prefect-home"), "PPOFLOW_PROGRESS": "0"}
        started = time.perf_counter()
        alone = trainer(root / "alone", args.steps, env)
        _, err = alone.communicate()
        if alone.returncode != 0:
            print(f"the reference run failed: {err.strip().splitlines()[-1:]}")
            return 1
        reference = final_actor(root / "alone", args.steps)
        print(f"reference run alone: {time.perf_counter() - started:.1f} s, {args.steps} steps")
        failures = 0
        for round_number in range(1, args.rounds + 1):
            dirs = [root / f"round-{round_number}" / f"run-{index}" for index in range(args.runs)]
            started = time.perf_counter()
            running = [trainer(run_dir, args.steps, env) for run_dir in dirs]
            launched = time.perf_counter() - started
            errors = [process.communicate()[1] for process in running]
            seconds = time.perf_counter() - started
            finished = sum(process.returncode == 0 for process in running)
            same = sum(final_actor(run_dir, args.steps) == reference for run_dir in dirs)
            lost_port = sum(
                "address already in use" in (run_dir / "logs/prefect-server.log").read_text(errors="replace")
                for run_dir in dirs
                if (run_dir / "logs/prefect-server.log").is_file()
            )
            print(
                f"round {round_number}: {args.runs} runs launched in {launched:.2f} s, "
                f"{finished} finished, {same} with the reference actor, "
                f"{lost_port} servers lost their port, {seconds:.1f} s"
            )
            for process, error in zip(running, errors, strict=True):
                if process.returncode != 0:
                    last = error.strip().splitlines()[-2:]
                    print(f"  exit {process.returncode}: {' / '.join(last)}")
            failures += (args.runs - finished) + (args.runs - same)
    print("every run finished with the reference actor" if not failures else f"{failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
