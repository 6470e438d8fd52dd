"""The reaper stops a run's leftover Ray processes once the driver is gone, even killed, and spares
processes that do not name Ray (a pid recycled by then)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def _sleeper(*marker: str) -> subprocess.Popen:
    # Killed when the test ends: a sleep that ended on its own on a slow machine would pass for the reaper's
    # work (or fail the bystander's check).
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)", *marker])


def test_leftover_ray_processes_end_when_the_driver_is_killed():
    driver, agent, bystander = _sleeper(), _sleeper("ray::DashboardAgent"), _sleeper("other")
    reaper = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ppoflow.tasks.models.reaper",
            str(driver.pid),
            str(agent.pid),
            str(bystander.pid),
        ]
    )
    try:
        time.sleep(1.0)
        assert agent.poll() is None and reaper.poll() is None  # the driver still runs: nothing happens
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        assert reaper.wait(timeout=120) == 0  # (a hang guard: a loaded machine starts Python slowly)
        assert agent.wait(timeout=120) == -signal.SIGKILL
        assert bystander.poll() is None
    finally:
        for process in (driver, agent, bystander, reaper):
            process.kill()
            process.wait()
