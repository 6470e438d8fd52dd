"""How fast `ppoflow explore` starts and shows its first page, on a demo run and on a run of 100,000
training responses.

    .venv/bin/python benchmarks/explorer.py                      # trains a 10-step demo run first
    .venv/bin/python benchmarks/explorer.py --run runs/demo      # an existing run
    .venv/bin/python benchmarks/explorer.py --iterations 100 --responses 1000

The large run is the demo run's own rows, repeated: `--iterations` steps of `--responses` training
responses (each step the demo's rollouts, rewards and advantages of one step, tiled with new sample
indices) and the demo's validation and metrics rows, written as ppoflow writes them
(iter=NNNNNN/<table>/part-00000.parquet, each step with a manifest, so committed), with its config,
data and tokenizer. For each run, each
round starts a fresh `ppoflow explore` process and a fresh headless Chromium page (Debian's chromium):

    started     the command's start → its URL printed (the server listens)
    first page  the page's navigation start → the sample table's first rows in the page (the
                browser's own clock, `performance.mark`): the page and its two files, the run's
                iterations, then its metric plots and a page of samples; beside it the seconds
                from Playwright's goto to its finding the rows (its own polling included)

then times the API calls a user makes next on the newest step (the server warm). Medians of
--rounds rounds. Exits 1 when a median first page of the large run takes a second or more, or a
start on the demo run takes 3 s or more.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
TILED = ("rollouts", "rewards", "advantages")
COPIED = ("validation", "metrics")


def train_demo(run_dir: Path, steps: int) -> None:
    command = [sys.executable, "-m", "ppoflow", "train", f"trainer.total_training_steps={steps}"]
    subprocess.run([*command, f"trainer.default_local_dir={run_dir}"], check=True, capture_output=True)


def build_large_run(demo: Path, out: Path, iterations: int, responses: int) -> int:
    """A run of `iterations` steps of `responses` training responses made of the demo's rows."""
    for name in ("config.yaml", "data", "model"):
        source = demo / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, out / name)
    steps = sorted(int(p.name[5:]) for p in demo.glob("iter=" + "[0-9]" * 6) if (p / "rollouts").is_dir())
    total = 0
    for step in range(1, iterations + 1):
        source = demo / f"iter={steps[(step - 1) % len(steps)]:06d}"
        folder = out / f"iter={step:06d}"
        for table in TILED:
            rows = pq.read_table(next((source / table).glob("*.parquet")))
            copies = -(-responses // rows.num_rows)
            tiled = pa.concat_tables([_with_copy(rows, k) for k in range(copies)]).slice(0, responses)
            _write(tiled, folder / table)
            total += tiled.num_rows if table == "rollouts" else 0
        for table in COPIED:
            rows = pq.read_table(next((source / table).glob("*.parquet")))
            if "iter" in rows.column_names:
                rows = rows.drop_columns(["iter"])
            _write(rows, folder / table)
        shutil.copy(source / "_manifest.json", folder / "_manifest.json")  # committed (its text unread)
    return total


def _with_copy(rows: pa.Table, k: int) -> pa.Table:
    at = rows.schema.get_field_index("sample_idx")
    shifted = pa.compute.add(rows.column("sample_idx"), pa.scalar(k * 1000, pa.int32()))
    return rows.set_column(at, rows.schema.field(at), shifted)


def _write(table: pa.Table, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, folder / "part-00000.parquet")


def one_round(run_dir: Path, browser) -> tuple[float, float, float, dict[str, float]]:
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "ppoflow", "explore", str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        url = re.search(r"at (\S+)", process.stdout.readline()).group(1)
        listening = time.perf_counter() - started
        page = browser.new_page()
        opened = time.perf_counter()
        page.goto(url)
        page.wait_for_selector("#samples tbody tr")
        driver = time.perf_counter() - opened
        # the page's own mark: navigation start → the first rows in the table
        first_page = page.evaluate("performance.getEntriesByName('first-samples')[0].startTime") / 1000
        page.close()
        return listening, first_page, driver, api_calls(url)
    finally:
        process.terminate()
        process.wait()


def api_calls(url: str) -> dict[str, float]:
    """Seconds of each call a user makes after the first page, on the newest training step."""
    base, token = url.split("/#token=")

    def get(path: str) -> tuple[float, dict]:
        request = urllib.request.Request(base + path, headers={"X-Ppoflow-Token": token})
        started = time.perf_counter()
        with urllib.request.urlopen(request) as response:
            body = json.loads(response.read())
        return time.perf_counter() - started, body

    seconds = {}
    seconds["run"], run = get("/api/run")
    last = run["train_iterations"][-1]
    newest = f"/api/samples?kind=train&iter={last}"
    seconds["longest first"], page = get(f"{newest}&sort=response_length&order=desc")
    seconds["score <= 0.5, page 3"], _ = get(f"{newest}&max_score=0.5&page=2")
    key = page["rows"][0]
    seconds["one sample"], _ = get(
        f"/api/sample?kind=train&iter={last}&prompt_id={key['prompt_id']}&sample_idx={key['sample_idx']}"
    )
    seconds["across iterations"], _ = get(
        f"/api/across?kind=train&prompt_id={key['prompt_id']}&iters=1&iters={last}"
    )
    return seconds


def measure(name: str, run_dir: Path, rounds: int, browser) -> tuple[float, float]:
    results = [one_round(run_dir, browser) for _ in range(rounds)]
    listening, first_page, driver = (statistics.median(r[i] for r in results) for i in range(3))
    print(
        f"{name}: started {listening:.2f} s, first page {first_page:.2f} s "
        f"({driver:.2f} s as the test driver saw it; medians of {rounds})"
    )
    for call in results[0][3]:
        print(f"  {call:<22} {statistics.median(r[3][call] for r in results) * 1000:7.1f} ms")
    return listening, first_page


def screenshot(run_dir: Path, out: Path, browser) -> None:
    """The sample view of the run's longest training response of its newest step, coloured by
    advantage, beside the same prompt in its first step: the README's picture."""
    process = subprocess.Popen(
        [sys.executable, "-m", "ppoflow", "explore", str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        url = re.search(r"at (\S+)", process.stdout.readline()).group(1)
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.goto(url)
        page.wait_for_selector("#samples tbody tr")
        with page.expect_response(lambda r: "/api/samples" in r.url):
            page.click('#samples th[data-sort="response_length"]')
        with page.expect_response(lambda r: "/api/samples" in r.url):
            page.click('#samples th[data-sort="response_length"]')
        page.locator("#samples tbody tr").first.click()
        page.wait_for_selector("#tokens .tok")
        page.select_option("#colour-by", "advantages")
        page.locator("#tokens .tok").nth(3).click()
        page.locator("#sample-section").screenshot(path=str(out))
        page.close()
    finally:
        process.terminate()
        process.wait()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", type=Path, help="an existing run (default: train a 10-step demo run)")
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--responses", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--screenshot", type=Path, help="save the sample view of --run as this PNG, only")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    if args.screenshot:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            screenshot(args.run, args.screenshot, browser)
        return 0
    with tempfile.TemporaryDirectory(prefix="explorer-bench-") as scratch:
        demo = args.run or Path(scratch) / "demo"
        if args.run is None:
            train_demo(demo, 10)
        large = Path(scratch) / "large"
        large.mkdir()
        total = build_large_run(demo, large, args.iterations, args.responses)
        print(f"large run: {args.iterations} iterations, {total:,} training responses")
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=CHROMIUM,
                args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
            )
            demo_start, _ = measure("demo run", demo, args.rounds, browser)
            _, large_page = measure(f"{total:,}-response run", large, args.rounds, browser)
            browser.close()
    return 0 if large_page < 1.0 and demo_start < 3.0 else 1


if __name__ == "__main__":
    sys.exit(main())
