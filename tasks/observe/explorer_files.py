"""What `ppoflow explore` reads of a run outside DuckDB: which step folders hold a table's files, and
the text of each token id (the run's tokenizer.json). Both are read as data: a planted or damaged
file gives less to show, never an error or code run."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from stat import S_ISREG

from ppoflow.tasks.storage.manifests import MANIFEST_NAME
from ppoflow.tasks.storage.schemas import ITERATION_TABLES
from ppoflow.tasks.storage.tables import step_of

__all__ = ["StepFolders", "TextSizes", "TokenTexts", "MAX_TOKENIZER_BYTES", "fitted", "ratios"]

MAX_TOKENIZER_BYTES = 100 * 2**20
"""A tokenizer.json larger than this is not read (the largest common ones are about 10 MB)."""


class StepFolders:
    """The tables each step folder holds (folders named as ppoflow names them), as the explorer reads
    them. A committed step (its manifest written) never changes, so its folder is looked into once;
    a run of thousands of steps is then listed with one directory read, and its first listing costs
    one read of each step folder (its table folders are taken to hold their files, as a commit
    names them; an uncommitted folder's are looked into)."""

    def __init__(self, run_dir: Path):
        self._run_dir = run_dir
        self._committed: dict[str, frozenset[str]] = {}
        """committed step folder name → the tables it holds"""
        self._lock = threading.Lock()  # (the page's requests and the plots' first read list at once)

    def tables_by_step(self) -> dict[int, frozenset[str]]:
        with self._lock:
            return self._tables_by_step()

    def _tables_by_step(self) -> dict[int, frozenset[str]]:
        found, names = {}, set()
        for entry in os.scandir(self._run_dir):
            step = step_of(entry.name)
            if step is None:
                continue
            names.add(entry.name)
            tables = self._committed.get(entry.name)
            if tables is None:
                tables, committed = _tables_in(entry.path)
                if committed:
                    self._committed[entry.name] = tables
            found[step] = tables
        for gone in set(self._committed) - names:  # a step set aside or removed
            del self._committed[gone]
        return found

    def steps_with(self, table: str) -> list[int]:
        return sorted(step for step, tables in self.tables_by_step().items() if table in tables)


def _tables_in(folder: str) -> tuple[frozenset[str], bool]:
    """(the tables a step folder holds files of, whether it is committed)."""
    try:
        names = set(os.listdir(folder))
    except OSError:  # a file, gone, unreadable: no tables
        return frozenset(), False
    committed = MANIFEST_NAME in names
    tables = names & _TABLE_NAMES
    if not committed:
        tables = {name for name in tables if any(Path(folder, name).glob("*.parquet"))}
    return frozenset(tables), committed


_TABLE_NAMES = frozenset(ITERATION_TABLES)


class TextSizes:
    """How many bytes the text columns of a step's files hold once read: DuckDB decompresses a
    column's values whole, even to show their first characters, so a small planted file of long texts
    (2 MB on disk, repeated values stored once) took the explorer from 144 MB to 1.6 GB. Read from the
    files' footers, and for a column stored as a dictionary from its values' lengths (each stored
    once): no text is held whole. Remembered per file while its size and time stay."""

    def __init__(self, run_dir: Path, limit: int):
        """`limit`: past this many bytes a column's size need not be known exactly."""
        self._run_dir = run_dir
        self.limit = limit
        self._known: dict[tuple[str, int, int], dict[str, int]] = {}

    def largest(self, files: Sequence[str], columns: Sequence[str]) -> tuple[str, int]:
        """(column, bytes) of the text column that holds the most bytes across `files`."""
        totals: dict[str, int] = {}
        for file in files:
            for column, size in self._sizes(Path(file), columns).items():
                totals[column] = totals.get(column, 0) + size
        return max(totals.items(), key=lambda item: item[1], default=("", 0))

    def _sizes(self, path: Path, columns: Sequence[str]) -> dict[str, int]:
        try:
            if not path.resolve().is_relative_to(self._run_dir):  # a link out: DuckDB refuses it
                return {}
            stat = path.stat()
            if not S_ISREG(stat.st_mode):  # a FIFO would block the read
                return {}
        except OSError:
            return {}
        key = (str(path), stat.st_size, stat.st_mtime_ns)
        if key not in self._known:
            self._known[key] = _text_bytes(path, columns, self.limit)
        return self._known[key]


def _text_bytes(path: Path, columns: Sequence[str], limit: int) -> dict[str, int]:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        present = [c for c in columns if c in parquet.schema_arrow.names]
        metadata, sizes, coded = parquet.metadata, dict.fromkeys(present, 0), set()
        for group in range(metadata.num_row_groups):
            for index in range(metadata.num_columns):
                chunk = metadata.row_group(group).column(index)
                if chunk.path_in_schema in sizes:
                    sizes[chunk.path_in_schema] += chunk.total_uncompressed_size
                    if chunk.has_dictionary_page:
                        coded.add(chunk.path_in_schema)
        for column in coded - {c for c, size in sizes.items() if size > limit}:  # stored once, read per row
            as_stored = pq.ParquetFile(path, read_dictionary=[column])
            for part in as_stored.read(columns=[column]).column(column).chunks:
                lengths = pc.binary_length(part.dictionary)
                sizes[column] = max(sizes[column], pc.sum(pc.take(lengths, part.indices)).as_py() or 0)
    except Exception:  # not parquet: DuckDB names it when it reads the file
        return {}
    return sizes


class TokenTexts:
    """The text of each token id, from the run's own tokenizer.json (model/base, where ppoflow copies
    a built-in model's), read as data by the tokenizers library; an id is shown as `<id>` when there
    is no such file inside the run, when it cannot be read, and for an id it does not know."""

    def __init__(self, run_dir: Path):
        self._run_dir = run_dir
        self._tokenizer = None
        self._loaded = False
        self._cache: dict[int, str] = {}

    def pieces(self, ids: Sequence[int] | None) -> list[str]:
        tokenizer = self._load()
        out = []
        for token_id in ids or []:
            piece = self._cache.get(token_id)
            if piece is None:
                piece = _piece(tokenizer, token_id)
                self._cache[token_id] = piece
            out.append(piece)
        return out

    def _load(self):
        if not self._loaded:
            path = self._run_dir / "model/base/tokenizer.json"
            try:
                inside = path.resolve().is_relative_to(self._run_dir)
                if inside and path.is_file() and path.stat().st_size <= MAX_TOKENIZER_BYTES:
                    from tokenizers import Tokenizer

                    self._tokenizer = Tokenizer.from_file(str(path))
            except Exception:  # a damaged or planted file: ids are shown instead
                self._tokenizer = None
            self._loaded = True
        return self._tokenizer


def _piece(tokenizer, token_id) -> str:
    if tokenizer is None or not isinstance(token_id, int) or token_id < 0:
        return f"<{token_id}>"
    try:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if text and "\ufffd" not in text:
            return text
        return tokenizer.id_to_token(token_id) or f"<{token_id}>"
    except Exception:  # an id beyond the vocabulary (OverflowError), or what a planted file makes
        return f"<{token_id}>"


def ratios(old, rollout) -> list[float | None] | None:
    """exp(old − rollout) per token; null where either is missing or the gap is not a number a
    float can take (a planted value)."""
    if not old or not rollout:
        return None
    ratios = []
    for o, r in zip(old, rollout, strict=False):
        gap = o - r if isinstance(o, float) and isinstance(r, float) else math.nan
        ratios.append(math.exp(gap) if math.isfinite(gap) and abs(gap) <= 700 else None)
    return ratios


def fitted(values: list, length: int) -> list:
    """A per-token list as long as the tokens shown: cut, or filled with nulls (a planted row whose
    lists disagree in length)."""
    return list(values[:length]) + [None] * (length - len(values))
