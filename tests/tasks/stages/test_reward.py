"""Reward scoring: verl-style custom reward files, per-row failures under reward.on_error, timeouts
that kill a stuck worker (counted in the worker's own time, not its waits for a CPU), and the
reward/error_rate metric."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest

from ppoflow.conf import load_config
from ppoflow.engine.tiny import ADDITION_DATA_SOURCE
from ppoflow.tasks.pipeline.plan import custom_function, run_settings
from ppoflow.tasks.pipeline.settings import RewardSettings
from ppoflow.tasks.stages.reward_functions import RewardFunctionError, check_custom_reward
from ppoflow.tasks.stages.rewards import aligned_components, reward_error_metrics, score_rows

# Each response text asks the reward function to misbehave in one way; anything else is scored.
REWARD_FILE = """
import math, os, signal, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    match solution_str:
        case "raise":
            return 1 / 0
        case "nan":
            return math.nan
        case "inf":
            return -math.inf
        case "text":
            return "1.0"
        case "no-score":
            return {"acc": 1.0}
        case "sleep":  # interrupted by SIGALRM inside the worker
            time.sleep(60)
        case "stuck":  # deaf to SIGALRM, as C code can be: only the parent's deadline ends it
            if "started" in extra_info:
                with open(extra_info["started"], "w") as started:
                    started.write(repr(time.monotonic()))
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(60)
        case "compute":  # 0.25 s of CPU on the CPU extra_info names; says how long the clock took
            os.sched_setaffinity(0, {extra_info["cpu"]})
            start, cpu = time.monotonic(), time.thread_time()
            while time.thread_time() - cpu < 0.25:
                pass
            return {"score": 1.0, "clock_s": time.monotonic() - start}
        case "spin":  # computes without end on the CPU extra_info names
            os.sched_setaffinity(0, {extra_info["cpu"]})
            while True:
                time.thread_time()
        case "exit":
            os._exit(3)
        case "dict":
            return {"score": 0.25, "acc": True, "pred": "7", "length": 3}
    return float(solution_str == ground_truth) + extra_info.get("bonus", 0.0)
