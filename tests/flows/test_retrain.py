"""Scheduled retraining, round by round, through the real retrain and evaluate flows: new data is
taken in once, trained on from the champion, and promoted only when it validates better."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ppoflow.engine.tiny import ADDITION_DATA_SOURCE, sample_addition_problems
from ppoflow.tasks.storage.confined_query import query

# The embedded default (batch 256) for 6 iterations per round, one torch thread for exact repeats.
ROUND = {"iterations": 6, "overrides": ["trainer.num_threads=1"]}


def addition_file(path: Path, rows: int, seed: int) -> Path:
    """A data file in verl's dataset format for the built-in addition task."""
    records = [
        {
            "prompt": p.prompt,
            "data_source": ADDITION_DATA_SOURCE,
            "reward_model": {"ground_truth": p.answer},
            "extra_info": {"index": i},
        }
        for i, p in enumerate(sample_addition_problems(rows, seed=seed))
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def retrain(incoming: Path, root: Path, **params):
    from ppoflow.flows.retrain import retrain as retrain_flow

    return retrain_flow(data_dir=str(incoming), run_dir=str(root), **(ROUND | params))


def promotions(root: Path) -> list[dict]:
    columns, rows = query(root, "SELECT * FROM promotions ORDER BY round")
    return [dict(zip(columns, row, strict=True)) for row in rows]


def test_rounds_promote_only_a_better_model_and_skip_data_seen_before(
    prefect_server, tiny_model_dir, tmp_path
):
    incoming, root = tmp_path / "incoming", tmp_path / "retrain"
    incoming.mkdir()

    addition_file(incoming / "batch-1.jsonl", 512, seed=11)
    first = retrain(incoming, root)
    [row] = promotions(root)
    assert [Path(f["path"]).name for f in row["files"]] == ["batch-1.jsonl"]
    assert (row["train_rows"], row["rejected_rows"]) == (512, 0)
    assert first["decision"] == row["decision"] == "promoted", row["reason"]
    assert row["incumbent"] == "base" and row["candidate_score"] > row["champion_score"]
    assert (row["first_step"], row["last_step"]) == (1, 6)
    champion = json.loads((root / "champion.json").read_text())
    assert champion["checkpoint"] == row["candidate_checkpoint"] and champion["step"] == 6
    assert (root / "champion").resolve() == Path(champion["checkpoint"])
    assert Path(champion["actor"], "config.json").is_file()

    # The same bytes under another name, and no other file: nothing is trained.
    (incoming / "batch-1-copy.jsonl").write_bytes((incoming / "batch-1.jsonl").read_bytes())
    (incoming / ".batch-2.jsonl.partial").write_text("{not yet complete")
    # Files that cannot be taken in as data are set aside once, not failed on every night.
    (incoming / "empty.jsonl").write_text("\n")
    (incoming / "binary.jsonl").write_bytes(b"\x00\xff\xfe garbage\n\x89PNG\r\n")
    good_rows = (incoming / "batch-1.jsonl").read_text().splitlines(keepends=True)[:20]
    (incoming / "fields.jsonl").write_text('{"foo": 1}\n' * 100 + "".join(good_rows))
    second = retrain(incoming, root)
    assert second["trained"] is False and "no new data" in second["reason"]
    assert "2 file(s) seen before, 3 set aside as unusable now, 0 unreadable now" in second["reason"]
    assert len(promotions(root)) == 1 and not (root / "rounds/round=000002").exists()
    _, unusable = query(root, "SELECT path, reason FROM unusable_files ORDER BY path")
    assert [(Path(path).name, reason.split(": ", 1)[-1]) for path, reason in unusable] == [
        (
            "binary.jsonl",
            "2 of its 2 rows are not dataset rows, more than data.max_reject_fraction=0.1 (the first: "
            "not UTF-8: 'utf-8' codec can't decode byte 0xff in position 1: invalid start byte)",
        ),
        ("empty.jsonl", f"data file {incoming / 'empty.jsonl'} has no rows".split(": ", 1)[-1]),
        (
            "fields.jsonl",
            "100 of its 120 rows are not dataset rows, more than data.max_reject_fraction=0.1 (the first: "
            "missing prompt: no 'prompt' field (data.prompt_key))",
        ),
    ]
    again = retrain(incoming, root)
    assert "5 file(s), all taken in or set aside before" in again["reason"]

    # Too few new prompts for one batch (train_batch_size 256): nothing trains, the file stays new.
    addition_file(incoming / "batch-0.jsonl", 100, seed=10)
    waiting = retrain(incoming, root)
    assert waiting["trained"] is False and "hold 100 usable prompts" in waiting["reason"]
    assert "waiting for more data" in waiting["reason"] and len(promotions(root)) == 1

    addition_file(incoming / "batch-2.jsonl", 512, seed=12)
    third = retrain(incoming, root)
    rows = promotions(root)
    assert [r["round"] for r in rows] == [1, 2]
    row = rows[1]
    assert [Path(f["path"]).name for f in row["files"]] == ["batch-0.jsonl", "batch-2.jsonl"]
    assert row["train_rows"] == 612
    # It continued from the champion: steps 7..12, incumbent scored on the same validation set again.
    assert row["incumbent"] == champion["checkpoint"] and (row["first_step"], row["last_step"]) == (7, 12)
    assert row["champion_score"] == pytest.approx(champion["score"])
    expected = "promoted" if row["candidate_score"] > row["champion_score"] else "kept"
    assert third["decision"] == row["decision"] == expected
    assert (
        f"{row['candidate_score']:.4f}" in row["reason"] and f"{row['champion_score']:.4f}" in row["reason"]
    )
    files = query(root, "SELECT version, path FROM dataset_files ORDER BY version")[1]
    names = [(v, Path(p).name) for v, p in files]
    assert names == [(1, "batch-1.jsonl"), (2, "batch-0.jsonl"), (2, "batch-2.jsonl")]
    steps = query(
        root, "SELECT round, list(iter ORDER BY iter) FROM round_metrics GROUP BY round ORDER BY round"
    )
    # each round's first row is the validation of the model it starts from (verl's, at that step)
    assert steps[1] == [(1, [0, 1, 2, 3, 4, 5, 6]), (2, [6, 7, 8, 9, 10, 11, 12])]

    # evaluate validates the champion with its run's settings and gets its recorded score.
    from ppoflow.flows.evaluate import evaluate

    now = json.loads((root / "champion.json").read_text())
    assert now["round"] == (2 if expected == "promoted" else 1)
    result = evaluate(run_dir=str(root))
    assert result["checkpoint"] == now["checkpoint"] and result["step"] == now["step"]
    assert result["val_score"] == pytest.approx(now["score"])


def test_evaluate_without_a_champion_says_so(prefect_server, tmp_path):
    from ppoflow.flows.evaluate import evaluate

    with pytest.raises(FileNotFoundError, match="no champion in .* yet: run the retrain flow first"):
        evaluate(run_dir=str(tmp_path))


def test_a_training_run_or_a_copy_without_its_rounds_is_refused_before_anything_is_written(
    prefect_server, tmp_path
):
    from ppoflow.tasks.retraining.rounds import record_round

    incoming = tmp_path / "incoming"
    incoming.mkdir()
    training = tmp_path / "training"
    training.mkdir()
    (training / "config.yaml").write_text("trainer: {}\n")
    with pytest.raises(ValueError, match="is a training run directory; retraining keeps its rounds"):
        retrain(incoming, training)
    assert sorted(p.name for p in training.iterdir()) == ["config.yaml"]

    copy = tmp_path / "copy"  # promotions.parquet copied, rounds/ not
    checkpoint = copy / "rounds/round=000001/checkpoints/iter=000004"
    row = {
        "decision": "promoted", "reason": "test", "candidate_score": 0.7, "champion_score": 0.5,
        "candidate_checkpoint": str(checkpoint), "incumbent": "base", "first_step": 1, "last_step": 4,
        "train_rows": 512, "rejected_rows": 0, "flow_run_id": None,
    }  # fmt: skip
    copy.mkdir()
    (copy / ".lock").touch()  # copied with the rest
    record_round(copy, 1, [], row)
    with pytest.raises(FileNotFoundError, match=r"names \(round 1, .*iter=000004\) is not there: a copied"):
        retrain(incoming, copy)
