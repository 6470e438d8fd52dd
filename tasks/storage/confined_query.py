"""`ppoflow query` and every reader of a run (show, diagnose, report): read-only SQL over a run's
tables, confined to its directory.

A reader never runs SQL read from the run: it defines the views itself, from the files there now, on
an in-memory database (`define_run_views` with the files listed, the definitions of the run's
catalog.duckdb otherwise, or for a retraining directory `define_retrain_views`). So a copied or moved
run reads as it is, and a damaged, deleted or planted catalog.duckdb changes nothing. The connection
is confined with DuckDB's own settings before any view is defined, locked so that no SET or RESET
undoes them (_lock_down): it opens files only under the directory (DuckDB resolves `..` and symlinks
before its prefix check, and `runs/demo-evil` is not under `runs/demo`; a link planted where a view
reads is named, with its target, when a read meets it), installs and loads no extension, sees no
Python object as a table and spills nothing to a temp folder. The directory stays readable, as the views
need it, and DuckDB would write there too; so `query` also runs read statements only: SELECT (which
covers WITH, VALUES, FROM-first, DESCRIBE, SHOW and SUMMARIZE), PIVOT, and EXPLAIN of a SELECT.
Every statement is checked before the first runs; COPY, ATTACH, USE, SET, LOAD … are a ValueError
naming their type.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import duckdb

from ppoflow.tasks.storage.catalog import VIEWS, checked_dir, define_run_views, sql_literal
from ppoflow.tasks.storage.retrain_tables import RETRAIN_VIEWS, define_retrain_views, is_retraining_directory

__all__ = ["connect_confined", "explained", "query", "query_batches"]

_ALIAS = "catalog"
BATCH_ROWS = 10_000


class NotARunDirectory(FileNotFoundError):
    """A directory that is neither a ppoflow run nor a retraining directory."""


@dataclass(frozen=True)
class Views:
    """The views of one kind of directory, and how to define those of them a query reads."""

    names: tuple[str, ...]
    define: Callable[[duckdb.DuckDBPyConnection, Path, Collection[str]], None]


def views_of(directory: Path) -> Views:
    """The views of a run directory (it has its config.yaml) or of a retraining directory."""
    if (directory / "config.yaml").is_file():
        return Views(VIEWS, _define_listed_run_views)
    if is_retraining_directory(directory):
        return Views(RETRAIN_VIEWS, define_retrain_views)
    raise NotARunDirectory(
        f"{directory} is not a ppoflow run directory (no config.yaml) nor a retraining directory"
    )


def _define_listed_run_views(con: duckdb.DuckDBPyConnection, directory: Path, names: Collection[str]) -> None:
    """A run's views over the files there now (one connection's: it sees no later step)."""
    define_run_views(con, directory, names, listed=True)


_LISTS_VIEWS = frozenset(
    {"show", "information_schema", "pg_catalog", "sqlite_master", "pg_tables", "pragma_show_tables"}
    | {"duckdb_views", "duckdb_tables", "duckdb_columns", "duckdb_dependencies", "duckdb_constraints"}
)


def views_read_by(sql: str, names: tuple[str, ...]) -> tuple[str, ...]:
    """The views `sql` may read: each whose name is a word of it (quoted, in a string or a comment:
    more than it reads, never fewer), or all when it lists the views. A view binds every file of its
    table when it is defined, ~0.1–0.2 s per view in a run of 1,000 steps: a query defines only these."""
    words = {word.lower() for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", sql)}
    if words & _LISTS_VIEWS:
        return names
    return tuple(name for name in names if name in words)


def connect_confined(
    run_dir: str | Path,
    sql: str | None = None,
    *,
    views: Collection[str] | None = None,
    steps: Collection[int] | None = None,
    unify: bool = False,
) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with the directory's views (views_of; with `sql`, only those
    it reads; with `views`, only those named there; a run's over its `steps` only, when given),
    confined to the directory (_lock_down). Close it when done (or use it as a context manager). A
    table file that cannot be read is a ValueError that says what to do (explained)."""
    directory = checked_dir(run_dir)
    kind = views_of(directory)
    names = kind.names if sql is None else views_read_by(sql, kind.names)
    if views is not None:
        names = tuple(name for name in names if name in views)
    con = duckdb.connect(":memory:")
    try:
        con.execute(f"ATTACH ':memory:' AS {_ALIAS}")
        con.execute(f"USE {_ALIAS}")
        con.execute("SET parquet_metadata_cache = true")  # the footers a view's definition read, read once
        _lock_down(con, directory)  # before the views are defined: defining one reads footers
        with explained(directory, kind.names):
            if kind.define is _define_listed_run_views:
                define_run_views(con, directory, names, listed=True, steps=steps, unify=unify)
            else:
                kind.define(con, directory, names)
    except BaseException:
        con.close()
        raise
    return con


