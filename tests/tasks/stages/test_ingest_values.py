"""Ingest of values a reward or the catalog could not use: booleans, NaN and blanks as ground truth,
non-string labels, numbers too long for Python, lone surrogates, nesting too deep. Each is a reject
with its line and reason; the other rows of the file are ingested."""

from __future__ import annotations

import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ppoflow.tasks.stages.prompt_rows import MAX_DEPTH, Rejected, prompt_row, raw_text

from .test_ingest import good, ids, ingest, rejects, write_jsonl


def test_boolean_non_finite_and_blank_ground_truths_are_rejected(tmp_path, tokenizer_state):
    # Python's json reads NaN, Infinity and 1e999 (not JSON, but what pandas and others write).
    raw = '{"prompt": "1 + 2 = ", "data_source": "sums", "reward_model": {"ground_truth": %s}}'
    lines = [
        good(truth=True),
        good(truth=False),
        raw % "NaN",
        raw % "Infinity",
        raw % "-Infinity",
        raw % "1e999",
        good(truth=""),
        good(truth=" \t"),
        good(truth=3),
        good(truth=2.5),
        good(truth="0"),
        good(truth=72.0),
        good(truth=-0.0),
    ]
    _, rows = ingest(tmp_path, tokenizer_state, write_jsonl(tmp_path / "t.jsonl", lines))
    assert rejects(tmp_path) == [
        (1, "reward_model.ground_truth must be a string or a number, got a JSON boolean"),
        (2, "reward_model.ground_truth must be a string or a number, got a JSON boolean"),
        (3, "reward_model.ground_truth must be a finite number, got NaN"),
        (4, "reward_model.ground_truth must be a finite number, got Infinity"),
        (5, "reward_model.ground_truth must be a finite number, got -Infinity"),
        (6, "reward_model.ground_truth must be a finite number, got Infinity"),
        (7, "empty reward_model.ground_truth"),
        (8, "empty reward_model.ground_truth"),
    ]
    # A whole number written as a float (pandas' integer column with a missing value) is the number.
    assert [r["ground_truth"] for r in rows] == ["3", "2.5", "0", "72", "0"]


def verl_parquet(path, truth_type: pa.DataType, truths: list) -> str:
    """verl-format rows whose reward_model.ground_truth column has the given parquet type."""
    message = pa.struct([("content", pa.string()), ("role", pa.string())])
    schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(message)),
            ("reward_model", pa.struct([("ground_truth", truth_type)])),
        ]
    )
    prompt = [{"content": "1 + 2 = ", "role": "user"}]
    records = [{"data_source": "sums", "prompt": prompt, "reward_model": {"ground_truth": t}} for t in truths]
    pq.write_table(pa.Table.from_pylist(records, schema=schema), path)
    return str(path)


BOOLEAN_TRUTH = "reward_model.ground_truth must be a string or a number, got a JSON boolean"
EMPTY_TRUTH = "empty reward_model.ground_truth"


@pytest.mark.parametrize(
    ("truth_type", "truths", "expected", "kept"),
    [
        # pandas writes a missing number as NaN, so a float ground-truth column can hold one.
        (
            pa.float64(),
            [float("nan"), 3.0],
            [(1, "reward_model.ground_truth must be a finite number, got NaN")],
            ["3"],
        ),
        (pa.bool_(), [True, False], [(1, BOOLEAN_TRUTH), (2, BOOLEAN_TRUTH)], []),
        (
            pa.string(),
            ["", " ", None, "4"],
            [(1, EMPTY_TRUTH), (2, EMPTY_TRUTH), (3, "missing reward_model.ground_truth")],
            ["4"],
        ),
    ],
    ids=["float", "bool", "string"],
)
def test_verl_parquet_ground_truths_are_checked_as_json_ones(
    tmp_path, tokenizer_state, truth_type, truths, expected, kept
):
    # One usable row beside the parquet file, so that a file of bad rows alone still ingests.
    usable = write_jsonl(tmp_path / "usable.jsonl", [good()])
    source = verl_parquet(tmp_path / "t.parquet", truth_type, truths)
    _, rows = ingest(tmp_path, tokenizer_state, [usable, source])
    assert rejects(tmp_path) == expected
    assert [r["ground_truth"] for r in rows] == ["3", *kept]


