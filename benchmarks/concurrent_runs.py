"""Several `ppoflow train` on one machine, started within the same second, each on a run directory of
its own and each with its own temporary Prefect server (as a sweep runs them), for several rounds:
does every run finish, as the same run trained alone?

    .venv/bin/python benchmarks/concurrent_runs.py                  # eight runs, five rounds
    .venv/bin/python benchmarks/concurrent_runs.py --runs 4 --rounds 2 --steps 1

All runs share one PREFECT_HOME, and so one Prefect database (`prefect.db`, as a user's
~/.prefect is shared by their runs); the first round starts on a database that none of them has
made yet (`--fresh`: every round), so that eight servers create it at once. One torch thread each.
For each round: the runs that finished, those whose tables and final weights equal the run alone's
(benchmarks/compare_runs.py's "same run"), the servers that lost their port, the runs whose logs
(`logs/train.log`, `logs/prefect-server.log`) say "database is locked", how many ports the servers
listened on (each run's own, from its flow run's link), the round's wall time and its peak memory:
the most that the processes it started held at once (their resident memory summed, sampled every
0.2 s) and the most the machine had in use above what it used before the round. Exits 1 if any run
failed, differed or met a locked database.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_runs import same_run  # noqa: E402

SMALL = [
    "data.train_batch_size=32",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "critic.ppo_mini_batch_size=16",
    "critic.ppo_micro_batch_size_per_gpu=16",
    "trainer.num_threads=1",
]
LOCKED = "database is locked"


def trainer(run_dir: Path, steps: int, env: dict[str, str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "ppoflow", "train", *SMALL, f"trainer.total_training_steps={steps}"]
    return subprocess.Popen(
        [*command, f"trainer.default_local_dir={run_dir}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def logs(run_dir: Path) -> str:
    texts = [(run_dir / "logs" / name) for name in ("train.log", "prefect-server.log")]
    return "".join(path.read_text(errors="replace") for path in texts if path.is_file())


def server_port(run_dir: Path) -> int | None:
    """The port of the run's temporary Prefect server, from its flow run's link (flow_runs.json)."""
    try:
        found = re.findall(r"http://127\.0\.0\.1:(\d+)/", (run_dir / "flow_runs.json").read_text())
    except OSError:
        return None
    return int(found[-1]) if found else None


class Memory:
    """While the block runs: the most the processes below this one held at once (resident, summed)
    and the most the machine had in use above its use at the start (MemTotal − MemAvailable)."""

    def __enter__(self) -> Memory:
        self.processes_peak = self.machine_peak = 0
        self.machine_before = _machine_used()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _sample(self) -> None:
        from ppoflow.tasks.models.processes import descendants

        while not self._done.wait(0.2):
            held = sum(_resident(pid) for pid in descendants(os.getpid()))
            self.processes_peak = max(self.processes_peak, held)
            self.machine_peak = max(self.machine_peak, _machine_used() - self.machine_before)


def _resident(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    found = re.search(r"VmRSS:\s+(\d+) kB", status)
    return int(found.group(1)) * 1024 if found else 0


def _machine_used() -> int:
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return (int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])) * 1024


def run_round(dirs: list[Path], steps: int, env: dict[str, str]) -> list[str]:
    """Train every run of `dirs` at once and print how that went; returns why runs failed."""
    started = time.perf_counter()
    with Memory() as memory:
        running = [trainer(run_dir, steps, env) for run_dir in dirs]
        launched = time.perf_counter() - started
        errors = [process.communicate()[1] for process in running]
    seconds = time.perf_counter() - started
    finished = sum(process.returncode == 0 for process in running)
    locked = sum(LOCKED in logs(run_dir) for run_dir in dirs)
    lost_port = sum("address already in use" in logs(run_dir) for run_dir in dirs)
    ports = {server_port(run_dir) for run_dir in dirs} - {None}
    print(
        f"  {len(dirs)} runs launched in {launched:.2f} s: {finished} finished, {locked} met a locked "
        f"database, {lost_port} servers lost their port, {len(ports)} ports; {seconds:.1f} s, peak memory "
        f"{memory.processes_peak / 2**30:.2f} GiB of the processes ({memory.machine_peak / 2**30:.2f} GiB "
        "more in use on the machine)",
        flush=True,
    )
    failed = [
        f"exit {process.returncode}: {' / '.join(error.strip().splitlines()[-2:])}"
        for process, error in zip(running, errors, strict=True)
        if process.returncode != 0
    ]
    return failed + [f"{run_dir.name} met a locked database" for run_dir in dirs if LOCKED in logs(run_dir)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--fresh", action="store_true", help="a Prefect database none has made, each round")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ppoflow-concurrent-") as scratch:
        root = Path(scratch)
        base = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PPOFLOW_FAULT")}
        base["PPOFLOW_PROGRESS"] = "0"
        reference, failures = root / "alone", 0
        for round_number in range(1, args.rounds + 1):
            fresh = round_number == 1 or args.fresh
            env = base | {"PREFECT_HOME": str(root / f"prefect-home-{round_number if args.fresh else 1}")}
            dirs = [root / f"round-{round_number}" / f"run-{index}" for index in range(args.runs)]
            print(f"round {round_number} ({'a new' if fresh else 'the same'} Prefect database):", flush=True)
            failed = run_round(dirs, args.steps, env)
            if not reference.exists():  # the same run alone, once a database exists
                started = time.perf_counter()
                alone = trainer(reference, args.steps, env)
                _, err = alone.communicate()
                if alone.returncode != 0:
                    print(f"the run alone failed: {err.strip().splitlines()[-1:]}")
                    return 1
                print(f"  the same run alone: {time.perf_counter() - started:.1f} s, {args.steps} steps")
            different = [run_dir.name for run_dir in dirs if not same_run(reference, run_dir)]
            print(f"  {len(dirs) - len(different)} of {len(dirs)} the same run as alone (compare_runs.py)")
            failed += [f"{name} is not the same run as alone" for name in different]
            for line in failed:
                print(f"  {line}")
            failures += len(failed)
    print("every run finished as the same run alone" if not failures else f"{failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
