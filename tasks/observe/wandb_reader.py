"""Read an offline wandb run back without the network or a wandb account: its config, history (one
dict per logged step) and summary, and the tables it logged (`val/generations`).

wandb (0.31) writes `RUN_DIR/wandb/offline-run-<time>-<id>/run-<id>.wandb` in a LevelDB-log-style format
and no longer ships a Python reader for it. The file starts with a 7-byte header: b":W&B", the magic
0xBEE1 and version 0 (little-endian uint16, uint8). The rest is 32 KiB blocks, counted from the file's
start, of records with a 7-byte header: a checksum (uint32, zlib's CRC-32 of the type byte then the
data), the data length (uint16) and the type (uint8): FULL, or FIRST, MIDDLE…, LAST for a record split
across blocks. A block with fewer than 7 bytes left is padded with zeros. Each record is a
`wandb.proto.wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FILE_HEADER = struct.Struct("<4sHB")
IDENT, MAGIC, VERSION = b":W&B", 0xBEE1, 0
RECORD_HEADER = struct.Struct("<IHB")
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


class WandbFileError(ValueError):
    """The file is not a wandb run file, or a record's checksum does not match."""


def read_records(path: str | Path) -> Iterator[bytes]:
    """The serialized records of a .wandb file, in order. A file cut off inside a record (a run still
    being written, or killed) ends at the last complete one."""
    data = Path(path).read_bytes()
    if len(data) < FILE_HEADER.size or FILE_HEADER.unpack_from(data) != (IDENT, MAGIC, VERSION):
        raise WandbFileError(f"{path}: not a wandb run file (header {data[:7]!r})")
    pos, pending = FILE_HEADER.size, bytearray()
    while True:
        left = BLOCK - pos % BLOCK
        if left < RECORD_HEADER.size:  # the block's zero-padded tail
            pos += left
            continue
        if pos + RECORD_HEADER.size > len(data):
            return
        checksum, length, kind = RECORD_HEADER.unpack_from(data, pos)
        if kind == 0 and length == 0:  # zeros to the end of the block
            pos += left
            continue
        chunk = data[pos + RECORD_HEADER.size : pos + RECORD_HEADER.size + length]
        if len(chunk) < length:
            return
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != checksum:
            raise WandbFileError(f"{path}: checksum mismatch in the record at byte {pos}")
        pos += RECORD_HEADER.size + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = bytearray(chunk)
        elif kind in (MIDDLE, LAST):
            pending += chunk
            if kind == LAST:
                yield bytes(pending)
        else:
            raise WandbFileError(f"{path}: unknown record type {kind} at byte {pos}")


@dataclass
class OfflineRun:
    """What a wandb run recorded. `history` holds one dict per logged step (`_step` is the step)."""

    folder: Path
    run_id: str = ""
    project: str = ""
    name: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    exit_code: int | None = None
    """The run's exit code as wandb recorded it at finish (None: never finished)."""

    def step(self, step: int) -> dict[str, Any]:
        """The history row of `step`; KeyError when nothing was logged there."""
        rows = [row for row in self.history if row.get("_step") == step]
        if not rows:
            raise KeyError(f"no history at step {step}")
        return rows[0]

    def table(self, value: dict[str, Any]) -> list[dict[str, Any]]:
        """The rows of a logged wandb Table, given its history value (a 'table-file' reference)."""
        if value.get("_type") != "table-file":
            raise ValueError(f"not a logged table: {value!r}")
        table = json.loads((self.folder / "files" / value["path"]).read_text())
        return [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]


def offline_runs(run_dir: str | Path) -> list[Path]:
    """The wandb run folders under a ppoflow run directory, oldest first."""
    return sorted(p for p in (Path(run_dir) / "wandb").glob("offline-run-*") if p.is_dir())


def read_run(path: str | Path) -> OfflineRun:
    """Read a wandb run: a .wandb file, an offline-run-* folder, or a ppoflow run directory (its
    latest wandb run)."""
    path = Path(path)
    if path.is_dir() and not list(path.glob("run-*.wandb")):
        runs = offline_runs(path)
        if not runs:
            raise FileNotFoundError(f"no wandb/offline-run-* folder in {path}")
        path = runs[-1]
    files = [path] if path.is_file() else sorted(path.glob("run-*.wandb"))
    if len(files) != 1:
        raise FileNotFoundError(f"expected one run-*.wandb file in {path}, found {len(files)}")
    from wandb.proto import wandb_internal_pb2

    run = OfflineRun(folder=files[0].parent)
    for data in read_records(files[0]):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        _apply(run, record)
    return run


def _apply(run: OfflineRun, record) -> None:
    match record.WhichOneof("record_type"):
        case "run":
            run.run_id, run.project, run.name = record.run.run_id, record.run.project, record.run.display_name
            _update(run.config, record.run.config.update, record.run.config.remove)
        case "config":
            _update(run.config, record.config.update, record.config.remove)
        case "history":
            row: dict[str, Any] = {}
            _update(row, record.history.item, ())
            run.history.append(row)
        case "summary":
            _update(run.summary, record.summary.update, record.summary.remove)
        case "exit":
            run.exit_code = record.exit.exit_code


def _update(target: dict[str, Any], items, removed) -> None:
    """Apply wandb's key/value_json items (a key, or a nested_key path) to a dict."""
    for item in items:
        *parents, last = [item.key] if item.key else list(item.nested_key)
        node = target
        for name in parents:
            node = node.setdefault(name, {})
        node[last] = json.loads(item.value_json)
    for item in removed:
        *parents, last = [item.key] if item.key else list(item.nested_key)
        node = target
        for name in parents:
            node = node.get(name, {})
        node.pop(last, None)
