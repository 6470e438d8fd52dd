"""The model cache ($PPOFLOW_CACHE): a model is built once however many processes ask for it at the
same time, an intact copy is reused, and a damaged one is rebuilt."""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ppoflow.tasks.storage.checkpoints import directory_digest
from ppoflow.tasks.storage.model_cache import CACHE_DIGEST, STALE_AFTER_S, cached_model_dir

BUILD = """
import os, sys, time
from pathlib import Path
from ppoflow.tasks.storage.model_cache import cached_model_dir

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
    assert sorted(p.name for p in target.parent.iterdir()) == [".model.lock", ".model.tmp", "model"]
    assert _listing(target.parent / ".model.tmp") == []  # no staging left
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
    assert sorted(p.name for p in target.parent.iterdir()) == [".model.lock", ".model.tmp", "model"]
    assert _listing(target.parent / ".model.tmp") == []  # the old copy is gone


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
from ppoflow.tasks.storage.model_cache import cached_model_dir

def build(staging):
    (staging / "weights.bin").write_bytes(b"w" * 1000)
    (Path(sys.argv[2]) / "started").touch()
    time.sleep(600)  # killed here, half way through

cached_model_dir(Path(sys.argv[1]), build)
"""


def _build_into(builds: list[Path]):
    def build(staging: Path) -> None:
        builds.append(staging)
        (staging / "weights.bin").write_bytes(b"w" * 1000)

    return build


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


def _age_all(folder: Path, seconds: float) -> None:
    """`folder` and everything in it, as if untouched for `seconds`."""
    for path in sorted(folder.rglob("*"), reverse=True):
        _age(path, seconds)
    _age(folder, seconds)


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_what_a_killed_build_left_is_removed_once_stale_by_the_next_build(tmp_path):
    cache, signals = tmp_path / "cache", tmp_path / "signals"
    signals.mkdir()
    target = cache / "model"
    building = subprocess.Popen([sys.executable, "-c", KILLED_BUILD, str(target), str(signals)])
    try:
        deadline = time.monotonic() + 120
        while not (signals / "started").exists() and building.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (signals / "started").exists()
    finally:
        building.kill()
        building.wait(timeout=30)
    [killed] = (cache / ".model.tmp").iterdir()  # the killed build's staging folder
    assert not target.exists()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.bin").write_bytes(b"k")
    (killed / "link").symlink_to(victim, target_is_directory=True)  # inside: unlinked, not followed
    _age_all(killed, STALE_AFTER_S + 60)
    recent = cache / ".model.tmp" / "model.recent12"  # a build of another host may still fill it
    recent.mkdir()
    others = cache / ".model.v2.tmp" / "model.v2.abcd1234"  # another entry's, whose name starts alike
    others.mkdir(parents=True)
    _age(others, STALE_AFTER_S + 60)

    builds: list[Path] = []
    assert cached_model_dir(target, _build_into(builds)) == target
    assert len(builds) == 1
    assert _listing(cache) == [
        ".model.lock",
        ".model.tmp",
        ".model.tmp/model.recent12",
        ".model.v2.tmp",
        ".model.v2.tmp/model.v2.abcd1234",
        "model",
        f"model/{CACHE_DIGEST}",
        "model/weights.bin",
    ]
    assert _listing(victim) == ["keep.bin"]


def test_an_intact_copy_is_kept_and_a_stale_copy_moved_aside_removed_without_waiting(tmp_path):
    target, builds = tmp_path / "model", []
    cached_model_dir(target, _build_into(builds))
    aside = tmp_path / ".model.tmp" / "model.old.k2j3h4ab"  # killed between the swap and the delete
    (aside / "model").mkdir(parents=True)
    (aside / "model" / "weights.bin").write_bytes(b"x" * 1000)
    _age_all(aside, STALE_AFTER_S + 60)
    held = os.open(tmp_path / ".model.lock", os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)  # as a process building it would
    try:
        returned = []
        asking = threading.Thread(
            target=lambda: returned.append(cached_model_dir(target, _build_into(builds))), daemon=True
        )
        asking.start()
        asking.join(timeout=60)
        assert returned == [target]  # the intact copy, without waiting for the lock
        assert aside.is_dir()
    finally:
        os.close(held)
    assert cached_model_dir(target, _build_into(builds)) == target
    assert len(builds) == 1  # the intact copy is reused
    assert _listing(tmp_path / ".model.tmp") == []


def test_leftovers_stay_where_no_lock_is_held(tmp_path, monkeypatch):
    target, builds = tmp_path / "model", []
    leftover = tmp_path / ".model.tmp" / "model.abcd1234"
    leftover.mkdir(parents=True)
    _age(leftover, STALE_AFTER_S + 60)

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)  # a filesystem without flock: another may be building
    assert cached_model_dir(target, _build_into(builds)) == target
    assert len(builds) == 1 and leftover.is_dir()


def test_a_planted_staging_link_is_refused_in_words(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / ".model.tmp").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(OSError) as refused:
        cached_model_dir(tmp_path / "model", _build_into([]))
    assert (
        str(refused.value)
        == f"{tmp_path / '.model.tmp'} cannot be a staging folder (not a folder); remove it"
    )
    assert _listing(tmp_path / "elsewhere") == [] and not (tmp_path / "model").exists()


def test_a_staging_folder_still_being_written_is_not_stale(tmp_path):
    target, builds = tmp_path / "model", []
    cached_model_dir(target, _build_into(builds))
    writing = tmp_path / ".model.tmp" / "model.abcd1234"  # an hour old, but its file is being written
    writing.mkdir()
    (writing / "model.safetensors").write_bytes(b"w")
    _age(writing, STALE_AFTER_S + 60)
    cached_model_dir(target, _build_into(builds))
    assert writing.is_dir()
    _age(writing / "model.safetensors", STALE_AFTER_S + 60)
    cached_model_dir(target, _build_into(builds))
    assert not writing.exists() and len(builds) == 1


def test_without_flock_a_build_that_finds_another_copy_renamed_in_first_takes_it(tmp_path, monkeypatch):
    target, builds = tmp_path / "model", []
    rename = os.replace

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    def renamed_in_first(source, destination):  # another process's build finished in between
        if Path(destination) == target and not target.exists():
            target.mkdir()
            (target / "weights.bin").write_bytes(b"o" * 1000)
            (target / CACHE_DIGEST).write_text(directory_digest(target))
            raise OSError(errno.ENOTEMPTY, "Directory not empty", str(destination))
        return rename(source, destination)

    monkeypatch.setattr(fcntl, "flock", no_flock)
    monkeypatch.setattr(os, "replace", renamed_in_first)
    assert cached_model_dir(target, _build_into(builds)) == target
    assert len(builds) == 1 and (target / "weights.bin").read_bytes() == b"o" * 1000
    assert _listing(tmp_path / ".model.tmp") == []  # this build's staging folder is removed
