"""One source row → one prompts-table row (verl's dataset schema, or a raw GSM8K row converted as
verl's preprocessing does), or `Rejected` with the short kind the ingest summary counts and the
reason the rejects table keeps. Every field a reward or the catalog relies on is checked here, so
that a bad value is a reject at ingest, never a failure (or a silent wrong score) later. And a row
as the model reads it (`rendered_prompt`, `prompt_token_ids`, `render_prompts`): ingest measures
it, rollouts and validation generate from it."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ppoflow.engine.data import truncate_prompt
from ppoflow.engine.gsm8k import verl_record

VERL_FIELDS = {"prompt", "reward_model", "data_source"}
JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
VERL_SPLITS = {"train": "train", "val": "test"}
"""extra_info.split of a converted raw GSM8K row, by ingest split: verl's preprocessing writes the
dataset's own split names, and the file verl validates on (data.val_files) is GSM8K's test split."""
KEPT_FIELDS = ("data_source", "ability", "reward_model", "extra_info")
"""The fields besides the prompt whose values reach the prompts table."""
MAX_DEPTH = 100
"""Deepest nesting a kept field may have. verl's rows nest three levels and pyarrow reads parquet no
deeper than about 50, while json.dumps (of extra_info, of a reject's raw text) recurses once per
level up to Python's recursion limit (1000)."""


class Rejected(Exception):
    """Why one row is rejected (raised inside the per-row checks, caught per row)."""

    def __init__(self, kind: str, reason: str | None = None):
        super().__init__(reason or kind)
        self.kind, self.reason = kind, reason or kind


def prompt_row(
    record: Any, prompt_key: str, split: str, position: int, source_key: str = "data_source"
) -> dict:
    """One prompts-table row (prompt_id is the bare id), or Rejected. Its data_source, which picks
    the reward function, is the row's `source_key` field (verl's data.reward_fn_key); a raw GSM8K
    row gets verl's 'openai/gsm8k'."""
    if isinstance(record, Rejected):
        raise record
    if not isinstance(record, dict):
        raise Rejected("not an object", f"not an object: a JSON {_json_type(record)}")
    if _is_raw_gsm8k(record):
        _check_values(record, ("question", "answer"))
        record, prompt_key, source_key = _gsm8k_record(record, split, position), "prompt", "data_source"
    _check_values(record, (prompt_key, source_key, *KEPT_FIELDS))
    if record.get(prompt_key) is None:
        raise Rejected("missing prompt", f"missing prompt: no {prompt_key!r} field (data.prompt_key)")
    text, messages = _prompt(record[prompt_key])
    return {
        "prompt_id": _row_id(record.get("extra_info"), position),
        "split": split,
        "row_index": position,
        "data_source": _data_source(record.get(source_key), source_key),
        "ability": _ability(record.get("ability")),
        "prompt_text": text,
        "prompt_messages": messages,
        "ground_truth": _ground_truth(record.get("reward_model")),
        "extra_info": json.dumps(record.get("extra_info") or {}, default=str, sort_keys=True),
    }


def _check_values(record: dict, fields: tuple[str, ...]) -> None:
    """Reject what no later write can take: a lone surrogate (no UTF-8 writer encodes one), an integer
    too long for Python to print, nesting deeper than MAX_DEPTH. Walked with a stack of its own: a
    recursive walk would fail on the very rows it is meant to catch."""
    stack = [(name, name, record[name], 0) for name in reversed(fields) if name in record]
    while stack:
        field, path, value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise Rejected(
                "nested too deeply",
                f"nested more than {MAX_DEPTH} levels deep, in {field} "
                f"(a row may be nested {MAX_DEPTH} deep)",
            )
        _check_scalar(path, value)
        stack.extend((field, sub, item, depth + 1) for sub, item in reversed(_children(path, value)))


def _check_scalar(path: str, value: Any) -> None:
    if isinstance(value, str) and not value.isascii() and _has_surrogate(value):
        raise Rejected("not valid Unicode", f"not valid Unicode: lone surrogate in {path}")
    if isinstance(value, int) and not _printable(value):
        digits = sys.get_int_max_str_digits()
        raise Rejected("number too long", f"a number of more than {digits} digits in {path}")


def _children(path: str, value: Any) -> list[tuple[str, Any]]:
    """(path, element) of each element of a list or dict; a dict's keys are listed as elements too,
    so that they are checked as the strings they are."""
    if isinstance(value, dict):
        paths = [(f"{path}.{_escaped(str(key))}", key, item) for key, item in value.items()]
        return [pair for sub, key, item in paths for pair in ((sub, key), (sub, item))]
    if isinstance(value, list | tuple):
        return [(f"{path}[{index}]", item) for index, item in enumerate(value)]
    return []


def _has_surrogate(text: str) -> bool:
    # json reads a valid escaped pair as one character, so any surrogate left in a str is lone.
    try:
        text.encode()
    except UnicodeEncodeError:
        return True
    return False


def _printable(number: int) -> bool:
    try:
        str(number)
    except ValueError:  # past sys.get_int_max_str_digits()
        return False
    return True


def _escaped(text: str) -> str:
    """Lone surrogates as their JSON escapes (\\ud800), so that the text can be written as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode()


def _prompt(prompt: Any) -> tuple[str | None, list[dict] | None]:
    """(prompt_text, prompt_messages) of a string or a chat-message prompt."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise Rejected("empty prompt")
        return prompt, None
    if not isinstance(prompt, list):
        raise Rejected("wrong prompt type", f"{_PROMPT_TYPE}, got a JSON {_json_type(prompt)}")
    for i, message in enumerate(prompt, 1):
        fields = [message.get(k) for k in ("role", "content")] if isinstance(message, dict) else [None]
        if not all(isinstance(f, str) for f in fields):
            raise Rejected("wrong prompt type", f"{_PROMPT_TYPE}; message {i} is {_short(message)}")
        if not fields[0].strip():
            raise Rejected("wrong prompt type", f"{_PROMPT_TYPE}; message {i} has an empty role")
    if not any(m["content"].strip() for m in prompt):
        raise Rejected("empty prompt")
    return None, [{"role": m["role"], "content": m["content"]} for m in prompt]


def _is_raw_gsm8k(record: dict) -> bool:
    """A row of the raw GSM8K files: a question and an answer, and no verl field to go by."""
    return {"question", "answer"} <= record.keys() and not VERL_FIELDS & record.keys()


def _gsm8k_record(record: dict, split: str, position: int) -> dict:
    """verl's preprocessing of a raw GSM8K row (extra_info.split: 'train', or 'test' for the val split,
    as verl writes them). The raw fields are checked first: the appended instruction would hide an
    empty question."""
    question = _raw_gsm8k_text(record, "question", "wrong prompt type")
    answer = _raw_gsm8k_text(record, "answer", "bad ground truth")
    if not question.strip():
        raise Rejected("empty prompt", "raw GSM8K row: empty question")
    try:
        converted = verl_record(question, answer, VERL_SPLITS.get(split, split), position)
    except ValueError as exc:
        raise Rejected("missing ground truth", f"raw GSM8K row: {exc}") from None
    # verl's pattern also matches '#### ,' or '#### .', which no response can answer correctly.
    if not any(char.isdigit() for char in converted["reward_model"]["ground_truth"]):
        raise Rejected("missing ground truth", "raw GSM8K row: the answer's '####' line has no number")
    return converted


def _raw_gsm8k_text(record: dict, name: str, kind: str) -> str:
    value = record[name]
    if not isinstance(value, str):
        raise Rejected(kind, f"raw GSM8K row: {name} must be a string, got a JSON {_json_type(value)}")
    return value


_PROMPT_TYPE = "prompt must be a string or a list of {role, content} messages with string fields"


def _ground_truth(reward_model: Any) -> str:
    """reward_model.ground_truth as the string reward functions compare against. A bool would become
    'True' and NaN 'nan' (pandas' missing number), which no response matches: both are rejects. A
    whole number stored as a float (72.0: pandas writes an integer column with a missing value as
    floats) is that whole number ('72', which a GSM8K answer '#### 72' matches; '72.0' matched none)."""
    truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if truth is None:
        raise Rejected("missing ground truth", "missing reward_model.ground_truth")
    if isinstance(truth, bool) or not isinstance(truth, str | int | float):
        raise Rejected(
            "bad ground truth",
            f"reward_model.ground_truth must be a string or a number, got a JSON {_json_type(truth)}",
        )
    if isinstance(truth, float) and not math.isfinite(truth):
        raise Rejected(
            "bad ground truth", f"reward_model.ground_truth must be a finite number, got {dumps(truth)}"
        )
    if not str(truth).strip():
        raise Rejected("empty ground truth", "empty reward_model.ground_truth")
    if isinstance(truth, float) and truth.is_integer():
        return str(int(truth))
    return str(truth)


def _data_source(value: Any, key: str = "data_source") -> str:
    """The name that selects the reward function; absent (or null, as in a parquet row) is 'unknown'."""
    if value is None:
        return "unknown"
    if not isinstance(value, str) or not value.strip():
        named = key if key == "data_source" else f"{key} (data.reward_fn_key)"
        raise Rejected("bad data source", f"{named} must be a non-empty string, got {_short(value)}")
    return value


def _ability(value: Any) -> str:
    """verl's task category, kept as a label; absent or null is ''."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise Rejected("bad ability", f"ability must be a string, got {_short(value)}")
    return value


def _row_id(extra_info: Any, position: int) -> str:
    """extra_info.index when present, else the row's position in its file."""
    index = extra_info.get("index") if isinstance(extra_info, dict) else None
    if index is None:
        return str(position)
    if isinstance(index, bool) or not isinstance(index, int | str) or not str(index).strip():
        raise Rejected(
            "bad id", f"extra_info.index must be an integer or a non-empty string, got {_short(index)}"
        )
    return str(index)


def _json_type(value: Any) -> str:
    return "null" if value is None else JSON_TYPES.get(type(value), type(value).__name__)


def _short(value: Any) -> str:
    text = dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def raw_text(record: Any) -> str:
    """A source row as JSON text for the rejects table, lone surrogates written as escapes; a row
    nested too deeply, or holding too long an integer, for json to write is described instead."""
    try:
        return _escaped(dumps(record))
    except RecursionError:
        return "(not shown: nested too deeply to print)"
    except ValueError:  # json.dumps's other error on a parsed row: an integer too long to print
        return f"(not shown: a number of more than {sys.get_int_max_str_digits()} digits)"


def rendered_prompt(tokenizer, row: dict, tools: Sequence[Mapping] = ()) -> str:
    """A prompt's text as the model sees it: the chat template applied to message prompts, with
    `tools` (multi-turn: the tools' schemas, which a tool-aware template such as Qwen's lists in the
    system prompt, as verl renders them) (raises what a missing or broken template raises)."""
    if row["prompt_messages"] is not None:
        messages = row["prompt_messages"]
        return tokenizer.apply_chat_template(
            messages, tools=[dict(t) for t in tools] or None, add_generation_prompt=True, tokenize=False
        )
    return row["prompt_text"]


def prompt_token_ids(tokenizer, row: dict, tools: Sequence[Mapping] = ()) -> list[int] | str:
    """Untruncated token ids of a prompt as the model sees it (rendered_prompt), or why it cannot be
    rendered. Shared by ingest (which measures) and rollout."""
    try:
        return list(tokenizer(rendered_prompt(tokenizer, row, tools), add_special_tokens=False)["input_ids"])
    except Exception as exc:  # no or a broken chat template (ValueError, jinja2 errors, ...)
        return f"cannot render the prompt: {type(exc).__name__}: {exc}"


def render_prompts(
    tokenizer, rows: list[dict], max_length: int, truncation: str, tools: Sequence[Mapping] = ()
) -> list[tuple[str, list[int]]]:
    """Prompt text as the model sees it (chat template applied to message prompts, with `tools`)
    and its ids."""
    rendered = []
    for row in rows:
        ids = prompt_token_ids(tokenizer, row, tools)
        if isinstance(ids, str):
            raise ValueError(f"prompt {row['prompt_id']}: {ids}")
        ids = truncate_prompt(ids, max_length, truncation)
        if ids is None:
            raise ValueError(
                f"prompt {row['prompt_id']} is longer than data.max_prompt_length={max_length} tokens "
                "and data.truncation=error; raise the limit, set data.truncation, "
                "or data.filter_overlong_prompts"
            )
        rendered.append((tokenizer.decode(ids), ids))
    return rendered
