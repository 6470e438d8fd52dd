"""Stored stage results: JSON of ppoflow's result types only; nothing in a run directory runs code."""

from __future__ import annotations

import base64
import json
import math
import os
import pickle

import pytest

from ppoflow.conf import load_config
from ppoflow.tasks.pipeline.cache_keys import key_for
from ppoflow.tasks.pipeline.plan import run_settings
from ppoflow.tasks.pipeline.results import (
    RESULTS_DIR,
    ResultSerializer,
    UnreadableResult,
    discard_unreadable_result,
    read_stored_result,
)
from ppoflow.tasks.pipeline.run import RunFiles
from ppoflow.tasks.pipeline.states import ModelState, StageResult, UpdateInputs
from ppoflow.tasks.stages.prepare_model import prepare_model
from ppoflow.tasks.storage.tables import ArtifactRef

SETTINGS = run_settings(load_config(), total_steps=40)  # the embedded default's


def _update_result() -> tuple[StageResult, ModelState]:
    rollouts = ArtifactRef("iter=000003/rollouts/part-00000.parquet", "sha256:" + "a" * 64, 32)
    advantages = ArtifactRef("iter=000003/advantages/part-00000.parquet", "sha256:" + "b" * 64, 32)
    parent = ModelState("actor", "lineage-2", 2, "checkpoints/iter=000002/actor", "sha256:" + "c" * 64)
    inputs = UpdateInputs(
        parent=parent,
        step=3,
        rollouts=rollouts,
        advantages=advantages,
        settings=SETTINGS.actor.update,
        optim=SETTINGS.actor.optim,
    )
    state = ModelState("actor", "lineage-3", 3, None, None, origin=inputs)
    stage = StageResult(
        "actor_update",
        (ArtifactRef("iter=000003/actor_update/part-00000.parquet", "sha256:" + "d" * 64, 2),),
        "update_actor-0123",
        0.25,
        (("actor/pg_loss", -0.5), ("actor/kl", float("nan")), ("perf/x", float("inf"))),
    )
    return stage, state


def test_a_result_round_trips_through_json_with_every_field_and_non_finite_floats():
    stage, state = _update_result()
    blob = ResultSerializer().dumps((stage, state))
    json.loads(blob)  # plain JSON
    back_stage, back_state = ResultSerializer().loads(blob)
    assert back_state == state and back_state.origin.optim.betas == (0.9, 0.999)
    assert back_state.origin.settings == SETTINGS.actor.update  # the same frozen settings, replayable
    assert back_stage.refs == stage.refs and back_stage.cache_key == stage.cache_key
    values = dict(back_stage.values)
    assert values["actor/pg_loss"] == -0.5 and math.isnan(values["actor/kl"]) and values["perf/x"] == math.inf


def test_a_type_that_is_not_a_result_cannot_be_stored():
    with pytest.raises(TypeError, match="cannot be stored"):
        ResultSerializer().dumps({"path": os.path})


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _record(path, serializer: dict, result: str) -> None:
    metadata = {"storage_key": str(path), "expiration": None, "serializer": serializer}
    path.write_text(
        json.dumps(
            {"metadata": metadata | {"prefect_version": "3", "storage_block_id": None}, "result": result}
        )
    )


@pytest.mark.parametrize(
    "serializer",
    [
        {"type": "pickle", "picklelib": "pickle", "picklelib_version": None},
        {"type": "pickle", "picklelib": "cloudpickle", "picklelib_version": None},
        {"type": "compressed/pickle"},
    ],
)
def test_a_planted_pickle_is_refused_and_never_unpickled(tmp_path, serializer):
    marker = tmp_path / "code-ran"
    record = tmp_path / "validate-0123"
    _record(record, serializer, base64.b64encode(pickle.dumps(_RunsCode(marker))).decode())
    with pytest.raises(UnreadableResult, match="not written by ppoflow"):
        read_stored_result(record)
    assert not marker.exists()


def test_prefects_json_serializer_with_a_chosen_decoder_is_refused(tmp_path):
    record = tmp_path / "validate-0123"
    serializer = {"type": "json", "jsonlib": "json", "object_decoder": "os.system"}
    _record(record, serializer, json.dumps({"touch x": 1}))
    with pytest.raises(UnreadableResult, match="not written by ppoflow"):
        read_stored_result(record)


@pytest.mark.parametrize(
    "result",
    [
        json.dumps({"type": "Popen", "fields": {"args": "touch x"}}),  # not a result type
        json.dumps({"type": "ModelState", "fields": {"role": "actor", "shell": True}}),  # unknown field
        json.dumps({"float": "1e999"}),
        "{not json",
        json.dumps({"dict": {"a": 1}, "extra": 2}),
    ],
)
def test_a_record_of_ours_that_does_not_decode_to_result_types_is_refused(tmp_path, result):
    record = tmp_path / "validate-0123"
    _record(record, {"type": "ppoflow-json"}, result)
    with pytest.raises(UnreadableResult):
        read_stored_result(record)


@pytest.mark.parametrize("content", [b"", b"\x80\x04garbage", b"[1, 2]", b'{"metadata": 1}'])
def test_a_damaged_record_is_unreadable_not_an_error(tmp_path, content):
    record = tmp_path / "validate-0123"
    record.write_bytes(content)
    with pytest.raises(UnreadableResult):
        read_stored_result(record)


