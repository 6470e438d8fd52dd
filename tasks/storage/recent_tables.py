"""Tables this process wrote or verified, kept in memory for the stages after it.

The stages of an iteration read what the stages before them wrote: the rollouts table alone is read
by the rewards, advantages, update and metrics stages. `read_table` (tasks/storage/tables.py) takes
a table from here while its file is still the one whose digest was checked: the same device, inode,
size, and modification and status-change times (nanoseconds; the latter no call can set back) as
when it was written or read. Any other file (written by another process, or changed since) is read
and verified from disk. (A same-size rewrite in place within the filesystem's timestamp granularity
of the write, one clock tick on kernels before 6.13, would keep the identity.) At most LIMIT_BYTES
of tables are kept, the least recently used dropped first.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

LIMIT_BYTES = 256 << 20

FileIdentity = tuple[int, int, int, int, int]


@dataclass(frozen=True)
class _Entry:
    digest: str
    identity: FileIdentity
    table: pa.Table
    nbytes: int


_entries: OrderedDict[str, _Entry] = OrderedDict()
_kept_bytes = 0
_lock = threading.Lock()


def file_identity(path: int | str | Path) -> FileIdentity:
    """(device, inode, size, modification and status-change times in ns) of `path` or an open file
    descriptor (an OSError if it is gone)."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def remember(path: str | Path, digest: str, identity: FileIdentity, table: pa.Table) -> None:
    """Keep `table`, the content of the file at `path` with `digest` while it has `identity`."""
    global _kept_bytes
    nbytes = table.nbytes
    if nbytes > LIMIT_BYTES:
        return
    key = os.path.abspath(path)
    with _lock:
        _drop(key)
        _entries[key] = _Entry(digest, identity, table, nbytes)
        _kept_bytes += nbytes
        while _kept_bytes > LIMIT_BYTES:
            _drop(next(iter(_entries)))


def _drop(key: str) -> None:
    global _kept_bytes
    entry = _entries.pop(key, None)
    if entry is not None:
        _kept_bytes -= entry.nbytes


def recall(path: str | Path, digest: str) -> pa.Table | None:
    """The table kept for `path` when its file is unchanged and has `digest`; else None."""
    key = os.path.abspath(path)
    with _lock:
        entry = _entries.get(key)
    if entry is None or entry.digest != digest:
        return None
    try:
        unchanged = file_identity(path) == entry.identity
    except OSError:
        unchanged = False
    with _lock:
        current = _entries.get(key) is entry  # not replaced by another thread meanwhile
        if not unchanged:
            if current:
                _drop(key)
            return None
        if current:
            _entries.move_to_end(key)
    return entry.table


def forget_all() -> None:
    """Drop every kept table."""
    global _kept_bytes
    with _lock:
        _entries.clear()
        _kept_bytes = 0
