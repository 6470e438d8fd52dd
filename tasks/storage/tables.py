"""Atomic parquet and JSON artifacts and their references (the per-iteration manifest that names them
is in manifests.py).

Every write goes to a temp file in the destination folder and is renamed onto its final name: a
crash of the process leaves the previous file or the new one, never a part of one, and no temp file.
A record read without a digest (a manifest, a JSON or text file) is fsynced before its rename and
its folder after, so a crash of the machine leaves it whole too. A parquet file, always read by its
digest, is fsynced in the background (`durability.sync_later`) and waited for before a manifest
names it (DESIGN.md "Atomic writes and the manifest").
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import numbers
import os
import re
import secrets
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from ppoflow.tasks.storage.durability import sync_later
from ppoflow.tasks.storage.recent_tables import LIMIT_BYTES, file_identity, recall, remember
from ppoflow.tasks.storage.regular_files import open_regular_file, refuse_links_below

__all__ = [
    "ArtifactCorrupt",
    "ArtifactRef",
    "artifact_is_valid",
    "conform_table",
    "file_digest",
    "iteration_dir",
    "read_json",
    "read_table",
    "stage_path",
    "step_of",
    "MAX_STEP",
    "saved_folders",
    "write_json_atomic",
    "write_text_atomic",
    "write_bytes_atomic",
    "write_table",
    "IOClock",
]


class IOClock:
    """Seconds a run has spent reading and writing its files, in total and by kind ("tables": parquet
    and manifests, "checkpoints", "catalog": DuckDB): one per run, held by its `Run`, reported by
    benchmarks/iteration.py."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.by_kind: dict[str, float] = {}

    @contextlib.contextmanager
    def timing(self, kind: str = "tables") -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.seconds += elapsed
            self.by_kind[kind] = self.by_kind.get(kind, 0.0) + elapsed


