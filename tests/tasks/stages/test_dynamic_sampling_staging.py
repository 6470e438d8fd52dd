"""Dynamic sampling's kept generation batches (iter=N/rollouts/.generation/<key>/): read back as
written, and a batches.json that names a file anywhere else (planted, or a link) is no batch at all:
the batch is generated again, nothing outside the staging folder is read."""

import json
import os

from ppoflow.tasks.pipeline.run import RunFiles
from ppoflow.tasks.stages.dynamic_sampling import GeneratedBatch, _stage, _staged
from ppoflow.tasks.storage.schemas import SCHEMAS


def _batch() -> GeneratedBatch:
    return GeneratedBatch(SCHEMAS["rollouts"].empty_table(), None, {"gen": 1.5, "old_log_prob": 0.25})


def _staging(tmp_path):
    run = RunFiles(str(tmp_path))
    staging = tmp_path / "iter=000001/rollouts/.generation/abc"
    staging.mkdir(parents=True)
    return run, staging


def test_a_kept_batch_reads_back_as_it_was_written(tmp_path):
    run, staging = _staging(tmp_path)
    _stage(run, staging, 0, _batch())
    back = _staged(run, staging, 0)
    assert back is not None and back.rollouts.equals(_batch().rollouts) and back.turns is None
    assert back.seconds == {"gen": 1.5, "old_log_prob": 0.25}
    assert _staged(run, staging, 1) is None  # not generated yet


def test_a_batch_named_outside_its_staging_folder_is_not_read(tmp_path):
    run, staging = _staging(tmp_path)
    _stage(run, staging, 0, _batch())
    index = json.loads((staging / "batches.json").read_text())
    kept = staging / "batch-00000.parquet"
    elsewhere = tmp_path / "iter=000001/planted.parquet"
    elsewhere.write_bytes(kept.read_bytes())  # a valid table with the right digest, in another folder
    for path in (
        "iter=000001/planted.parquet",
        str(elsewhere),
        "iter=000001/rollouts/.generation/abc/../../planted.parquet",
    ):
        index["0"]["rollouts"]["path"] = path
        (staging / "batches.json").write_text(json.dumps(index))
        assert _staged(run, staging, 0) is None, path


def test_a_link_in_the_staging_folder_is_not_followed(tmp_path):
    run, staging = _staging(tmp_path)
    _stage(run, staging, 0, _batch())
    kept = staging / "batch-00000.parquet"
    outside = tmp_path / "outside.parquet"
    os.replace(kept, outside)
    kept.symlink_to(outside)
    assert _staged(run, staging, 0) is None


def test_a_damaged_index_is_no_batch(tmp_path):
    run, staging = _staging(tmp_path)
    _stage(run, staging, 0, _batch())
    for text in ("[]", "{", '{"0": 3}', '{"0": {"rollouts": {"path": 1}}}', "null"):
        (staging / "batches.json").write_text(text)
        assert _staged(run, staging, 0) is None, text
