"""A user's tool runs in a worker process: its results, and every way it can fail (raises, hangs,
returns the wrong type, dies, does not import) is one error result, the next call working again."""

from __future__ import annotations

import textwrap
import time

import pytest

from ppoflow.engine.names import BUILTIN_TOOL_CLASSES
from ppoflow.engine.tool_calls import ToolCall
from ppoflow.engine.tools import BUILTIN_TOOLS, ToolContext
from ppoflow.tasks.models.tool_runner import ProcessToolRunner, ToolLoadError, check_tools
from ppoflow.tasks.pipeline.placement import ToolSpec

TOOLS = """
import os, time

class Echo:
    def __init__(self, config, tool_schema):
        self.prefix = config.get("prefix", "")
        self.name = tool_schema["function"]["name"]

    def execute(self, parameters, *, ground_truth, extra_info):
        mode = parameters.get("mode")
        if mode == "raise":
            raise KeyError("boom")
        if mode == "hang":
            time.sleep(60)
        if mode == "spin":
            while True:
                pass
        if mode == "die":
            os._exit(3)
        if mode == "bytes":
            return b"x"
        if mode == "nan":
            return "x", float("nan")
        if mode == "reward":
            return "scored", 0.5
        if mode == "huge_reward":
            return "x", 10**400
        if mode == "subclass":
            class Text(str):
                pass
            return Text("sub")
        if mode == "fork_and_die":
            if os.fork() == 0:  # the child keeps the pipe open
                time.sleep(60)
                os._exit(0)
            os._exit(5)
        if mode == "unprintable":
            class Odd(Exception):
                def __str__(self):
                    raise RuntimeError("no")
            raise Odd()
        if mode == "spawn":  # a child, one in a session of its own, one whose parent exits at once
            import subprocess, sys
            sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
            plain = subprocess.Popen(sleep)
            session = subprocess.Popen(sleep, start_new_session=True)
            fork = (
                "import subprocess; print(subprocess.Popen("
                f"{sleep!r}, start_new_session=True, stdout=subprocess.DEVNULL, "
                "stderr=subprocess.DEVNULL).pid)"
            )
            orphan = subprocess.run([sys.executable, "-c", fork], capture_output=True, text=True).stdout
            return f"{plain.pid} {session.pid} {orphan.strip()}"
        if mode == "print":
            import subprocess, sys
            print("to stdout")
            print("to stderr", file=sys.stderr)
            subprocess.run([sys.executable, "-c", "print('from a child')"])
            return "printed"
        if mode == "interrupt":
            raise KeyboardInterrupt
        if mode == "orphan":
            import subprocess, sys
            code = "import time; time.sleep(60)  # " + parameters["tag"]
            subprocess.Popen([sys.executable, "-c", code]).wait()
        return f"{self.prefix}{self.name}:{parameters.get('text')}:{ground_truth}:{extra_info.get('k')}"
"""


def spec(tmp_path, name="echo", **config) -> ToolSpec:
    path = tmp_path / "my_tools.py"
    path.write_text(textwrap.dedent(TOOLS))
    schema = {"type": "function", "function": {"name": name}}
    return ToolSpec(name, "my_tools.py:Echo", schema, config, str(path), "Echo", "digest")


def call(runner, **arguments):
    ((result, seconds),) = runner.run([ToolCall("echo", arguments)], ToolContext("42", {"k": "v"}))
    return result, seconds


def test_a_user_tool_gets_its_config_schema_arguments_and_context(tmp_path):
    with ProcessToolRunner([spec(tmp_path, prefix=">")], timeout_s=5) as runner:
        result, seconds = call(runner, text="hi")
        assert (result.text, result.reward, result.error) == (">echo:hi:42:v", None, None)
        assert seconds >= 0
        assert call(runner, mode="reward")[0].reward == 0.5


