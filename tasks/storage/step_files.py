"""A run's step files as ppoflow's readers take them: the step folders listed now (`step_folders`),
each table's regular parquet files there (`table_files`), and the SQL that reads them with their
iteration, one step's (`step_sql`) or many steps' (`listed_files_sql`). A listing names the files
there at that moment: a reader's views see no later step (the catalog's views glob instead)."""

from __future__ import annotations

import os
from pathlib import Path

import duckdb

from ppoflow.tasks.storage.tables import iteration_dir, step_of

__all__ = [
    "ITER",
    "listed_files_sql",
    "parquet_files",
    "sql_literal",
    "step_folders",
    "step_sql",
    "table_files",
]

ITER = "CAST(parse_filename(parse_dirpath(parse_dirpath(filename)))[6:] AS INTEGER)"
"""A step file's iteration: the digits of its step folder's name (`…/iter=000001/<table>/<file>`; the
views read only step folders named so). DuckDB tests it on each file's name to skip the files a
filter on `iter` rules out: parsing the path is about twice as fast as a regular expression."""


def step_folders(run_dir: Path) -> list[tuple[int, str]]:
    """(step, folder path) of every step folder of the run (named as `tables.step_of` names them),
    oldest first: one listing of the run directory."""
    found = ((step_of(entry.name), entry.path) for entry in os.scandir(run_dir))
    return sorted((step, path) for step, path in found if step is not None)


def table_files(run_dir: Path, table: str, folders: list[tuple[int, str]] | None = None) -> list[str]:
    """The parquet files of an iteration table in the run's step folders (`folders`, as step_folders
    gives them, when given), oldest step first: one listing of each step folder's table folder."""
    files = []
    for _, folder in step_folders(run_dir) if folders is None else folders:
        files += parquet_files(os.path.join(folder, table))
    return files


def parquet_files(folder: str | Path) -> list[str]:
    """The parquet files of a folder, by name: regular files only (a FIFO planted as one would block
    every reader that opened it; a link loop names nothing), links to one included (one that leads
    out of the run is refused by the readers' confinement); none when the folder cannot be listed."""
    try:
        with os.scandir(folder) as entries:
            return sorted(e.path for e in entries if e.name.endswith(".parquet") and _regular(e))
    except OSError:  # not there, not a folder, a link loop, unreadable: no files of it
        return []


def _regular(entry: os.DirEntry) -> bool:
    """Whether a folder entry is a regular file, or a link to one (a link loop is none)."""
    try:
        return entry.is_file()
    except OSError:
        return False


def step_sql(run_dir: Path, table: str, step: int) -> str | None:
    """A FROM item of one step's rows of an iteration table, read from its folder alone (a step of a
    run of thousands costs what it costs in a run of ten), with `iter`; None when the folder holds
    no file of it."""
    files = parquet_files(iteration_dir(run_dir, step) / table)
    if not files:
        return None
    sources = ", ".join(sql_literal(f) for f in files)
    return (
        f"(SELECT {step}::INTEGER AS iter, * FROM read_parquet([{sources}], hive_partitioning=false, "
        "union_by_name=true))"
    )


def listed_files_sql(
    con: duckdb.DuckDBPyConnection | None, files: list[str], *, union: bool | None = None
) -> str:
    """A SELECT of the rows of `files` (step files, `…/iter=…/<table>/…parquet`), each row with the
    iteration its folder names. DuckDB binds a read of many files by reading every footer when their
    columns may differ (union_by_name), ~0.2 ms a file; files of one ppoflow version share their
    table's declared columns, so when the first and the last file have the same columns the others
    are taken to have them too, and only those two are read to bind. (A file in between that lacks
    a column fails the query; one with a column more would have it left out: only a run whose steps
    were written by two versions of ppoflow, the newer in between, could have one.) `union` decides
    instead when given (then `con` is not used)."""
    if union is None and len(files) > 1:
        assert con is not None
        first, last = _readable(con, files), _readable(con, files[::-1])
        union = first is None or last is None or first[1] != last[1]
        if first is not None and first[0] != files[0]:  # DuckDB binds from the first file it is given
            files = [first[0], *(f for f in files if f != first[0])]
    sources = ", ".join(sql_literal(f) for f in files)
    return (
        f"SELECT {ITER} AS iter, * EXCLUDE (filename) FROM read_parquet([{sources}], "
        f"hive_partitioning=false, union_by_name={str(bool(union)).lower()}, filename=true)"
    )


def _readable(con: duckdb.DuckDBPyConnection, files: list[str], tries: int = 3) -> tuple[str, list] | None:
    """The first of `files` (of the first `tries`) that DuckDB can read, and its columns; None when
    none can be (a damaged file fails only the queries that read it)."""
    for file in files[:tries]:
        try:
            return file, con.execute(f"DESCRIBE SELECT * FROM read_parquet({sql_literal(file)})").fetchall()
        except duckdb.PermissionException:
            raise
        except duckdb.Error:
            continue
    return None


def sql_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"
