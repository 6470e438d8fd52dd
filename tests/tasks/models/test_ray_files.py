"""The files of a run's own Ray: a folder of the run's own in $TMPDIR (in /tmp when $TMPDIR is too
long a path for Ray's sockets), removed by the reaper after a killed driver; a run that removed
them itself has closed its Ray, and the reaper then leaves without touching anything."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ppoflow.tasks.models.reaper import RAY_SOCKET_SUFFIX, SOCKET_PATH_MAX, private_ray_dir


def _sleeper(*marker: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(3600)", *marker]
    )  # killed at the end


def _reaper(driver: subprocess.Popen, directory: str, *processes: subprocess.Popen) -> subprocess.Popen:
    command = [sys.executable, "-m", "ppoflow.tasks.models.reaper", str(driver.pid), "--files", directory]
    return subprocess.Popen(command + [str(p.pid) for p in processes])


def test_ray_files_go_to_a_new_folder_short_enough_for_its_sockets(monkeypatch, tmp_path):
    short = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))  # pytest's folders are long
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(short))
        first, second = private_ray_dir(), private_ray_dir()
        assert first != second and Path(first).parent == short and Path(first).name.startswith("ppoflow-ray-")
        assert oct(os.stat(first).st_mode & 0o777) == "0o700"
        assert len(first) + RAY_SOCKET_SUFFIX <= SOCKET_PATH_MAX

        long = tmp_path / ("x" * 40)
        long.mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(long))
        fallback = private_ray_dir()
        try:
            assert Path(fallback).parent == Path("/tmp")
        finally:
            os.rmdir(fallback)
    finally:
        shutil.rmtree(short)


def test_a_killed_driver_leaves_neither_ray_processes_nor_ray_files(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    directory = private_ray_dir()
    (Path(directory) / "session_1").mkdir()
    driver, agent = _sleeper(), _sleeper("ray::DashboardAgent")
    reaper = _reaper(driver, directory, agent)
    try:
        time.sleep(1.0)
        assert agent.poll() is None and reaper.poll() is None and os.path.isdir(directory)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        assert reaper.wait(timeout=120) == 0  # (a hang guard: a loaded machine starts Python slowly)
        assert agent.wait(timeout=120) == -signal.SIGKILL
        assert not os.path.exists(directory)
    finally:
        for process in (driver, agent, reaper):
            process.kill()
            process.wait()


def test_a_run_that_removed_its_ray_files_has_closed_its_ray_and_is_left_alone(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    directory = private_ray_dir()
    driver, agent = _sleeper(), _sleeper("ray::DashboardAgent")  # the agent stands for a recycled pid
    reaper = _reaper(driver, directory, agent)
    try:
        os.rmdir(directory)
        assert reaper.wait(timeout=120) == 0  # while the driver still runs
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        time.sleep(1.0)
        assert agent.poll() is None
    finally:
        for process in (driver, agent, reaper):
            process.kill()
            process.wait()