def timed_io(kind: str):
    """A decorator: the function takes a keyword `clock` (an IOClock, or None), to which the call's
    wall time is added as `kind`."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, clock: IOClock | None = None, **kwargs):
            if clock is None:
                return fn(*args, **kwargs)
            with clock.timing(kind):
                return fn(*args, **kwargs)

        return wrapper

    return decorate


RESULTS_DIR = ".prefect-results"
"""The run's folder of stored stage results (Prefect's, as `pipeline.results` writes them)."""
COMPRESSION = "zstd"
COMPRESS_FROM_BYTES = 1 << 16
"""Smaller tables are written uncompressed: zstd would save a few kilobytes and costs a set-up per
column (the embedded default's 74-column metrics row: 4.0 ms compressed, 1.3 ms not)."""
_CHUNK = 1 << 20
_STAGE_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_ITER_NAME = re.compile(r"iter=([0-9]+)")
MAX_STEP = 999_999_999
"""The largest step a run holds: nine digits at most, so that every step number is one DuckDB's
INTEGER holds (a planted `iter=999999999999` folder is not a step folder: no reader fails on it)."""


@dataclass(frozen=True)
class ArtifactRef:
    """A written artifact (a parquet file, or an iteration's manifest): `path` relative to the run
    directory (runs can be moved), `digest` "sha256:<hex>" of its bytes, and its row count (a
    manifest's: its number of stages). Small and JSON-able: what tasks return."""

    path: str
    digest: str
    rows: int

    def __post_init__(self) -> None:
        _relative(self.path)  # a reference read back from a run directory must not point outside it

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ArtifactRef:
        return cls(path=str(data["path"]), digest=str(data["digest"]), rows=int(data["rows"]))


class ArtifactCorrupt(ValueError):
    """An artifact's bytes no longer match the digest recorded when it was written."""

    def __init__(self, path: str | Path, expected: str, actual: str):
        self.path, self.expected, self.actual = str(path), expected, actual
        super().__init__(
            f"artifact {path} is corrupt: expected {expected}, file has {actual} (truncated or "
            "changed since it was written); delete it and rerun the stage that wrote it"
        )

    def __reduce__(self):  # picklable with its three arguments (Prefect persists failures)
        return type(self), (self.path, self.expected, self.actual)


def _digest(data: bytes | pa.Buffer) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def file_digest(path: str | Path) -> str:
    """'sha256:<hex>' of a regular file's bytes, read in 1 MiB chunks (an OSError for anything else:
    a FIFO planted under an artifact's name would block the read forever)."""
    with _open_regular(path) as f:
        return _stream_digest(f)


def _stream_digest(f: BinaryIO) -> str:
    sha = hashlib.sha256()
    while chunk := f.read(_CHUNK):
        sha.update(chunk)
    return f"sha256:{sha.hexdigest()}"


def _open_regular(path: str | Path) -> BinaryIO:
    """`path` opened for reading if it is a regular file; an OSError otherwise. Opened without
    blocking, so that a FIFO planted under a file's name cannot stall the run."""
    return open(open_regular_file(path, os.O_RDONLY, follow_links=True), "rb")


def conform_table(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """`table` with exactly `schema`'s columns, order, types and field docs, or a ValueError that
    names the missing/unexpected columns, the column that cannot be cast, or nulls in a required one."""
    name = (schema.metadata or {}).get(b"table", b"declared").decode()
    have, want = table.column_names, schema.names
    if len(set(have)) != len(have):
        raise ValueError(f"table has duplicate columns: {sorted({c for c in have if have.count(c) > 1})}")
    missing, extra = [c for c in want if c not in have], [c for c in have if c not in want]
    if missing or extra:
        raise ValueError(
            f"table does not match the {name} schema: missing columns {missing}, unexpected columns {extra}"
        )
    columns = []
    for field in schema:
        column = table.column(field.name)
        try:
            column = column.cast(field.type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
            raise ValueError(
                f"column {field.name!r}: cannot cast {column.type} to {field.type}: {exc}"
            ) from exc
        if not field.nullable and column.null_count:
            raise ValueError(f"column {field.name!r} is required by the {name} schema but has nulls")
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=schema)


@timed_io("tables")
def write_table(
    table: pa.Table,
    run_dir: str | Path,
    relative_path: str,
    schema: pa.Schema | None = None,
    *,
    sync_now: bool = False,
) -> ArtifactRef:
    """Write `table` as parquet to run_dir/relative_path atomically (conformed to `schema` when
    given; zstd from COMPRESS_FROM_BYTES) and return its reference. Its fsync is queued
    (durability.py), unless `sync_now`: a table read without its digest is a record."""
    relative = _relative(relative_path)
    final = Path(run_dir) / relative
    refuse_links_below(run_dir, final.parent)
    if schema is not None:
        try:
            table = conform_table(table, schema)
        except ValueError as exc:
            raise ValueError(f"{final}: {exc}") from exc
    if relative.startswith("iter=") and "iter" in table.column_names:
        raise ValueError(f"{final}: a column named 'iter' would clash with the iter=NNNNNN folder")
    sink = pa.BufferOutputStream()
    try:
        compression = COMPRESSION if table.nbytes >= COMPRESS_FROM_BYTES else "none"
        pq.write_table(table, sink, compression=compression)
    except Exception as exc:
        raise _naming_path(exc, final) from exc
    digest = _atomic_write(final, sink.getvalue(), sync_now=sync_now)
    with contextlib.suppress(OSError):  # kept for this process's next reads (recent_tables.py)
        remember(final, digest, file_identity(final), table)
    return ArtifactRef(path=relative, digest=digest, rows=table.num_rows)


@timed_io("tables")
def read_table(run_dir: str | Path, ref: ArtifactRef, *, verify: bool = True) -> pa.Table:
    """Read a referenced parquet file; with `verify`, raise ArtifactCorrupt unless its digest matches."""
    path = Path(run_dir) / ref.path
    if not verify:
        return _read_parquet(path)
    recent = recall(path, ref.digest)
    if recent is not None:
        return recent
    with _open_regular(path) as f:
        identity = file_identity(f.fileno())
        if identity[2] > LIMIT_BYTES:  # hashed in chunks and parsed from the same open file
            actual = _stream_digest(f)
            if actual != ref.digest:
                raise ArtifactCorrupt(path, ref.digest, actual)
            f.seek(0)
            return _read_parquet(f)
        data = f.read()
    actual = _digest(data)
    if actual != ref.digest:
        raise ArtifactCorrupt(path, ref.digest, actual)
    table = _read_parquet(pa.BufferReader(data))
    remember(path, actual, identity, table)
    return table


def _read_parquet(source: Path | pa.BufferReader | BinaryIO) -> pa.Table:
    # A file, not a dataset: no partition columns are inferred from the iter= folder.
    with pq.ParquetFile(source) as parquet:
        return parquet.read()


def artifact_is_valid(run_dir: str | Path, ref: ArtifactRef) -> bool:
    """True when the referenced file exists and its digest matches; never raises for a missing file."""
    try:
        return file_digest(Path(run_dir) / ref.path) == ref.digest
    except OSError:
        return False


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write a text file with the same temp-file, fsync and rename as every artifact."""
    _atomic_write(Path(path), text.encode())


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write a file's bytes with the same temp-file, fsync and rename as every artifact: a planted
    link or FIFO at `path` is replaced, never followed."""
    _atomic_write(Path(path), data)


@timed_io("tables")
def write_json_atomic(path: str | Path, obj: Any) -> str:
    """Write `obj` as indented, key-sorted JSON atomically (ArtifactRefs and Paths are serialized);
    returns the file's digest."""
    return _atomic_write(Path(path), _json_bytes(obj))


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n").encode()


def read_json(path: str | Path) -> Any:
    with _open_regular(path) as f:
        return json.loads(f.read())


def iteration_dir(run_dir: str | Path, iteration: int) -> Path:
    return Path(run_dir) / f"iter={iteration_number(iteration):06d}"


def step_of(folder_name: str) -> int | None:
    """The step an `iter=NNNNNN` folder holds, from its name as ppoflow writes it (six digits at
    least, no other form, at most MAX_STEP); None for any other name (planted, say)."""
    match = _ITER_NAME.fullmatch(folder_name)
    if match is None or len(match[1]) > len(str(MAX_STEP)) or folder_name != f"iter={int(match[1]):06d}":
        return None
    return int(match[1])


def saved_folders(root: Path, name: str) -> list[Path]:
    """root/iter=<step>/<name> (a role's model or optimizer folder), oldest step first, by number;
    an `iter=` folder not named as ppoflow names them (`tables.step_of`; planted, say) is none."""
    found = ((step_of(path.parent.name), path) for path in root.glob(f"iter=*/{name}"))
    return [path for _, path in sorted((step, path) for step, path in found if step is not None)]


def stage_path(iteration: int, stage: str, part: int = 0) -> str:
    """Relative path of a stage's parquet part: 'iter=000001/rollouts/part-00000.parquet'."""
    if not _STAGE_NAME.match(stage):
        raise ValueError(f"stage name {stage!r} must be lower-case letters, digits and '_'")
    if part < 0:
        raise ValueError(f"part must be >= 0, got {part}")
    return f"iter={iteration_number(iteration):06d}/{stage}/part-{part:05d}.parquet"


def _atomic_write(path: Path, data: bytes | pa.Buffer, *, sync_now: bool = True) -> str:
    """Write `data` to a temp file beside `path` and rename it into place; return the digest of the
    bytes. With `sync_now` the file is fsynced before the rename and its folder after; without, both
    are fsynced in the background after the rename (durability.py). On any failure remove the temp
    file and re-raise naming `path`."""
    folder = path.parent
    # A dot name with a .tmp suffix: never matched by the catalog's '*.parquet' globs.
    tmp = folder / f".{path.name}.{secrets.token_hex(6)}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
            f.write(data)
            if sync_now:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if sync_now:
            _fsync_dir(folder)
        else:
            sync_later([path, folder])
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if not isinstance(exc, Exception) or str(path) in str(exc):
            raise
        raise _naming_path(exc, path) from exc
    return _digest(data)


def _naming_path(exc: Exception, path: Path) -> Exception:
    """The same kind of error, with a message that names the file that could not be written."""
    try:
        if isinstance(exc, OSError) and exc.errno is not None:
            return type(exc)(exc.errno, f"{exc.strerror}; could not write", str(path))
        return type(exc)(f"could not write {path}: {exc}")
    except Exception:  # an exception type with an unusual constructor
        return OSError(f"could not write {path}: {type(exc).__name__}: {exc}")


def _fsync_dir(folder: Path) -> None:
    if os.name != "posix":  # Windows cannot open a directory for fsync; rename is already durable
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _relative(relative_path: str) -> str:
    rel = PurePosixPath(relative_path)
    if rel.is_absolute() or not rel.parts or ".." in rel.parts:
        raise ValueError(f"artifact path must be relative to the run directory, got {relative_path!r}")
    return rel.as_posix()


def iteration_number(iteration: int) -> int:
    """`iteration` as an int, checked: an integer from 0 to MAX_STEP (a bool is not one)."""
    integral = isinstance(iteration, numbers.Integral) and not isinstance(iteration, bool)
    if not integral or not 0 <= iteration <= MAX_STEP:
        raise ValueError(f"iteration must be an int from 0 to {MAX_STEP:,}, got {iteration!r}")
    return int(iteration)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, ArtifactRef):
        return obj.to_dict()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")
