"""Nothing in a run directory is trusted unchecked: planted results never run, and every model file
and manifest the run names is verified and rebuilt before the run reports success."""

from __future__ import annotations

import base64
import json
import os
import pickle
import shutil
from dataclasses import replace

import pytest
from transformers import AutoModelForCausalLM

from ppoflow.tasks.pipeline.results import ResultSerializer
from ppoflow.tasks.storage.tables import file_digest
from tests.conftest import try_lock

from .conftest import train


def _copy(run_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    return copy


class _RunsCode:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_pickle_result_never_runs_and_its_stage_runs_again(small_run, tmp_path):
    run_dir, summary, _ = small_run
    copy = _copy(run_dir, tmp_path)
    marker = tmp_path / "code-ran"
    results = sorted((copy / ".prefect-results").iterdir())  # every stage's stored result
    assert {path.name.split("-")[0] for path in results} >= {"validation", "actor_update", "prepare_model"}
    for path in results:
        record = json.loads(path.read_text())
        assert record["metadata"]["serializer"] == {"type": "ppoflow-json"}
        record["metadata"]["serializer"] = {
            "type": "pickle",
            "picklelib": "pickle",
            "picklelib_version": None,
        }
        record["result"] = base64.b64encode(pickle.dumps(_RunsCode(marker))).decode()
        path.write_text(json.dumps(record))
    again, _ = train(copy)
    assert not marker.exists()
    assert again["val_scores"] == summary["val_scores"]
    for path in results:  # every stage ran again and stored its result as JSON
        assert json.loads(path.read_text())["metadata"]["serializer"] == {"type": "ppoflow-json"}


def test_damaged_checkpoints_and_base_model_are_rebuilt_before_the_run_succeeds(small_run, tmp_path):
    run_dir, summary, _ = small_run
    copy = _copy(run_dir, tmp_path)
    final = copy / "checkpoints/iter=000002/actor/model.safetensors"
    tokenizer = copy / "checkpoints/iter=000002/critic/tokenizer.json"
    optimizer = copy / "checkpoints/iter=000002/actor.optim/model-00001-of-00001.safetensors"
    base = copy / "model/base/model.safetensors"
    expected = {path: file_digest(path) for path in (final, tokenizer, optimizer, base)}
    final.write_bytes(final.read_bytes()[:1000])
    tokenizer.write_bytes(tokenizer.read_bytes()[:10])
    flipped = bytearray(optimizer.read_bytes())
    flipped[len(flipped) // 2] ^= 0x01
    optimizer.write_bytes(bytes(flipped))
    base.write_bytes(base.read_bytes()[:100])
    again, _ = train(copy)
    assert {path: file_digest(path) for path in expected} == expected
    assert again["actor_checkpoint"] == str(final.parent)
    AutoModelForCausalLM.from_pretrained(final.parent)  # the file the run names loads
    assert again["val_scores"] == summary["val_scores"]


def test_a_deleted_final_checkpoint_is_saved_again(small_run, tmp_path):
    run_dir, _, _ = small_run
    copy = _copy(run_dir, tmp_path)
    final = copy / "checkpoints/iter=000002"
    expected = file_digest(final / "critic/model.safetensors")
    shutil.rmtree(final / "critic")
    shutil.rmtree(final / "critic.optim")
    train(copy)
    assert file_digest(final / "critic/model.safetensors") == expected


def test_a_deleted_manifest_is_written_again_and_killed_writes_leave_nothing(small_run, tmp_path):
    run_dir, _, _ = small_run
    copy = _copy(run_dir, tmp_path)
    manifest = copy / "iter=000001/_manifest.json"
    expected = json.loads(manifest.read_text())
    manifest.unlink()
    leftovers = [
        copy / ".catalog.duckdb.5f3a9c0d1e2b.tmp",
        copy / ".catalog.duckdb.5f3a9c0d1e2b.tmp.wal",
        copy / "iter=000002/rollouts/.part-00000.parquet.a1b2c3d4e5f6.tmp",
    ]
    for path in leftovers:
        path.write_bytes(b"partial")
    staging = copy / "checkpoints/iter=000002/.actor.k2j3h4"
    staging.mkdir()
    optimizer_staging = copy / "checkpoints/iter=000002/.actor.optim.x1y2z3"
    optimizer_staging.mkdir()
    (optimizer_staging / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"partial")
    train(copy)
    rewritten = json.loads(manifest.read_text())
    assert rewritten["stages"].keys() == expected["stages"].keys()
    for stage, entry in expected["stages"].items():  # the metrics row is computed again (perf/ differs)
        if stage != "metrics":
            assert rewritten["stages"][stage]["refs"] == entry["refs"], stage
    [metrics] = rewritten["stages"]["metrics"]["refs"]
    assert file_digest(copy / metrics["path"]) == metrics["digest"]
    assert not any(path.exists() for path in [*leftovers, staging, optimizer_staging])
    assert (copy / "catalog.duckdb").is_file()


def test_a_stored_result_naming_a_checkpoint_outside_the_run_is_recomputed(small_run, tmp_path):
    run_dir, summary, _ = small_run
    copy = _copy(run_dir, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(copy / "checkpoints/iter=000002/actor", elsewhere)
    [path] = [p for p in (copy / ".prefect-results").glob("actor_update-*") if "iter=000002" in p.read_text()]
    record = json.loads(path.read_text())
    stage, state = ResultSerializer().loads(record["result"].encode())
    record["result"] = ResultSerializer().dumps((stage, replace(state, checkpoint=str(elsewhere)))).decode()
    path.write_text(json.dumps(record))
    again, _ = train(copy)
    assert again["actor_checkpoint"] == str(copy / "checkpoints/iter=000002/actor")
    assert again["val_scores"] == summary["val_scores"]


def test_pruning_deletes_nothing_a_link_in_the_run_points_at(small_run, tmp_path):
    run_dir, _, _ = small_run
    copy = _copy(run_dir, tmp_path)
    victim = tmp_path / "victim"
    (victim / "actor").mkdir(parents=True)
    (victim / "actor/keep.txt").write_text("precious")
    (victim / "actor.optim").mkdir()
    (victim / "actor.optim/state.json").write_text("precious")
    (copy / "checkpoints/iter=000000").symlink_to(victim)
    train(copy, "trainer.total_training_steps=3", "trainer.max_actor_ckpt_to_keep=1")
    assert (victim / "actor/keep.txt").read_text() == "precious"
    assert (victim / "actor.optim/state.json").read_text() == "precious"
    kept = sorted(p.parent.parent.name for p in (copy / "checkpoints").glob("iter=*/actor/config.json"))
    assert kept == ["iter=000003"]


def test_a_results_store_that_is_not_a_folder_stops_the_run_before_it_starts(small_run, tmp_path):
    run_dir, _, _ = small_run
    copy = _copy(run_dir, tmp_path)
    shutil.rmtree(copy / ".prefect-results")
    (copy / ".prefect-results").write_text("not a folder")
    with pytest.raises(NotADirectoryError, match="stage results are kept in a folder"):
        train(copy)
    assert try_lock(copy)  # and the run is not left locked
