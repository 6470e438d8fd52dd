"""A small two-iteration PPO run under Prefect, shared by the flow and CLI tests; the timing of a
kept-alive connection to one of ppoflow's servers."""

from __future__ import annotations

import http.client
import statistics
import time

import pytest

SMALL = [
    "data.train_batch_size=32",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "critic.ppo_mini_batch_size=16",
    "critic.ppo_micro_batch_size_per_gpu=16",
    "trainer.total_training_steps=2",
]


def train(run_dir, *overrides: str):
    """Run the ppo-train flow; returns (summary, flow run id)."""
    from ppoflow.flows.train import ppo_train

    state = ppo_train(None, [*SMALL, f"trainer.default_local_dir={run_dir}", *overrides], return_state=True)
    return state.result(), state.state_details.flow_run_id


@pytest.fixture(scope="session")
def small_run(prefect_server, tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("small-run")
    summary, flow_run_id = train(run_dir)
    return run_dir, summary, flow_run_id


def kept_alive_median_seconds(port: int, method: str, path: str, **request) -> float:
    """The median seconds of 21 requests on one kept-alive connection to 127.0.0.1:`port`, each
    answered 200. Without TCP_NODELAY on the server's side every answer waits for the client's delayed
    ACK: 40 ms or more."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    seconds = []
    for _ in range(21):
        started = time.perf_counter()
        connection.request(method, path, **request)
        answer = connection.getresponse()
        answer.read()
        seconds.append(time.perf_counter() - started)
        assert answer.status == 200
    connection.close()
    return statistics.median(seconds)
