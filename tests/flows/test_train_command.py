"""`ppoflow train` as a user sees it: one line when a stage fails (the traceback in the run's log),
one Ctrl-C stops it in seconds, nothing it started outlives it, and a rerun says "cached"."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from ppoflow.tasks.models.reaper import descendants

from .conftest import SMALL, kept_alive_median_seconds

ONE_THREAD = ["trainer.num_threads=1"]


def _command(run_dir: Path, *overrides: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ppoflow",
        "train",
        *SMALL,
        *ONE_THREAD,
        f"trainer.default_local_dir={run_dir}",
        *overrides,
    ]


def _env(*, own_server: bool, fault: str | None = None) -> dict[str, str]:
    """The environment of a `python -m ppoflow` in this Python's environment, activated (its bin folder
    first on PATH): the commands it suggests name it `ppoflow`."""
    env = {k: v for k, v in os.environ.items() if k not in ("PPOFLOW_FAULT", "PREFECT_API_URL")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if not own_server:
        from prefect.settings import PREFECT_API_URL

        env["PREFECT_API_URL"] = PREFECT_API_URL.value()
    if fault:
        env["PPOFLOW_FAULT"] = fault
    return env | {"PPOFLOW_PROGRESS": "0"}


def _running(pid: int) -> bool:
    """Alive and not a zombie (a reparented zombie waits for init, which may be slow to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_failed_stage_is_one_line_and_the_rerun_resumes_saying_cached(
    prefect_server, tiny_model_dir, tmp_path
):
    failed = subprocess.run(
        _command(tmp_path),
        env=_env(own_server=False, fault="actor_update@2:raise"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert failed.returncode == 1
    log = tmp_path / "logs/train.log"
    assert failed.stderr.splitlines() == [
        "ppoflow: training stopped: PPOFLOW_FAULT=actor_update@2:raise: "
        "injected failure in actor_update at step 2",
        f"ppoflow: full log: {log}; after fixing the cause, resume with: ppoflow train "
        + " ".join(_command(tmp_path)[4:]),
    ]
    assert "Traceback" not in failed.stdout
    text = log.read_text()
    assert "Traceback" in text and "InjectedFault" in text and "step   1/2" in text
    resumed = subprocess.run(  # -v: Prefect's own lines on the terminal too
        [*_command(tmp_path), "-v"], env=_env(own_server=False), capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Task run 'actor_update-step1' - Finished in state Cached" in resumed.stderr
    steps = [line for line in resumed.stdout.splitlines() if line.startswith("step ")]
    assert steps[1].startswith("step   1/2") and steps[1].endswith("· cached")
    assert steps[2].startswith("step   2/2") and steps[2].endswith("s") and "cached" not in steps[2]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stop", "code", "said", "logged"),
    [
        ("ctrl-c", 130, "interrupted", "interrupted (Ctrl-C)"),
        ("sigterm", 143, "stopped by SIGTERM", "stopped by SIGTERM"),
    ],
)
def test_one_ctrl_c_or_sigterm_stops_training_in_seconds_with_one_line_and_no_process_left(
    tiny_model_dir, tmp_path, stop, code, said, logged
):
    trainer = subprocess.Popen(
        _command(tmp_path, "trainer.total_training_steps=20"),
        env=_env(own_server=True),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a shell gives a foreground job
    )
    launched = time.monotonic()
    try:
        _wait_for(lambda: (tmp_path / "iter=000001/_manifest.json").exists(), 240, "step 1 to finish")
        to_step_1 = time.monotonic() - launched  # how slow this machine is now
        started = set(descendants(trainer.pid))
        assert started, "the trainer runs its Prefect server as a child"
        sent = time.monotonic()
        if stop == "ctrl-c":
            os.killpg(trainer.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        else:
            os.kill(trainer.pid, signal.SIGTERM)  # what `kill` or a service manager does: the trainer only
        out, err = trainer.communicate(timeout=60)
        stopped_after = time.monotonic() - sent
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
    assert trainer.returncode == code, err[-3000:]
    # Stopping takes seconds (3.8–4.5 s beside 4 busy processes on 2 cores); a trainer that ignored the
    # signal would go on for 19 more steps, far longer than half the time step 1 took.
    assert stopped_after < max(20, to_step_1 / 2), f"took {stopped_after:.1f} s to stop"
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err[-3000:]
    [line] = lines
    assert line.startswith(f"ppoflow: {said}; step") and f"finished and kept in {tmp_path};" in line
    assert line.endswith(
        "resume with: ppoflow train " + " ".join(_command(tmp_path)[4:]) + " trainer.total_training_steps=20"
    )
    assert "Traceback" not in out + err
    assert logged in (tmp_path / "logs/train.log").read_text()
    assert (tmp_path / "logs/prefect-server.log").is_file()  # what the server said, kept off the terminal
    _wait_for(lambda: not any(_running(pid) for pid in started), 120, "the trainer's children to exit")


@pytest.mark.slow
def test_the_suggested_commands_name_ppoflow_as_it_was_started(prefect_server, tiny_model_dir, tmp_path):
    """The README's set-up runs `.venv/bin/ppoflow`, whose folder is not on PATH: the resume line of a
    failed start and the `try` line of a finished run name the program as typed."""
    from ppoflow.tasks.observe.console import VALIDATION_QUERY
    from ppoflow.tasks.storage.confined_query import query

    bin_folder = Path(sys.executable).parent
    if not (bin_folder / "ppoflow").is_file():
        pytest.skip("needs the ppoflow program beside this Python (bash scripts/setup)")
    typed = f"{bin_folder.parent.name}/bin/ppoflow"  # .venv/bin/ppoflow, from the folder holding .venv
    arguments = [
        "train",
        "trainer.val_only=true",
        "data.val_max_samples=10",
        *ONE_THREAD,
        f"trainer.default_local_dir={tmp_path / 'run'}",
    ]
    env = _env(own_server=False)
    path = [
        p for p in os.environ.get("PATH", "").split(os.pathsep) if Path(p).resolve() != bin_folder.resolve()
    ]
    env["PATH"] = os.pathsep.join(path)

    def started(fault: str | None = None) -> subprocess.CompletedProcess:
        fault_env = {"PPOFLOW_FAULT": fault} if fault else {}
        return subprocess.run(
            [typed, *arguments],
            cwd=bin_folder.parent.parent,
            env=env | fault_env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    failed = started("validation@0:raise")
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert failed.stderr.splitlines()[-1].endswith("resume with: " + shlex.join([typed, *arguments]))
    done = started()
    assert done.returncode == 0, done.stderr[-3000:]
    query_line = f'try             {typed} query {tmp_path / "run"} "{VALIDATION_QUERY}"'
    assert done.stdout.splitlines()[-1] == query_line
    assert query(tmp_path / "run", "SELECT iter, step FROM metrics")[1] == [(0, 0)]  # its validation's row


LATE_WORD = (
    "import atexit, sys\n"
    "atexit.register(lambda: print('a late word from a library', file=sys.stderr))\n"
    "from ppoflow.cli import main\n"
)
"""A library's exit hook that prints (registered before ppoflow runs, so it runs last)."""


def _as_program(arguments: list[str]) -> str:
    """Python code that runs `ppoflow ARGUMENTS` as the `ppoflow` program does, after LATE_WORD."""
    return LATE_WORD + f"sys.argv = {['ppoflow', *arguments]!r}\nsys.exit(main())\n"


@pytest.fixture(scope="module")
def one_step_program(tiny_model_dir, tmp_path_factory):
    """A 1-step `ppoflow train` run as the `ppoflow` program (beside a library's exit hook that
    prints), on a temporary server with a database of its own and Prefect's settings as ppoflow
    leaves them (whatever database and event settings the environment names): (the finished
    process, its run directory, the server's database)."""
    root = tmp_path_factory.mktemp("one-step-program")
    run_dir, database = root / "run", root / "prefect.db"
    arguments = _command(run_dir, "trainer.total_training_steps=1")[3:]
    inherited = {
        k: v for k, v in _env(own_server=True).items() if "DATABASE" not in k and "EVENT_PERSISTER" not in k
    }
    env = inherited | {"PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{database}"}
    done = subprocess.run(
        [sys.executable, "-c", _as_program(arguments)], env=env, capture_output=True, text=True, timeout=300
    )
    return done, run_dir, database


@pytest.mark.slow
def test_what_prints_on_the_way_out_goes_to_the_log_not_under_the_last_line(one_step_program):
    done, run_dir, _ = one_step_program
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1].startswith("try ")
    assert done.stderr == ""
    assert (run_dir / "logs/train.log").read_text().endswith("a late word from a library\n")


@pytest.mark.slow
def test_a_python_caller_of_main_keeps_what_prints_on_the_way_out(tiny_model_dir, tmp_path):
    arguments = _command(tmp_path, "trainer.total_training_steps=1")[3:]
    code = LATE_WORD + f"sys.exit(main({arguments!r}))\n"
    done = subprocess.run(
        [sys.executable, "-c", code], env=_env(own_server=True), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1].startswith("try ")
    assert done.stderr == "a late word from a library\n"
    assert "a late word" not in (tmp_path / "logs/train.log").read_text()


def test_a_killed_trainer_takes_its_prefect_server_along(tiny_model_dir, tmp_path):
    trainer = subprocess.Popen(
        _command(tmp_path), env=_env(own_server=True), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        _wait_for(lambda: (tmp_path / "iter=000000/validation").exists(), 240, "training to start")
        server = set(descendants(trainer.pid))
        assert server
        trainer.kill()
        trainer.wait()
        gone = lambda: not any(_running(pid) for pid in server)  # noqa: E731
        _wait_for(gone, 120, "the server to exit with the trainer")
    finally:
        if trainer.poll() is None:
            trainer.kill()


@pytest.mark.skipif(
    shutil.which("unshare") is None, reason="needs unshare (util-linux) for a small filesystem"
)
@pytest.mark.parametrize("size", ["3m", "16k"])
def test_a_full_disk_stops_training_with_one_line(prefect_server, tiny_model_dir, tmp_path, size):
    """A 3 MB filesystem fills while the first checkpoint is written (by safetensors, whose own
    error would otherwise end the run in a long traceback); a 16 kB one while the base model is
    copied, with no room left for the log file either."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    small_disk = [
        "unshare",
        "-rm",
        "sh",
        "-c",
        f'mount -t tmpfs -o size={size} none "$0" && exec "$@"',
        str(mount),
    ]
    full = subprocess.run(
        small_disk + _command(mount / "run"),
        env=_env(own_server=False),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert full.returncode == 1, full.stderr[-3000:]
    first, second = full.stderr.splitlines()
    assert first.startswith("ppoflow: training stopped: the disk is full (no space left on device)")
    assert len(first) < 500
    assert second.startswith(f"ppoflow: full log: {mount / 'run/logs/train.log'}")
    assert "Traceback" not in full.stdout + full.stderr


def test_the_temporary_servers_settings_unless_the_environment_says_otherwise(monkeypatch):
    """Prefect's default writes each task-run event in a transaction of its own, which kept the
    server busy for ~40% of a core beside training, and stores every event; a setting of the
    user's own still wins."""
    from ppoflow.prefect_server import TemporaryServer

    monkeypatch.setenv("PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL", "3")
    with TemporaryServer() as url, urllib.request.urlopen(f"{url}/admin/settings", timeout=30) as answer:
        settings = json.load(answer)
    recorder = settings["server"]["services"]["task_run_recorder"]
    assert (recorder["batch_size"], recorder["flush_interval"]) == (100, 3.0)
    assert settings["server"]["services"]["event_persister"]["enabled"] is False
    assert settings["server"]["ui"]["enabled"] is False


def test_the_temporary_server_answers_a_kept_alive_connection_without_a_delayed_ack():
    """Served on a TCP socket object (ppoflow/prefect_serving.py), each accepted connection gets
    TCP_NODELAY: uvicorn's own --fd served it as a Unix socket, and every response on a kept-alive
    connection then waited for the client's delayed ACK, 40 ms or more (a median 44 ms here)."""
    from ppoflow.prefect_server import TemporaryServer

    with TemporaryServer() as url:
        port = urllib.parse.urlsplit(url).port
        json_body = {"body": b"{}", "headers": {"Content-Type": "application/json"}}
        median = kept_alive_median_seconds(port, "POST", "/api/flows/filter", **json_body)
    assert median < 0.025, median


def test_servers_of_one_prefect_home_start_one_at_a_time():
    """Eight `ppoflow train` started together on a Prefect home without a database raced its
    migrations: three servers exited ("duplicate column name: block_type_name"). A server's startup
    (migrations, block registrations) waits while another server of the same home starts."""
    import fcntl
    import threading
    import urllib.error

    from ppoflow.prefect_server import TemporaryServer
    from ppoflow.prefect_serving import STARTUP_LOCK

    home = Path(os.environ["PREFECT_HOME"])  # (this test process's own, tests/conftest.py)
    home.mkdir(parents=True, exist_ok=True)
    starting = os.open(home / STARTUP_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(starting, fcntl.LOCK_EX)  # as another server starting on this home holds it
    server, seen = TemporaryServer(), []

    def look_then_release() -> None:  # (the server is started by the main thread: its parent-death
        deadline = time.monotonic() + 60  # signal follows the thread that started it)
        while not server.url and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(3)  # its process has started, and waits
        try:
            urllib.request.urlopen(f"{server.url}/health", timeout=2)
            seen.append("answered")
        except (urllib.error.URLError, TimeoutError, ConnectionError):
            seen.append("no answer")
        os.close(starting)  # the other server is up: this one starts

    looking = threading.Thread(target=look_then_release, daemon=True)
    looking.start()
    try:
        url = server.__enter__()
        with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
            assert response.status == 200
    finally:
        server.stop()
        looking.join(10)
    assert seen == ["no answer"]


@pytest.mark.slow
def test_the_temporary_server_records_every_task_run_and_stores_no_events(one_step_program):
    """What the Prefect UI shows of a run comes from its flow run, task runs and states, which are
    recorded; Prefect's events about them are not stored (most of the database's growth)."""
    done, _, database = one_step_program
    assert done.returncode == 0, done.stderr[-3000:]
    with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as prefect_db:
        [(flow_state,)] = prefect_db.execute("SELECT state_type FROM flow_run").fetchall()
        task_runs = dict(prefect_db.execute("SELECT name, state_type FROM task_run").fetchall())
        [(events,)] = prefect_db.execute("SELECT count(*) FROM events").fetchall()
    assert flow_state == "COMPLETED"
    stages = ["rollouts", "rewards", "advantages", "critic_update", "actor_update", "validation", "metrics"]
    assert {f"{stage}-step1" for stage in stages} <= task_runs.keys()
    assert set(task_runs.values()) == {"COMPLETED"}
    assert events == 0


def test_the_temporary_server_refuses_to_start_after_prefect_was_imported():
    """Prefect reads PREFECT_API_URL when it is imported: set later, it would start a server of its
    own and ours would sit idle."""
    code = "import prefect\nfrom ppoflow.prefect_server import prefect_api\nwith prefect_api():\n    pass\n"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "prefect_api() must be entered before prefect is imported" in done.stderr


def test_a_server_that_does_not_start_is_one_line_that_names_its_log(tmp_path):
    env = _env(own_server=True) | {"PREFECT_API_DATABASE_CONNECTION_URL": "nosuchdatabase://"}
    failed = subprocess.run(_command(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    server_log = tmp_path / "logs/prefect-server.log"
    assert failed.returncode == 1
    assert failed.stderr.splitlines() == [
        f"ppoflow: the temporary Prefect server exited with code 1; its output is in {server_log} "
        "(or set PREFECT_API_URL to use a running server)"
    ]
    assert "Can't load plugin: sqlalchemy.dialects:nosuchdatabase" in server_log.read_text()
    assert server_log.read_text().count("Traceback") == 1  # one try: a server that crashes is not retried
    assert server_log.read_text().startswith("--- ")  # where this run's server starts in the file


def test_without_a_log_file_the_error_quotes_the_servers_last_line(monkeypatch):
    from ppoflow.prefect_server import ServerDidNotStart, TemporaryServer

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_API_DATABASE_CONNECTION_URL", "nosuchdatabase://")
    with pytest.raises(ServerDidNotStart) as failed, TemporaryServer():
        pass
    assert str(failed.value) == (
        "the temporary Prefect server exited with code 1; it said: sqlalchemy.exc.NoSuchModuleError: "
        "Can't load plugin: sqlalchemy.dialects:nosuchdatabase "
        "(or set PREFECT_API_URL to use a running server)"
    )


@pytest.mark.parametrize("planted", ["link", "fifo"])
@pytest.mark.parametrize("name", ["prefect-server.log", "train.log"])
def test_a_planted_log_file_is_refused_before_anything_is_written_through_it(tmp_path, planted, name):
    outside = tmp_path / "outside.txt"
    outside.write_text("not the run's\n")
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / ".lock").touch()  # a run directory that was trained before
    log = run_dir / "logs" / name
    if planted == "link":
        log.symlink_to(outside)
    else:
        os.mkfifo(log)
    failed = subprocess.run(
        _command(run_dir), env=_env(own_server=True), capture_output=True, text=True, timeout=120
    )
    assert failed.returncode == 1
    [line] = failed.stderr.splitlines()
    which = "the Prefect server's log" if name == "prefect-server.log" else "the run's log"
    assert line.startswith(f"ppoflow: cannot write {which} {log}: ")
    assert outside.read_text() == "not the run's\n"


@pytest.mark.parametrize("planted", ["link", "file"])
def test_a_logs_folder_that_is_a_link_or_a_file_is_refused(tmp_path, planted):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".lock").touch()  # a run directory that was trained before
    if planted == "link":
        (run_dir / "logs").symlink_to(elsewhere)
    else:
        (run_dir / "logs").write_text("x")
    failed = subprocess.run(
        _command(run_dir), env=_env(own_server=True), capture_output=True, text=True, timeout=120
    )
    assert failed.returncode == 1
    why = "is a link, not the run's logs folder" if planted == "link" else "is not a folder"
    [line] = failed.stderr.splitlines()
    assert line.startswith(f"ppoflow: {run_dir / 'logs'} {why}")
    assert list(elsewhere.iterdir()) == []


def test_a_run_in_progress_is_refused_in_one_line_and_its_logs_are_left_alone(tmp_path):
    """The lock is taken before the logs are opened or a server started, and as soon as the config
    names the run: before the training stack is imported (torch, Prefect) and a user's tools are
    checked (a refusal took 17.8 s under load)."""
    from ppoflow.tasks.storage.lock import acquire_run_lock, release_run_lock

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (tmp_path / "broken.py").write_text("raise ImportError('not imported before the lock')\n")
    schema = "    tool_schema: {type: function, function: {name: t}}\n"
    (tmp_path / "tools.yaml").write_text("tools:\n  - class_name: broken.py:T\n" + schema)
    tools = [
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}",
    ]
    acquire_run_lock(run_dir)  # this process trains it
    try:
        refused = subprocess.run(
            [*_command(run_dir), *tools],
            env=_env(own_server=True) | {"PYTHONPROFILEIMPORTTIME": "1"},
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        release_run_lock(run_dir)
    assert refused.returncode == 3
    imported = {
        line.rsplit("|", 1)[1].strip() for line in refused.stderr.splitlines() if "import time:" in line
    }
    assert "ppoflow.conf" in imported and not imported & {"torch", "prefect", "transformers.modeling_utils"}
    [line] = [line for line in refused.stderr.splitlines() if "import time:" not in line]
    assert line.startswith(f"ppoflow: run directory {run_dir} is being written by process {os.getpid()} ")
    assert not (run_dir / "logs").exists()


def test_a_refused_program_leaves_the_running_trainers_log_alone_on_its_way_out(tmp_path):
    """What prints after the refusal (a library's exit hook) goes to the refused command's stderr,
    not into the log of the process that trains the run."""
    from ppoflow.tasks.storage.lock import acquire_run_lock, release_run_lock

    acquire_run_lock(tmp_path)  # this process trains it
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs/train.log").write_text("the trainer's own words\n")
    try:
        refused = subprocess.run(
            [sys.executable, "-c", _as_program(_command(tmp_path)[3:])],
            env=_env(own_server=True),
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        release_run_lock(tmp_path)
    assert refused.returncode == 3
    assert refused.stderr.splitlines()[1:] == ["a late word from a library"]
    assert (tmp_path / "logs/train.log").read_text() == "the trainer's own words\n"


def test_a_sigterm_another_handler_swallowed_is_still_known_as_the_stop():
    """Inside a flow run Prefect's SIGTERM handler raises its TerminationSignal, which DuckDB turns
    into "Query interrupted": the stop is read from the wakeup pipe, not only from our handler."""
    from ppoflow.train_command import _Interrupt

    def swallowing(signum, frame):  # as Prefect's handler inside a DuckDB query ends up
        raise RuntimeError("Query interrupted")

    with _Interrupt() as interrupt:
        ours = signal.signal(signal.SIGTERM, swallowing)
        try:
            with pytest.raises(RuntimeError, match="Query interrupted"):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)  # the handler runs at the next bytecode
        finally:
            signal.signal(signal.SIGTERM, ours)
        assert interrupt.by is None  # our handler never ran
        assert interrupt.arrived() == signal.SIGTERM
        assert interrupt.exit_code() == 143 and interrupt.said() == "stopped by SIGTERM"