def _lock_down(con: duckdb.DuckDBPyConnection, run_dir: Path) -> None:
    """Confine a connection to the run directory, once the catalog is attached: with external access
    off, DuckDB checks every path it opens (file, glob, ATTACH, COPY, extension folder) against
    allowed_directories, and lock_configuration refuses every later SET and RESET. In this order:
    turning external access off adds DuckDB's temp folder to the allowed directories unless
    temp_directory is emptied first, and allowed_directories cannot change once external access is off."""
    for setting in (
        "temp_directory = ''",
        f"allowed_directories = [{sql_literal(str(run_dir))}]",
        "enable_external_access = false",
        "autoinstall_known_extensions = false",
        "autoload_known_extensions = false",
        "allow_community_extensions = false",
        "python_enable_replacements = false",
        "lock_configuration = true",
    ):
        con.execute(f"SET {setting}")


_READS = ("SELECT", "PIVOT", "EXPLAIN SELECT")
"""The statement kinds (see _kind) that query runs."""


def _read_statements(
    con: duckdb.DuckDBPyConnection, sql: str, views: Collection[str]
) -> list[duckdb.Statement]:
    """The statements of `sql`, parsed by DuckDB; a ValueError unless there is one at least and every
    one is a read (_READS). The connection alone would still let COPY or ATTACH write in the run."""
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as exc:
        raise ValueError(f"{exc}\navailable views: {', '.join(sorted(views))}") from exc
    if not statements:
        raise ValueError("no SQL statement to run; ppoflow query runs read-only SELECT statements")
    for statement in statements:
        kind = _kind(con, statement)
        if kind not in _READS:
            raise ValueError(
                "ppoflow query runs read-only SELECT statements (SELECT, WITH, VALUES, FROM, DESCRIBE, "
                f"SHOW, SUMMARIZE, PIVOT, EXPLAIN of a SELECT); refused this {kind} statement: "
                f"{_excerpt(statement.query)}"
            )
    return statements


def _kind(con: duckdb.DuckDBPyConnection, statement: duckdb.Statement) -> str:
    """DuckDB's type of a statement. EXPLAIN also names what it explains, since EXPLAIN ANALYZE runs
    it; a PIVOT without an IN list, which DuckDB types MULTI (a temporary enum type, then a SELECT),
    is PIVOT."""
    suffixes = _token_suffixes(statement.query)
    first = next(suffixes, "")
    if statement.type == duckdb.StatementType.EXPLAIN:
        explained = _first_statement(con, suffixes)
        return f"EXPLAIN {_kind(con, explained) if explained else 'UNKNOWN'}"
    if statement.type == duckdb.StatementType.MULTI and re.match(r"PIVOT(_WIDER)?\b", first, re.I):
        return "PIVOT"
    return statement.type.name


def _first_statement(con: duckdb.DuckDBPyConnection, texts: Iterator[str]) -> duckdb.Statement | None:
    """The first text that parses as one statement: after EXPLAIN, this skips ANALYZE or an option
    list such as (ANALYZE, FORMAT json) and finds the statement explained."""
    for text in texts:
        try:
            parsed = con.extract_statements(text)
        except duckdb.ParserException:
            continue
        return parsed[0] if len(parsed) == 1 else None
    return None


def _token_suffixes(sql: str) -> Iterator[str]:
    """`sql` from each of its tokens on, comments skipped (duckdb.tokenize counts UTF-8 bytes)."""
    raw = sql.encode()
    for start, kind in duckdb.tokenize(sql):
        if kind != duckdb.token_type.comment:
            yield raw[start:].decode()


def _excerpt(sql: str, limit: int = 120) -> str:
    text = " ".join(sql.split())
    return text if len(text) <= limit else f"{text[: limit - 1]}…"


def query(
    run_dir: str | Path, sql: str, *, views: Collection[str] | None = None
) -> tuple[list[str], list[tuple]]:
    """Run `sql`, one or more read statements, over the run's tables; returns (column names, rows)
    of the last. All statements are checked before the first runs (_read_statements). A SQL error is
    a ValueError carrying DuckDB's message and the available views; so is a file outside the run.
    `views`: define only these (none: `sql` reads the run's files by their paths)."""
    with query_batches(run_dir, sql, views=views) as (columns, batches):
        return columns, [row for batch in batches for row in batch]