def test_a_record_ppoflow_wrote_reads_back(tmp_path):
    stage, state = _update_result()
    record = tmp_path / "update_actor-0123"
    _record(record, {"type": "ppoflow-json"}, ResultSerializer().dumps((stage, state)).decode())
    assert read_stored_result(record)[1] == state


@pytest.mark.parametrize(
    "fields",
    [
        {"type": "ModelState", "fields": {"role": "../../x", "lineage": "l", "step": 1, "checkpoint": None}},
        {
            "type": "ModelState",
            "fields": {"role": "actor", "lineage": "l", "step": 1, "checkpoint": "../../x"},
        },
        {"type": "ArtifactRef", "fields": {"path": "/etc/passwd", "digest": "sha256:00", "rows": 1}},
        {"type": "ArtifactRef", "fields": {"path": "iter=000001/../../x", "digest": "sha256:00", "rows": 1}},
        {"type": "StageResult", "fields": {"stage": "s", "refs": "oops", "cache_key": "k", "seconds": 1.0}},
        {
            "type": "StageResult",
            "fields": {"stage": "s", "refs": {"tuple": [1]}, "cache_key": "k", "seconds": 1},
        },
        {
            "type": "ModelState",
            "fields": {"role": "actor", "lineage": "l", "step": 10**18, "checkpoint": None},
        },
        {"type": "ArtifactRef", "fields": {"path": "a.parquet", "digest": "sha256:00", "rows": True}},
    ],
)
def test_a_record_of_ours_with_paths_outside_the_run_or_wrong_types_is_refused(tmp_path, fields):
    record = tmp_path / "update_actor-0123"
    _record(record, {"type": "ppoflow-json"}, json.dumps(fields))
    with pytest.raises(UnreadableResult):
        read_stored_result(record)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("loss_agg_mode", "seq-mean-anything"),  # not one of the Literal's values
        ("ppo_epochs", True),  # a bool where a count is
        ("ppo_epochs", -1),
        ("clip_ratio_low", "0.2"),
        ("use_kl_loss", 1),  # an int where a bool is
        ("unknown", 1),
    ],
)
def test_recorded_update_settings_are_checked_field_by_field(tmp_path, field, value):
    """A replayed update trains with the recorded settings: a forged one is unreadable (recomputed),
    not a surprise in the engine."""
    _, state = _update_result()
    record = json.loads(ResultSerializer().dumps(state))
    record["fields"]["origin"]["fields"]["settings"]["fields"][field] = value
    path = tmp_path / "update_actor-0123"
    _record(path, {"type": "ppoflow-json"}, json.dumps(record))
    with pytest.raises(UnreadableResult):
        read_stored_result(path)
    untouched = tmp_path / "update_actor-4567"
    _record(untouched, {"type": "ppoflow-json"}, ResultSerializer().dumps(state).decode())
    assert read_stored_result(untouched) == state


def test_a_fifo_under_a_results_name_is_discarded_without_blocking(tmp_path):
    run = RunFiles(str(tmp_path))
    parameters = {"model_path": "builtin:tiny-addition", "seed": 1, "source": "builtin:tiny-addition"}
    path = tmp_path / RESULTS_DIR / key_for(prepare_model, {"run": run, **parameters})
    path.parent.mkdir()
    os.mkfifo(path)
    discard_unreadable_result(run, prepare_model, parameters)
    assert not path.exists()


def test_planted_results_are_removed_together_and_said_once(tmp_path, caplog):
    """A folder of planted records was removed record by record as each stage came to it, and every
    stage was trained again without a word: now the first found has the rest removed with it, in
    one warning naming them and why."""
    run = RunFiles(str(tmp_path))
    folder = tmp_path / RESULTS_DIR
    folder.mkdir()
    calls = [{"model_path": f"builtin:m{i}", "seed": i, "source": f"builtin:m{i}"} for i in range(3)]
    keys = [key_for(prepare_model, {"run": run, **parameters}) for parameters in calls]
    pickled = {"type": "pickle", "picklelib": "cloudpickle", "picklelib_version": None}
    _record(folder / keys[0], pickled, base64.b64encode(pickle.dumps(1)).decode())
    (folder / keys[1]).write_text("garbage")
    stage, _ = _update_result()
    _record(folder / keys[2], {"type": "ppoflow-json"}, ResultSerializer().dumps(stage).decode())
    (folder / "notes.txt").write_text("not a stored result's name: Prefect never reads it")
    with caplog.at_level("INFO", logger="ppoflow.tasks.pipeline.results"):
        discard_unreadable_result(run, prepare_model, calls[1])
        discard_unreadable_result(run, prepare_model, calls[0])  # already gone: nothing more to say
    assert [(record.levelname, record.getMessage()) for record in caplog.records] == [
        (
            "WARNING",
            f"removed 2 stored stage results from {folder} that ppoflow did not write or cannot read "
            f"({keys[1]}: not a JSON record (Expecting value: line 1 column 1 (char 0)); "
            f"{keys[0]}: not written by ppoflow (its serializer: 'pickle')): their stages are computed again",
        )
    ]
    assert sorted(p.name for p in folder.iterdir()) == sorted([keys[2], "notes.txt"])
    assert read_stored_result(folder / keys[2]).refs == stage.refs