def test_non_string_and_blank_labels_and_ids_are_rejected(tmp_path, tokenizer_state):
    lines = [
        good(data_source=True),
        good(data_source=""),
        good(data_source="  "),
        good(data_source=7),
        good(ability=False),
        good(ability=1.5),
        good(extra_info={"index": ""}),
        good(extra_info={"index": " "}),
        good(prompt=[{"role": " ", "content": "1 + 2 = "}]),
        good(data_source=None, ability=None),
        good(ability="", extra_info={"index": "a"}),
    ]
    _, rows = ingest(tmp_path, tokenizer_state, write_jsonl(tmp_path / "t.jsonl", lines))
    shape = "prompt must be a string or a list of {role, content} messages with string fields"
    assert rejects(tmp_path) == [
        (1, "data_source must be a non-empty string, got true"),
        (2, 'data_source must be a non-empty string, got ""'),
        (3, 'data_source must be a non-empty string, got "  "'),
        (4, "data_source must be a non-empty string, got 7"),
        (5, "ability must be a string, got false"),
        (6, "ability must be a string, got 1.5"),
        (7, 'extra_info.index must be an integer or a non-empty string, got ""'),
        (8, 'extra_info.index must be an integer or a non-empty string, got " "'),
        (9, f"{shape}; message 1 has an empty role"),
    ]
    # null is read as absent, as a parquet column without a value for that row.
    assert [(r["data_source"], r["ability"]) for r in rows] == [("unknown", ""), ("sums", "")]
    assert ids(rows) == ["train-9", "train-a"]


def row_text(prompt='"1 + 2 = "', truth='"3"', extra="{}", source='"sums"') -> str:
    """A row as JSON text, for what json.dumps does not write: escapes, long numbers, deep nesting."""
    truth = f'{{"ground_truth": {truth}}}'
    return f'{{"prompt": {prompt}, "data_source": {source}, "reward_model": {truth}, "extra_info": {extra}}}'


DIGITS = sys.get_int_max_str_digits()  # Python's limit for reading and printing an integer: 4300
TOO_MANY_DIGITS = f"JSON with a number of more than {DIGITS} digits (Python's limit)"
TOO_DEEP = f"JSON nested deeper than Python reads (about {sys.getrecursionlimit():,} levels)"


def nested(depth: int, inner: str = "1") -> str:
    return "[" * depth + inner + "]" * depth


def test_a_number_too_long_for_python_is_a_reject_for_its_line(tmp_path, tokenizer_state):
    lines = [
        good(),
        row_text(truth="1" * (DIGITS + 1)),
        row_text(extra=f'{{"n": {"7" * 100_000}}}'),
        row_text(truth="9" * DIGITS),  # at the limit: read and kept
    ]
    _, rows = ingest(tmp_path, tokenizer_state, write_jsonl(tmp_path / "t.jsonl", lines))
    assert rejects(tmp_path) == [(2, TOO_MANY_DIGITS), (3, TOO_MANY_DIGITS)]
    assert ids(rows) == ["train-0", "train-3"] and rows[1]["ground_truth"] == "9" * DIGITS


def test_an_integer_too_long_to_print_is_rejected_naming_its_field():
    # Not readable from JSON or parquet, but a row built in Python can hold one.
    with pytest.raises(Rejected) as info:
        prompt_row(good(truth=10**DIGITS, extra_info={"index": 1}), "prompt", "train", 0)
    assert info.value.kind == "number too long"
    assert info.value.reason == f"a number of more than {DIGITS} digits in reward_model.ground_truth"


LONE = "not valid Unicode: lone surrogate in "


def test_lone_surrogates_are_rejected_naming_the_field(tmp_path, tokenizer_state):
    # json reads the escape \ud800 as a lone surrogate, which no UTF-8 writer can encode.
    chat = '[{"role": "user", "content": "1 + 2 = \\udfff"}]'
    lines = [
        good(),
        row_text(prompt='"1 + \\ud800 = "'),
        row_text(prompt=chat),
        row_text(truth='"\\ud800"'),
        row_text(source='"s\\ud800"'),
        row_text(extra='{"a": ["x", "\\udc80"]}'),
        row_text(extra='{"\\ud800": 1}'),
        good(ability="\ud800"),  # json.dumps writes it as the escape
        row_text(extra='{"note": "\\ud83d\\ude00"}'),  # a valid pair: one character
        good(comment="\ud800"),  # a field ingest does not keep
    ]
    _, rows = ingest(tmp_path, tokenizer_state, write_jsonl(tmp_path / "t.jsonl", lines))
    assert rejects(tmp_path) == [
        (2, LONE + "prompt"),
        (3, LONE + "prompt[0].content"),
        (4, LONE + "reward_model.ground_truth"),
        (5, LONE + "data_source"),
        (6, LONE + "extra_info.a[1]"),
        (7, LONE + "extra_info.\\ud800"),
        (8, LONE + "ability"),
    ]
    assert ids(rows) == ["train-0", "train-8", "train-9"]
    assert json.loads(rows[1]["extra_info"]) == {"note": "\U0001f600"}


def test_lone_surrogates_in_a_json_list_are_rejected_and_shown_escaped(tmp_path, tokenizer_state):
    (tmp_path / "t.json").write_text(json.dumps([good(), good(truth="\ud800")]))
    _, rows = ingest(tmp_path, tokenizer_state, str(tmp_path / "t.json"))
    assert rejects(tmp_path) == [(2, LONE + "reward_model.ground_truth")]
    raw = pq.read_table(tmp_path / "run/data/rejects_train.parquet").column("raw").to_pylist()
    assert raw == [json.dumps(good(truth="\ud800"), ensure_ascii=False).replace("\ud800", "\\ud800")]
    assert ids(rows) == ["train-0"]


