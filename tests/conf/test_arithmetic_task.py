"""The shipped real-model task (data/arithmetic, conf/arithmetic_smollm2.yaml): its files are what
generate.py writes, validation holds out sums that training never shows, every row ingests as a
GSM8K-scored prompt, and the config finds its data from any directory."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from ppoflow.conf import load_config
from ppoflow.engine.gsm8k import compute_score
from ppoflow.tasks.stages.prompt_rows import prompt_row

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data" / "arithmetic"


def rows(split: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / f"{split}.jsonl").read_text().splitlines()]


def operands(row: dict) -> tuple[int, int]:
    content = row["prompt"][0]["content"]  # "Calculate a + b. Format: …"
    a, b = content.removeprefix("Calculate ").split(".")[0].split(" + ")
    return int(a), int(b)


def test_the_shipped_files_are_what_generate_writes(tmp_path):
    spec = importlib.util.spec_from_file_location("generate", DATA / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    generate.write(tmp_path)
    for split in ("train", "test"):
        assert (tmp_path / f"{split}.jsonl").read_bytes() == (DATA / f"{split}.jsonl").read_bytes(), split


def test_validation_holds_out_sums_that_training_never_shows():
    train = {operands(row) for row in rows("train")}
    test = {operands(row) for row in rows("test")}
    assert len(train) == 60 and len(test) == 40 and not train & test
    assert train | test == {(a, b) for a in range(10) for b in range(10)}


def test_every_row_ingests_as_a_gsm8k_prompt_scored_by_its_sum():
    for split in ("train", "test"):
        for position, record in enumerate(rows(split)):
            row = prompt_row(record, "prompt", split, position)
            a, b = operands(record)
            assert row["data_source"] == "openai/gsm8k" and row["ground_truth"] == str(a + b)
            assert row["prompt_messages"][0]["role"] == "user"
            # The answer the prompt asks for scores 1 under verl's strict rule; another number 0.
            assert compute_score(f"{a} + {b} = {a + b}\n#### {a + b}", row["ground_truth"]) == 1.0
            assert compute_score(f"{a} + {b} = {a + b + 1}\n#### {a + b + 1}", row["ground_truth"]) == 0.0


def test_the_config_finds_the_shipped_data_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(REPO / "conf" / "arithmetic_smollm2.yaml", check_paths=False)
    assert cfg.data.train_files == str(DATA / "train.jsonl")
    assert cfg.data.val_files == str(DATA / "test.jsonl")
    assert cfg.actor_rollout_ref.model.path == "builtin:smollm2-135m-instruct"
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.actor_rollout_ref.rollout.n == 8
