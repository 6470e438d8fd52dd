"""One writer per run directory, checked with real processes: racers released together, a holder
killed with SIGKILL, re-entry within one process, forked and exec'd children."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ppoflow.tasks.storage.lock import LOCK_NAME, RunLocked, acquire_run_lock, release_run_lock

RACERS = 20
TRIALS = 100
NOT_RECORDED = "another process, not yet recorded in"

HOLD = """
import sys
from pathlib import Path
from ppoflow.tasks.storage.lock import acquire_run_lock, release_run_lock
run_dir = Path(sys.argv[1])
acquire_run_lock(run_dir)
print("held", flush=True)
sys.stdin.readline()
release_run_lock(run_dir)
"""
"""Take the lock, say so, and hold it until a line arrives on stdin."""

TRY = """
import sys
from pathlib import Path
from ppoflow.tasks.storage.lock import RunLocked, acquire_run_lock, release_run_lock
try:
    acquire_run_lock(Path(sys.argv[1]))
except RunLocked as error:
    print(error)
else:
    print("held")
    release_run_lock(Path(sys.argv[1]))
"""
"""Try the lock once from a fresh process: prints "held" or the refusal."""


def _contend(dirs, start, tried, results):
    """One racer: for each trial's directory, try the lock at the barrier and keep what it got until
    every racer has tried."""
    for trial, run_dir in enumerate(dirs):
        start.wait(timeout=60)
        try:
            acquire_run_lock(run_dir)
            outcome = "held"
        except RunLocked as error:
            outcome = str(error)
        except Exception as error:  # a broken lock may fail in other ways; counted as a failure
            outcome = f"error: {error!r}"
        tried.wait(timeout=60)
        if outcome == "held":
            release_run_lock(run_dir)
        results.put((trial, os.getpid(), outcome))


def test_of_many_processes_released_together_exactly_one_holds_the_lock(tmp_path):
    dirs = [tmp_path / f"trial-{trial:02d}" for trial in range(TRIALS)]
    for run_dir in dirs:
        run_dir.mkdir()
    ctx = multiprocessing.get_context("fork")
    start, tried, results = ctx.Barrier(RACERS), ctx.Barrier(RACERS), ctx.Queue()
    racers = [ctx.Process(target=_contend, args=(dirs, start, tried, results)) for _ in range(RACERS)]
    for racer in racers:
        racer.start()
    outcomes = [results.get(timeout=120) for _ in range(RACERS * TRIALS)]
    for racer in racers:
        racer.join(timeout=60)
        assert racer.exitcode == 0
    by_trial = [[(pid, outcome) for t, pid, outcome in outcomes if t == trial] for trial in range(TRIALS)]
    holders = [[pid for pid, outcome in trial if outcome == "held"] for trial in by_trial]
    several = sum(len(pids) > 1 for pids in holders)
    assert all(len(pids) == 1 for pids in holders), (
        f"{several} of {TRIALS} trials had more than one holder, {holders.count([])} had none"
    )
    for (winner,), trial in zip(holders, by_trial, strict=True):
        for pid, outcome in trial:
            if pid != winner:
                assert f"being written by process {winner} on " in outcome or NOT_RECORDED in outcome, outcome
    assert all((run_dir / LOCK_NAME).read_text() == "" for run_dir in dirs)


class Holder:
    """A separate Python process that holds the run's lock until told to release it."""

    def __init__(self, run_dir: Path):
        self.process = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(run_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout.readline() == "held\n"
        self.pid = self.process.pid

    def release(self) -> None:
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        assert self.process.wait(timeout=30) == 0

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)


