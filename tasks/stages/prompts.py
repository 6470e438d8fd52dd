"""The `prompts` stage (ingest): JSON/JSONL/parquet prompts (or the built-in task) →
data/<split>.parquet, and every source row that cannot become a prompt → data/rejects_<split>.parquet
with its file, line and reason.

Bad input is handled per row, so one broken line never sinks a file; nothing is dropped silently:
each rejected row is in the rejects table and counted in the summary line, and the ingest fails when
more than data.max_reject_fraction of the rows are rejected.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from prefect import task

from ppoflow.engine.tiny import ADDITION_DATA_SOURCE, all_addition_problems, sample_addition_problems
from ppoflow.tasks.observe.console import say
from ppoflow.tasks.pipeline.cache_keys import current_cache_key, stage_cache_key
from ppoflow.tasks.pipeline.run import Run
from ppoflow.tasks.pipeline.settings import IngestSettings
from ppoflow.tasks.pipeline.states import ModelState, StageResult, StageTimer
from ppoflow.tasks.stages.prepare_model import BUILTIN_DATA, BUILTIN_TRAIN_ROWS
from ppoflow.tasks.stages.prompt_rows import Rejected, prompt_row, prompt_token_ids, raw_text, rendered_prompt
from ppoflow.tasks.storage.data_sources import content_digest, open_data_file
from ppoflow.tasks.storage.regular_files import refuse_links_below
from ppoflow.tasks.storage.schemas import SCHEMAS
from ppoflow.tasks.storage.tables import ArtifactRef, write_table

RAW_CHARS = 2000


@dataclass(frozen=True)
class Reject:
    """A source row that did not become a prompt; `kind` is the short label the summary counts."""

    source: str
    line: int
    kind: str
    reason: str
    raw: str


@task(name="prompts", task_run_name="prompts-{split}", cache_key_fn=stage_cache_key)
def prompts(
    run: Run,
    files: str | list[str],
    split: str,
    source_digest: str,
    data: IngestSettings,
    tokenizer_state: ModelState,
) -> StageResult:
    """JSON/JSONL/parquet prompts (or the built-in task) → data/<split>.parquet (+ rejects_<split>)."""
    timer = StageTimer()
    names = [files] if isinstance(files, str) else list(files)
    if files == BUILTIN_DATA:
        table, rejects = pa.Table.from_pylist(_builtin_prompts(split), schema=SCHEMAS["prompts"]), []
    else:
        table, rejects = _file_prompts(names, split, data, run.models.tokenizer(run, tokenizer_state))
    rejects_ref = _write_rejects(run, split, rejects)
    _check(split, names, table.num_rows, rejects, data, run.path / _rejects_path(split))
    if data.max_samples > 0:  # verl's data.{train,val}_max_samples: the first N good rows
        table = table.slice(0, data.max_samples)
    refs = (write_table(table, run.path, f"data/{split}.parquet", SCHEMAS["prompts"], clock=run.io),)
    say(_summary(split, names, table.num_rows, rejects, run.path / _rejects_path(split)))
    values = (("rows", float(table.num_rows)), ("rejected", float(len(rejects))))
    return StageResult("prompts", refs + rejects_ref, current_cache_key(), timer.seconds, values)


class NotEnoughData(ValueError):
    """The training prompts cannot fill one batch."""


def require_full_batch(train: StageResult, files: str | list[str], batch_size: int) -> None:
    """Fail before anything trains when the ingested training prompts cannot fill one batch of
    data.train_batch_size (a run would otherwise stop at its first rollout, or train 0 steps)."""
    rows, rejected = int(train.value("rows")), int(train.value("rejected"))
    if rows < batch_size:
        names = ", ".join([files] if isinstance(files, str) else files)
        raise NotEnoughData(
            f"data.train_files ({names}) hold {rows} usable prompts ({rejected} rows rejected), fewer than "
            f"data.train_batch_size={batch_size}: one batch cannot be filled"
        )


def source_digest(files: str | list[str]) -> str:
    """Identity of the input files (their bytes, read a MiB at a time), so an edited data file is a
    cache miss (and named at start: data_sources.py)."""
    return content_digest(files)


def _builtin_prompts(split: str) -> list[dict]:
    problems = (
        all_addition_problems() if split == "val" else sample_addition_problems(BUILTIN_TRAIN_ROWS, seed=0)
    )
    return [
        {
            "prompt_id": f"{split}-{i}",
            "split": split,
            "row_index": i,
            "data_source": ADDITION_DATA_SOURCE,
            "ability": "arithmetic",
            "prompt_text": p.prompt,
            "prompt_messages": None,
            "ground_truth": p.answer,
            "extra_info": json.dumps({"a": p.a, "b": p.b, "index": i}),
        }
        for i, p in enumerate(problems)
    ]


ROWS_PER_BATCH = 4096
"""Ingested rows are kept as Arrow, this many at a time, not as Python objects (which took several
times their size: a 1 GB file peaked at 3.6 GB)."""


def _file_prompts(
    names: list[str], split: str, data: IngestSettings, tokenizer
) -> tuple[pa.Table, list[Reject]]:
    """verl's dataset schema: prompt (chat messages or text), data_source, ability,
    reward_model.ground_truth, extra_info. Ids are scoped per file (prefixed by the file's position
    when there are several), as verl datasets number extra_info.index from 0 in each file. The files
    are read a line (JSONL) or a batch (parquet) at a time."""
    rows: list[dict] = []
    kept: list[pa.Table] = []
    rejects: list[Reject] = []
    for k, name in enumerate(names):
        prefix = f"{split}-" if len(names) == 1 else f"{split}-{k}-"
        seen: dict[str, int] = {}
        position = -1
        for position, (line, raw, record) in enumerate(_read_rows(Path(name))):
            try:
                row = prompt_row(record, data.prompt_key, split, position, data.reward_fn_key)
                _check_length(tokenizer, row, data)
                first = seen.get(row["prompt_id"])
                if first is not None:
                    raise Rejected(
                        "duplicate id", f"duplicate id {row['prompt_id']} (first at {name}:{first})"
                    )
            except Rejected as rejected:
                rejects.append(Reject(name, line, rejected.kind, rejected.reason, raw[:RAW_CHARS]))
                continue
            seen[row["prompt_id"]] = line
            rows.append(row | {"prompt_id": prefix + row["prompt_id"]})
            if len(rows) == ROWS_PER_BATCH:
                kept.append(pa.Table.from_pylist(rows, schema=SCHEMAS["prompts"]))
                rows = []
        if position < 0:
            raise ValueError(f"data file {name} has no rows")
    kept.append(pa.Table.from_pylist(rows, schema=SCHEMAS["prompts"]))
    return pa.concat_tables(kept), rejects


HEAD_CHARS_PER_TOKEN = 16
"""A prompt longer than data.max_prompt_length × this in characters is first measured by its head
of that many characters: a head that alone holds more tokens than the limit (and a margin for the
word it cuts) makes it overlong without tokenizing the rest (a 20 MB prompt took 8 GB and 38 s to
tokenize whole)."""


def _check_length(tokenizer, row: dict, data: IngestSettings) -> None:
    """Measure the prompt as rollout renders it; overlong is a reject when filtered or when
    data.truncation=error (which then fails the ingest), else rollout truncates it."""
    limit = data.max_prompt_length
    rejected = data.filter_overlong_prompts or data.truncation == "error"
    kind = "overlong prompt" if data.filter_overlong_prompts else "overlong prompt (truncation=error)"
    if rejected:
        _check_head(tokenizer, row, limit, kind, data.tools)
    ids = prompt_token_ids(tokenizer, row, data.tools)
    if isinstance(ids, str):
        raise Rejected("cannot render", ids)
    if len(ids) > limit and rejected:
        raise Rejected(kind, f"prompt is {len(ids)} tokens, longer than data.max_prompt_length={limit}")


def _check_head(tokenizer, row: dict, limit: int, kind: str, tools) -> None:
    try:
        text = rendered_prompt(tokenizer, row, tools)
    except Exception:  # measured (and rejected, naming why) by prompt_token_ids
        return
    head = text[: limit * HEAD_CHARS_PER_TOKEN]
    if len(head) == len(text):
        return
    tokens = len(tokenizer(head, add_special_tokens=False)["input_ids"])
    if tokens > limit + HEAD_CHARS_PER_TOKEN:
        raise Rejected(
            kind,
            f"prompt is {len(text):,} characters, longer than data.max_prompt_length={limit} tokens "
            f"(its first {len(head):,} characters alone are {tokens:,} tokens)",
        )


def unusable_data_file(path: Path, data: IngestSettings) -> str | None:
    """Why `path` cannot be taken in as training data at all, or None: its format cannot be read
    (unsupported, not a JSON list, not parquet), it has no rows, or more than
    data.max_reject_fraction of its rows are not dataset rows (malformed JSON, missing fields, with
    `data`'s prompt_key and reward_fn_key; rows too long for the tokenizer are ingest's to count).
    OSError when it cannot be read now (it may be readable later)."""
    rows = rejected = 0
    first = None
    try:
        for position, (_, _, record) in enumerate(_read_rows(path)):
            rows += 1
            try:
                prompt_row(record, data.prompt_key, "train", position, data.reward_fn_key)
            except Rejected as reject:
                rejected += 1
                first = first or reject.reason
    except ValueError as error:
        return str(error)
    limit = data.max_reject_fraction
    if not rows:
        return f"data file {path} has no rows"
    if rejected / rows > limit:
        return (
            f"data file {path}: {rejected} of its {rows} rows are not dataset rows, more than "
            f"data.max_reject_fraction={limit} (the first: {first})"
        )
    return None


def _read_rows(path: Path) -> Iterator[tuple[int, str, Any]]:
    """(line, raw text, parsed record or Rejected) per row: the 1-based line of a JSONL file, the
    element (JSON list) or row (parquet) index + 1. JSONL and parquet are read a line or a batch at a
    time; a JSON list is read whole (json reads no list in parts)."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        yield from _parquet_rows(path)
        return
    if suffix not in (".jsonl", ".ndjson", ".json"):
        raise ValueError(f"data file {path}: unsupported format; use .jsonl, .json or .parquet")
    with open_data_file(path) as file:
        head = file.peek(1 << 16)[: 1 << 16]
        if suffix == ".json" and head.lstrip(codecs.BOM_UTF8 + b" \t\r\n").startswith(b"["):
            yield from _json_rows(path, file.read())
        else:  # (JSON lines saved as .json too: what `datasets` writes by default)
            yield from _jsonl_rows(file)


