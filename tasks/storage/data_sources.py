"""What data a run was trained and validated on: the content digest of each split's files, as its
last ingest took them in (`data/sources.json`).

The `prompts` stage is cached by this digest, so a data file edited in place (same path) was taken in
again without a word, and every step recomputed and rewritten in place. A start compares the digest
of the files its config names with the one recorded: training data whose content changed makes
another run (refused, as other data files are: run_config.require_same_run), and changed validation
data is named, as a changed setting is.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, BinaryIO

from ppoflow.tasks.storage.regular_files import open_regular_file
from ppoflow.tasks.storage.tables import read_json, write_json_atomic

__all__ = ["DATA_SOURCES", "content_digest", "data_changed", "open_data_file", "record_sources"]

DATA_SOURCES = "data/sources.json"
BUILTIN_PREFIX = "builtin:"
_CHUNK = 1 << 20


def content_digest(files: str | list[str]) -> str:
    """The sha256 of the files' bytes, one after the other, read a MiB at a time (a built-in data
    set's name stands for itself). OSError naming a file that cannot be read."""
    if isinstance(files, str) and files.startswith(BUILTIN_PREFIX):
        return files
    digest = hashlib.sha256()
    for name in [files] if isinstance(files, str) else files:
        with open_data_file(Path(name)) as file:
            while chunk := file.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def open_data_file(path: Path) -> BinaryIO:
    """A data file, opened for reading as a regular file (a FIFO put there since the config was
    checked would block the read forever); one line that names it when it cannot be."""
    try:
        descriptor = open_regular_file(path, os.O_RDONLY, follow_links=True)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"data file {path} does not exist (data.train_files / data.val_files)"
        ) from None
    except OSError as error:
        raise OSError(f"data file {path} cannot be read: {error.strerror}") from None
    return os.fdopen(descriptor, "rb")


def record_sources(run_dir: Path, split: str, files: str | list[str], digest: str) -> None:
    """Record that the run's `split` was ingested from `files` with content `digest` (written only
    when it differs from the record)."""
    recorded = _recorded(run_dir)
    entry = {"files": _listed(files), "digest": digest}
    if recorded.get(split) != entry:
        write_json_atomic(Path(run_dir) / DATA_SOURCES, recorded | {split: entry})


def data_changed(run_dir: Path, split: str, files: str | list[str], digest: str | None = None) -> str | None:
    """ "old → new" (digests, shortened) when the run last ingested `split` from these same files and
    their content has changed since; None otherwise (no record, other files, the same content).
    `digest`: the files' content digest, when already known."""
    entry = _recorded(run_dir).get(split)
    if (
        not isinstance(entry, dict)
        or entry.get("files") != _listed(files)
        or not isinstance(entry.get("digest"), str)
    ):
        return None
    now = content_digest(files) if digest is None else digest
    if now == entry["digest"]:
        return None
    return f"sha256:{entry['digest'][:12]} → sha256:{now[:12]}"


def _listed(files: str | list[str]) -> list[str]:
    return [files] if isinstance(files, str) else list(files)


def _recorded(run_dir: Path) -> dict[str, Any]:
    """The record; empty when there is none or it is not one (planted, damaged: nothing compared)."""
    try:
        recorded = read_json(Path(run_dir) / DATA_SOURCES)
    except (OSError, ValueError):
        return {}
    return recorded if isinstance(recorded, dict) else {}