def try_from_another_process(run_dir: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-c", TRY, str(run_dir)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def refusal(run_dir: Path) -> str:
    with pytest.raises(RunLocked) as refused:
        acquire_run_lock(run_dir)
    return str(refused.value)


def test_the_refusal_names_the_holders_pid_host_and_start(tmp_path):
    holder = Holder(tmp_path)
    try:
        message = refusal(tmp_path)
    finally:
        holder.release()
    assert message.startswith(
        f"run directory {tmp_path} is being written by process {holder.pid} on {socket.gethostname()} (since "
    )
    assert message.endswith("); wait for it to finish or stop it")


def test_a_holder_not_yet_recorded_is_not_named(tmp_path):
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    record = tmp_path / LOCK_NAME
    holder = Holder(tmp_path)
    try:
        record.write_text("")  # as between the holder's flock and its write
        assert f"by another process, not yet recorded in {record}; wait" in refusal(tmp_path)
        record.write_text(f'{{"pid": {int(exited.stdout)}, "host": "{socket.gethostname()}"}}')
        message = refusal(tmp_path)  # a killed holder's record, before the new holder replaces it
        assert f"not recorded in {record} (process {int(exited.stdout)} recorded there has exited)" in message
        assert str(holder.pid) not in message
    finally:
        holder.release()


def test_a_holder_killed_with_sigkill_leaves_the_lock_free(tmp_path):
    holder = Holder(tmp_path)
    holder.kill()
    assert f'"pid": {holder.pid}' in (tmp_path / LOCK_NAME).read_text()  # its record stays behind
    acquire_run_lock(tmp_path)
    try:
        assert (tmp_path / LOCK_NAME).exists()
        assert f'"pid": {os.getpid()}' in (tmp_path / LOCK_NAME).read_text()
        assert f"process {os.getpid()} " in try_from_another_process(tmp_path)
    finally:
        release_run_lock(tmp_path)


def test_a_released_lock_is_cleared_and_taken_by_the_next_process(tmp_path):
    Holder(tmp_path).release()
    assert (tmp_path / LOCK_NAME).read_text() == ""
    assert try_from_another_process(tmp_path) == "held"


def test_the_same_process_may_acquire_again_and_holds_until_the_last_release(tmp_path):
    run_dir, link = tmp_path / "run", tmp_path / "link"
    run_dir.mkdir()
    link.symlink_to(run_dir)
    acquire_run_lock(run_dir)
    acquire_run_lock(link)  # the same directory, reached another way
    release_run_lock(run_dir)
    assert f"process {os.getpid()} " in try_from_another_process(run_dir)
    release_run_lock(link)
    assert try_from_another_process(run_dir) == "held"
    release_run_lock(run_dir)  # one release too many does nothing
    assert try_from_another_process(run_dir) == "held"


def test_a_release_by_a_process_that_does_not_hold_the_lock_does_nothing(tmp_path):
    release_run_lock(tmp_path)  # no lock file at all
    holder = Holder(tmp_path)
    try:
        release_run_lock(tmp_path)
        assert f"process {holder.pid} " in try_from_another_process(tmp_path)
        assert f'"pid": {holder.pid}' in (tmp_path / LOCK_NAME).read_text()
    finally:
        holder.release()


def test_an_execd_child_does_not_keep_the_lock(tmp_path):
    acquire_run_lock(tmp_path)
    # (killed below: a child whose sleep ended on a slow machine would hold nothing, whatever it inherited)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], close_fds=False)
    try:
        release_run_lock(tmp_path)
        assert try_from_another_process(tmp_path) == "held"
    finally:
        child.kill()
        child.wait()


def _in_forked_child(run_dir, parent_released, results):
    results.put(_try_and_release(run_dir))
    parent_released.wait(timeout=60)
    results.put(_try_and_release(run_dir))


def _try_and_release(run_dir) -> str:
    """ "held" (then released), or the refusal's message."""
    try:
        acquire_run_lock(run_dir)
    except RunLocked as error:
        return str(error)
    release_run_lock(run_dir)
    return "held"


def test_a_forked_child_is_not_the_holder_and_can_take_the_lock_once_its_parent_releases_it(tmp_path):
    ctx = multiprocessing.get_context("fork")
    parent_released, results = ctx.Event(), ctx.Queue()
    acquire_run_lock(tmp_path)
    try:
        child = ctx.Process(target=_in_forked_child, args=(tmp_path, parent_released, results))
        child.start()
        assert f"process {os.getpid()} " in results.get(timeout=60)
    finally:
        release_run_lock(tmp_path)
    parent_released.set()
    assert results.get(timeout=60) == "held"
    child.join(timeout=60)
    assert child.exitcode == 0


def test_a_planted_link_or_fifo_is_never_the_lock_and_what_it_points_at_is_untouched(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious data")
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).symlink_to(victim)
    with pytest.raises(RunLocked, match="cannot be the run's lock file"):
        acquire_run_lock(run)
    assert victim.read_text() == "precious data"
    (run / LOCK_NAME).unlink()
    os.mkfifo(run / LOCK_NAME)
    with pytest.raises(RunLocked, match="not a regular file"):
        acquire_run_lock(run)