def _jsonl_rows(lines: Iterable[bytes]) -> Iterator[tuple[int, str, Any]]:
    for line, raw in enumerate(lines, 1):
        raw = raw.removesuffix(b"\n")
        if line == 1:
            raw = raw.removeprefix(codecs.BOM_UTF8)
        if not raw.strip():
            continue
        text = raw.decode("utf-8", errors="replace")
        try:
            decoded = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield line, text, Rejected("not UTF-8", f"not UTF-8: {exc}")
            continue
        yield line, text, _parsed(decoded)


def _parsed(text: str) -> Any:
    """The JSON value of one row, or Rejected: a row json cannot read is that row's reject."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        return Rejected("malformed JSON", f"malformed JSON: {exc}")
    except RecursionError:  # valid JSON, nested deeper than Python's parser goes
        return Rejected(
            "JSON beyond Python's limits",
            f"JSON nested deeper than Python reads (about {sys.getrecursionlimit():,} levels)",
        )
    except ValueError:  # json's only other error: an integer longer than Python reads
        digits = sys.get_int_max_str_digits()
        return Rejected(
            "JSON beyond Python's limits", f"JSON with a number of more than {digits} digits (Python's limit)"
        )


def _json_rows(path: Path, content: bytes) -> Iterator[tuple[int, str, Any]]:
    try:
        text = content.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"data file {path} is not UTF-8: {exc}") from exc
    try:
        records = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"data file {path} is not a JSON list: malformed JSON: {exc}") from exc
    except (RecursionError, ValueError):  # an element nested too deeply, or too long a number
        for i, element in enumerate(_list_elements(path, text)):
            yield i + 1, element, _parsed(element)
        return
    for i, record in enumerate(records):
        yield i + 1, raw_text(record), record


_LIST_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{},]', re.S)


def _list_elements(path: Path, text: str) -> list[str]:
    """The text of each element of a top-level JSON list, split at the commas outside strings and
    brackets: found without recursion, for a list json.loads gave up on. A list left open ends with
    its last element; text after the list is an error of the file, as json.loads makes it."""
    elements: list[str] = []
    depth, start = 0, text.index("[") + 1
    for token in _LIST_TOKEN.finditer(text, start):
        char = token.group()[0]
        if char in "[{":
            depth += 1
        elif char in "]}" and depth:
            depth -= 1
        elif char == "]" or (char == "," and not depth):
            elements.append(text[start : token.start()].strip())
            start = token.end()
            if char == "]":
                if text[start:].strip():
                    raise ValueError(f"data file {path} is not a JSON list: text after the list")
                return elements
    return [*elements, text[start:].strip()]


def _parquet_rows(path: Path) -> Iterator[tuple[int, str, Any]]:
    index = 0
    with open_data_file(path) as file:
        try:
            batches = pq.ParquetFile(file).iter_batches(batch_size=ROWS_PER_BATCH)
            for batch in batches:
                for record in batch.to_pylist():
                    index += 1
                    yield index, raw_text(record), record
        except (pa.ArrowException, OSError) as exc:
            raise ValueError(f"data file {path} is not readable parquet: {exc}") from exc


def _rejects_path(split: str) -> str:
    return f"data/rejects_{split}.parquet"


def _write_rejects(run: Run, split: str, rejects: list[Reject]) -> tuple[ArtifactRef, ...]:
    """data/rejects_<split>.parquet when any row was rejected; a stale one from an earlier ingest
    of a since-fixed file is removed, so the catalog's rejects view shows only current rejects."""
    if not rejects:
        stale = run.path / _rejects_path(split)
        refuse_links_below(run.path, stale.parent)  # never through a planted data/ link
        stale.unlink(missing_ok=True)  # a link there is removed itself, not what it points at
        return ()
    columns = {
        "source": [r.source for r in rejects],
        "line": [r.line for r in rejects],
        "reason": [r.reason for r in rejects],
        "raw": [r.raw for r in rejects],
    }
    table = pa.table(columns, schema=SCHEMAS["rejects"])
    return (write_table(table, run.path, _rejects_path(split), SCHEMAS["rejects"], clock=run.io),)


