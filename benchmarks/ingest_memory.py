"""How much memory ingest takes for a large data file: a JSONL file of --mb megabytes of verl dataset
rows (addition prompts, each with a long `extra_info.note` so that a row is ~1 kB) is taken in by the
prompts stage's reading (`_file_prompts`, with the tiny model's tokenizer and the embedded default's
data settings) and written as the run's `data/train.parquet`, in a process of its own; prints its
peak resident memory and seconds.

    .venv/bin/python benchmarks/ingest_memory.py --mb 200
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MEASURE = """
import resource, sys, time
from pathlib import Path
from ppoflow.conf import load_config
from ppoflow.engine.models import load_tokenizer
from ppoflow.tasks.pipeline.plan import run_plan
from ppoflow.tasks.stages.prepare_model import build_tiny_base
from ppoflow.tasks.stages.prompts import _file_prompts
from ppoflow.tasks.storage.schemas import SCHEMAS
from ppoflow.tasks.storage.tables import write_table

data, out = sys.argv[1], Path(sys.argv[2])
tokenizer = load_tokenizer(build_tiny_base(seed=1))
settings = run_plan(load_config(None, [f"data.train_files={data}"], check_paths=False)).data.train
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
started = time.perf_counter()
table, rejects = _file_prompts([data], "train", settings, tokenizer)
write_table(table if hasattr(table, "num_rows") else __import__("pyarrow").Table.from_pylist(
    table, schema=SCHEMAS["prompts"]), out, "data/train.parquet", SCHEMAS["prompts"])
seconds = time.perf_counter() - started
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
rows = table.num_rows if hasattr(table, "num_rows") else len(table)
print(f"{rows:,} rows, {len(rejects):,} rejected: {seconds:.1f} s, peak {peak / 2**10:.0f} MiB "
      f"(before reading {before / 2**10:.0f} MiB)")
"""


def write_data(path: Path, megabytes: int) -> int:
    note = "x" * 900
    written = rows = 0
    with path.open("w") as out:
        while written < megabytes * 2**20:
            a, b = rows % 10, (rows // 10) % 10
            row = {
                "data_source": "ppoflow/addition",
                "prompt": f"{a} + {b} = ",
                "ability": "arithmetic",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"index": rows, "note": note},
            }
            line = json.dumps(row) + "\n"
            out.write(line)
            written += len(line)
            rows += 1
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ppoflow-ingest-") as scratch:
        data = Path(scratch) / "big.jsonl"
        rows = write_data(data, args.mb)
        print(f"{data.stat().st_size / 2**20:.0f} MiB of JSONL, {rows:,} rows", flush=True)
        out = Path(scratch) / "run"
        done = subprocess.run(
            [sys.executable, "-c", MEASURE, str(data), str(out)], capture_output=True, text=True
        )
        if done.returncode != 0:
            print(done.stderr[-2000:])
            return 1
        print(done.stdout.strip())
        print(f"data/train.parquet: {(out / 'data/train.parquet').stat().st_size / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
