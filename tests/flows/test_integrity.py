"""Damaged artifacts are recomputed, write failures leave nothing partial, and resumes at an epoch
boundary train the remaining steps (the verl #7401 case)."""

from __future__ import annotations

import errno
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from ppoflow.flows.iteration import ValidatedOtherwise
from ppoflow.tasks.storage import tables
from ppoflow.tasks.storage.checkpoints import StateUnavailable
from ppoflow.tasks.storage.confined_query import query
from ppoflow.tasks.storage.run_config import AnotherRun

from .conftest import train
from .test_train_flow import task_states


def _copy(run_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    return copy


def _ran(flow_run_id) -> set[str]:
    return {
        name.rsplit("-", 1)[0] for name, state in task_states(flow_run_id).items() if state == "Completed"
    }


def test_an_altered_parquet_is_recomputed_and_comes_out_identical(small_run, tmp_path):
    run_dir, summary, _ = small_run
    copy = _copy(run_dir, tmp_path)
    target = copy / "iter=000001/advantages/part-00000.parquet"
    original = target.read_bytes()
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0xFF
    target.write_bytes(bytes(damaged))
    again, flow_run_id = train(copy)
    assert _ran(flow_run_id) == {"advantages"}
    assert target.read_bytes() == original
    assert again["val_scores"] == summary["val_scores"]


def test_a_truncated_checkpoint_is_rebuilt_by_replaying_its_update(small_run, tmp_path):
    run_dir, _, _ = small_run
    copy = _copy(run_dir, tmp_path)
    weights = copy / "checkpoints/iter=000001/actor/model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[:1000])
    (copy / "iter=000002/rollouts/part-00000.parquet").unlink()  # step 2's rollout needs actor state 1
    rollout_before = (run_dir / "iter=000002/rollouts/part-00000.parquet").read_bytes()
    _, flow_run_id = train(copy)
    assert _ran(flow_run_id) == {"actor_update", "rollouts"}
    assert weights.read_bytes() == original  # the update replayed from the base, saved bit for bit
    assert (copy / "iter=000002/rollouts/part-00000.parquet").read_bytes() == rollout_before


def test_a_failed_write_leaves_no_partial_artifact_and_the_next_run_resumes(
    prefect_server, tiny_model_dir, small_run, tmp_path, monkeypatch
):
    run_dir, summary, _ = small_run
    real_replace = tables.os.replace

    def disk_full_for_step_2_advantages(src, dst):
        if "iter=000002/advantages" in str(dst):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(tables.os, "replace", disk_full_for_step_2_advantages)
    with pytest.raises(OSError, match="No space left on device.*iter=000002/advantages/part-00000.parquet"):
        train(tmp_path)
    assert not (tmp_path / "iter=000002/advantages").exists() or not any(
        (tmp_path / "iter=000002/advantages").iterdir()
    )
    assert (tmp_path / ".lock").read_text() == ""  # released: the holder's record is cleared
    monkeypatch.setattr(tables.os, "replace", real_replace)
    again, _ = train(tmp_path)
    assert again["val_scores"] == summary["val_scores"]
    ours = load_file(tmp_path / "checkpoints/iter=000002/actor/model.safetensors")
    theirs = load_file(run_dir / "checkpoints/iter=000002/actor/model.safetensors")
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_resume_mode_disable_recomputes_every_stage(small_run, tmp_path):
    run_dir, summary, _ = small_run
    copy = _copy(run_dir, tmp_path)
    again, flow_run_id = train(copy, "trainer.resume_mode=disable")
    assert "Cached" not in set(task_states(flow_run_id).values())
    assert again["val_scores"] == summary["val_scores"]


def test_a_run_resumed_at_an_epoch_boundary_trains_the_remaining_steps(
    prefect_server, tiny_model_dir, tmp_path
):
    data = tmp_path / "sums.jsonl"
    rows = [
        {
            "data_source": "ppoflow/addition",
            "prompt": f"{a} + {b} = ",
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"index": 10 * a + b},
        }
        for a in range(8)
        for b in range(8)
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    files = [
        f"data.train_files={data}",
        "trainer.total_training_steps=null",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
    ]
    train(tmp_path / "run", *files, "trainer.total_epochs=1")  # 64 prompts / 32 per step = 2 steps
    assert query(tmp_path / "run", "SELECT max(iter) FROM actor_update")[1] == [(2,)]
    _, flow_run_id = train(tmp_path / "run", *files, "trainer.total_epochs=2")
    assert query(tmp_path / "run", "SELECT DISTINCT iter FROM actor_update ORDER BY iter")[1] == [
        (1,),
        (2,),
        (3,),
        (4,),
    ]
    ran = [name for name, state in task_states(flow_run_id).items() if state == "Completed"]
    assert len([n for n in ran if n.startswith("actor_update")]) == 2  # steps 3 and 4 only
    # The data file edited in place (the same path): another run, refused before anything changes. It
    # was taken in again without a word, and every step computed again and rewritten in place.
    trained = data.read_text()
    data.write_text(trained.replace('"ground_truth": "0"', '"ground_truth": "1"', 1))
    before = {
        p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file() and "logs" not in p.parts
    }
    with pytest.raises(
        AnotherRun, match=r"data\.train_files: .*sums\.jsonl, edited since the run's last start"
    ):
        train(tmp_path / "run", *files, "trainer.total_epochs=2")
    assert {p: p.read_bytes() for p in before} == before
    data.write_text(trained)  # put back: the run is as it was, every stage served from cache
    _, flow_run_id = train(tmp_path / "run", *files, "trainer.total_epochs=2")
    assert "Completed" not in set(task_states(flow_run_id).values())


def test_settings_that_do_not_change_a_stage_do_not_invalidate_it(small_run, tmp_path):
    run_dir, summary, _ = small_run
    copy = _copy(run_dir, tmp_path)
    _, flow_run_id = train(
        copy, "trainer.max_actor_ckpt_to_keep=1", "actor_rollout_ref.rollout.val_kwargs.top_k=5"
    )
    assert _ran(flow_run_id) == {"validation"}  # pruning policy: no stage; val_kwargs: validation only
    assert len(list(copy.glob("checkpoints/iter=*/actor"))) == 2  # pruning happens only when updates run


def test_val_only_validates_and_trains_nothing(prefect_server, tiny_model_dir, tmp_path, capsys):
    """Two sampled answers per prompt: its one metrics row holds verl's mean@2, best@2, worst@2 and
    maj@2, each equal to its recomputation from the validation rows."""
    from ppoflow.tasks.observe.console import VALIDATION_QUERY

    from .test_metrics_sql import assert_metrics_match_rows

    summary, _ = train(
        tmp_path,
        "trainer.val_only=true",
        "data.val_max_samples=30",
        "actor_rollout_ref.rollout.val_kwargs.n=2",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
    )
    assert query(tmp_path, "SELECT DISTINCT iter FROM validation")[1] == [(0,)]
    assert query(tmp_path, "SELECT count(*) FROM rollouts")[1] == [(0,)]
    assert len(summary["val_scores"]) == 1
    assert f'"{VALIDATION_QUERY}"' in capsys.readouterr().out  # the query it suggests has rows
    assert query(tmp_path, VALIDATION_QUERY)[1] == [
        (0, "ppoflow/addition", pytest.approx(summary["val_scores"][0]))
    ]
    columns, rows = query(tmp_path, "SELECT * FROM metrics")
    assert len(rows) == 1
    row = dict(zip(columns, rows[0], strict=True))
    assert (row["iter"], row["step"]) == (0, 0)
    reward = "ppoflow/addition/acc"
    assert row[f"val-core/{reward}/mean@2"] == pytest.approx(summary["val_scores"][0])
    for name in (
        f"val-core/{reward}/best@2/mean",
        f"val-core/{reward}/maj@2/mean",
        f"val-aux/{reward}/worst@2/mean",
    ):
        assert name in row, name
    assert all(c.startswith(("val-core/", "val-aux/")) for c in columns if c not in ("iter", "step"))
    assert assert_metrics_match_rows(tmp_path)[f"val-core/{reward}/maj@2/mean"].keys() == {0}


def test_val_only_on_a_trained_run_validates_its_newest_checkpoint(small_run, tmp_path):
    """verl's resume_mode=auto loads the newest checkpoint before a validation-only start validates it;
    that step's validation is reused and its training row kept. resume_mode=disable: the base model."""
    run_dir, summary, _ = small_run
    copy = _copy(run_dir, tmp_path)
    files = {path: path.read_bytes() for path in copy.rglob("*.parquet")}
    checked, flow_run_id = train(copy, "trainer.val_only=true")
    assert checked["val_scores"] == [summary["val_scores"][-1]]  # step 2's model, not the base's 0th
    assert summary["val_scores"][-1] != summary["val_scores"][0]
    assert _ran(flow_run_id) == set()  # step 2's validation and metrics: both already there
    assert {path: path.read_bytes() for path in copy.rglob("*.parquet")} == files
    # Other validation settings rewrote step 2's validation rows under its metrics row (the tables
    # disagreed): refused before anything is validated.
    with pytest.raises(ValidatedOtherwise, match="validates step 2, which this run trained with other"):
        train(copy, "trainer.val_only=true", "actor_rollout_ref.rollout.val_kwargs.top_k=5")
    assert {path: path.read_bytes() for path in copy.rglob("*.parquet")} == files
    base, _ = train(copy, "trainer.val_only=true", "trainer.resume_mode=disable")
    assert base["val_scores"] == [summary["val_scores"][0]]


def test_val_only_on_a_copied_run_never_validates_the_originals_checkpoint(small_run, tmp_path):
    """A copy's trainer state still names the original's folders: the copy's own checkpoint is the
    one validated, and a copy whose checkpoint was deleted is refused, not served the original's."""
    run_dir, _, _ = small_run
    copy = _copy(run_dir, tmp_path)
    shutil.rmtree(copy / "checkpoints/iter=000002/actor")
    with pytest.raises(
        FileNotFoundError, match=r"the actor checkpoint it names is not there, at .*copy/checkpoints"
    ):
        train(copy, "trainer.val_only=true")
    assert (run_dir / "checkpoints/iter=000002/actor").is_dir()  # the original's, which it did not take
    weights_gone = _copy(run_dir, tmp_path / "weights")
    (weights_gone / "checkpoints/iter=000002/actor/model.safetensors").unlink()
    with pytest.raises(StateUnavailable, match=r"checkpoints/iter=000002/actor was altered or truncated"):
        train(weights_gone, "trainer.val_only=true")  # (ppoflow train: one line, exit 3)


def test_too_few_training_prompts_for_one_batch_fail_before_anything_trains(
    prefect_server, tiny_model_dir, tmp_path
):
    from ppoflow.tasks.stages.prompts import NotEnoughData

    with pytest.raises(
        NotEnoughData, match=r"hold 20 usable prompts \(0 rows rejected\).*train_batch_size=32"
    ):
        train(tmp_path, "data.train_max_samples=20")
    assert not list(tmp_path.glob("iter=*"))  # not even the validation before training ran


def test_steps_an_earlier_start_trained_from_another_step_are_moved_aside(small_run, tmp_path, capsys):
    """A shorter rerun with the same config keeps the steps after it (a longer run reuses them); with
    another config, they were trained from a step that is no longer the run's: moved to superseded/,
    so that queries and export see the run as its last start left it."""
    from ppoflow.tasks.storage.export import actor_checkpoint

    run_dir, _, _ = small_run
    copy = _copy(run_dir, tmp_path)
    # A step 3 that an earlier start (another config, killed after it) trained from another step 2:
    # the chain is checked step after step, so step 2 stays and step 3 is moved.
    shutil.copytree(copy / "iter=000002", copy / "iter=000003")
    manifest = json.loads((copy / "iter=000003/_manifest.json").read_text())
    manifest["iteration"], manifest["started_from"]["critic"] = 3, "0" * 64
    (copy / "iter=000003/_manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    train(copy, "trainer.total_training_steps=1")
    assert "steps 3–3 of an earlier start do not continue this run's step 2: moved" in capsys.readouterr().out
    assert (copy / "iter=000002/_manifest.json").is_file() and not (copy / "iter=000003").exists()
    shutil.rmtree(copy / "superseded")
    # The critic's learning rate: step 1's actor is the same, its critic is not, so step 2 on disk
    # (its advantages, both updates) was trained from another step 1.
    lr, keep_one = "critic.optim.lr=2e-5", "trainer.max_critic_ckpt_to_keep=1"
    train(copy, "trainer.total_training_steps=1", lr, keep_one)
    [moved] = (copy / "superseded").iterdir()
    assert (
        f"steps 2–2 of an earlier start do not continue this run's step 1: moved to superseded/{moved.name}/"
        in (capsys.readouterr().out)
    )
    assert (moved / "iter=000002/_manifest.json").is_file()
    assert (copy / "checkpoints/superseded" / moved.name / "iter=000002/actor/model.safetensors").is_file()
    assert not (copy / "iter=000002").exists() and not (copy / "checkpoints/iter=000002").exists()
    assert query(copy, "SELECT max(iter) FROM metrics")[1] == [(1,)]
    assert actor_checkpoint(copy) == copy / "checkpoints/iter=000001/actor"
    for role in ("actor", "critic"):  # the later steps on disk did not make step 1's checkpoint "old"
        assert (copy / f"checkpoints/iter=000001/{role}.optim").is_dir()
    assert (copy / "checkpoints/iter=000001/critic/model.safetensors").is_file()  # kept: the newest
