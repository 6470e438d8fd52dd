"""Atomic artifacts: round trips, digests, failures that leave nothing behind, manifests."""

import errno
import hashlib
import os
import pickle

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ppoflow.tasks.storage import manifests, regular_files, tables
from ppoflow.tasks.storage.manifests import read_manifest, stage_refs, write_manifest
from ppoflow.tasks.storage.schemas import SCHEMAS
from ppoflow.tasks.storage.tables import (
    COMPRESS_FROM_BYTES,
    ArtifactCorrupt,
    ArtifactRef,
    artifact_is_valid,
    file_digest,
    iteration_dir,
    read_json,
    read_table,
    stage_path,
    write_json_atomic,
    write_table,
)
from tests.conftest import try_lock

REL = "iter=000001/actor_update/part-00000.parquet"


def actor_steps(loss: float = 0.5, rows: int = 2) -> pa.Table:
    """Loosely typed (int64 ints, no kl_loss typing) so that conforming has work to do."""
    return pa.table(
        {
            "epoch": [0] * rows,
            "mini_batch": list(range(rows)),
            **{c: [loss] * rows for c in ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")},
            **{c: [loss] * rows for c in ("entropy", "grad_norm", "lr")},
            "kl_loss": [None] * rows,
            "other_metrics": pa.array([[] for _ in range(rows)], pa.map_(pa.string(), pa.float64())),
        }
    )


def leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_write_read_round_trip_conforms_to_the_schema(tmp_path):
    ref = write_table(actor_steps(), tmp_path, REL, schema=SCHEMAS["actor_update"])
    assert ref == ArtifactRef(path=REL, digest=file_digest(tmp_path / REL), rows=2)
    assert ref.digest == "sha256:" + hashlib.sha256((tmp_path / REL).read_bytes()).hexdigest()
    table = read_table(tmp_path, ref)
    assert table.schema.equals(SCHEMAS["actor_update"])
    assert table.schema.field("pg_loss").metadata[b"doc"]  # docs travel inside the parquet
    assert table.column("mini_batch").to_pylist() == [0, 1]
    assert pq.ParquetFile(tmp_path / REL).metadata.row_group(0).column(0).compression == "UNCOMPRESSED"
    assert leftovers(tmp_path / "iter=000001/actor_update") == []
    assert pickle.loads(pickle.dumps(ref)) == ref


def test_tables_from_64_kib_are_compressed_with_zstd(tmp_path):
    small, large = actor_steps(rows=300), actor_steps(rows=1000)
    assert small.nbytes < COMPRESS_FROM_BYTES <= large.nbytes
    for name, table in (("small", small), ("large", large)):
        ref = write_table(table, tmp_path, f"{name}.parquet", SCHEMAS["actor_update"])
        assert read_table(tmp_path, ref).column("mini_batch").to_pylist() == list(range(table.num_rows))
    codec = {
        n: pq.ParquetFile(tmp_path / f"{n}.parquet").metadata.row_group(0).column(2).compression
        for n in ("small", "large")
    }
    assert codec == {"small": "UNCOMPRESSED", "large": "ZSTD"}


def test_refs_are_relative_so_a_moved_run_still_reads(tmp_path):
    ref = write_table(actor_steps(), tmp_path / "a", REL)
    (tmp_path / "a").rename(tmp_path / "b")
    assert read_table(tmp_path / "b", ref).num_rows == 2
    assert artifact_is_valid(tmp_path / "b", ref)


def test_same_table_gives_the_same_digest(tmp_path):
    first = write_table(actor_steps(), tmp_path, REL, SCHEMAS["actor_update"])
    again = write_table(actor_steps(), tmp_path, "other/x.parquet", SCHEMAS["actor_update"])
    assert first.digest == again.digest


def _fail_in_writer(exc):
    def writer(table, where, **kwargs):
        where.write(b"PAR1 half a file")
        raise exc

    return ("pyarrow.parquet.write_table", writer)


def _fail_in(name, exc):
    def fail(*args, **kwargs):
        raise exc

    return (name, fail)


@pytest.mark.parametrize(
    "make_exc",
    [lambda: OSError(errno.ENOSPC, "No space left on device"), lambda: PermissionError("denied")],
    ids=["ENOSPC", "PermissionError"],
)
@pytest.mark.parametrize("where", ["writer", "replace"])
def test_a_failed_write_leaves_the_previous_file_and_no_temp_file(tmp_path, monkeypatch, where, make_exc):
    good = write_table(actor_steps(0.5), tmp_path, REL, SCHEMAS["actor_update"])
    exc = make_exc()
    target, fake = {
        "writer": _fail_in_writer(exc),
        "replace": _fail_in("os.replace", exc),
    }[where]
    monkeypatch.setattr(target, fake)
    with pytest.raises(type(exc)) as raised:
        write_table(actor_steps(9.0), tmp_path, REL, SCHEMAS["actor_update"])
    monkeypatch.undo()
    assert str(tmp_path / REL) in str(raised.value)
    if isinstance(exc, OSError) and exc.errno:
        assert raised.value.errno == errno.ENOSPC
    assert leftovers(tmp_path / "iter=000001/actor_update") == []
    assert artifact_is_valid(tmp_path, good)
    assert read_table(tmp_path, good).column("pg_loss").to_pylist() == [0.5, 0.5]


def test_a_failed_first_write_leaves_no_final_file(tmp_path, monkeypatch):
    monkeypatch.setattr(*_fail_in("os.replace", OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(OSError, match="part-00000.parquet"):
        write_table(actor_steps(), tmp_path, REL)
    monkeypatch.undo()
    assert not (tmp_path / REL).exists()
    assert leftovers(tmp_path / "iter=000001/actor_update") == []


def test_json_write_failure_leaves_the_old_json(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    write_json_atomic(path, {"step": 1})
    monkeypatch.setattr(*_fail_in("os.replace", PermissionError("denied")))
    with pytest.raises(PermissionError, match="state.json"):
        write_json_atomic(path, {"step": 2})
    monkeypatch.undo()
    assert read_json(path) == {"step": 1}
    assert leftovers(tmp_path) == []


def test_digest_check_catches_a_truncated_file(tmp_path):
    ref = write_table(actor_steps(), tmp_path, REL)
    data = (tmp_path / REL).read_bytes()
    (tmp_path / REL).write_bytes(data[: len(data) // 2])
    assert not artifact_is_valid(tmp_path, ref)
    with pytest.raises(ArtifactCorrupt) as raised:
        read_table(tmp_path, ref)
    err = raised.value
    assert isinstance(err, ValueError)
    assert (err.expected, err.actual) == (ref.digest, file_digest(tmp_path / REL))
    assert str(tmp_path / REL) in str(err) and "corrupt" in str(err)
    assert pickle.loads(pickle.dumps(err)).actual == err.actual


def test_digest_check_catches_a_flipped_byte(tmp_path):
    ref = write_table(actor_steps(), tmp_path, REL)
    data = bytearray((tmp_path / REL).read_bytes())
    data[len(data) // 3] ^= 0x01
    (tmp_path / REL).write_bytes(bytes(data))
    assert not artifact_is_valid(tmp_path, ref)
    with pytest.raises(ArtifactCorrupt, match="expected sha256:"):
        read_table(tmp_path, ref)


def test_a_missing_file_is_invalid_not_an_error(tmp_path):
    ref = ArtifactRef(path=REL, digest="sha256:00", rows=1)
    assert artifact_is_valid(tmp_path, ref) is False
    with pytest.raises(FileNotFoundError):
        read_table(tmp_path, ref)


def test_conform_names_missing_and_unexpected_columns(tmp_path):
    table = actor_steps().drop_columns(["lr", "entropy"]).append_column("surprise", pa.array([1, 2]))
    with pytest.raises(ValueError) as raised:
        write_table(table, tmp_path, REL, SCHEMAS["actor_update"])
    message = str(raised.value)
    assert "missing columns ['entropy', 'lr']" in message
    assert "unexpected columns ['surprise']" in message
    assert "actor_update" in message and str(tmp_path / REL) in message
    assert not (tmp_path / REL).exists()


def test_conform_names_a_column_that_cannot_be_cast_or_has_nulls(tmp_path):
    bad_type = actor_steps().set_column(0, "epoch", pa.array(["zero", "one"]))
    with pytest.raises(ValueError, match="column 'epoch': cannot cast string to int32"):
        write_table(bad_type, tmp_path, REL, SCHEMAS["actor_update"])
    nulls = actor_steps().set_column(2, "pg_loss", pa.array([None, 1.0]))
    with pytest.raises(ValueError, match="column 'pg_loss' is required"):
        write_table(nulls, tmp_path, REL, SCHEMAS["actor_update"])


def test_paths_must_stay_inside_the_run_and_iter_is_reserved(tmp_path):
    for bad in ("/abs/x.parquet", "../x.parquet", ""):
        with pytest.raises(ValueError, match="relative"):
            write_table(actor_steps(), tmp_path, bad)
    with pytest.raises(ValueError, match="'iter'"):
        write_table(pa.table({"iter": [1]}), tmp_path, REL)


def test_layout_helpers():
    assert stage_path(1, "rollouts") == "iter=000001/rollouts/part-00000.parquet"
    assert stage_path(12, "rewards", part=3) == "iter=000012/rewards/part-00003.parquet"
    assert iteration_dir("/r", 7).as_posix() == "/r/iter=000007"
    with pytest.raises(ValueError):
        stage_path(-1, "rollout")
    with pytest.raises(ValueError):
        stage_path(1, "roll/out")


def test_manifest_round_trip(tmp_path):
    assert read_manifest(tmp_path, 1) is None
    ref = write_table(actor_steps(), tmp_path, REL, SCHEMAS["actor_update"])
    stage = {"refs": [ref], "rows": 2, "cache_key": "abc", "seconds": 0.25, "extra": "kept"}
    write_manifest(tmp_path, 1, {"actor_update": stage})
    manifest = read_manifest(tmp_path, 1)
    assert manifest["iteration"] == 1
    assert manifest["stages"]["actor_update"]["refs"] == [ref.to_dict()]
    assert manifest["stages"]["actor_update"]["extra"] == "kept"
    assert stage_refs(manifest, "actor_update") == [ref]
    assert (iteration_dir(tmp_path, 1) / manifests.MANIFEST_NAME).is_file()
    assert leftovers(iteration_dir(tmp_path, 1)) == []


def test_manifest_entries_must_be_complete(tmp_path):
    with pytest.raises(ValueError, match=r"stage 'reward' lacks \['cache_key', 'seconds'\]"):
        write_manifest(tmp_path, 1, {"reward": {"refs": [], "rows": 0}})
    assert read_manifest(tmp_path, 1) is None


def test_json_is_readable_and_permissions_follow_the_umask(tmp_path):
    path = tmp_path / "nested" / "config.json"
    write_json_atomic(path, {"b": [1, 2], "a": tmp_path})
    assert read_json(path) == {"a": str(tmp_path), "b": [1, 2]}
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_fifo_under_an_artifacts_name_is_an_error_not_a_hang(tmp_path):
    fifo = tmp_path / "part-00000.parquet"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        file_digest(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        tables.read_json(fifo)
    assert not tables.artifact_is_valid(tmp_path, ArtifactRef("part-00000.parquet", "sha256:00", 1))


def test_nothing_is_deleted_through_a_link_below_the_root(tmp_path):
    victim = tmp_path / "outside/iter=000000/actor"
    victim.mkdir(parents=True)
    (victim / "keep.txt").write_text("precious")
    root = tmp_path / "run/checkpoints"
    root.mkdir(parents=True)
    (root / "iter=000000").symlink_to(tmp_path / "outside/iter=000000")
    assert regular_files.leads_outside(root, root / "iter=000000/actor")
    with pytest.raises(OSError, match="refusing to delete through a link"):
        regular_files.remove_from_run(root, root / "iter=000000/actor")
    assert (victim / "keep.txt").read_text() == "precious"
    moved = tmp_path / "bigger-disk"  # the root itself may be a link: checkpoints moved elsewhere
    (moved / "iter=000001/actor").mkdir(parents=True)
    (tmp_path / "run/linked").symlink_to(moved)
    assert not regular_files.leads_outside(tmp_path / "run/linked", tmp_path / "run/linked/iter=000001/actor")
    regular_files.remove_from_run(tmp_path / "run/linked", tmp_path / "run/linked/iter=000001/actor")
    assert not (moved / "iter=000001/actor").exists()


def test_nothing_is_written_through_a_link_below_the_run(tmp_path):
    """A folder of the run replaced by a link elsewhere: a table, a manifest, a checkpoint or a
    trainer state that would be written into it is refused, naming the link, and nothing lands
    outside. The run directory (or its checkpoints folder) may itself be a link."""
    from ppoflow.tasks.pipeline.run import RunFiles
    from ppoflow.tasks.pipeline.states import TrainState
    from ppoflow.tasks.pipeline.trainer_state import record_trainer_state
    from ppoflow.tasks.storage.checkpoints import write_checkpoint

    outside = tmp_path / "outside"
    outside.mkdir()
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "iter=000001").symlink_to(outside)
    (run / "checkpoints/iter=000002").symlink_to(outside)
    (outside / "actor").mkdir()  # a saved-looking step: the trainer state would be written beside it

    def fill(model_dir, optimizer_dir):
        (model_dir / "model.safetensors").write_bytes(b"weights")
        (optimizer_dir / "state.json").write_text("{}")

    link = "refusing to write through a link inside the run"
    with pytest.raises(OSError, match=link) as table:
        write_table(actor_steps(), run, "iter=000001/actor_update/part-00000.parquet")
    with pytest.raises(OSError, match=link):
        write_manifest(run, 1, {})
    with pytest.raises(OSError, match=link) as checkpoint:
        write_checkpoint(run, "critic", 2, fill)
    with pytest.raises(OSError, match=link):
        record_trainer_state(RunFiles(str(run)), 2, TrainState(None, None, None, 0.0), {})
    assert table.value.filename == str(run / "iter=000001")
    assert checkpoint.value.filename == str(run / "checkpoints/iter=000002")
    assert sorted(p.name for p in outside.iterdir()) == ["actor"]
    (tmp_path / "linked-run").symlink_to(run)  # the run itself through a link: written as always
    ref = write_table(actor_steps(), tmp_path / "linked-run", "iter=000003/actor_update/part-00000.parquet")
    assert (run / ref.path).is_file()
    bigger = tmp_path / "bigger-disk"  # and its checkpoints folder moved to a larger disk
    bigger.mkdir()
    moved = tmp_path / "moved-run"
    moved.mkdir()
    (moved / "checkpoints").symlink_to(bigger)
    relative, _, _ = write_checkpoint(moved, "critic", 3, fill)
    assert (bigger / "iter=000003/critic/model.safetensors").read_bytes() == b"weights"
    assert relative == "checkpoints/iter=000003/critic"


def test_a_run_directory_that_cannot_be_made_is_named_with_its_keys(tmp_path):
    (tmp_path / "a-file").write_text("in the way")
    named = r"Not a directory; cannot make the run directory \(trainer.default_local_dir"
    with pytest.raises(NotADirectoryError, match=named):
        regular_files.make_run_directory(tmp_path / "a-file/run")


def test_a_linked_results_folder_stops_the_run_before_it_writes(tmp_path):
    from ppoflow.tasks.models.host import ModelHost
    from ppoflow.tasks.pipeline.run import open_run

    outside, run = tmp_path / "outside", tmp_path / "run"
    outside.mkdir()
    run.mkdir()
    (run / ".lock").touch()  # a run directory (see test_a_folder_of_other_files_is_no_run_directory)
    (run / ".prefect-results").symlink_to(outside)
    with pytest.raises(OSError, match="stage results are kept in a folder of the run, not a link"):
        open_run(run, "trainer: {}\n", ModelHost())
    assert not (run / "config.yaml").exists() and try_lock(run)  # nothing written, not left locked


def test_a_folder_of_other_files_is_no_run_directory(tmp_path):
    """A run replaces data/train.parquet, model/, config.yaml and deletes .*.tmp files below it: a
    folder that holds files but never had a run's lock file is refused before anything is written."""
    from ppoflow.tasks.models.host import ModelHost
    from ppoflow.tasks.pipeline.run import close_run, open_run
    from ppoflow.tasks.storage.lock import NotARunDirectory

    folder = tmp_path / "project"
    (folder / "data").mkdir(parents=True)
    (folder / "data/train.parquet").write_bytes(b"the user's data")
    (folder / "notes").mkdir()
    (folder / "notes/.draft.tmp").write_text("a draft")
    with pytest.raises(NotARunDirectory, match="holds files .* and is not a ppoflow run directory"):
        open_run(folder, "trainer: {}\n", ModelHost())
    assert sorted(p.name for p in folder.rglob("*")) == [".draft.tmp", "data", "notes", "train.parquet"]
    assert (folder / "data/train.parquet").read_bytes() == b"the user's data"
    empty = tmp_path / "empty"
    empty.mkdir()
    # a new or empty folder is taken, and again as a run
    close_run(open_run(empty, "trainer: {}\n", ModelHost()))
    close_run(open_run(empty, "trainer: {}\n", ModelHost()))


def test_a_run_whose_lock_file_was_deleted_is_told_the_command_that_restores_it(tmp_path):
    """A run directory without .lock was refused as someone's folder, with advice to choose another.
    It is still refused (a run still open holds the deleted file: a second writer now would mix their
    files), but a folder of ppoflow's own files is named as a run and given the command that restores
    its lock; a folder that only has a config.yaml (as $HOME may) still is no run."""
    import shlex
    import subprocess

    from ppoflow.tasks.models.host import ModelHost
    from ppoflow.tasks.pipeline.run import close_run, finish_run, open_run
    from ppoflow.tasks.storage.lock import NotARunDirectory, acquire_run_lock

    run = tmp_path / "my run"  # a space: the command quotes the path
    close_run(finish_run(open_run(run, "trainer: {}\n", ModelHost())))  # its config.yaml and catalog
    (run / ".lock").unlink()
    with pytest.raises(NotARunDirectory) as refused:
        open_run(run, "trainer: {}\n", ModelHost())
    command = f"touch {shlex.quote(str(run / '.lock'))}"
    assert str(refused.value) == (
        f"{run} is a ppoflow run (config.yaml, catalog.duckdb) whose lock file .lock was deleted: if no "
        f"ppoflow process is using it, restore the lock with `{command}` and run again (a run still open "
        "holds the deleted one, and two writers would mix their files)"
    )
    subprocess.run(command, shell=True, check=True)  # the command as given, through a shell
    close_run(open_run(run, "trainer: {}\n", ModelHost()))
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.yaml").write_text("editor: vim\n")
    (home / "iter=000001").mkdir()  # a folder of that name, but no step committed in it
    with pytest.raises(NotARunDirectory, match="not a ppoflow run directory: .* choose a new or empty one"):
        open_run(home, "trainer: {}\n", ModelHost())
    (home / "config.yaml").unlink()
    (home / "catalog.duckdb").write_bytes(b"")  # without a config.yaml beside it: not ppoflow's
    with pytest.raises(NotARunDirectory, match="is not a ppoflow run directory"):
        open_run(home, "trainer: {}\n", ModelHost())
    retraining = tmp_path / "retraining"  # the retrain flow's directory: its rounds
    (retraining / "rounds" / "round=000001").mkdir(parents=True)
    with pytest.raises(NotARunDirectory, match=r"retraining is a ppoflow run \(rounds\) whose lock file"):
        acquire_run_lock(retraining)


def test_the_temp_sweep_leaves_links_and_what_they_point_at_alone(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / ".notes.abc.tmp").write_text("someone else's")
    run = tmp_path / "run"
    (run / "iter=000001/rollouts").mkdir(parents=True)
    (run / "iter=000001/rollouts/.part-00000.parquet.0a1b2c.tmp").write_bytes(b"partial")
    (run / "iter=000002").symlink_to(outside)
    (run / ".config.yaml.9f8e7d.tmp").symlink_to(outside / ".notes.abc.tmp")
    regular_files.remove_stale_temp_files(run)
    assert not (run / "iter=000001/rollouts/.part-00000.parquet.0a1b2c.tmp").exists()
    assert (outside / ".notes.abc.tmp").read_text() == "someone else's"


def test_a_checkpoint_of_another_model_is_refused_for_resume(tmp_path):
    import json

    from ppoflow.tasks.pipeline.trainer_state import ResumeRefused, _check_same_architecture

    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    for folder, layers in ((ours, 3), (theirs, 2)):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_hidden_layers": layers}))
    with pytest.raises(ResumeRefused, match="another model .*num_hidden_layers 2 there, 3 configured"):
        _check_same_architecture("trainer.resume_from_path=x", "actor", theirs, ours)
    _check_same_architecture("trainer.resume_from_path=x", "actor", ours, ours)


def test_an_optimizer_folder_with_a_pipe_a_link_or_a_dot_file_is_not_what_was_saved(tmp_path):
    """A reader would block on a planted pipe (beyond SIGTERM) or read through a link, and it takes
    every *.safetensors, dot-files too: the digest covers every entry and refuses the first two."""
    from ppoflow.tasks.storage.checkpoints import optimizer_digest

    model = tmp_path / "actor"
    optimizer = tmp_path / "actor.optim"
    optimizer.mkdir()
    (optimizer / "state.json").write_text("{}")
    recorded = optimizer_digest(model)
    (optimizer / ".c.safetensors").write_bytes(b"planted")
    assert optimizer_digest(model) != recorded
    (optimizer / ".c.safetensors").unlink()
    os.mkfifo(optimizer / "x.safetensors")
    with pytest.raises(OSError, match="x.safetensors is not a regular file"):
        optimizer_digest(model)
    (optimizer / "x.safetensors").unlink()
    (optimizer / "y.safetensors").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError, match="not a regular file"):
        optimizer_digest(model)


def test_resume_from_a_folder_without_optimizer_state_is_refused_unless_only_validating(tmp_path):
    import json

    from ppoflow.tasks.pipeline.states import ModelState, TrainState
    from ppoflow.tasks.pipeline.trainer_state import ResumeRefused, resume_state

    folder = tmp_path / "checkpoints/iter=000001"
    (folder / "actor").mkdir(parents=True)
    (folder / "actor/config.json").write_text("{}")
    record = {"global_step": 1, "kl_coef": 0.1, "critic": None}
    record["actor"] = {"lineage": "l", "step": 1, "digest": "d", "checkpoint": str(folder / "actor")}
    (folder / "trainer_state.json").write_text(json.dumps(record))
    initial = TrainState(ModelState("actor", "base", 0, None), None, None, 0.05)
    with pytest.raises(ResumeRefused, match="actor optimizer state is not there"):
        resume_state(folder, initial, run_dir=tmp_path)
    step, state = resume_state(folder, initial, run_dir=tmp_path, train=False)
    assert step == 2 and state.actor.checkpoint == str(folder / "actor") and state.kl_coef == 0.1
    moved = tmp_path / "moved"
    (tmp_path / "checkpoints").rename(moved)  # found beside trainer_state.json after a move
    _, state = resume_state(moved / "iter=000001", initial, run_dir=tmp_path, train=False)
    assert state.actor.checkpoint == str(moved / "iter=000001/actor")
    (moved / "iter=000001/trainer_state.json").write_text("[1]")
    with pytest.raises(ValueError, match="trainer_state.json is not a ppoflow trainer state"):
        resume_state(moved / "iter=000001", initial, run_dir=tmp_path)


def test_the_io_clock_adds_each_call_to_its_kind(tmp_path):
    clock = tables.IOClock()
    ref = write_table(actor_steps(), tmp_path, REL, clock=clock)
    read_table(tmp_path, ref, clock=clock)
    write_json_atomic(tmp_path / "x.json", {"a": 1}, clock=clock)
    assert set(clock.by_kind) == {"tables"}
    assert clock.by_kind["tables"] == clock.seconds > 0
    with clock.timing("checkpoints"):
        pass
    assert set(clock.by_kind) == {"tables", "checkpoints"}
    assert clock.seconds == pytest.approx(sum(clock.by_kind.values()))


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_checkpoint_files_are_readable_as_the_umask_allows(tmp_path, tiny_model_dir, umask):
    """Weights and optimizer state included: safetensors writes them under a private temporary
    name (0600) and renames it into place."""
    from ppoflow.engine.models import load_actor, load_tokenizer
    from ppoflow.engine.optim import build_optimizer
    from ppoflow.tasks.pipeline.model_files import save_checkpoint
    from ppoflow.tasks.pipeline.run import RunFiles
    from ppoflow.tasks.storage.checkpoints import Trainable, optimizer_dir

    from ...engine.settings import optim_settings

    model = load_actor(tiny_model_dir)
    optimizer, scheduler = build_optimizer(model, optim_settings(lr=0.01))
    model(input_ids=torch.ones(1, 3, dtype=torch.long)).logits.sum().backward()
    optimizer.step()
    previous = os.umask(umask)
    try:
        relative, _, _ = save_checkpoint(
            RunFiles(str(tmp_path)),
            "actor",
            1,
            Trainable(model, optimizer, scheduler),
            load_tokenizer(tiny_model_dir),
        )
    finally:
        os.umask(previous)
    folder = tmp_path / relative
    files = [*folder.iterdir(), *optimizer_dir(folder).iterdir()]
    assert {"model.safetensors", "model-00001-of-00001.safetensors"} <= {f.name for f in files}
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in files} == {
        f.name: oct(0o666 & ~umask) for f in files
    }
    assert oct(folder.stat().st_mode & 0o777) == oct(0o777 & ~umask)


def test_a_model_copied_into_the_run_is_readable_as_the_umask_allows(tmp_path, tiny_model_dir):
    """model/base is a copy of the base model's folder (the ppoflow cache's, or a user's private
    one): the copy's folder and files take the umask's modes, not the source's."""
    import shutil

    from ppoflow.tasks.pipeline.run import RunFiles
    from ppoflow.tasks.stages.prepare_model import _install_copy

    private = tmp_path / "private-model"
    shutil.copytree(tiny_model_dir, private)
    private.chmod(0o700)
    for path in private.iterdir():
        path.chmod(0o600)
    copy = _install_copy(private, RunFiles(str(tmp_path / "run")), "model/base")
    umask = os.umask(0o077)
    os.umask(umask)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in [copy, *copy.iterdir()]}
    assert modes == {n: oct((0o777 if n == "base" else 0o666) & ~umask) for n in modes}