def test_deeply_nested_lines_are_rejected_and_the_rest_ingested(tmp_path, tokenizer_state):
    lines = [
        good(),
        "[" * 100_000,
        row_text(extra=f'{{"a": {nested(5000)}}}'),  # deeper than json can read
        row_text(extra=f'{{"a": {nested(150)}}}'),  # read, but deeper than a row may be
        row_text(extra=f'{{"a": {nested(90)}}}'),
        good(),
    ]
    _, rows = ingest(tmp_path, tokenizer_state, write_jsonl(tmp_path / "t.jsonl", lines))
    assert rejects(tmp_path) == [
        (2, TOO_DEEP),
        (3, TOO_DEEP),
        (
            4,
            f"nested more than {MAX_DEPTH} levels deep, in extra_info (a row may be nested {MAX_DEPTH} deep)",
        ),
    ]
    assert ids(rows) == ["train-0", "train-4", "train-5"]
    assert json.loads(rows[1]["extra_info"]) == {"a": json.loads(nested(90))}


def test_deep_or_unreadable_elements_of_a_json_list_are_rejected_alone(tmp_path, tokenizer_state):
    deep = f'{{"prompt": "1 + 2 = ", "extra_info": {nested(5000)}}}'
    big = row_text(truth="1" * (DIGITS + 1))
    text = f"[{json.dumps(good())}, {deep}, {big},\n {json.dumps(good(prompt='2 + 2 = '))}]"
    (tmp_path / "t.json").write_text(text)
    _, rows = ingest(tmp_path, tokenizer_state, str(tmp_path / "t.json"))
    assert rejects(tmp_path) == [(2, TOO_DEEP), (3, TOO_MANY_DIGITS)]
    assert [r["prompt_text"] for r in rows] == ["1 + 2 = ", "2 + 2 = "]
    assert ids(rows) == ["train-0", "train-3"]
    raw = pq.read_table(tmp_path / "run/data/rejects_train.parquet").column("raw").to_pylist()
    assert raw == [deep[:2000], big[:2000]]
    # A list left open after a deep element: what follows belongs to that element.
    (tmp_path / "open.json").write_text(f"[{json.dumps(good())}, " + "[" * 100_000)
    _, rows = ingest(tmp_path, tokenizer_state, str(tmp_path / "open.json"))
    assert rejects(tmp_path) == [(2, TOO_DEEP)] and ids(rows) == ["train-0"]


def test_a_json_list_with_text_after_it_is_still_an_error_of_the_file(tmp_path, tokenizer_state):
    path = tmp_path / "t.json"
    path.write_text(f"[{json.dumps(good())}, {nested(5000)}] trailing")
    with pytest.raises(ValueError, match=f"data file {path} is not a JSON list: text after the list"):
        ingest(tmp_path, tokenizer_state, str(path))


def test_parquet_rows_are_nested_no_deeper_than_pyarrow_reads(tmp_path, tokenizer_state):
    # pyarrow refuses a schema nested past its depth limit, as a file error; a row it can read
    # (here 40 levels) is within ingest's limit.
    def deep(depth: int) -> pa.Table:
        kind, value = pa.int64(), 1
        for _ in range(depth):
            kind, value = pa.list_(kind), [value]
        return pa.table(
            {
                "prompt": ["1 + 2 = "],
                "reward_model": [{"ground_truth": "3"}],
                "extra_info": pa.array([value], kind),
            }
        )

    pq.write_table(deep(40), tmp_path / "ok.parquet")
    _, rows = ingest(tmp_path, tokenizer_state, str(tmp_path / "ok.parquet"))
    assert json.loads(rows[0]["extra_info"]) == json.loads(nested(40))
    pq.write_table(deep(60), tmp_path / "deep.parquet")
    with pytest.raises(
        ValueError, match=f"data file {tmp_path}/deep.parquet is not readable parquet: .*too deeply"
    ):
        ingest(tmp_path, tokenizer_state, str(tmp_path / "deep.parquet"))


def test_a_row_built_too_deep_is_rejected_and_shown_without_recursion():
    extra_info: list = []
    for _ in range(5000):
        extra_info = [extra_info]
    record = good(extra_info={"a": extra_info})
    with pytest.raises(Rejected) as info:
        prompt_row(record, "prompt", "train", 0)
    assert (
        info.value.reason
        == f"nested more than {MAX_DEPTH} levels deep, in extra_info (a row may be nested {MAX_DEPTH} deep)"
    )
    assert raw_text(record) == "(not shown: nested too deeply to print)"
    assert raw_text(good(truth=10**DIGITS)) == f"(not shown: a number of more than {DIGITS} digits)"
