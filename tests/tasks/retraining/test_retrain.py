"""Retraining bookkeeping: the promotion rule, content-addressed intake, the champion pointer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ppoflow.tasks.pipeline.trainer_state import STATE_FILE
from ppoflow.tasks.retraining.evaluation import plan_evaluation
from ppoflow.tasks.retraining.rounds import (
    DataFile,
    decide,
    find_new_data,
    next_round,
    read_champion,
    record_round,
    refresh_retrain_catalog,
    round_overrides,
    round_scores,
    sync_champion_pointer,
)
from ppoflow.tasks.storage.confined_query import query


@pytest.mark.parametrize(
    ("candidate", "incumbent", "margin", "decision", "phrase"),
    [
        (0.80, 0.70, 0.0, "promoted", "better by +0.1000"),
        (0.70, 0.70, 0.0, "kept", "a tie keeps the champion"),
        (0.65, 0.70, 0.0, "kept", "a regression of -0.0500"),
        (0.72, 0.70, 0.05, "kept", "is not more than min_improvement=0.05"),
        (0.76, 0.70, 0.05, "promoted", "better by +0.0600"),
        (math.nan, 0.70, 0.0, "kept", "no validation score"),
        (None, 0.70, 0.0, "kept", "no validation score"),
    ],
)
def test_promotion_rule(candidate, incumbent, margin, decision, phrase):
    got, reason = decide(candidate, incumbent, margin)
    assert got == decision and phrase in reason


def test_the_same_score_summed_in_another_order_is_a_tie():
    candidate, incumbent = (0.1 + 0.2 + 0.3) / 3, (0.3 + 0.2 + 0.1) / 3
    assert candidate > incumbent  # by one unit in the last place
    tie = ("kept", "candidate 0.2000 vs champion 0.2000: a tie keeps the champion")
    assert decide(candidate, incumbent, 0.0) == tie
    assert decide(incumbent + 1e-6, incumbent, 0.0)[0] == "promoted"  # one more right answer in a million


def _promotion(root: Path, step: int, score: float, decision: str = "promoted") -> dict:
    checkpoint = root / f"rounds/round=000001/checkpoints/iter={step:06d}"
    (checkpoint / "actor").mkdir(parents=True, exist_ok=True)
    return {
        "decision": decision,
        "reason": "test",
        "candidate_score": score,
        "champion_score": 0.5,
        "candidate_checkpoint": str(checkpoint),
        "incumbent": "base",
        "first_step": 1,
        "last_step": step,
        "train_rows": 512,
        "rejected_rows": 0,
        "flow_run_id": None,
    }


def test_files_are_taken_in_once_by_content(tmp_path):
    data, root = tmp_path / "incoming", tmp_path / "root"
    data.mkdir()
    root.mkdir()
    (data / "a.jsonl").write_text('{"x": 1}\n')
    (data / "b.json").write_text("[]")
    (data / "notes.txt").write_text("not data")
    (data / ".c.jsonl").write_text("being written")
    new, skipped = find_new_data(data, root)
    assert [Path(f.path).name for f in new] == ["a.jsonl", "b.json"] and skipped == 0
    record_round(root, 1, new, _promotion(root, 4, 0.7))
    (data / "a-renamed.jsonl").write_bytes((data / "a.jsonl").read_bytes())
    assert find_new_data(data, root) == ([], 3)
    (data / "a.jsonl").write_text('{"x": 2}\n')  # edited in place: new content, new version
    new, skipped = find_new_data(data, root)
    assert [Path(f.path).name for f in new] == ["a.jsonl"] and skipped == 2
    assert next_round(root) == 2


def test_a_missing_data_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="retraining data folder .*nowhere does not exist"):
        find_new_data(tmp_path / "nowhere", tmp_path)


def test_the_champion_follows_the_last_promotion_and_is_repaired_from_the_table(tmp_path):
    assert read_champion(tmp_path) is None
    files = [DataFile(str(tmp_path / "f.jsonl"), "0" * 64, 10)]
    record_round(tmp_path, 1, files, _promotion(tmp_path, 4, 0.7))
    record_round(tmp_path, 2, files, _promotion(tmp_path, 8, 0.6, decision="kept"))
    champion = read_champion(tmp_path)
    assert (champion.round, champion.step, champion.score) == (1, 4, 0.7)
    pointer = json.loads((tmp_path / "champion.json").read_text())
    assert pointer["checkpoint"] == champion.checkpoint and pointer["actor"].endswith("iter=000004/actor")
    assert (tmp_path / "champion").resolve() == Path(champion.checkpoint)
    # A crash between the promotions row and the pointer: reading leaves the files alone, the next
    # retraining run (under its lock) rewrites them from the table.
    (tmp_path / "champion.json").unlink()
    (tmp_path / "champion").unlink()
    assert read_champion(tmp_path) == champion and not (tmp_path / "champion.json").exists()
    assert sync_champion_pointer(tmp_path) == champion
    assert json.loads((tmp_path / "champion.json").read_text()) == pointer
    assert (tmp_path / "champion").resolve() == Path(champion.checkpoint)
    assert not list(tmp_path.glob(".champion*"))
    files = query(tmp_path, "SELECT version, path, sha256, bytes FROM dataset_files ORDER BY version")[1]
    assert files == [
        (1, str(tmp_path / "f.jsonl"), "0" * 64, 10),
        (2, str(tmp_path / "f.jsonl"), "0" * 64, 10),
    ]
    assert query(tmp_path, "SELECT list(decision ORDER BY round) FROM promotions")[1] == [
        (["promoted", "kept"],)
    ]


def test_a_moved_or_copied_retraining_directory_continues_from_its_own_champion(tmp_path):
    first = tmp_path / "first"
    first.mkdir()
    record_round(first, 1, [], _promotion(first, 4, 0.7))
    moved = tmp_path / "elsewhere" / "rounds" / "moved"  # a path that has a folder named rounds itself
    moved.parent.mkdir(parents=True)
    first.rename(moved)
    champion = sync_champion_pointer(moved)
    assert champion.checkpoint == str(moved / "rounds/round=000001/checkpoints/iter=000004")
    assert json.loads((moved / "champion.json").read_text())["checkpoint"] == champion.checkpoint
    assert (moved / "champion").resolve() == Path(champion.checkpoint)
    overrides = round_overrides(moved, 2, [], champion, iterations=3, test_freq=0)
    assert f"trainer.resume_from_path={champion.checkpoint}" in overrides


def test_an_empty_retraining_directory_has_empty_views(tmp_path):
    (tmp_path / "rounds").mkdir()  # a round under way: nothing recorded yet
    refresh_retrain_catalog(tmp_path)
    for view in ("promotions", "dataset_files", "round_metrics"):
        assert query(tmp_path, f"SELECT count(*) FROM {view}")[1] == [(0,)]


def test_round_metrics_reads_only_the_rounds_step_folders(tmp_path):
    """A stray folder in a round (a copy, `iter=000002'`) is not read: it failed every query of the
    view with a conversion error naming no folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for folder, value in (
        ("iter=000001", 0.5),
        ("iter=000002", 0.75),
        ("iter=000002'", 9.0),
        ("iter=2", 9.0),
    ):
        metrics = tmp_path / "rounds/round=000001" / folder / "metrics"
        metrics.mkdir(parents=True)
        pq.write_table(pa.table({"step": [1], "val": [value]}), metrics / "part-00000.parquet")
    stray_round = tmp_path / "rounds/round=000001 copy/iter=000001/metrics"
    stray_round.mkdir(parents=True)
    pq.write_table(pa.table({"step": [1], "val": [9.0]}), stray_round / "part-00000.parquet")
    refresh_retrain_catalog(tmp_path)
    columns, rows = query(tmp_path, "SELECT round, iter, val FROM round_metrics ORDER BY iter")
    assert rows == [(1, 1, 0.5), (1, 2, 0.75)]