@pytest.mark.parametrize(
    ("mode", "error"),
    [
        ("raise", "KeyError: 'boom'"),
        ("bytes", "returned bytes, not text"),
        ("nan", "not a finite number"),
        ("hang", "longer than multi_turn.tool_timeout_s=1 s"),
        ("spin", "longer than multi_turn.tool_timeout_s=1 s"),
        ("die", "exited (exit code 3)"),
        ("fork_and_die", "exited (exit code 5)"),
        ("huge_reward", "not a finite number"),
        ("unprintable", "Odd: (its message cannot be printed)"),
    ],
)
def test_a_failing_call_is_an_error_result_and_the_next_call_works(tmp_path, mode, error):
    with ProcessToolRunner([spec(tmp_path)], timeout_s=1) as runner:
        started = time.monotonic()
        result, _ = call(runner, mode=mode)
        assert error in result.error and result.text.startswith("Error when executing tool: ")
        assert time.monotonic() - started < 15
        assert call(runner, text="again")[0].text == "echo:again:42:v"


def test_a_str_subclass_comes_back_as_plain_text(tmp_path):
    with ProcessToolRunner([spec(tmp_path)], timeout_s=5) as runner:
        result, _ = call(runner, mode="subclass")
    assert (result.text, type(result.text), result.error) == ("sub", str, None)


def test_a_timed_out_tools_child_processes_are_stopped_with_it(tmp_path):
    import subprocess

    tag = f"ppoflow-orphan-{tmp_path.name}"
    with ProcessToolRunner([spec(tmp_path)], timeout_s=1) as runner:
        result, _ = call(runner, mode="orphan", tag=tag)
        assert "longer than" in result.error
    time.sleep(0.5)
    assert tag not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


def test_a_worker_that_cannot_start_again_is_an_error_result(tmp_path):
    flaky = tmp_path / "flaky.py"
    flaky.write_text(
        "import os, pathlib\n"
        "class T:\n"
        "    def __init__(self, config, tool_schema):\n"
        "        marker = pathlib.Path(config['marker'])\n"
        "        if marker.exists():\n"
        "            raise RuntimeError('port in use')\n"
        "        marker.write_text('x')\n"
        "    def execute(self, parameters, *, ground_truth, extra_info):\n"
        "        os._exit(1)\n"
    )
    schema = {"type": "function", "function": {"name": "t"}}
    broken = ToolSpec("t", "flaky.py:T", schema, {"marker": str(tmp_path / "m")}, str(flaky), "T", "d")
    with ProcessToolRunner([broken], timeout_s=2) as runner:
        first, second = runner.run([ToolCall("t", {}), ToolCall("t", {})], ToolContext())
    assert "exited (exit code 1)" in first[0].error
    assert "could not be started again" in second[0].error and "port in use" in second[0].error


def test_unknown_tools_and_bad_builtin_arguments_are_error_results(tmp_path):
    calculator = ToolSpec("calculator", "ppoflow:calculator")
    with ProcessToolRunner([calculator], timeout_s=1) as runner:
        (unknown, _), (bad, _), (good, _) = runner.run(
            [
                ToolCall("search", {}),
                ToolCall("calculator", {"expression": "1/0"}),
                ToolCall("calculator", {"expression": "6*7"}),
            ],
            ToolContext(),
        )
    assert "unknown tool 'search' (tools: calculator)" in unknown.error
    assert bad.error == "division by zero" and good.text == "42"
    assert runner._worker is None  # built-in tools never start a worker