"""


def reward_file(tmp_path, text=REWARD_FILE, name="my_reward.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def config(path, *, on_error="zero", timeout_s=5.0, name="compute_score", weights=None):
    return RewardSettings(
        weights=weights or {"correctness": 0.9, "format": 0.1},
        rm_weight=None,
        rule_reward=True,
        reward_fn_key="data_source",
        timeout_s=timeout_s,
        on_error=on_error,
        gsm8k_method="strict",
        custom_function=None if path is None else custom_function(str(path), name),
    )


def score(responses, reward, data_source="gsm8k", truth="7", extra_info=None):
    rows = [
        {"prompt_id": f"p{i}", "sample_idx": i % 2, "data_source": data_source, "response_text": text}
        for i, text in enumerate(responses)
    ]
    info = json.dumps(extra_info) if extra_info is not None else None
    prompts = {r["prompt_id"]: {"ground_truth": truth, "extra_info": info} for r in rows}
    return score_rows(rows, prompts, reward).to_pylist()


def test_custom_float_is_the_score_weights_do_not_apply_and_extra_info_is_parsed(tmp_path):
    rows = score(["7", "8"], config(reward_file(tmp_path)), extra_info={"bonus": 0.5})
    assert [r["score"] for r in rows] == [1.5, 0.5]
    assert [dict(r["components"]) for r in rows] == [{"score": 1.5}, {"score": 0.5}]
    assert [r["error"] for r in rows] == [None, None]
    assert {r["data_source"] for r in rows} == {"gsm8k"}  # a custom function serves every source


def test_custom_dict_score_is_the_reward_and_every_numeric_key_a_component(tmp_path):
    (row,) = score(["dict"], config(reward_file(tmp_path)))
    assert row["score"] == 0.25 and row["error"] is None
    assert dict(row["components"]) == {"score": 0.25, "acc": 1.0, "length": 3.0}


def test_bad_rows_score_zero_with_their_error_and_the_rest_are_scored(tmp_path):
    responses = ["raise", "7", "nan", "inf", "text", "no-score", "exit", "8"]
    rows = score(responses, config(reward_file(tmp_path), on_error="zero"))
    errors = dict(zip(responses, (r["error"] for r in rows), strict=True))
    assert errors["raise"] == "ZeroDivisionError: division by zero"
    assert errors["nan"] == "returned nan"
    assert errors["inf"] == "returned -inf"
    assert errors["text"].startswith("returned '1.0' (str); expected a number or a dict")
    assert errors["no-score"] == "returned a dict without a numeric 'score' (keys: ['acc'])"
    assert "exited (exit code 3)" in errors["exit"]
    assert errors["7"] is None and errors["8"] is None
    assert [r["score"] for r in rows] == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert [dict(r["components"]) for r in rows if r["error"]] == [{}] * 6


def test_on_error_fail_names_the_first_row_the_reason_the_count_and_the_key(tmp_path):
    with pytest.raises(RewardFunctionError) as info:
        score(["7", "raise", "8", "nan"], config(reward_file(tmp_path), on_error="fail"))
    message = str(info.value)
    assert "reward failed on 2 of 4 rows" in message
    assert "prompt_id=p1 sample_idx=1: ZeroDivisionError: division by zero" in message
    assert "reward.on_error=zero" in message


def test_a_hang_is_killed_after_timeout_s_and_the_other_rows_are_still_scored(tmp_path):
    start = time.monotonic()
    rows = score(["sleep", "7", "stuck", "8", "7"], config(reward_file(tmp_path), timeout_s=1))
    # Neither 60 s sleep was waited out. The rest is two worker starts, which a loaded machine slows
    # without bound: how soon the parent kills a stuck worker is timed in the next test.
    assert time.monotonic() - start < 50
    assert [r["score"] for r in rows] == [0.0, 1.0, 0.0, 0.0, 1.0]
    assert rows[0]["error"] == "TimeoutError: took longer than reward.timeout_s=1 s"
    assert rows[2]["error"] == "TimeoutError: took longer than reward.timeout_s=1 s; the worker was killed"
    assert [r["error"] for r in rows[3:]] == [None, None]


def test_a_stuck_call_is_killed_within_seconds_of_timeout_s(tmp_path):
    started = tmp_path / "started"
    reward = config(reward_file(tmp_path), timeout_s=1)
    rows = score(["7", "stuck"], reward, extra_info={"started": str(started)})
    took = time.monotonic() - float(started.read_text())  # (one clock for every process)
    assert rows[1]["error"] == "TimeoutError: took longer than reward.timeout_s=1 s; the worker was killed"
    # Timed from the call's start inside the worker, so the worker's start-up is not in it: what is
    # left is the parent's deadline (timeout_s and a margin for the worker to report, 2.1 s of a
    # blocked worker's time, which is the clock's) and the kill, milliseconds of CPU.
    assert 1.0 <= took < 6.0


HOG = """
import os, signal, sys
from ppoflow.tasks.models.processes import exit_with_parent
exit_with_parent(int(sys.argv[1]), signal.SIGKILL)
os.sched_setaffinity(0, {int(sys.argv[2])})
print(flush=True)
while True:
    pass
