"""GSM8K end to end: raw {question, answer} JSONL is ingested as verl's preprocessing writes it, the
parquet verl's preprocessing produces gives the same prompts table, the whole train set ingests
without a reject, and openai/gsm8k rows are scored by the configured extraction method."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ppoflow.conf import load_config
from ppoflow.engine.tiny import build_tiny_tokenizer
from ppoflow.tasks.models.host import ModelHost
from ppoflow.tasks.pipeline.plan import run_settings
from ppoflow.tasks.pipeline.run import Run
from ppoflow.tasks.pipeline.states import ModelState
from ppoflow.tasks.stages.prompts import prompts
from ppoflow.tasks.stages.rewards import score_rows
from tests.conftest import gsm8k_file
from tests.tasks.stages.test_ingest import DATA as INGEST

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# The tiny tokenizer is one token per character and the longest GSM8K question is 985 characters.
DATA = replace(INGEST, max_prompt_length=2048, max_reject_fraction=0.0)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
# verl's examples/data_preprocess/gsm8k.py output, as `datasets` writes it (struct fields sorted).
VERL_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
        (
            "extra_info",
            pa.struct(
                [
                    ("answer", pa.string()),
                    ("index", pa.int64()),
                    ("question", pa.string()),
                    ("split", pa.string()),
                ]
            ),
        ),
    ]
)


@pytest.fixture(scope="module")
def tokenizer_state(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chat-tokenizer")
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return ModelState(role="actor", lineage="test", step=0, checkpoint=str(directory))


def gsm8k_lines(name: str, limit: int | None = None) -> list[str]:
    path = gsm8k_file(name)
    lines = path.read_text().splitlines()
    return lines[:limit] if limit else lines


def write_lines(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def ingest(tmp_path, state, source: str, split="train", run="run", **data):
    result = prompts.fn(
        run=Run(str(tmp_path / run), models=ModelHost()),
        files=source,
        split=split,
        source_digest="t",
        data=replace(DATA, **data),
        tokenizer_state=state,
    )
    return result, pq.read_table(tmp_path / run / f"data/{split}.parquet").to_pylist()


def verl_parquet(path: Path, lines: list[str], split: str = "train") -> str:
    """What verl's preprocessing writes for these raw rows of GSM8K's `split` ("train" or "test"),
    built here independently of ppoflow."""
    records = []
    for index, line in enumerate(lines):
        raw = json.loads(line)
        records.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"content": raw["question"] + " " + INSTRUCTION, "role": "user"}],
                "ability": "math",
                "reward_model": {
                    "ground_truth": raw["answer"].split("#### ")[1].replace(",", ""),
                    "style": "rule",
                },
                "extra_info": {
                    "answer": raw["answer"],
                    "index": index,
                    "question": raw["question"],
                    "split": split,
                },
            }
        )
    pq.write_table(pa.Table.from_pylist(records, schema=VERL_SCHEMA), path)
    return str(path)


def test_raw_jsonl_becomes_verls_gsm8k_rows(tmp_path, tokenizer_state):
    lines = gsm8k_lines("train.jsonl", 50)
    result, rows = ingest(tmp_path, tokenizer_state, write_lines(tmp_path / "train.jsonl", lines))
    assert result.value("rows") == 50 and result.value("rejected") == 0
    assert [r["prompt_id"] for r in rows] == [f"train-{i}" for i in range(50)]
    first = json.loads(lines[0])
    assert first["question"].startswith("Natalia sold clips")
    row = rows[0]
    assert (row["data_source"], row["ability"], row["prompt_text"]) == ("openai/gsm8k", "math", None)
    assert row["prompt_messages"] == [{"role": "user", "content": first["question"] + " " + INSTRUCTION}]
    assert row["ground_truth"] == "72"
    assert json.loads(row["extra_info"]) == {
        "split": "train",
        "index": 0,
        "answer": first["answer"],
        "question": first["question"],
    }


def test_the_val_split_and_a_raw_row_without_an_answer(tmp_path, tokenizer_state):
    lines = gsm8k_lines("test.jsonl", 3) + [json.dumps({"question": "How many?", "answer": "Five."})]
    source = write_lines(tmp_path / "test.jsonl", lines)
    with pytest.raises(ValueError, match="1 of 4 rows .* rejected"):
        ingest(tmp_path, tokenizer_state, source, split="val")
    reasons = pq.read_table(tmp_path / "run/data/rejects_val.parquet").to_pylist()
    assert [(r["line"], r["reason"]) for r in reasons] == [
        (4, "raw GSM8K row: the GSM8K answer has no '#### <number>' line")
    ]
    lines = lines[:3]
    _, rows = ingest(tmp_path, tokenizer_state, write_lines(tmp_path / "test.jsonl", lines), split="val")
    assert [r["prompt_id"] for r in rows] == ["val-0", "val-1", "val-2"]
    assert {json.loads(r["extra_info"])["split"] for r in rows} == {"test"}  # verl's name of the split
    assert {r["split"] for r in rows} == {"val"}  # ingest's


def test_raw_rows_with_an_empty_question_or_no_answer_number_are_rejected(tmp_path, tokenizer_state):
    """The instruction is appended to the question, so an empty question must be caught before."""
    answer = "She has 2 + 3 = 5 apples.\n#### 5"
    rows = [
        {"question": "", "answer": answer},
        {"question": " \n\t", "answer": answer},
        {"question": True, "answer": answer},
        {"question": ["How many?"], "answer": answer},
        {"question": "How many?", "answer": 5},
        {"question": "How many?", "answer": None},
        {"question": "How many?", "answer": "  "},
        {"question": "How many?", "answer": "#### ,"},
        {"question": "How many?", "answer": "#### ."},
        {"question": "How many?", "answer": "#### -"},
        {"question": "How many?", "answer": answer},
    ]
    source = write_lines(tmp_path / "train.jsonl", [json.dumps(row) for row in rows])
    result, kept = ingest(tmp_path, tokenizer_state, source, max_reject_fraction=1.0)
    no_number = "raw GSM8K row: the answer's '####' line has no number"
    reasons = pq.read_table(tmp_path / "run/data/rejects_train.parquet").to_pylist()
    assert [(r["line"], r["reason"]) for r in reasons] == [
        (1, "raw GSM8K row: empty question"),
        (2, "raw GSM8K row: empty question"),
        (3, "raw GSM8K row: question must be a string, got a JSON boolean"),
        (4, "raw GSM8K row: question must be a string, got a JSON array"),
        (5, "raw GSM8K row: answer must be a string, got a JSON number"),
        (6, "raw GSM8K row: answer must be a string, got a JSON null"),
        (7, "raw GSM8K row: the GSM8K answer has no '#### <number>' line"),
        (8, no_number),
        (9, no_number),
        (10, "raw GSM8K row: the GSM8K answer has no '#### <number>' line"),
    ]
    assert result.value("rejected") == 10
    assert [(r["prompt_id"], r["ground_truth"]) for r in kept] == [("train-10", "5")]


def test_raw_rows_with_a_lone_surrogate_are_rejected_naming_the_field(tmp_path, tokenizer_state):
    # json reads the escape \ud800 as a lone surrogate, which the prompts table cannot encode.
    answer = "She has 2 + 3 = 5 apples.\n#### 5"
    rows = [
        {"question": "How many\ud800?", "answer": answer},
        {"question": "How many?", "answer": answer.replace("She", "\udfffShe")},
        {"question": "How many?", "answer": answer},
    ]
    source = write_lines(tmp_path / "train.jsonl", [json.dumps(row) for row in rows])
    result, kept = ingest(tmp_path, tokenizer_state, source, max_reject_fraction=1.0)
    reasons = pq.read_table(tmp_path / "run/data/rejects_train.parquet").to_pylist()
    assert [(r["line"], r["reason"]) for r in reasons] == [
        (1, "not valid Unicode: lone surrogate in question"),
        (2, "not valid Unicode: lone surrogate in answer"),
    ]
    assert [(r["prompt_id"], r["ground_truth"]) for r in kept] == [("train-2", "5")]


def test_verl_parquet_gives_the_same_prompts_as_raw_jsonl(tmp_path, tokenizer_state):
    lines = gsm8k_lines("train.jsonl", 20)
    _, from_jsonl = ingest(tmp_path, tokenizer_state, write_lines(tmp_path / "train.jsonl", lines), run="a")
    _, from_parquet = ingest(
        tmp_path, tokenizer_state, verl_parquet(tmp_path / "train.parquet", lines), run="b"
    )
    assert pq.read_schema(tmp_path / "train.parquet").names == [
        "data_source",
        "prompt",
        "ability",
        "reward_model",
        "extra_info",
    ]
    assert len(from_parquet) == len(from_jsonl) == 20
    for a, b in zip(from_jsonl, from_parquet, strict=True):
        assert json.loads(a.pop("extra_info")) == json.loads(b.pop("extra_info"))
        assert a == b


def test_the_val_split_is_the_same_table_from_raw_jsonl_and_verls_test_parquet(tmp_path, tokenizer_state):
    """verl's test.parquet says extra_info.split = "test"; the raw test.jsonl ingested as the val split
    must give the very same prompts table."""
    lines = gsm8k_lines("test.jsonl", 20)
    source = write_lines(tmp_path / "test.jsonl", lines)
    _, from_jsonl = ingest(tmp_path, tokenizer_state, source, split="val", run="a")
    parquet = verl_parquet(tmp_path / "test.parquet", lines, split="test")
    _, from_parquet = ingest(tmp_path, tokenizer_state, parquet, split="val", run="b")
    assert len(from_jsonl) == 20 and from_jsonl == from_parquet
    assert {json.loads(r["extra_info"])["split"] for r in from_parquet} == {"test"}
    table = "data/val.parquet"
    assert pq.read_table(tmp_path / "a" / table).equals(pq.read_table(tmp_path / "b" / table))


def test_the_whole_train_set_ingests_without_rejects(tmp_path, tokenizer_state):
    lines = gsm8k_lines("train.jsonl")
    result, rows = ingest(tmp_path, tokenizer_state, write_lines(tmp_path / "train.jsonl", lines))
    assert len(rows) == result.value("rows") == 7473 and result.value("rejected") == 0
    assert not (tmp_path / "run/data/rejects_train.parquet").exists()
    final_lines = [json.loads(r["extra_info"])["answer"].split("#### ")[1] for r in rows]
    with_commas = [
        (line, r["ground_truth"]) for line, r in zip(final_lines, rows, strict=True) if "," in line
    ]
    assert len(with_commas) > 10 and all(truth == line.replace(",", "") for line, truth in with_commas)


def test_gsm8k_rows_are_scored_by_the_configured_method(tmp_path, tokenizer_state):
    lines = gsm8k_lines("train.jsonl", 5)
    _, rows = ingest(tmp_path, tokenizer_state, write_lines(tmp_path / "train.jsonl", lines))
    prompts = {r["prompt_id"]: r for r in rows}
    answers = [json.loads(line)["answer"] for line in lines]
    responses = [
        answers[0],
        answers[1].replace("####", "so"),
        f"#### {rows[2]['ground_truth']}0",
        "no answer",
    ]
    generated = [
        {"prompt_id": f"train-{i}", "sample_idx": 0, "data_source": "openai/gsm8k", "response_text": text}
        for i, text in enumerate(responses)
    ]
    scores = {}
    for method in ("strict", "flexible"):
        reward = run_settings(load_config(None, [f"reward.gsm8k_method={method}"]), 1).reward
        assert reward.gsm8k_method == method
        table = score_rows(generated, prompts, reward).to_pylist()
        assert [r["error"] for r in table] == [None] * 4
        scores[method] = [round(r["score"], 6) for r in table]
    # default weights {correctness: 0.9, format: 0.1}: correct 1.0, extracted but wrong 0.1, none 0
    assert scores == {"strict": [1.0, 0.0, 0.1, 0.0], "flexible": [1.0, 1.0, 0.1, 0.0]}
    defaults = run_settings(load_config(None, []), 1).reward
    assert defaults.gsm8k_method == "strict"
