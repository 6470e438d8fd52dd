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


def test_further_batches_draw_each_prompt_once_a_pass_and_never_a_kept_one():
    """10 prompts, the step's own batch rows 0–3, batches of 4: the first pass draws the 6 others
    (4 then 2), each once; the next pass draws again only the rows not kept; a pass that keeps nothing
    ends the draws; the same seed and step draw the same rows."""
    from ppoflow.tasks.stages.dynamic_sampling import PromptDraws

    draws = PromptDraws(10, [0, 1, 2, 3], seed=7, step=3)
    first, second = draws.next(4, kept={1}), draws.next(4, kept={1})
    assert len(first) == 4 and len(second) == 2
    assert sorted(first + second) == [4, 5, 6, 7, 8, 9] and draws.pass_number == 0
    kept = {1, first[0], second[0]}
    again = draws.next(4, kept)  # pass 1: every row but the kept ones
    assert draws.pass_number == 1 and len(again) == 4 and not set(again) & kept
    rest = draws.next(4, kept) + draws.next(4, kept)
    assert sorted(again + rest) == sorted(set(range(10)) - kept)
    assert draws.next(4, kept) == []  # pass 1 kept nothing more: no pass 2
    replay = PromptDraws(10, [0, 1, 2, 3], seed=7, step=3)
    assert replay.next(4, kept={1}) == first
    assert PromptDraws(10, [0, 1, 2, 3], seed=7, step=4).next(6, kept=set()) != first + second
