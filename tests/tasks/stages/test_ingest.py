"""Ingest: every bad row goes to the rejects table with its file, line and reason; good rows all
arrive, in input order, with stable ids; the run fails only past data.max_reject_fraction."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ppoflow.engine.tiny import build_tiny_tokenizer
from ppoflow.tasks.models.host import ModelHost
from ppoflow.tasks.pipeline.run import Run
from ppoflow.tasks.pipeline.settings import IngestSettings
from ppoflow.tasks.pipeline.states import ModelState
from ppoflow.tasks.stages.prompts import prompts
from ppoflow.tasks.storage.catalog import refresh_catalog
from ppoflow.tasks.storage.confined_query import query

DATA = IngestSettings(
    prompt_key="prompt",
    reward_fn_key="data_source",
    max_prompt_length=16,
    truncation="error",
    filter_overlong_prompts=False,
    max_reject_fraction=1.0,
    max_samples=-1,
)


def good(prompt="1 + 2 = ", truth="3", **extra) -> dict:
    return {"prompt": prompt, "data_source": "sums", "reward_model": {"ground_truth": truth}, **extra}


def write_jsonl(path, lines) -> str:
    """Lines are dicts (dumped), str (written as is) or bytes (written raw)."""
    blobs = [
        json.dumps(x).encode() if isinstance(x, dict) else x if isinstance(x, bytes) else x.encode()
        for x in lines
    ]
    path.write_bytes(b"\n".join(blobs) + b"\n")
    return str(path)


def ingest(tmp_path, state, files, split="train", **data):
    run = Run(str(tmp_path / "run"), models=ModelHost())
    result = prompts.fn(
        run=run,
        files=files,
        split=split,
        source_digest="test",
        data=replace(DATA, **data),
        tokenizer_state=state,
    )
    return result, pq.read_table(run.path / f"data/{split}.parquet").to_pylist()


def rejects(tmp_path, split="train") -> list[tuple[int, str]]:
    table = pq.read_table(tmp_path / "run" / f"data/rejects_{split}.parquet")
    return [(r["line"], r["reason"]) for r in table.to_pylist()]


def ids(rows) -> list[str]:
    return [r["prompt_id"] for r in rows]


def test_malformed_json_lines_are_rejected_with_their_line_numbers(tmp_path, tokenizer_state, capsys):
    source = write_jsonl(tmp_path / "train.jsonl", [good(), '{"prompt": "1 +', good(), "", "[1, 2", good()])
    result, rows = ingest(tmp_path, tokenizer_state, source)
    assert rejects(tmp_path) == [
        (2, "malformed JSON: Unterminated string starting at: line 1 column 12 (char 11)"),
        (5, "malformed JSON: Expecting ',' delimiter: line 1 column 6 (char 5)"),
    ]
    assert ids(rows) == ["train-0", "train-2", "train-4"]  # positions: the blank line is not a row
    assert [r["row_index"] for r in rows] == [0, 2, 4]
    assert result.value("rows") == 3 and result.value("rejected") == 2
    assert [ref.path for ref in result.refs] == ["data/train.parquet", "data/rejects_train.parquet"]
    out = capsys.readouterr().out
    assert f"ingest train: 3 rows from {source}, 2 rejected (2 malformed JSON) → " in out
    assert out.strip().endswith("data/rejects_train.parquet")


def test_missing_and_mistyped_fields_are_rejected_with_the_reason(tmp_path, tokenizer_state):
    lines = [
        good(),
        "[1, 2]",
        {"question": "1 + 2 = ", "reward_model": {"ground_truth": "3"}},
        good(prompt=12),
        good(prompt=[{"role": "user", "content": 5}]),
        good(prompt=["1 + 2 = "]),
        {"prompt": "1 + 2 = "},
        good(truth=None),
        good(truth=[3]),
        good(truth=3),
        good(prompt=[{"role": "user", "content": "1 + 2 = "}]),
    ]
    _, rows = ingest(tmp_path, tokenizer_state, write_jsonl(tmp_path / "t.jsonl", lines))
    shape = "prompt must be a string or a list of {role, content} messages with string fields"
    assert rejects(tmp_path) == [
        (2, "not an object: a JSON array"),
        (3, "missing prompt: no 'prompt' field (data.prompt_key)"),
        (4, f"{shape}, got a JSON number"),
        (5, f'{shape}; message 1 is {{"role": "user", "content": 5}}'),
        (6, f'{shape}; message 1 is "1 + 2 = "'),
        (7, "missing reward_model.ground_truth"),
        (8, "missing reward_model.ground_truth"),
        (9, "reward_model.ground_truth must be a string or a number, got a JSON array"),
    ]
    assert ids(rows) == ["train-0", "train-9", "train-10"]
    assert [r["ground_truth"] for r in rows] == ["3", "3", "3"]  # a number is stringified
    assert rows[2]["prompt_messages"] == [{"role": "user", "content": "1 + 2 = "}]


def test_a_custom_prompt_key_is_read_and_named_in_the_reason(tmp_path, tokenizer_state):
    lines = [{"question": "1 + 2 = ", "reward_model": {"ground_truth": "3"}}, good()]
    _, rows = ingest(
        tmp_path, tokenizer_state, write_jsonl(tmp_path / "t.jsonl", lines), prompt_key="question"
    )
    assert rejects(tmp_path) == [(2, "missing prompt: no 'question' field (data.prompt_key)")]
    assert ids(rows) == ["train-0"] and rows[0]["prompt_text"] == "1 + 2 = "


def test_empty_and_whitespace_prompts_are_rejected(tmp_path, tokenizer_state):
    lines = [good(prompt=""), good(), good(prompt=" \t "), good(prompt=[{"role": "user", "content": "  "}])]
    _, rows = ingest(tmp_path, tokenizer_state, write_jsonl(tmp_path / "t.jsonl", lines))
    assert rejects(tmp_path) == [(1, "empty prompt"), (3, "empty prompt"), (4, "empty prompt")]
    assert ids(rows) == ["train-1"]


def test_a_non_utf8_line_is_rejected_alone(tmp_path, tokenizer_state):
    lines = [good(), b'{"prompt": "1 + \xff = ", "reward_model": {"ground_truth": "3"}}', good()]
    _, rows = ingest(tmp_path, tokenizer_state, write_jsonl(tmp_path / "t.jsonl", lines))
    assert rejects(tmp_path) == [
        (2, "not UTF-8: 'utf-8' codec can't decode byte 0xff in position 16: invalid start byte")
    ]
    raw = pq.read_table(tmp_path / "run/data/rejects_train.parquet").column("raw").to_pylist()
    assert raw == ['{"prompt": "1 + \ufffd = ", "reward_model": {"ground_truth": "3"}}']
    assert ids(rows) == ["train-0", "train-2"]


def test_duplicate_ids_are_rejected_naming_the_first(tmp_path, tokenizer_state):
    lines = [good(extra_info={"index": 7}), good(extra_info={"index": 8}), good(extra_info={"index": 7})]
    source = write_jsonl(tmp_path / "t.jsonl", lines)
    _, rows = ingest(tmp_path, tokenizer_state, source)
    assert rejects(tmp_path) == [(3, f"duplicate id 7 (first at {source}:1)")]
    assert ids(rows) == ["train-7", "train-8"]


def test_raw_text_is_kept_up_to_2000_characters(tmp_path, tokenizer_state):
    lines = [good(), "{" + "x" * 3000]
    ingest(tmp_path, tokenizer_state, write_jsonl(tmp_path / "t.jsonl", lines))
    raw = pq.read_table(tmp_path / "run/data/rejects_train.parquet").column("raw").to_pylist()
    assert raw == ["{" + "x" * 1999]


OVERLONG = [good(), good(prompt="1 + 2 + 3 + 4 + 5 = "), good(prompt=[{"role": "user", "content": "9" * 17}])]


def test_overlong_prompts_are_rejected_when_filtered(tmp_path, tokenizer_state):
    source = write_jsonl(tmp_path / "t.jsonl", OVERLONG)
    _, rows = ingest(tmp_path, tokenizer_state, source, filter_overlong_prompts=True, truncation="left")
    assert rejects(tmp_path) == [
        (2, "prompt is 20 tokens, longer than data.max_prompt_length=16"),
        (3, "prompt is 17 tokens, longer than data.max_prompt_length=16"),  # measured through the template
    ]
    assert ids(rows) == ["train-0"]


def test_a_prompt_of_millions_of_characters_is_measured_by_its_head(tmp_path, tokenizer_state):
    """Tokenized whole, a 20 MB prompt took 8 GB; its first max_prompt_length × 16 characters alone
    show it is overlong."""
    source = write_jsonl(tmp_path / "t.jsonl", [good(), good(prompt="1 + " * 2_000_000 + "1 = ")])
    _, rows = ingest(tmp_path, tokenizer_state, source, filter_overlong_prompts=True)
    assert rejects(tmp_path) == [
        (
            2,
            "prompt is 8,000,004 characters, longer than data.max_prompt_length=16 tokens (its first 256 "
            "characters alone are 256 tokens)",
        )
    ]
    assert ids(rows) == ["train-0"]


def test_overlong_prompts_under_truncation_error_fail_naming_the_first_line(tmp_path, tokenizer_state):
    source = write_jsonl(tmp_path / "t.jsonl", OVERLONG)
    expected = re.escape(
        f"{source}:2: prompt is 20 tokens, longer than data.max_prompt_length=16 and data.truncation=error "
        f"(2 prompts of train are too long, listed in {tmp_path}/run/data/rejects_train.parquet); "
        "raise data.max_prompt_length, set data.truncation=left|right|middle, "
        "or set data.filter_overlong_prompts=true"
    )
    with pytest.raises(ValueError, match=expected):
        ingest(tmp_path, tokenizer_state, source, truncation="error")
    assert [line for line, _ in rejects(tmp_path)] == [2, 3]
    assert not (tmp_path / "run/data/train.parquet").exists()


@pytest.mark.parametrize("truncation", ["left", "right", "middle"])
def test_overlong_prompts_are_kept_when_rollout_truncates(tmp_path, tokenizer_state, truncation):
    source = write_jsonl(tmp_path / "t.jsonl", OVERLONG)
    result, rows = ingest(tmp_path, tokenizer_state, source, truncation=truncation)
    assert ids(rows) == ["train-0", "train-1", "train-2"]
    assert rows[1]["prompt_text"] == "1 + 2 + 3 + 4 + 5 = "
    assert result.value("rejected") == 0 and len(result.refs) == 1
    assert not (tmp_path / "run/data/rejects_train.parquet").exists()


def test_a_reject_share_above_the_limit_fails_and_at_the_limit_passes(tmp_path, tokenizer_state, capsys):
    source = write_jsonl(tmp_path / "t.jsonl", [good(), "{oops", good(), good(prompt="")])
    expected = re.escape(
        f"ingest train: 2 of 4 rows from {source} rejected (50.0%: 1 malformed JSON, 1 empty prompt), "
        "more than data.max_reject_fraction=0.4; each is listed with its line and reason in "
        f"{tmp_path}/run/data/rejects_train.parquet; fix the data or raise data.max_reject_fraction"
    )
    with pytest.raises(ValueError, match=expected):
        ingest(tmp_path, tokenizer_state, source, max_reject_fraction=0.4)
    assert not (tmp_path / "run/data/train.parquet").exists()

    _, rows = ingest(tmp_path, tokenizer_state, source, max_reject_fraction=0.5)
    assert ids(rows) == ["train-0", "train-2"]
    assert [line for line, _ in rejects(tmp_path)] == [2, 4]
    assert "2 rejected (1 malformed JSON, 1 empty prompt)" in capsys.readouterr().out

    fixed = write_jsonl(tmp_path / "t.jsonl", [good(), good()])  # a fixed file leaves no stale rejects
    ingest(tmp_path, tokenizer_state, fixed, max_reject_fraction=0.0)
    assert not (tmp_path / "run/data/rejects_train.parquet").exists()
    assert f"ingest train: 2 rows from {fixed}, none rejected" in capsys.readouterr().out


def test_missing_empty_and_all_rejected_files_are_errors(tmp_path, tokenizer_state):
    with pytest.raises(FileNotFoundError, match=f"data file {tmp_path}/nope.jsonl does not exist"):
        ingest(tmp_path, tokenizer_state, str(tmp_path / "nope.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match=f"data file {tmp_path}/empty.jsonl has no rows"):
        ingest(tmp_path, tokenizer_state, str(tmp_path / "empty.jsonl"))
    source = write_jsonl(tmp_path / "bad.jsonl", ["{", good(prompt="")])
    with pytest.raises(ValueError, match=r"2 of 2 rows .* rejected \(100.0%.*\(no row left\)"):
        ingest(tmp_path, tokenizer_state, source)


RECORDS = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{i} + 1 = "}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        "extra_info": {"split": "train", "index": i},
    }
    for i in range(3)
]


def test_json_list_and_verl_parquet_give_the_same_prompts_as_jsonl(tmp_path, tokenizer_state):
    bad = {**RECORDS[0], "prompt": [{"role": "user", "content": " "}], "extra_info": {"index": 9}}
    records = [RECORDS[0], bad, *RECORDS[1:]]
    (tmp_path / "t.json").write_text(json.dumps(records))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "t.parquet")
    tables = {}
    for name in ("t.jsonl", "t.json", "t.parquet"):
        if name == "t.jsonl":
            write_jsonl(tmp_path / name, records)
        result, tables[name] = ingest(
            tmp_path / name.replace(".", "_"), tokenizer_state, str(tmp_path / name)
        )
        assert rejects(tmp_path / name.replace(".", "_")) == [(2, "empty prompt")], name
    assert tables["t.jsonl"] == tables["t.json"] == tables["t.parquet"]
    assert ids(tables["t.parquet"]) == ["train-0", "train-1", "train-2"]
    assert tables["t.parquet"][1]["prompt_messages"] == [{"role": "user", "content": "1 + 1 = "}]
    assert json.loads(tables["t.parquet"][1]["extra_info"]) == {"split": "train", "index": 1}


def test_several_files_scope_ids_per_file(tmp_path, tokenizer_state):
    first = write_jsonl(tmp_path / "a.jsonl", [good(extra_info={"index": 0})])
    second = write_jsonl(tmp_path / "b.jsonl", [good(extra_info={"index": 0}), "{"])
    _, rows = ingest(tmp_path, tokenizer_state, [first, second])
    assert ids(rows) == ["train-0-0", "train-1-0"]
    assert rejects(tmp_path) == [
        (2, "malformed JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)")
    ]


def test_rejects_of_both_splits_are_queryable_in_the_catalog(tmp_path, tokenizer_state):
    train = write_jsonl(tmp_path / "train.jsonl", [good(), good(prompt="")])
    val = write_jsonl(tmp_path / "val.jsonl", ["[]", good()])
    ingest(tmp_path, tokenizer_state, train)
    ingest(tmp_path, tokenizer_state, val, split="val")
    (tmp_path / "run/config.yaml").write_text("trainer: {}\n")  # what makes it a run to ppoflow's readers
    refresh_catalog(tmp_path / "run")
    assert query(tmp_path / "run", "SELECT reason FROM rejects ORDER BY reason")[1] == [
        ("empty prompt",),
        ("not an object: a JSON array",),
    ]
    assert query(tmp_path / "run", "SELECT prompt_id FROM prompts ORDER BY prompt_id")[1] == [
        ("train-0",),
        ("val-1",),
    ]


def test_the_builtin_task_has_no_rejects(tmp_path, tokenizer_state):
    result, rows = ingest(tmp_path, tokenizer_state, "builtin:addition", split="val")
    assert len(rows) == 100 and ids(rows)[:2] == ["val-0", "val-1"]
    assert len(result.refs) == 1


def test_message_prompts_without_a_chat_template_are_rejected(tmp_path, tmp_path_factory):
    directory = tmp_path_factory.mktemp("plain-tokenizer")
    build_tiny_tokenizer().save_pretrained(directory)
    state = ModelState(role="actor", lineage="plain", step=0, checkpoint=str(directory))
    lines = [good(), good(prompt=[{"role": "user", "content": "1 + 2 = "}])]
    _, rows = ingest(tmp_path, state, write_jsonl(tmp_path / "t.jsonl", lines))
    [(line, reason)] = rejects(tmp_path)
    assert line == 2 and reason.startswith("cannot render the prompt: ValueError: Cannot use chat template")
    assert ids(rows) == ["train-0"]


def test_the_data_source_comes_from_the_field_reward_fn_key_names(tmp_path, tokenizer_state):
    """verl's data.reward_fn_key: the row's field that picks the reward function."""
    lines = [good(task="sums"), good(task="other", data_source="ignored"), good(data_source="sums")]
    path = write_jsonl(tmp_path / "t.jsonl", lines)
    _, rows = ingest(tmp_path, tokenizer_state, path, reward_fn_key="task")
    assert [r["data_source"] for r in rows] == ["sums", "other", "unknown"]
    lines = [good(task=7)]
    ingest(
        tmp_path,
        tokenizer_state,
        write_jsonl(tmp_path / "u.jsonl", [good(task="x"), *lines]),
        reward_fn_key="task",
    )
    assert rejects(tmp_path) == [(2, "task (data.reward_fn_key) must be a non-empty string, got 7")]
