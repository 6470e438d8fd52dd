"""Does a step cost more in a long run? A run of --steps committed steps is planted from a real run's
step folders, and the costs that a run's length could grow are timed beside those of a short run
planted the same way (--short steps):

    .venv/bin/python benchmarks/long_run.py                       # trains a 4-step run first
    .venv/bin/python benchmarks/long_run.py --run runs/demo --steps 5000 --short 40

Planting: step k of the planted run is a copy of step ((k - 1) mod S) + 1 of the real run (S its
trained steps): every table file copied, the metrics row's `step` set to k, and the manifest written
again with its step, paths and the new metrics file's digest, so every step is committed; step 0
(the validation before training), the config, the ingested data and the tokenizer are copied as they
are, and the catalog is built as the last commit would have left it.
Then, for each planted run, medians of --rounds:

    commit      committing step N + 1 (`commit_step`: the fsync wait, its manifest, the catalog check)
                for files copied in from step 1, its manifest removed between rounds
    query       `ppoflow query RUN "SELECT … FROM rewards WHERE iter = N"` (one step), the process
    show        `ppoflow show RUN` (the newest step), the process
    diagnose    `ppoflow diagnose RUN --format json`, the process
    explore     `ppoflow explore RUN`: its start to its URL printed (the server answers), then its
                first answers to the page's two first calls: the run (`/api/run`) and the metric plots
                (`/api/metrics`, four metrics, every step)

Prints one line per measure and the ratio long / short; exits 1 when a measure other than the
plots' first answer takes more than twice the short run's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from concurrent_runs import SMALL  # noqa: E402  (the embedded default, small: its runs' settings)

ROOT = Path(__file__).resolve().parent.parent
PPOFLOW = [sys.executable, "-m", "ppoflow"]
BOUNDED = ("commit", "query", "show", "diagnose", "explore start")


def train_run(run_dir: Path, steps: int) -> None:
    command = [*PPOFLOW, "train", *SMALL, f"trainer.total_training_steps={steps}"]
    subprocess.run([*command, f"trainer.default_local_dir={run_dir}"], check=True, capture_output=True)


def step_name(step: int) -> str:
    return f"iter={step:06d}"


def trained_steps(run: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in run.glob("iter=" + "[0-9]" * 6) if (p / "rollouts").is_dir())


def plant_step(source: Path, target: Path, step: int, manifest: dict) -> None:
    """Copy a step folder to `target` as step `step`: its files, the metrics row's step, its manifest."""
    old = source.name
    for folder in source.iterdir():
        if not folder.is_dir():
            continue
        (target / folder.name).mkdir(parents=True)
        for part in folder.iterdir():
            if folder.name == "metrics":
                table = pq.read_table(part)
                at = table.schema.get_field_index("step")
                column = pa.array([step] * table.num_rows, table.schema.field(at).type)
                pq.write_table(
                    table.set_column(at, table.schema.field(at), column), target / folder.name / part.name
                )
            else:
                shutil.copyfile(part, target / folder.name / part.name)
    text = json.dumps(manifest).replace(f'"{old}/', f'"{step_name(step)}/')
    document = json.loads(text)
    document["iteration"] = step
    digests = {}
    metrics = target / "metrics"
    for part in metrics.iterdir():
        digests[f"{step_name(step)}/metrics/{part.name}"] = (
            "sha256:" + hashlib.sha256(part.read_bytes()).hexdigest()
        )
    for entry in document["stages"].values():
        for ref in entry["refs"]:
            ref["digest"] = digests.get(ref["path"], ref["digest"])
    (target / "_manifest.json").write_text(json.dumps(document, indent=2, sort_keys=True))


def plant(real: Path, out: Path, steps: int) -> None:
    out.mkdir(parents=True)
    for name in ("config.yaml", "data", "model", ".lock", "iter=000000"):
        source = real / name
        if source.is_dir():
            shutil.copytree(source, out / name)
        elif source.exists():
            shutil.copy(source, out / name)
    sources = trained_steps(real)
    manifests = {s: json.loads((real / step_name(s) / "_manifest.json").read_text()) for s in sources}
    for step in range(1, steps + 1):
        source = sources[(step - 1) % len(sources)]
        plant_step(real / step_name(source), out / step_name(step), step, manifests[source])
    from ppoflow.tasks.storage.catalog import refresh_catalog

    refresh_catalog(out)  # as the run's last commit left it


