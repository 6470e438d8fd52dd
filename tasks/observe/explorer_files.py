"""What `ppoflow explore` reads of a run outside DuckDB: which step folders hold a table's files, and
the text of each token id (the run's tokenizer.json). Both are read as data: a planted or damaged
file gives less to show, never an error or code run."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ppoflow.tasks.storage.manifests import MANIFEST_NAME
from ppoflow.tasks.storage.tables import step_of

__all__ = ["StepFolders", "TokenTexts", "MAX_TOKENIZER_BYTES"]

MAX_TOKENIZER_BYTES = 100 * 2**20
"""A tokenizer.json larger than this is not read (the largest common ones are about 10 MB)."""


class StepFolders:
    """The steps whose folders hold files of each table, as the views read them (folders named as
    ppoflow names them). A committed step (its manifest written) never changes, so its folder is
    looked into once; a run of thousands of steps is then listed with one directory read."""

    def __init__(self, run_dir: Path):
        self._run_dir = run_dir
        self._known: dict[str, dict[str, bool]] = {}
        """table → folder name → has files, for committed folders and found files"""

    def steps_with(self, table: str) -> list[int]:
        known = self._known.setdefault(table, {})
        names = set()
        for entry in os.scandir(self._run_dir):
            if step_of(entry.name) is None:
                continue
            names.add(entry.name)
            if entry.name not in known:
                found = any(Path(entry.path, table).glob("*.parquet"))
                if found or Path(entry.path, MANIFEST_NAME).is_file():
                    known[entry.name] = found
        for gone in set(known) - names:  # a step set aside or removed
            del known[gone]
        return sorted(step_of(name) for name, found in known.items() if found)


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
