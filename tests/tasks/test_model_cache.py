"""The model cache ($PPOFLOW_CACHE): a model is built once however many processes ask for it at the
same time, an intact copy is reused, and a damaged one is rebuilt."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from ppoflow.tasks.stages.prepare_model import CACHE_DIGEST, cached_model_dir

BUILD = """
import os, sys, time
from pathlib import Path
from ppoflow.tasks.stages.prepare_model import cached_model_dir

target, builds, ready = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
(ready / str(os.getpid())).touch()
deadline = time.monotonic() + 60
while len(list(ready.iterdir())) < 3 and time.monotonic() < deadline:  # all three ask at once
    time.sleep(0.01)

def build(staging):
    with open(builds, "a") as record:
        record.write(f"{os.getpid()}\\n")
    time.sleep(1.0)  # long enough for the others to ask meanwhile
    (staging / "weights.bin").write_bytes(b"w" * 1000)

print(cached_model_dir(target, build))
print(sorted(p.name for p in target.iterdir()))
"""


def test_processes_asking_at_once_build_the_model_once_and_both_get_it(tmp_path):
    target, builds, ready = tmp_path / "cache/model", tmp_path / "builds.txt", tmp_path / "ready"
    ready.mkdir()
    asking = [
        subprocess.Popen(
            [sys.executable, "-c", BUILD, str(target), str(builds), str(ready)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    answers = [process.communicate(timeout=120)[0] for process in asking]
    assert [process.returncode for process in asking] == [0, 0, 0]
    assert len(builds.read_text().splitlines()) == 1
    assert answers == [f"{target}\n{sorted([CACHE_DIGEST, 'weights.bin'])}\n"] * 3
    assert sorted(p.name for p in target.parent.iterdir()) == [".model.lock", "model"]  # no staging left
    assert len(list(ready.iterdir())) == 3


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
    assert sorted(p.name for p in target.parent.iterdir()) == [".model.lock", "model"]  # old copy gone


def test_a_planted_lock_file_is_refused_in_words(tmp_path):
    (tmp_path / ".model.lock").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError) as refused:
        cached_model_dir(tmp_path / "model", lambda staging: None)
    assert str(refused.value).startswith(
        f"{tmp_path / '.model.lock'} cannot be the model cache's lock file ("
    )
    assert str(refused.value).endswith("); remove it")
    assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "model").exists()


KILLED_BUILD = """
import sys, time
from pathlib import Path
from ppoflow.tasks.stages.prepare_model import cached_model_dir

def build(staging):
    (staging / "weights.bin").write_bytes(b"w" * 1000)
    (Path(sys.argv[2]) / "started").touch()
    time.sleep(600)  # killed here, half way through

cached_model_dir(Path(sys.argv[1]), build)
"""


def test_what_a_killed_build_left_is_removed_by_the_next_build_and_links_are_left_alone(tmp_path):
    cache, signals = tmp_path / "cache", tmp_path / "signals"
    signals.mkdir()
    target = cache / "model"
    building = subprocess.Popen([sys.executable, "-c", KILLED_BUILD, str(target), str(signals)])
    try:
        deadline = time.monotonic() + 60
        while not (signals / "started").exists() and building.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (signals / "started").exists()
    finally:
        building.kill()
        building.wait(timeout=30)
    staged = [p.name for p in cache.iterdir() if p.name.startswith(".model.") and p.is_dir()]
    assert len(staged) == 1 and not target.exists()  # the killed build's staging folder
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.bin").write_bytes(b"k")
    (cache / ".model.planted").symlink_to(victim, target_is_directory=True)
    (cache / ".model-other.abc123").mkdir()  # another cache entry's staging: not this one's

    builds = []

    def build(staging: Path) -> None:
        builds.append(staging)
        (staging / "weights.bin").write_bytes(b"w" * 1000)

    assert cached_model_dir(target, build) == target
    assert len(builds) == 1
    assert sorted(p.name for p in cache.iterdir()) == [
        ".model-other.abc123",
        ".model.lock",
        ".model.planted",
        "model",
    ]
    assert (victim / "keep.bin").read_bytes() == b"k"


def test_a_copy_moved_aside_by_a_killed_swap_is_removed_without_rebuilding(tmp_path):
    target, builds = tmp_path / "model", []

    def build(staging: Path) -> None:
        builds.append(staging)
        (staging / "weights.bin").write_bytes(b"w" * 1000)

    cached_model_dir(target, build)
    aside = tmp_path / ".model.old.k2j3h4ab"  # killed after the swap, before the old copy was deleted
    (aside / "model").mkdir(parents=True)
    (aside / "model" / "weights.bin").write_bytes(b"x" * 1000)
    assert cached_model_dir(target, build) == target
    assert len(builds) == 1  # the intact copy is kept
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.lock", "model"]