def test_round_overrides_continue_from_the_champion(tmp_path):
    record_round(tmp_path, 1, [], _promotion(tmp_path, 4, 0.7))
    champion = read_champion(tmp_path)
    files = [DataFile("/data/new.jsonl", "1" * 64, 5)]
    overrides = round_overrides(tmp_path, 2, files, champion, iterations=3, test_freq=0)
    assert f"trainer.default_local_dir={tmp_path}/rounds/round=000002" in overrides
    assert 'data.train_files=["/data/new.jsonl"]' in overrides
    assert "trainer.total_training_steps=7" in overrides and "trainer.test_freq=3" in overrides
    assert f"trainer.resume_from_path={champion.checkpoint}" in overrides
    first = round_overrides(tmp_path, 1, files, None, iterations=3, test_freq=1)
    assert "trainer.total_training_steps=3" in first and not any("resume" in o for o in first)


def test_round_scores_need_the_incumbents_validation():
    summary = {"validation": [[4, 0.7], [7, 0.8]]}
    assert round_scores(summary, 5, 7) == (0.7, 0.8)
    assert round_scores({"validation": [[4, 0.7]]}, 5, 7) == (0.7, None)
    with pytest.raises(RuntimeError, match="did not validate the incumbent at step 4"):
        round_scores({"validation": [[7, 0.8]]}, 5, 7)


def test_evaluations_of_different_models_or_settings_never_share_a_folder(tmp_path):
    checkpoint = tmp_path / "runs/a/checkpoints/iter=000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / STATE_FILE).write_text("{}")
    (tmp_path / "runs/a/config.yaml").write_text("")
    hf_dirs = [tmp_path / "x/actor", tmp_path / "y/actor"]
    for folder in hf_dirs:
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
    plan = plan_evaluation(str(checkpoint), tmp_path, None, [])
    assert plan.config_file == str(tmp_path / "runs/a/config.yaml")
    assert (
        f"trainer.resume_from_path={checkpoint}" in plan.overrides
        and "trainer.val_only=true" in plan.overrides
    )
    assert plan.run_dir.name.startswith("a-iter=000004-")
    again = plan_evaluation(str(checkpoint), tmp_path, None, [])
    other_settings = plan_evaluation(str(checkpoint), tmp_path, None, ["data.val_files=[v.jsonl]"])
    first_hf, second_hf = (plan_evaluation(str(f), tmp_path, None, []) for f in hf_dirs)
    assert again.run_dir == plan.run_dir
    assert len({plan.run_dir, other_settings.run_dir, first_hf.run_dir, second_hf.run_dir}) == 4
    assert f"actor_rollout_ref.model.path={hf_dirs[0]}" in first_hf.overrides
    with pytest.raises(FileNotFoundError, match="neither a ppoflow checkpoint folder"):
        plan_evaluation(str(tmp_path / "runs"), tmp_path, None, [])