def test_a_tool_file_that_does_not_import_fails_before_any_generation(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('missing dependency')\n")
    bad = ToolSpec("x", "broken.py:X", {}, {}, str(broken), "X", "d")
    with pytest.raises(ToolLoadError, match="importing it failed: ImportError: missing dependency"):
        check_tools([bad], 5)
    missing_class = ToolSpec("echo", "my_tools.py:Nope", {}, {}, spec(tmp_path).module_file, "Nope", "d")
    with pytest.raises(ToolLoadError, match="has no class 'Nope'"):
        check_tools([missing_class], 5)


def test_the_config_names_and_the_engine_agree_on_the_builtin_tools():
    assert set(BUILTIN_TOOLS) == set(BUILTIN_TOOL_CLASSES)


def test_a_tool_file_that_hangs_on_import_is_named_with_the_time_it_took(tmp_path):
    """A file that waits forever when imported was given up on after 150 s with "the tool worker did
    not start: None"."""
    hangs = tmp_path / "hangs.py"
    hangs.write_text("import time\ntime.sleep(600)\n")
    schema = {"type": "function", "function": {"name": "wait"}}
    spec_of_it = ToolSpec("wait", "hangs.py:Tool", schema, {}, str(hangs), "Tool", "d")
    started = time.monotonic()
    with pytest.raises(ToolLoadError) as raised:
        check_tools([spec(tmp_path), spec_of_it], 5, load_timeout_s=2)
    assert str(raised.value) == (
        f"tool 'wait' (hangs.py:Tool): importing {hangs} and building the tool took longer than 2 s; "
        "stopped (does the file wait for something when imported?)"
    )
    assert time.monotonic() - started < 10


TRAINER = """
import sys, time
from ppoflow.engine.tool_calls import ToolCall
from ppoflow.engine.tools import ToolContext
from ppoflow.tasks.models.tool_runner import ProcessToolRunner
from ppoflow.tasks.pipeline.placement import ToolSpec

if __name__ == "__main__":  # (the worker is spawned: it imports this file)
    path, how = sys.argv[1], sys.argv[2]
    schema = {"type": "function", "function": {"name": "echo"}}
    runner = ProcessToolRunner([ToolSpec("echo", "my_tools.py:Echo", schema, {}, path, "Echo", "d")], 30)
    ((result, _),) = runner.run([ToolCall("echo", {"mode": "spawn"})], ToolContext())
    print(result.text, flush=True)
    if how == "stop":
        runner.close()
        print("stopped", flush=True)
    time.sleep(120)
"""


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


@pytest.mark.parametrize("how", ["sigkill", "stop"])
def test_nothing_a_tool_started_outlives_the_trainer_or_the_worker(tmp_path, how):
    """SIGKILL of `ppoflow train` left a tool's children running (9 orphans in one run), and children
    in a session of their own escaped even a clean stop. Every process a tool starts stays below its
    worker and ends with it: a child, one in a new session, one whose parent exited at once."""
    import signal
    import subprocess
    import sys

    tool = spec(tmp_path)
    (tmp_path / "trainer.py").write_text(TRAINER)
    trainer = subprocess.Popen(
        [sys.executable, str(tmp_path / "trainer.py"), tool.module_file, how],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pids = [int(pid) for pid in trainer.stdout.readline().split()]
        assert len(pids) == 3 and all(running(pid) for pid in pids)
        if how == "sigkill":
            trainer.send_signal(signal.SIGKILL)
        else:
            assert trainer.stdout.readline() == "stopped\n"
        deadline = time.monotonic() + 10
        while any(running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in pids if running(pid)]
    finally:
        trainer.kill()
        trainer.wait()


def test_what_a_tool_prints_goes_to_the_log_and_an_interrupt_in_it_is_the_calls_error(
    tmp_path, capfd, caplog
):
    """A tool's prints (and its children's) went to the user's terminal, and a KeyboardInterrupt
    raised in a tool printed a 15-line traceback per call: the prints go to the run's log with the
    call, and the interrupt is the call's error."""
    logged_here = caplog.at_level("INFO", logger="ppoflow.tasks.models.tool_runner")
    with logged_here, ProcessToolRunner([spec(tmp_path)], timeout_s=5) as runner:
        assert call(runner, mode="print")[0].text == "printed"
        interrupted = call(runner, mode="interrupt")[0]
        assert call(runner, text="after")[0].text == "echo:after:42:v"
    assert interrupted.error == "KeyboardInterrupt: "
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")
    (logged,) = [r.getMessage() for r in caplog.records if "printed" in r.getMessage()]
    assert logged.startswith("""tool 'echo', called with {"mode": "print"} printed:\n""")
    assert all(line in logged for line in ("to stdout", "to stderr", "from a child"))
