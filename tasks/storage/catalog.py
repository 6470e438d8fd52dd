"""run_dir/catalog.duckdb: DuckDB views over every table of a run, all iterations at once.

The catalog holds views only; the data stays in the parquet files. It is rebuilt in a temp database
and renamed into place, so it is never held open read-write: readers (`duckdb catalog.duckdb`,
`connect_readonly`, other processes) are never locked out, and never see a half-made catalog.
Readers that were open before a refresh keep the previous catalog until they reconnect.
Views name absolute paths: after moving a run directory, call refresh_catalog again.

Iteration views glob `iter=NNNNNN/<stage>/*.parquet` (six digits; steps from 1,000,000 on, one glob
per longer width), so a new iteration's rows appear without a refresh once the view exists, and a
folder ppoflow did not name (`iter=000005'`, `iter=5`, a copy) is never read: one would have failed
every query of the table, or counted its rows twice. `iter` comes from the file name, not from
DuckDB's hive partitioning: hive parsing reads every `key=value` folder of the absolute path, so a
run under `runs/seed=3/` would overwrite the rollouts' `seed` column with 3, and it types
`iter=000001` as VARCHAR. Filters on `iter` still prune files.

It is for any DuckDB client (`duckdb catalog.duckdb`, pandas, polars). ppoflow's own readers do not
open it: they define the same views from the files themselves (confined_query.py).
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Collection
from pathlib import Path

import duckdb
import pyarrow as pa

from ppoflow.tasks.storage.schemas import (
    DATA_FILES,
    INVARIANTS,
    ITERATION_TABLES,
    TABLES,
    empty_table,
)
from ppoflow.tasks.storage.step_files import (
    ITER,
    listed_files_sql,
    sql_literal,
    step_folders,
    table_files,
)
from ppoflow.tasks.storage.tables import iteration_dir, read_json, step_of, timed_io, write_json_atomic

__all__ = [
    "CATALOG_NAME",
    "VIEWS",
    "check_invariants",
    "connect_readonly",
    "define_run_views",
    "empty_table_sql",
    "refresh_catalog",
    "write_catalog",
    "table_violations",
]

CATALOG_NAME = "catalog.duckdb"
CATALOG_TABLES = ".catalog-tables.json"
"""Which tables had files at the last refresh (see refresh_catalog_if_stale)."""
VIEWS: tuple[str, ...] = (*TABLES, "updates")
_ALIAS = "catalog"
UPDATES_DOC = (
    "A view: the rows of actor_update and critic_update together, with `role` ('actor' or 'critic') "
    "first; their columns: `ppoflow schema actor_update`, `ppoflow schema critic_update`."
)
_UPDATES = (
    "SELECT 'actor' AS role, * FROM actor_update "
    "UNION ALL BY NAME SELECT 'critic' AS role, * FROM critic_update"
)


@timed_io("catalog")
def refresh_catalog_if_stale(run_dir: str | Path, step: int | None = None) -> Path:
    """Refresh only when a table that had no files at the last refresh has some now: the views read
    their globs at query time, so new iterations of a non-empty table appear without a refresh.
    With `step` (the step just committed), only its folder and the data files are looked at, not
    every step's: a table's first files appear in the step that writes them."""
    run_dir = Path(run_dir).resolve()
    final = run_dir / CATALOG_NAME
    recorded = _recorded_tables(run_dir)
    if final.is_file() and recorded is not None:
        present = tables_with_files(run_dir, step)
        if step is None and present == recorded:
            return final
        if step is not None and set(present) <= set(recorded) and not _first_of_its_width(run_dir, step):
            return final
    return refresh_catalog.__wrapped__(run_dir)  # undecorated: this call's time is already counted


def step_folder_globs(run_dir: Path) -> list[str]:
    """Globs of the run's step folders as ppoflow names them (`tables.step_of`): `iter=` and six
    digits, and for steps from 1,000,000 on `iter=[1-9]` and the digits of each longer name there. A
    stray folder (`iter=000005'`, `iter=5`, `iter=000005 copy`) matches none."""
    longer = {len(e.name) for e in os.scandir(run_dir) if len(e.name) > _SIX and step_of(e.name) is not None}
    return ["iter=" + "[0-9]" * 6, *(_longer_glob(length) for length in sorted(longer))]


_SIX = len("iter=000000")


def _longer_glob(length: int) -> str:
    """The glob of step folders whose names have `length` characters, seven digits or more."""
    return "iter=[1-9]" + "[0-9]" * (length - len("iter=0"))


def stray_step_folders(run_dir: Path) -> list[str]:
    """The names in the run that start with `iter=` but are not a step folder ppoflow names (a copy,
    a typo): no view reads them."""
    names = (entry.name for entry in os.scandir(run_dir))
    return sorted(name for name in names if name.startswith("iter=") and step_of(name) is None)


def _first_of_its_width(run_dir: Path, step: int) -> bool:
    """Whether `step`'s folder is the run's first of seven digits or more (step 1,000,000): the views
    glob each width of step folder that existed when the catalog was built."""
    name = iteration_dir(run_dir, step).name
    return len(name) > _SIX and all(p.name == name for p in run_dir.glob(_longer_glob(len(name))))


def tables_with_files(run_dir: Path, step: int | None = None) -> list[str]:
    """The tables with files: in any step's folder, or with `step`, in that step's folder only."""
    steps = step_folder_globs(run_dir) if step is None else [iteration_dir(run_dir, step).name]
    present = []
    for name in TABLES:
        if name in DATA_FILES:
            found = any((run_dir / f).is_file() for f in DATA_FILES[name])
        else:
            found = any(next(run_dir.glob(f"{folders}/{name}/*.parquet"), None) for folders in steps)
        if found:
            present.append(name)
    return present


def _recorded_tables(run_dir: Path) -> list[str] | None:
    """The tables the last refresh found files of; None for a record that is not a list of table
    names (a damaged or planted one: the catalog is refreshed)."""
    try:
        recorded = read_json(run_dir / CATALOG_TABLES)
    except (OSError, ValueError):
        return None
    if not isinstance(recorded, list) or not all(isinstance(t, str) and t in TABLES for t in recorded):
        return None
    return recorded


@timed_io("catalog")
def refresh_catalog(run_dir: str | Path) -> Path:
    """(Re)create every view in run_dir/catalog.duckdb; returns its path. Safe while readers are open."""
    run_dir = checked_dir(run_dir)
    present = tables_with_files(run_dir)

    final = write_catalog(run_dir, lambda con: define_run_views(con, run_dir))
    write_json_atomic(run_dir / CATALOG_TABLES, present)
    return final


def define_run_views(
    con: duckdb.DuckDBPyConnection,
    run_dir: Path,
    names: Collection[str] = VIEWS,
    *,
    listed: bool = False,
    steps: Collection[int] | None = None,
    unify: bool = False,
) -> None:
    """Create on `con` the views `names` (a view per table, and `updates`) of the run directory
    `run_dir` (resolved), with the views they read. The catalog's views glob the step folders, so
    that new steps appear in them; `listed` views name the files there now (one connection's
    readers: see listed_files_sql), of `steps` only when given; `unify`: bound from every file's
    columns (a file between the first and the last lacked one of theirs)."""
    wanted = set(names) | ({"actor_update", "critic_update"} if "updates" in names else set())
    folders = step_folders(run_dir) if listed else []  # (listed once for every view)
    if steps is not None:
        kept = frozenset(steps)
        folders = [(step, folder) for step, folder in folders if step in kept]
    for name in TABLES:
        if name in wanted:
            view = _view_sql(con, run_dir, name, listed, folders, unify)
            con.execute(f"CREATE VIEW {_ident(name)} AS {view}")
    if "updates" in wanted:
        con.execute(f"CREATE VIEW updates AS {_UPDATES}")


def checked_dir(run_dir: str | Path) -> Path:
    try:
        run_dir = Path(run_dir).resolve()
    except (RuntimeError, OSError):  # Python before 3.13 raises on a symbolic link loop
        raise ValueError(f"run directory {run_dir} is a symbolic link loop: it names nothing") from None
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run directory at {run_dir}")
    if any(c in str(run_dir) for c in "*?[]{}"):
        raise ValueError(f"run directory {run_dir} contains glob characters; DuckDB cannot read it by glob")
    return run_dir


def write_catalog(run_dir: str | Path, define: Callable[[duckdb.DuckDBPyConnection], None]) -> Path:
    """Build run_dir/catalog.duckdb with the views `define` creates, in a temp database renamed into
    place (readers never see a half-made catalog and are never locked out); returns its path."""
    run_dir = checked_dir(run_dir)
    final = run_dir / CATALOG_NAME
    tmp = run_dir / f".{CATALOG_NAME}.{secrets.token_hex(6)}.tmp"
    try:
        con = duckdb.connect(str(tmp))
        try:
            define(con)
            con.execute("CHECKPOINT")
        finally:
            con.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        # A WAL left by someone who opened the old catalog read-write would be replayed onto the new one.
        Path(f"{final}.wal").unlink(missing_ok=True)
        os.replace(tmp, final)
        fd = os.open(run_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        tmp.unlink(missing_ok=True)
        Path(f"{tmp}.wal").unlink(missing_ok=True)
    return final


def connect_readonly(
    run_dir: str | Path, retries: int = 50, wait_s: float = 0.1
) -> duckdb.DuckDBPyConnection:
    """A read-only connection whose default database is the run's catalog. Retries while another
    process holds the file read-write. Close it when done (or use it as a context manager)."""
    path = Path(run_dir).resolve() / CATALOG_NAME
    if path.is_symlink():  # it would be read as the run's tables from wherever it points
        raise ValueError(f"{path} is a link, not the run's catalog; remove it and rerun the training command")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"no run directory at {path.parent}")
    if not path.is_file():
        raise FileNotFoundError(f"no catalog at {path}; has this run finished an iteration?")
    # ATTACH into a fresh in-memory database rather than duckdb.connect(path): connect() reuses an
    # open in-process instance of the same path, which would serve the catalog as it was before a refresh.
    for attempt in range(retries + 1):
        con = duckdb.connect(":memory:")
        try:
            con.execute(f"ATTACH {sql_literal(str(path))} AS {_ALIAS} (READ_ONLY)")
            con.execute(f"USE {_ALIAS}")
            return con
        except duckdb.IOException as exc:
            con.close()
            if "lock" not in str(exc).lower():
                raise
            if attempt == retries:
                raise TimeoutError(
                    f"catalog {path} stayed locked for {retries * wait_s:.1f} s; another process holds "
                    f"it read-write (close that client, or open it read-only): {exc}"
                ) from exc
            time.sleep(wait_s)
    raise AssertionError("unreachable")


def check_invariants(run_dir: str | Path) -> dict[str, list[str]]:
    """Run every INVARIANTS query over the catalog's non-empty views; returns table -> failing SQL
    (an empty dict when all hold)."""
    con = connect_readonly(run_dir)
    try:
        return _violations(con, TABLES)
    finally:
        con.close()


def table_violations(name: str, table: pa.Table) -> list[str]:
    """The INVARIANTS queries of `name` that fail on an in-memory table (an iteration table without
    an `iter` column is treated as one iteration): for tests of the stages that write them."""
    if name in ITERATION_TABLES and "iter" not in table.column_names:
        table = table.append_column("iter", pa.array([0] * table.num_rows, pa.int32()))
    con = duckdb.connect(":memory:")
    try:
        con.register(name, table)
        return _violations(con, [name]).get(name, [])
    finally:
        con.close()


def _violations(con: duckdb.DuckDBPyConnection, names) -> dict[str, list[str]]:
    failures: dict[str, list[str]] = {}
    for name in names:
        if not INVARIANTS[name] or not con.execute(f"SELECT EXISTS (FROM {_ident(name)})").fetchall()[0][0]:
            continue
        failing = [sql for sql in INVARIANTS[name] if con.execute(f"SELECT EXISTS ({sql})").fetchall()[0][0]]
        if failing:
            failures[name] = failing
    return failures


def _view_sql(
    con: duckdb.DuckDBPyConnection,
    run_dir: Path,
    name: str,
    listed: bool = False,
    folders: list[tuple[int, str]] | None = None,
    unify: bool = False,
) -> str:
    if name in DATA_FILES:
        files = [run_dir / f for f in DATA_FILES[name] if (run_dir / f).is_file()]
        if not files:
            return _empty_sql(con, name, with_iter=False)
        paths = ", ".join(sql_literal(str(f)) for f in files)
        return f"SELECT * FROM read_parquet([{paths}], hive_partitioning=false, union_by_name=true)"
    if listed:
        found = table_files(run_dir, name, folders)
        # a metrics row's columns differ by design (a validated step has more): always unified
        if not found:
            return _empty_sql(con, name, with_iter=True)
        return listed_files_sql(con, found, union=True if unify or name == "metrics" else None)
    patterns = [f"{folders}/{name}/*.parquet" for folders in step_folder_globs(run_dir)]
    patterns = [p for p in patterns if any(run_dir.glob(p))]  # read_parquet errors on a glob matching none
    if not patterns:
        return _empty_sql(con, name, with_iter=True)
    return step_files_sql([f"{run_dir}/{pattern}" for pattern in patterns])


def step_files_sql(globs: list[str]) -> str:
    """A SELECT of the rows of the step files that `globs` match (`…/iter=…/<table>/*.parquet`, each
    glob matching at least one file), each row with the iteration its file's folder names."""
    sources = ", ".join(sql_literal(glob) for glob in globs)
    return (
        f"SELECT {ITER} AS iter, * EXCLUDE (filename) FROM read_parquet([{sources}], "
        "hive_partitioning=false, union_by_name=true, filename=true)"
    )


def empty_table_sql(con: duckdb.DuckDBPyConnection, name: str) -> str:
    """A zero-row SELECT of a table with its declared columns (and `iter` for an iteration table)."""
    return _empty_sql(con, name, with_iter=name in ITERATION_TABLES)


def _empty_sql(con: duckdb.DuckDBPyConnection, name: str, *, with_iter: bool) -> str:
    """A zero-row SELECT with the declared columns, typed as DuckDB reads the parquet."""
    probe = empty_table(name)
    con.register("_schema_probe", probe)
    try:
        described = con.execute("DESCRIBE SELECT * FROM _schema_probe").fetchall()
    finally:
        con.unregister("_schema_probe")
    columns = ["CAST(NULL AS INTEGER) AS iter"] if with_iter else []
    columns += [f"CAST(NULL AS {type_}) AS {_ident(column)}" for column, type_, *_ in described]
    return f"SELECT {', '.join(columns)} LIMIT 0"


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'
