"""Are two run directories the same run? Table by table, the rows of every iteration (wall-clock and
memory columns aside), and the weights of the final checkpoints.

    python benchmarks/compare_runs.py RUN_A RUN_B

Reads each run's parquet files directly (iter=N/<stage>/, whatever the stage folders are called, so
runs written by different versions of ppoflow compare) and prints one line per table: rows, and
whether their content is equal. Exits 1 when anything differs.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from safetensors.torch import load_file

TABLES = {  # table → the folder names it has had
    "rollouts": ("rollouts", "rollout"),
    "turns": ("turns",),
    "rewards": ("rewards", "reward"),
    "advantages": ("advantages", "advantage"),
    "critic_update": ("critic_update",),
    "actor_update": ("actor_update",),
    "validation": ("validation",),
    "metrics": ("metrics",),
}
WALL_CLOCK = ("timing_s/", "timing_per_token_ms/", "perf/")
"""Metric prefixes that measure the machine, not the run."""


def read(run: Path, folders: tuple[str, ...]) -> pa.Table | None:
    parts = sorted(p for folder in folders for p in run.glob(f"iter=*/{folder}/part-*.parquet"))
    if not parts:
        return None
    tables = []
    for part in parts:
        table = pq.read_table(part)
        keep = [c for c in table.column_names if not c.startswith(WALL_CLOCK)]
        iteration = int(part.parent.parent.name.removeprefix("iter="))
        tables.append(table.select(keep).append_column("iter", pa.array([iteration] * table.num_rows)))
    return pa.concat_tables(tables, promote_options="default")


def digest(table: pa.Table) -> str:
    table = table.select(sorted(table.column_names))
    return hashlib.sha256(repr(table.to_pylist()).encode()).hexdigest()[:12]


def weights(run: Path) -> dict[str, str]:
    """role → digest of the newest checkpoint's tensors (names and values)."""
    found = {}
    for role in ("actor", "critic"):
        saved = sorted(run.glob(f"checkpoints/iter=*/{role}/model.safetensors"))
        if saved:
            tensors = load_file(saved[-1])
            h = hashlib.sha256()
            for name in sorted(tensors):
                h.update(name.encode())
                h.update(tensors[name].contiguous().view(-1).numpy().tobytes())
            found[f"{role} ({saved[-1].parent.parent.name})"] = h.hexdigest()[:12]
    return found


def same_run(run_a: Path, run_b: Path, say=lambda line: None) -> bool:
    """Whether every table and the final weights of the two runs are equal; `say(line)` is told each
    table's and each role's comparison."""
    same = True
    say(f"{'table':<16}{'rows A':>8}{'rows B':>8}  {'digest A':<14}{'digest B':<14}equal")
    for name, folders in TABLES.items():
        a, b = read(run_a, folders), read(run_b, folders)
        if a is None and b is None:
            continue
        equal = (
            a is not None
            and b is not None
            and a.select(sorted(a.column_names)).equals(b.select(sorted(b.column_names)))
        )
        same &= equal
        rows = [t.num_rows if t is not None else 0 for t in (a, b)]
        digests = [digest(t) if t is not None else "-" for t in (a, b)]
        say(f"{name:<16}{rows[0]:>8}{rows[1]:>8}  {digests[0]:<14}{digests[1]:<14}{'yes' if equal else 'NO'}")
    wa, wb = weights(run_a), weights(run_b)
    for role in sorted(set(wa) | set(wb)):
        da, db = wa.get(role, "-"), wb.get(role, "-")
        say(f"{'weights ' + role:<32}  {da:<14}{db:<14}{'yes' if da == db else 'NO'}")
        same &= da == db
    return same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    args = parser.parse_args()
    same = same_run(args.run_a, args.run_b, print)
    print("same run" if same else "DIFFERENT")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
