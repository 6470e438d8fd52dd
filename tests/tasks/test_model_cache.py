"""The model cache ($PPOFLOW_CACHE): a model is built once however many processes ask for it at the
same time, an intact copy is reused, and a damaged one is rebuilt."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ppoflow.tasks.stages.prepare_model import CACHE_DIGEST, cached_model_dir

BUILD = """
import os, sys, time
from pathlib import Path
from ppoflow.tasks.stages.prepare_model import cached_model_dir

target, builds = Path(sys.argv[1]), Path(sys.argv[2])

def build(staging):
    with open(builds, "a") as record:
        record.write(f"{os.getpid()}\\n")
    time.sleep(1.0)  # long enough for the other process to ask meanwhile
    (staging / "weights.bin").write_bytes(b"w" * 1000)

print(cached_model_dir(target, build))
print(sorted(p.name for p in target.iterdir()))
"""


def test_processes_asking_at_once_build_the_model_once_and_both_get_it(tmp_path):
    target, builds = tmp_path / "cache/model", tmp_path / "builds.txt"
    asking = [
        subprocess.Popen(
            [sys.executable, "-c", BUILD, str(target), str(builds)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    answers = [process.communicate(timeout=120)[0] for process in asking]
    assert [process.returncode for process in asking] == [0, 0, 0]
    assert len(builds.read_text().splitlines()) == 1
    assert answers == [f"{target}\n{sorted([CACHE_DIGEST, 'weights.bin'])}\n"] * 3
    assert sorted(p.name for p in target.parent.iterdir()) == [".model.lock", "model"]  # no staging left


def test_an_intact_copy_is_reused_and_a_damaged_one_rebuilt(tmp_path):
    target, builds = tmp_path / "model", []

    def build(staging: Path) -> None:
        builds.append(staging)
        (staging / "weights.bin").write_bytes(b"w" * 1000)

    assert cached_model_dir(target, build) == target
    assert cached_model_dir(target, build) == target
    assert len(builds) == 1
    (target / "weights.bin").write_bytes(b"x" * 1000)  # damaged after it was built
    cached_model_dir(target, build)
    assert len(builds) == 2
    assert (target / "weights.bin").read_bytes() == b"w" * 1000
