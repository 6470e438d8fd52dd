"""What the Prefect UI shows of a training run, read back from the API: the run's Logs tab holds the
lines ppoflow prints (attached to the flow run or the task run that said them), and every task run
is named by its stage."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

from prefect import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId
from prefect.client.schemas.objects import Log

from .test_train_flow import task_states

PAGE = 200  # the most logs the API returns per call


def run_logs(client, flow_run_id) -> list[Log]:
    """Every log of a flow run and its task runs, oldest first."""
    logs: list[Log] = []
    while True:
        page = client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
            limit=PAGE,
            offset=len(logs),
        )
        logs += page
        if len(page) < PAGE:
            return logs


def wait_for_log(open_client: Callable, flow_run_id, text: str, timeout_s: float = 120) -> list[Log]:
    """The run's logs once one of them contains `text` (or at the deadline): a background worker
    sends logs in batches, so they can reach the API after the run's final state."""
    deadline = time.monotonic() + timeout_s
    while True:
        with open_client() as client:
            logs = run_logs(client, flow_run_id)
        if any(text in log.message for log in logs) or time.monotonic() > deadline:
            return logs
        time.sleep(0.5)


def _local_client():
    return get_client(sync_client=True)


def test_the_lines_ppoflow_prints_are_in_the_runs_prefect_log_once(small_run):
    """A run under a worker has no terminal to read: its step lines must be on its Logs tab."""
    run_dir, _, flow_run_id = small_run
    logs = wait_for_log(_local_client, flow_run_id, "run directory")
    steps = [log for log in logs if re.match(r"step +\d+/2 · ", log.message)]
    assert [log.message[:10] for log in steps] == ["step   0/2", "step   1/2", "step   2/2"]
    assert all(log.task_run_id is None and log.level == logging.INFO for log in steps)
    assert "ppo_kl" in steps[1].message and " kl " not in steps[1].message
    assert [log.message for log in logs if log.message.startswith("run directory")] == [
        f"run directory   {run_dir}"
    ]
    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    ingest_train = next(run.id for run in task_runs if run.name == "prompts-train")
    [ingest] = [log for log in logs if log.message.startswith("ingest train: ")]
    assert ingest.task_run_id == ingest_train and "2,048 rows" in ingest.message


def test_every_task_run_is_named_by_its_stage(small_run):
    """Names like `prepare_model-f80` (a hash) say nothing on the run's graph."""
    names = set(task_states(small_run[2]))
    assert "prepare_model" in names and "prompts-train" in names
    assert [n for n in names if not re.fullmatch(r"[a-z_]+-(step\d+|train|val)|prepare_model", n)] == []


def test_the_run_graph_links_each_stage_to_the_stages_whose_outputs_it_takes(small_run):
    """The UI's run graph draws a task run's inputs: each stage's edges come from the task runs that
    returned the tables and model states it takes, across iterations too."""
    flow_run_id = small_run[2]
    task_states(flow_run_id)  # every task run recorded
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    names = {run.id: run.name for run in runs}
    upstream = {
        run.name: {names.get(getattr(i, "id", None)) for inputs in run.task_inputs.values() for i in inputs}
        for run in runs
    }
    assert upstream["metrics-step0"] == {"validation-step0"}  # the validation before training's row
    assert upstream["rollouts-step1"] >= {"prepare_model", "prompts-train"}
    assert upstream["rewards-step1"] >= {"rollouts-step1", "prompts-train"}
    assert upstream["advantages-step1"] >= {"rollouts-step1", "rewards-step1"}
    assert upstream["critic_update-step1"] >= {"rollouts-step1", "advantages-step1"}
    assert upstream["actor_update-step1"] >= {"rollouts-step1", "advantages-step1"}
    assert upstream["rollouts-step2"] >= {"actor_update-step1"}
    assert upstream["advantages-step2"] >= {"rollouts-step2", "actor_update-step1", "critic_update-step1"}
    assert upstream["metrics-step2"] >= {
        "rollouts-step2",
        "rewards-step2",
        "advantages-step2",
        "critic_update-step2",
        "actor_update-step2",
    }
