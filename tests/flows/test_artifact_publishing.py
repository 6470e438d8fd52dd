"""The Prefect artifacts of a run are sent at most every PUBLISH_INTERVAL_S; what an interval held back
is sent when the run ends or fails, so the card shows every logged iteration."""

from __future__ import annotations

import json

from prefect import flow, get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

from ppoflow.tasks.observe.artifacts import PrefectArtifacts


@flow
def _three_iterations_then_failure(run_path: str) -> None:
    from pathlib import Path

    artifacts = PrefectArtifacts(Path(run_path), total=10)
    for step in range(3):  # well within one interval: nothing is sent yet
        artifacts.log(step, {"critic/score/mean": 0.5 + step})
    assert artifacts.published_rows == 0
    artifacts.fail()


def test_rows_held_back_by_the_interval_are_published_when_the_run_fails(prefect_server, tmp_path):
    state = _three_iterations_then_failure(str(tmp_path), return_state=True)
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])
            )
        )
    by_type = {a.type: a for a in found}
    assert [row["step"] for row in json.loads(by_type["table"].data)] == [0, 1, 2]
    assert by_type["progress"].data == 20.0  # step 2 of 10