"""


@pytest.fixture
def shared_cpu():
    """A CPU that four busy processes keep busy: a process there gets at most a fifth of it. They end
    with the test, or with its process if that is killed first."""
    cpu = min(os.sched_getaffinity(0))
    hogs = [
        subprocess.Popen([sys.executable, "-c", HOG, str(os.getpid()), str(cpu)], stdout=subprocess.PIPE)
        for _ in range(4)
    ]
    try:
        for hog in hogs:
            assert hog.stdout.readline() == b"\n"  # spinning on it
        yield cpu
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


@pytest.mark.skipif(not Path("/proc/self/schedstat").exists(), reason="needs Linux's /proc/<pid>/schedstat")
def test_time_spent_waiting_for_a_cpu_does_not_count_toward_timeout_s(tmp_path, shared_cpu):
    """On a busy machine a call that needs 0.25 s of CPU takes longer than timeout_s=0.5 by the clock
    and is still scored; a call that computes without end is still stopped at timeout_s of its own
    time (0.2 s: at a fifth of a CPU or less, a second or more of the clock)."""
    path = reward_file(tmp_path)
    (row,) = score(["compute"], config(path, timeout_s=0.5), extra_info={"cpu": shared_cpu})
    assert row["error"] is None and row["score"] == 1.0
    assert dict(row["components"])["clock_s"] > 0.5  # it waited for the CPU: the clock alone timed it out
    (row,) = score(["spin"], config(path, timeout_s=0.2), extra_info={"cpu": shared_cpu})
    assert row["error"] == "TimeoutError: took longer than reward.timeout_s=0.2 s"


def test_on_error_fail_stops_at_the_first_timeout(tmp_path):
    with pytest.raises(RewardFunctionError, match="1 of the first 2 of 3 rows .* reward.timeout_s"):
        score(["7", "sleep", "sleep"], config(reward_file(tmp_path), on_error="fail", timeout_s=1))


@pytest.mark.parametrize(
    ("text", "name", "message"),
    [
        (REWARD_FILE, "my_score", "no function 'my_score'"),
        ("def compute_score(:\n", "compute_score", "importing it failed: SyntaxError"),
        ("import no_such_module_xyz\n", "compute_score", "importing it failed: ModuleNotFoundError"),
    ],
)
def test_a_file_that_cannot_serve_is_one_clear_error_before_scoring(tmp_path, text, name, message):
    path = reward_file(tmp_path, text)
    named_once = f"^custom_reward_function.path={path}: {message}"  # the key was named twice
    with pytest.raises(RewardFunctionError, match=named_once):
        score(["7"], config(path, name=name))
    # The train flow checks it before anything is generated, as scoring will load it.
    with pytest.raises(RewardFunctionError, match=named_once):
        check_custom_reward(custom_function(str(path), name), timeout_s=10)
    check_custom_reward(custom_function(str(reward_file(tmp_path)), "compute_score"), timeout_s=10)
    check_custom_reward(None, timeout_s=10)


def test_a_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(RewardFunctionError, match="custom_reward_function.path=.*nope.py: no such file"):
        custom_function(str(tmp_path / "nope.py"), "compute_score")
    reward = config(reward_file(tmp_path))
    (tmp_path / "my_reward.py").unlink()
    with pytest.raises(RewardFunctionError, match="my_reward.py: no such file"):
        score(["7"], reward)


def test_builtin_reward_is_weighted_and_its_failures_follow_on_error():
    rows = score(["7", "8", "x"], config(None), data_source=ADDITION_DATA_SOURCE)
    assert [r["score"] for r in rows] == pytest.approx([1.0, 0.1, 0.0])
    assert dict(rows[0]["components"]) == {"correctness": 1.0, "format": 1.0}
    (row,) = score(["7"], config(None), data_source="gsm8k")
    assert row["score"] == 0.0 and "no built-in reward for data_source 'gsm8k'" in row["error"]
    with pytest.raises(RewardFunctionError, match="prompt_id=p0 .*no built-in reward"):
        score(["7"], config(None, on_error="fail"), data_source="gsm8k")


def test_error_rate_metric_and_aligned_components_from_a_rewards_table_with_errors():
    rows = [
        {"prompt_id": f"p{i}", "sample_idx": 0, "data_source": source, "response_text": "7"}
        for i, source in enumerate([ADDITION_DATA_SOURCE, "gsm8k", "gsm8k", ADDITION_DATA_SOURCE])
    ]
    prompts = {r["prompt_id"]: {"ground_truth": "7", "extra_info": None} for r in rows}
    table = score_rows(rows, prompts, config(None))
    assert reward_error_metrics(table) == {"reward/error_rate": 0.5}
    assert reward_error_metrics(table, "val-aux/reward") == {"val-aux/reward/error_rate": 0.5}
    assert aligned_components(table) == [
        {"correctness": 1.0, "format": 1.0},
        {"correctness": 0.0, "format": 0.0},
        {"correctness": 0.0, "format": 0.0},
        {"correctness": 1.0, "format": 1.0},
    ]
    assert math.isclose(reward_error_metrics(table.slice(0, 1))["reward/error_rate"], 0.0)


def test_reward_section_carries_the_file_digest_timeout_and_policy(tmp_path):
    path = reward_file(tmp_path)
    overrides = [f"custom_reward_function.path={path}", "reward.on_error=zero", "reward.timeout_s=2"]
    reward = run_settings(load_config(None, overrides), 1).reward
    assert reward.custom_function.path == str(path.resolve())
    assert reward.custom_function.name == "compute_score"
    assert (reward.timeout_s, reward.on_error) == (2.0, "zero")
    path.write_text(REWARD_FILE + "\n# edited\n")
    edited = run_settings(load_config(None, overrides), 1).reward
    assert edited.custom_function.digest != reward.custom_function.digest
    assert run_settings(load_config(None, []), 1).reward.custom_function is None


def _prompts(run_dir, sources: list[str], split: str):
    import pyarrow as pa

    from ppoflow.tasks.storage.schemas import SCHEMAS
    from ppoflow.tasks.storage.tables import write_table

    rows = [
        {
            "prompt_id": f"{split}-{i}",
            "split": split,
            "row_index": i,
            "data_source": source,
            "ability": "math",
            "prompt_text": "1+1=",
            "prompt_messages": None,
            "ground_truth": "2",
            "extra_info": "{}",
        }
        for i, source in enumerate(sources)
    ]
    table = pa.Table.from_pylist(rows, schema=SCHEMAS["prompts"])
    return write_table(table, run_dir, f"data/prompts_{split}.parquet", SCHEMAS["prompts"])


def test_a_data_source_without_a_built_in_reward_is_refused_after_ingest(tmp_path):
    from ppoflow.tasks.models.host import ModelHost
    from ppoflow.tasks.pipeline.run import close_run, open_run
    from ppoflow.tasks.stages.rewards import require_builtin_rewards

    run = open_run(tmp_path / "run", "trainer: {}\n", ModelHost())
    try:
        known = [ADDITION_DATA_SOURCE, "openai/gsm8k"]
        tables = {"train": _prompts(run.path, known * 3, "train"), "val": _prompts(run.path, known, "val")}
        builtin = config(None)
        require_builtin_rewards(run, builtin, tables)
        tables["val"] = _prompts(run.path, [*known, "my/math", "my/math"], "val")
        reward = replace(builtin, reward_fn_key="source")
        with pytest.raises(RewardFunctionError) as refused:
            require_builtin_rewards(run, reward, tables)
        assert str(refused.value).startswith(
            "2 val prompt(s) have a source (data.reward_fn_key) with no built-in reward, the first 'my/math' "
            "(row 2 of data.val_files); the built-in rewards score ppoflow/addition, openai/gsm8k, "
            "ppoflow/tool-addition: set custom_reward_function.path"
        )
        require_builtin_rewards(run, config(reward_file(tmp_path)), tables)
        tables["train"] = _prompts(run.path, ["my/math"], "train")
        only_model = replace(reward, rule_reward=False)  # the reward model's score alone, in training
        require_builtin_rewards(run, only_model, {"train": tables["train"]})
        with pytest.raises(RewardFunctionError, match="val prompt"):  # validation is scored by rules
            require_builtin_rewards(run, only_model, tables)
    finally:
        close_run(run)


@pytest.mark.parametrize(
    ("weights", "hint"), [("{corectness: 1.0}", " (did you mean 'correctness'?)"), ("{fluency: 0.5}", "")]
)
def test_a_weight_of_a_component_the_built_in_rewards_do_not_return_is_refused_at_load(weights, hint):
    from ppoflow.conf.schema_common import ConfigError

    with pytest.raises(ConfigError) as refused:
        load_config(None, [f"reward.weights={weights}"])
    name = weights.strip("{}").split(":")[0]
    assert f"reward.weights names '{name}'{hint}, a component the built-in rewards do not return" in str(
        refused.value
    )
    custom = load_config(None, [f"reward.weights={weights}", "custom_reward_function.path=" + __file__])
    assert custom.no_effect_warning().startswith(  # the function scores each response itself
        f"no effect in this run: reward.weights.{name} (custom_reward_function.path scores each response"
    )


def test_dapos_overlong_penalty_is_a_component_of_its_own_added_to_the_score():
    """reward_model.reward_manager=dapo with overlong_buffer: the penalty of each response's length is
    the component `overlong`, added with its weight (1 as verl's DAPO manager adds it)."""
    from dataclasses import replace

    from ppoflow.tasks.pipeline.settings import OverlongSettings

    rows = [
        {"prompt_id": f"p{i}", "sample_idx": 0, "data_source": ADDITION_DATA_SOURCE, "response_text": "7",
         "response_length": length}
        for i, length in enumerate([2, 3, 4])
    ]  # fmt: skip
    prompts = {r["prompt_id"]: {"ground_truth": "7", "extra_info": None} for r in rows}
    reward = replace(
        config(None), overlong=OverlongSettings(buffer=2, penalty_factor=0.5, max_response_length=4)
    )
    scored = score_rows(rows, prompts, reward).to_pylist()
    assert [dict(r["components"])["overlong"] for r in scored] == [0.0, -0.25, -0.5]
    assert [r["score"] for r in scored] == pytest.approx([1.0, 0.75, 0.5])