def _check(
    split: str, names: list[str], rows: int, rejects: list[Reject], data: IngestSettings, path: Path
) -> None:
    """Fail on any overlong prompt under data.truncation=error, when every row was rejected, or when
    the rejected share is above data.max_reject_fraction."""
    overlong = [r for r in rejects if r.kind == "overlong prompt (truncation=error)"]
    if overlong:
        first = overlong[0]
        raise ValueError(
            f"{first.source}:{first.line}: {first.reason} and data.truncation=error "
            f"({len(overlong):,} prompts of {split} are too long, listed in {_shown(path)}); "
            "raise data.max_prompt_length, set data.truncation=left|right|middle, "
            "or set data.filter_overlong_prompts=true"
        )
    total, limit = rows + len(rejects), data.max_reject_fraction
    if rejects and (not rows or len(rejects) / total > limit):
        raise ValueError(
            f"ingest {split}: {len(rejects):,} of {total:,} rows from {', '.join(names)} rejected "
            f"({len(rejects) / total:.1%}: {_kinds(rejects)}), more than data.max_reject_fraction={limit}"
            f"{'' if rows else ' (no row left)'}; each is listed with its line and reason in "
            f"{_shown(path)}; fix the data or raise data.max_reject_fraction"
        )


def _summary(split: str, names: list[str], rows: int, rejects: list[Reject], path: Path) -> str:
    text = f"ingest {split}: {rows:,} rows from {', '.join(names)}"
    if not rejects:
        return f"{text}, none rejected"
    return f"{text}, {len(rejects):,} rejected ({_kinds(rejects)}) → {_shown(path)}"


def _kinds(rejects: list[Reject]) -> str:
    """'2 malformed JSON, 1 empty prompt': counts per kind, most frequent first."""
    return ", ".join(f"{n:,} {kind}" for kind, n in Counter(r.kind for r in rejects).most_common())


def _shown(path: Path) -> str:
    """The path relative to the working directory when it is inside it."""
    relative = os.path.relpath(path)
    return path.as_posix() if relative.startswith("..") else relative
