"""The metrics rows `ppoflow explore` plots: each step's row, read once per file, a damaged file left
out and named.

A step's metrics file is read again only when its name, size or modification time changes; the
others come from memory, so a run of thousands of steps costs one read of each file, not one per look
at the plots. Files are read many at a time; when a batch cannot be read, its files are read one by
one and each that cannot be read is left out: its step has no point in the plots, and one line names
it (`note`, once per version of the file), where the page and the terminal show it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from ppoflow.tasks.storage.step_files import listed_files_sql, parquet_files
from ppoflow.tasks.storage.tables import iteration_dir

__all__ = ["MetricRows"]

BATCH_FILES = 64
"""Steps' metrics files read in one query (a query holds the run's connection: a page waits less)."""
Stamp = tuple[tuple[str, int, int], ...]
"""A step's metrics files: name, size and modification time of each."""


class MetricRows:
    """Each step's metrics row. `read(sql)` runs a query on the run's confined connection (a
    ValueError when DuckDB cannot read a file); `note(line)` says a step that was left out."""

    def __init__(self, run_dir: Path, read: Callable[[str], list[dict]], note: Callable[[str], None]):
        self._run_dir = run_dir
        self._read = read
        self._note = note
        self._lock = threading.Lock()
        self._rows: dict[int, tuple[Stamp, dict]] = {}
        self._left_out: dict[int, tuple[Stamp, str]] = {}

    def rows(self, steps: Iterable[int], stopping: Callable[[], bool] = lambda: False) -> dict[int, dict]:
        """The row of each of `steps` that can be read (those whose files are new or changed are read
        now), by step."""
        with self._lock:
            wanted = {step: stamp for step in steps if (stamp := self._stamp(step))}
            rows = {step: row for step, (stamp, row) in self._rows.items() if wanted.get(step) == stamp}
            skipped = {step for step, (stamp, _) in self._left_out.items() if wanted.get(step) == stamp}
            missing = [step for step in sorted(wanted) if step not in rows and step not in skipped]
            for start in range(0, len(missing), BATCH_FILES):
                if stopping():
                    break
                rows |= self._read_steps(missing[start : start + BATCH_FILES], wanted)
            self._rows = {step: (wanted[step], rows[step]) for step in rows}
            self._left_out = {step: entry for step, entry in self._left_out.items() if step in wanted}
            return dict(sorted(rows.items()))

    def known(self) -> dict[int, dict]:
        """The rows read so far, without looking at the files (the plots may still be reading)."""
        return {step: row for step, (_, row) in sorted(self._rows.items())}

    def left_out(self) -> list[str]:
        """One line per step whose metrics file could not be read, in step order."""
        return [line for _, (_, line) in sorted(self._left_out.items())]

    def _stamp(self, step: int) -> Stamp:
        found = []
        for file in parquet_files(iteration_dir(self._run_dir, step) / "metrics"):
            try:
                stat = os.stat(file)
            except OSError:
                continue
            found.append((os.path.basename(file), stat.st_size, stat.st_mtime_ns))
        return tuple(found)

    def _files(self, step: int, stamp: Stamp) -> list[str]:
        folder = iteration_dir(self._run_dir, step) / "metrics"
        return [str(folder / name) for name, _, _ in stamp]

    def _read_steps(self, steps: list[int], stamps: dict[int, Stamp]) -> dict[int, dict]:
        with contextlib.suppress(ValueError):
            return self._read_files(steps, stamps)
        rows = {}
        for step in steps:  # one by one: which of them cannot be read
            try:
                rows |= self._read_files([step], stamps)
            except ValueError as error:
                self._leave_out(step, stamps[step], error)
        return rows

    def _read_files(self, steps: list[int], stamps: dict[int, Stamp]) -> dict[int, dict]:
        files = [f for step in steps for f in self._files(step, stamps[step])]
        return {row["iter"]: row for row in self._read(listed_files_sql(None, files, union=True))}

    def _leave_out(self, step: int, stamp: Stamp, error: ValueError) -> None:
        folder = iteration_dir(self._run_dir, step) / "metrics"
        why = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        why = why.replace(f"{self._run_dir}{os.sep}", "").split(": a table file of the run is damaged")[0]
        line = (
            f"step {step} left out of the plots: {folder.relative_to(self._run_dir)} cannot be read "
            f"({why[:300]}); training the run again recomputes it"
        )
        self._left_out[step] = (stamp, line)
        self._note(line)
