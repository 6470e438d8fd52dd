"""How `ppoflow query` prints rows: a table for people, CSV or JSON for programs, written batch by
batch as DuckDB returns them (a large result is never held whole).

Values are data, never markup: a table cell `[/INST]` or `[red]` prints as written. CSV and JSON
keep every value: lists, maps and structs as JSON text in CSV and as JSON in JSON; NaN and
infinities, which JSON has no number for, as null; DECIMAL as a number; BLOB as hex."""

from __future__ import annotations

import csv
import datetime
import decimal
import json
import math
import sys
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text

TABLE_ROWS = 10_000
"""The most rows the table format draws (the rest are counted): CSV and JSON print any number."""
CELL_CHARS = 80
"""The widest a table cell is drawn; CSV and JSON print the whole value."""


def print_rows(
    columns: list[str], batches: Iterable[list[tuple]], fmt: str, console: Console, out: TextIO = sys.stdout
) -> None:
    """Print the rows of `batches` as `fmt` (table, csv or json): a table on `console`, else on `out`."""
    if fmt == "csv":
        _csv(columns, batches, out)
    elif fmt == "json":
        _json(columns, batches, out)
    else:
        _table(columns, batches, console)


_JSON_AS_IS = frozenset({type(None), bool, int, str})


def jsonable(value: Any) -> Any:
    """`value` as a DuckDB result holds it, as a JSON value (json.dumps with allow_nan=False takes it)."""
    if type(value) in _JSON_AS_IS:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, decimal.Decimal):
        if not value.is_finite():
            return None
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, datetime.date | datetime.time):  # datetime too
        return value.isoformat()
    if isinstance(value, datetime.timedelta | uuid.UUID):
        return str(value)
    return str(value)


def _csv(columns: list[str], batches: Iterable[list[tuple]], out: TextIO) -> None:
    writer = csv.writer(out)
    writer.writerow(columns)
    for rows in batches:
        writer.writerows(
            [_csv_cell(v) for v in row] if any(type(v) in _NOT_CSV for v in row) else row for row in rows
        )


_NOT_CSV = frozenset({dict, list, tuple, bytes, bytearray, memoryview})
"""Types whose str() is Python's, not CSV's: written as JSON text, or hex."""


def _csv_cell(value: Any) -> Any:
    if isinstance(value, dict | list | tuple):
        return json.dumps(jsonable(value), ensure_ascii=False, allow_nan=False)
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    return value  # None is an empty field; floats as repr (nan, inf as written)


def _json(columns: list[str], batches: Iterable[list[tuple]], out: TextIO) -> None:
    """A JSON array of objects, one a line."""
    encoder = json.JSONEncoder(ensure_ascii=False, allow_nan=False)

    def line(row: tuple) -> str:
        return encoder.encode(dict(zip(columns, map(jsonable, row), strict=True)))

    separator = "["
    for rows in batches:
        out.write(separator + "\n" + ",\n".join(map(line, rows)))
        separator = ","
    out.write("\n]\n" if separator == "," else "[]\n")


def _table(columns: list[str], batches: Iterable[list[tuple]], console: Console) -> None:
    from rich.table import Table
    from rich.text import Text

    table = Table()
    for column in columns:
        table.add_column(Text(column))
    total = cut = 0
    for rows in batches:
        for row in rows:
            total += 1
            if total <= TABLE_ROWS:
                texts = [_table_text(v) for v in row]
                cut += any(len(t) > CELL_CHARS for t in texts)
                table.add_row(*(_table_cell(v, t) for v, t in zip(row, texts, strict=True)))
    console.print(table)
    notes = []
    if total > TABLE_ROWS:
        notes.append(f"the first {TABLE_ROWS:,} drawn: add LIMIT, or --format csv or json for all")
    if cut:
        notes.append(f"cells over {CELL_CHARS} characters cut: --format csv or json prints them whole")
    counted = f"{total:,} row{'s' if total != 1 else ''}"
    console.print(Text(f"({'; '.join([counted, *notes])})"))


def _table_text(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, dict | list | tuple):
        return json.dumps(jsonable(value), ensure_ascii=False, allow_nan=False)
    return str(value)


def _table_cell(value: Any, text: str) -> Text:
    from rich.text import Text

    if value is None:
        return Text(text, style="dim")
    return Text(text if len(text) <= CELL_CHARS else text[: CELL_CHARS - 1] + "…")
