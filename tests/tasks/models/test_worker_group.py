"""The worker group's failure lines: a cluster address with nothing behind it, a rank whose process
died and a rank that raised each become one line that says what happened (no Ray started here)."""

from __future__ import annotations

import socket

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from ppoflow.tasks.models.workers import WorkerFailed, _check_reachable, _first_line


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


@pytest.mark.parametrize("scheme", ["", "ray://"])
def test_a_ray_address_with_no_cluster_fails_at_once(scheme):
    address = f"{scheme}127.0.0.1:{_closed_port()}"
    with pytest.raises(
        WorkerFailed, match=f"no Ray cluster answers at RAY_ADDRESS={address} .*unset RAY_ADDRESS"
    ):
        _check_reachable(address)


def test_an_address_ray_resolves_itself_is_left_to_ray():
    _check_reachable("auto")  # nothing to connect to before Ray looks


def test_a_dead_rank_and_a_raising_rank_are_one_line_each():
    died = _first_line(ActorDiedError(), pid=4242)
    assert died.startswith("its process (pid 4242) died") and "\n" not in died
    raised = RayTaskError("train", "Traceback ...\n  File x\nValueError: bad batch", ValueError("bad batch"))
    assert _first_line(raised, pid=1) == "ValueError: bad batch"
