"""Committing a step: the manifest is written last from the stages' results, kept as it is when it
already names the same files, and written again when it is damaged or not a manifest at all."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from ppoflow.tasks.pipeline.commit import commit_step
from ppoflow.tasks.pipeline.run import RunFiles
from ppoflow.tasks.pipeline.states import StageResult, timing_values
from ppoflow.tasks.storage.manifests import read_manifest
from ppoflow.tasks.storage.tables import stage_path, write_table


@pytest.fixture
def step_results(tmp_path):
    ref = write_table(pa.table({"x": [1, 2]}), tmp_path, stage_path(1, "rewards"))
    return RunFiles(str(tmp_path)), [
        StageResult("rewards", (ref,), "rewards-key", 0.5, timing_values({"reward": 0.5}))
    ]


def test_the_manifest_names_each_stages_files_seconds_and_timers(step_results):
    run, results = step_results
    commit_step(run, 1, results)
    [entry] = read_manifest(run.path, 1)["stages"].values()
    assert entry["rows"] == 2 and entry["cache_key"] == "rewards-key" and entry["timers"] == {"reward": 0.5}


def test_a_step_with_the_same_files_keeps_its_manifest_even_with_other_seconds(step_results):
    run, results = step_results
    commit_step(run, 1, results)
    path = run.path / "iter=000001/_manifest.json"
    before = (path.read_bytes(), path.stat().st_ino)
    slower = [StageResult(r.stage, r.refs, r.cache_key, 9.0, timing_values({"reward": 9.0})) for r in results]
    commit_step(run, 1, slower)
    assert (path.read_bytes(), path.stat().st_ino) == before


@pytest.mark.parametrize("planted", ['{"stages": []}', '{"stages": {"rewards": 1}}', "[]", '"x"'])
def test_a_manifest_that_is_not_one_is_written_again(step_results, planted):
    run, results = step_results
    path = run.path / "iter=000001/_manifest.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(planted)
    commit_step(run, 1, results)
    assert json.loads(path.read_text())["stages"]["rewards"]["cache_key"] == "rewards-key"