def timed_commit(run: Path, real: Path, rounds: int) -> float:
    """Median seconds of commit_step for the step after the run's last, its files copied from step 1."""
    from ppoflow.tasks.pipeline.commit import commit_step
    from ppoflow.tasks.pipeline.run import RunFiles
    from ppoflow.tasks.pipeline.states import StageResult
    from ppoflow.tasks.storage.tables import ArtifactRef

    last = max(trained_steps(run))
    step = last + 1
    source = real / step_name(trained_steps(real)[0])
    manifest = json.loads((source / "_manifest.json").read_text())
    plant_step(source, run / step_name(step), step, manifest)
    document = json.loads((run / step_name(step) / "_manifest.json").read_text())
    (run / step_name(step) / "_manifest.json").unlink()
    results = [
        StageResult(
            name, tuple(ArtifactRef.from_dict(r) for r in entry["refs"]), entry["cache_key"], entry["seconds"]
        )
        for name, entry in document["stages"].items()
    ]
    states = {key: document[key] for key in ("started_from", "ended_with") if key in document}
    seconds = []
    for _ in range(rounds):
        (run / step_name(step) / "_manifest.json").unlink(missing_ok=True)
        files = RunFiles(str(run.resolve()))
        started = time.perf_counter()
        commit_step(files, step, results, states or None)
        seconds.append(time.perf_counter() - started)
    shutil.rmtree(run / step_name(step))
    return statistics.median(seconds)


def timed_process(command: list[str], rounds: int) -> float:
    seconds = []
    for _ in range(rounds):
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        seconds.append(time.perf_counter() - started)
        if done.returncode not in (0, 1):  # diagnose: 1 is a warning found
            raise RuntimeError(
                f"{' '.join(command[2:])} exited {done.returncode}: {done.stderr.strip()[-500:]}"
            )
    return statistics.median(seconds)


def timed_explorer(run: Path, rounds: int) -> tuple[float, float, float]:
    """Medians of: the start to the URL printed, then the first /api/run, the first /api/metrics."""
    starts, overviews, plots = [], [], []
    for _ in range(rounds):
        started = time.perf_counter()
        process = subprocess.Popen(
            [*PPOFLOW, "explore", str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            line = process.stdout.readline()
            starts.append(time.perf_counter() - started)
            match = re.search(r"at (http://127\.0\.0\.1:\d+)/#token=(\S+)", line)
            if match is None:
                raise RuntimeError(f"no URL in {line!r}: {process.stderr.read()[-500:]}")
            base, token = match.groups()

            started = time.perf_counter()
            overview = ask(base, token, "/api/run")
            overviews.append(time.perf_counter() - started)
            names = overview["default_metrics"][:4]
            started = time.perf_counter()
            ask(base, token, "/api/metrics?" + urllib.parse.urlencode([("names", n) for n in names]))
            plots.append(time.perf_counter() - started)
        finally:
            process.terminate()
            process.communicate(timeout=30)
    return statistics.median(starts), statistics.median(overviews), statistics.median(plots)


def ask(base: str, token: str, path: str) -> dict:
    request = urllib.request.Request(base + path, headers={"X-Ppoflow-Token": token})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def measure(run: Path, real: Path, rounds: int) -> dict[str, float]:
    last = max(trained_steps(run))
    sql = f"SELECT count(*), avg(score) FROM rewards WHERE iter = {last}"
    found = {"commit": timed_commit(run, real, rounds)}
    found["query"] = timed_process([*PPOFLOW, "query", str(run), sql], rounds)
    found["show"] = timed_process([*PPOFLOW, "show", str(run)], rounds)
    found["diagnose"] = timed_process([*PPOFLOW, "diagnose", str(run), "--format", "json"], rounds)
    start, overview, plots = timed_explorer(run, rounds)
    found |= {"explore start": start, "explore /api/run": overview, "explore /api/metrics": plots}
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, help="a trained run (default: train a 4-step one)")
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--short", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", type=Path, help="plant the runs here and keep them (planted once: reused)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ppoflow-long-run-") as scratch:
        root = args.keep or Path(scratch)
        real = args.run
        if real is None:
            real = root / "real"
            train_run(real, 4)
        results = {}
        for steps in (args.short, args.steps):
            started = time.perf_counter()
            if not (root / f"planted-{steps}").exists():
                plant(real.resolve(), root / f"planted-{steps}", steps)
                print(f"planted {steps:,} steps in {time.perf_counter() - started:.1f} s", flush=True)
            results[steps] = measure(root / f"planted-{steps}", real.resolve(), args.rounds)
        short, long = results[args.short], results[args.steps]
        print(f"\nmedians of {args.rounds}    {args.short:>7,} steps  {args.steps:>7,} steps   ratio")
        over = []
        for name in short:
            ratio = long[name] / short[name]
            print(f"  {name:<22} {short[name]:>9.3f} s {long[name]:>9.3f} s   {ratio:5.2f}")
            if name in BOUNDED and ratio > 2:
                over.append(name)
        if over:
            print(f"more than twice the short run's: {', '.join(over)}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
