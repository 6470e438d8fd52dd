"""Multi-turn rollouts end to end: the built-in tiny calculator model (conf/tool_calculator.yaml)
learns to call its calculator, every turn and call is a row of the turns table, the masks, log-probs
and advantages skip the tool's tokens, and a run SIGKILLed inside its rollouts stage resumes into
the same tables as one that was never killed.

Every run is a real `ppoflow train` process against the session's Prefect server, one torch thread.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from ppoflow.tasks.storage.confined_query import query

ROOT = Path(__file__).resolve().parents[2]
SHORT = [
    "data.train_batch_size=8",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
    "trainer.total_training_steps=4",
    "trainer.test_freq=2",
    "trainer.save_freq=2",
    "trainer.num_threads=1",
]
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


def train(run_dir: Path, *overrides: str, fault: str | None = None) -> subprocess.CompletedProcess:
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PPOFLOW_PROGRESS": "0"}
    env.pop("PPOFLOW_FAULT", None)
    if fault:
        env["PPOFLOW_FAULT"] = fault
    args = [sys.executable, "-m", "ppoflow", "train", "--config", str(ROOT / "conf/tool_calculator.yaml")]
    args += [*SHORT, f"trainer.default_local_dir={run_dir}", *overrides]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def tool_run(prefect_server, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tool-run")
    done = train(run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def rows(run_dir: Path, sql: str) -> list[dict]:
    columns, found = query(run_dir, sql)
    return [dict(zip(columns, row, strict=True)) for row in found]


@pytest.mark.slow
def test_the_tiny_model_learns_to_call_the_calculator(tool_run):
    """Validation (greedy, 100 held-out sums) at steps 0, 2 and 4: the share of answers that call the
    tool and the share that are right both rise; the warm start calls it on about a quarter."""
    by_step = rows(
        tool_run,
        "SELECT iter, avg(components['correctness']) AS correct, "
        "avg(CAST(tool_calls > 0 AS DOUBLE)) AS calls FROM validation GROUP BY iter ORDER BY iter",
    )
    first, last = by_step[0], by_step[-1]
    assert (first["iter"], last["iter"]) == (0, 4)
    assert first["calls"] < 0.6 and first["correct"] < 0.6
    assert last["calls"] >= first["calls"] + 0.3 and last["correct"] >= first["correct"] + 0.3
    metrics = rows(tool_run, 'SELECT "val-aux/tool_call_counts/mean" AS c FROM metrics WHERE iter = 4')
    assert metrics[0]["c"] == pytest.approx(last["calls"])


@pytest.mark.slow
def test_each_turn_is_a_row_and_each_call_reads_the_calculators_answer(tool_run):
    calls = rows(
        tool_run,
        "SELECT t.iter, t.prompt_id, t.sample_idx, t.text, t.result, t.error, t.token_start, t.token_end, "
        "t.arguments, r.response_ids, r.response_mask, r.old_log_probs, r.response_length, r.finish_reason, "
        "a.advantages "
        "FROM turns t JOIN rollouts r USING (iter, prompt_id, sample_idx) "
        "JOIN advantages a USING (iter, prompt_id, sample_idx) WHERE t.role = 'tool'",
    )
    assert len(calls) > 10
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tool_run / "model" / "base")
    for call in calls:
        if call["error"] is None:  # the calculator's own sum of what the model asked for
            a, _, b = call["arguments"].split('"')[3].partition(" + ")
            assert call["result"] == str(int(a) + int(b))
        span = slice(call["token_start"], call["token_end"])
        if span.start == span.stop:  # the tool turn did not fit: the response ends at its length limit
            assert call["text"] == "" and call["finish_reason"] == "length"
            assert call["token_start"] == call["response_length"]
            continue
        assert (
            tokenizer.decode(call["response_ids"][span]) == f"{RESPONSE_OPEN}{call['text']}{RESPONSE_CLOSE}"
        )
        mask = call["response_mask"]
        assert len(mask) == call["response_length"] == len(call["old_log_probs"]) == len(call["advantages"])
        assert set(mask[span]) == {0} and 1 in mask[: call["token_start"]]
        assert all(
            call["old_log_probs"][k] == 0.0 and call["advantages"][k] == 0.0
            for k in range(*span.indices(len(mask)))
        )
        assert all(call["old_log_probs"][k] < 0 for k, m in enumerate(mask) if m == 1)
    turns = rows(
        tool_run,
        "SELECT r.num_turns, r.tool_calls, count(*) FILTER (WHERE t.role = 'assistant') AS assistant, "
        "count(DISTINCT t.turn) FILTER (WHERE t.role = 'tool' AND t.token_end > t.token_start) AS shown, "
        "count(*) FILTER (WHERE t.role = 'tool') AS calls "
        "FROM rollouts r JOIN turns t USING (iter, prompt_id, sample_idx) "
        "GROUP BY iter, prompt_id, sample_idx, r.num_turns, r.tool_calls",
    )
    # verl's num_turns: the prompt, each assistant turn and each tool turn the model read
    assert all(t["num_turns"] == 1 + t["assistant"] + t["shown"] for t in turns)
    assert all(t["tool_calls"] == t["calls"] for t in turns)


def same_tables(run_dir: Path, reference: Path, pattern: str, *, without: tuple[str, ...] = ()) -> None:
    ours = sorted(p.relative_to(run_dir) for p in run_dir.glob(pattern) if not p.name.startswith("."))
    theirs = sorted(p.relative_to(reference) for p in reference.glob(pattern) if not p.name.startswith("."))
    assert ours == theirs and ours, pattern
    for path in ours:
        a, b = pq.read_table(run_dir / path), pq.read_table(reference / path)
        keep = [c for c in a.column_names if c not in without]
        assert a.select(keep).equals(b.select(keep)), path


@pytest.mark.slow
def test_a_sigkill_inside_rollouts_resumes_into_the_same_tables(tool_run, tmp_path):
    killed = train(tmp_path, fault="rollouts@3")
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert not list(tmp_path.glob("iter=000003/turns/*.parquet"))
    done = train(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for stage in ("rollouts", "rewards", "advantages", "validation"):
        same_tables(tmp_path, tool_run, f"iter=*/{stage}/*.parquet")
    same_tables(tmp_path, tool_run, "iter=*/turns/*.parquet", without=("seconds",))


@pytest.mark.slow
def test_show_renders_the_turns_and_diagnose_reads_them(tool_run):
    from ppoflow.tasks.observe.diagnose import load_run

    shown = subprocess.run(
        [sys.executable, "-m", "ppoflow", "show", str(tool_run), "--best", "8"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert shown.returncode == 0, shown.stderr
    assert "turn 1 tool calculator" in shown.stdout and "[tool_calls]" in shown.stdout
    assert "tool" in shown.stdout.split("from", 1)[1]  # the token table marks the tool's tokens
    run = load_run(tool_run)
    errors = run.series("turns/tool_error_rate")
    assert [i for i, _ in errors] == [1, 2, 3, 4] and all(0 <= v <= 1 for _, v in errors)
    assert [i for i, _ in run.series("turns/turn_limit_rate")] == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_worker_group_of_two_ranks_generates_the_same_conversations(tool_run, tmp_path):
    """Two ranks (FSDP2 on Ray, gloo) each generate their share of the step's prompts and of the
    validation prompts, tools included: the same turns as one process, log-probs within rounding."""
    done = train(
        tmp_path,
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "trainer.total_training_steps=1",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    same_tables(tmp_path, tool_run, "iter=000000/validation/*.parquet")
    same_tables(tmp_path, tool_run, "iter=000001/turns/*.parquet", without=("seconds",))
    ours = pq.read_table(next(tmp_path.glob("iter=000001/rollouts/*.parquet")))
    theirs = pq.read_table(next(tool_run.glob("iter=000001/rollouts/*.parquet")))
    for column in ("prompt_id", "sample_idx", "response_ids", "response_mask", "num_turns", "tool_calls"):
        assert ours[column].equals(theirs[column]), column
    for a, b in zip(ours["old_log_probs"].to_pylist(), theirs["old_log_probs"].to_pylist(), strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4