@contextlib.contextmanager
def query_batches(
    run_dir: str | Path, sql: str, batch_rows: int = BATCH_ROWS, *, views: Collection[str] | None = None
) -> Iterator[tuple[list[str], Iterator[list[tuple]]]]:
    """`query`, its rows fetched `batch_rows` at a time while the block runs: a large result is
    never held whole in memory."""
    directory = checked_dir(run_dir)
    names = views_of(directory).names
    try:
        con = _executed(directory, sql, views, unify=False)
    except MixedColumns:  # a file between a table's first and last lacks one of their columns
        con = _executed(directory, sql, views, unify=True)
    with con:
        columns = [d[0] for d in con.description]

        def batches() -> Iterator[list[tuple]]:
            with explained(directory, names):
                while rows := con.fetchmany(batch_rows):
                    yield rows

        yield columns, batches()


class MixedColumns(ValueError):
    """A table's files do not all have the columns of its first and its last."""


def _executed(
    directory: Path, sql: str, views: Collection[str] | None, *, unify: bool
) -> duckdb.DuckDBPyConnection:
    """A confined connection that has run every statement of `sql` (the last one's rows still to
    fetch); MixedColumns when a view bound from two files met a file with fewer columns."""
    names = views_of(directory).names
    con = connect_confined(directory, sql, views=views, unify=unify)
    try:
        statements = _read_statements(con, sql, names)
        with explained(directory, names):
            for statement in statements:
                try:
                    con.execute(statement)
                except duckdb.InvalidInputException as exc:
                    if not unify and "schema mismatch" in str(exc):
                        raise MixedColumns(str(exc)) from exc
                    raise
    except BaseException:
        con.close()
        raise
    return con


@contextlib.contextmanager
def explained(directory: Path, views: Collection[str]) -> Iterator[None]:
    """DuckDB's errors as a ValueError that says what to do: the available `views`; that only the
    run's files can be read; that a damaged table file is recomputed by training again."""
    available = f"available views: {', '.join(sorted(views))}"
    try:
        yield
    except duckdb.PermissionException as exc:
        if outside := _links_out(directory):
            raise ValueError(f"{directory}{outside}") from exc
        raise ValueError(
            f"{exc}\na query may read only the run's files, under {directory} (a relative path "
            f"is taken from the current directory); {available}"
        ) from exc
    except duckdb.Error as exc:
        if _DAMAGED_PARQUET.search(str(exc)):  # one line: DuckDB's first (it names the file), and the fix
            raise ValueError(
                f"{str(exc).strip().splitlines()[0]}: a table file of the run is damaged: run the "
                "training command again to recompute the stage that wrote it (its digest no longer "
                "matches its manifest)"
            ) from exc
        raise ValueError(f"{exc}\n{available}") from exc


READ_BY_VIEWS = ("data", "rounds")
"""Folders the views read besides the step folders (`iter=…`) and a retraining directory's own parquet
files. A link elsewhere (checkpoints kept on another disk) is the user's: no view reads it."""


def _links_out(directory: Path, limit: int = 3) -> str:
    """The symbolic links in the run that lead out of it where its views read, said with what to do;
    "" when there are none. Looked for when DuckDB refused to read a file (the confinement names the
    file, not the link on its way)."""
    outside, root = [], directory.resolve()
    for top in sorted(directory.iterdir()):
        if not (top.name.startswith("iter=") or top.name in READ_BY_VIEWS or top.suffix == ".parquet"):
            continue
        for path in (top, *sorted(top.rglob("*") if top.is_dir() and not top.is_symlink() else ())):
            if path.is_symlink() and not path.resolve().is_relative_to(root):  # (rglob follows no link)
                outside.append(f"{path} -> {os.readlink(path)}")
    if not outside:
        return ""
    more = f" and {len(outside) - limit} more" if len(outside) > limit else ""
    named = ", ".join(outside[:limit])
    return (
        f" holds symbolic links that lead out of it, where its views read: {named}{more}: "
        "remove them, or put a copy of the file there"
    )


_DAMAGED_PARQUET = re.compile(r"No magic bytes found|Invalid Input Error: .*[Pp]arquet|Corrupt", re.S)
