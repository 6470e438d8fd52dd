"""What `ppoflow explore` shows, read from a run: its iterations and metrics, a page of samples
(training responses or validation answers) filtered, sorted and paged in DuckDB, one sample with its
tokens and per-token values, and one prompt's responses across iterations.

Every read goes through one confined, read-only connection (confined_query.connect_confined): what
it reads is named by ppoflow from the run's files, never by SQL found in the run, and every value
that comes from a request is a bound parameter; a sort column or a metric name is checked against
the names that exist before it becomes an identifier. The connection opens no file for writing and
takes no lock, so training goes on beside it. A query of one step reads that step's folder; only a
prompt's iterations read every step's files, listed when asked: a run that is training shows its new
iterations, and opening a run of thousands of steps reads none of its tables. A file that cannot be
read gives less to show: its step is left out of the plots, named in one line (`left_out`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import duckdb

from ppoflow.tasks.observe.explorer_files import StepFolders, TextSizes, TokenTexts, fitted, ratios
from ppoflow.tasks.observe.explorer_metrics import MetricRows
from ppoflow.tasks.observe.explorer_requests import ExplorerError, SampleFilter, check_kind, check_step
from ppoflow.tasks.storage.catalog import DATA_FILES, checked_dir, empty_table_sql
from ppoflow.tasks.storage.confined_query import connect_confined, explained
from ppoflow.tasks.storage.flow_runs import read_flow_runs
from ppoflow.tasks.storage.step_files import listed_files_sql, parquet_files, step_sql, table_files
from ppoflow.tasks.storage.tables import iteration_dir

__all__ = ["ExplorerError", "RunExplorer", "SampleFilter"]

EXPLORED_VIEWS = ("prompts", "rollouts", "rewards", "advantages", "validation", "metrics", "turns")
LISTED_RESPONSE_CHARS = 160
LISTED_PROMPT_CHARS = 100
SHOWN_TEXT_CHARS = 20_000
"""Each text of a sample (prompt, response, ground truth, error, turn) is cut to this many characters:
a planted 10 MB text stays a page."""
SHOWN_TOKENS = 32_768
"""A response's first tokens shown, with their per-token values (verl's longest are 32k)."""
MAX_TEXT_BYTES = 128 * 2**20
"""A step's text column larger than this (uncompressed) is not read: see _require_texts_fit."""
TEXT_COLUMNS = (
    "prompt_text",
    "response_text",
    "ground_truth",
    "error",
    "pred",
    "text",
    "arguments",
    "result",
)
RECHECK_SECONDS = 2.0
"""How often at most a request looks for tables that got their first files."""
TOKEN_COLUMNS = {
    "old_log_probs": "log-prob (old)",
    "rollout_log_probs": "log-prob (rollout)",
    "ratio_old_to_rollout": "ratio old / rollout",
    "ref_log_probs": "log-prob (ref)",
    "kl": "KL to ref",
    "values": "value",
    "advantages": "advantage",
    "returns": "return",
    "token_level_rewards": "token reward",
}
"""The per-token columns a response can be coloured by, and their labels."""
DEFAULT_METRICS = ("critic/score/mean", "actor/ppo_kl", "response_length/mean")


_ROW_KEY = "USING (iter, prompt_id, sample_idx)"
_WHERE_KEY = "WHERE r.prompt_id = ? AND r.sample_idx = ?"
_SCORED_BY = {"train": "w", "val": "r"}
"""Where a kind of sample's score, ground truth and error are: a training response's in its rewards
row (`w`), a validation answer's in its own row (`r`)."""


def _score(kind: str) -> str:
    """A score as the page sorts and filters it: only a finite one (a NaN, a reward function's
    failure, would sort above every number). isfinite, as DuckDB 2.0 folds isnan() and `= 'NaN'` to
    false on a parquet column whose statistics leave NaN out."""
    score = f"{_SCORED_BY[kind]}.score"
    return f"CASE WHEN isfinite({score}) THEN {score} END"


class RunExplorer:
    """One run, read for the explorer; safe to call from several threads (one query at a time).

    A query of one step reads that step's folder (read_parquet of its files, confined as the views
    are), not the view of every step: a page costs the same in a run of ten steps or of ten thousand.
    """

    def __init__(self, run_dir: str | Path, note: Callable[[str], None] = lambda line: None):
        """`note(line)`: called once for each file that cannot be read (its step is left out)."""
        self.run_dir = checked_dir(run_dir)
        if not (self.run_dir / "config.yaml").is_file():
            raise ExplorerError(
                f"{self.run_dir} is not a ppoflow run directory (no config.yaml); a retraining "
                "directory's runs are its rounds' folders"
            )
        self._lock = threading.Lock()
        self._con: duckdb.DuckDBPyConnection | None = None
        self._data: frozenset[str] = frozenset()
        self._checked_at = 0.0
        self._stopping = False
        self._steps = StepFolders(self.run_dir)
        self._tokens = TokenTexts(self.run_dir)
        self._text_sizes = TextSizes(self.run_dir, MAX_TEXT_BYTES)
        self._metrics = MetricRows(self.run_dir, self._rows, note)
        self._stubs: dict[str, str] = {}

    def stop(self) -> None:
        """Refuse every query from now on and interrupt the one running (the server is stopping)."""
        self._stopping = True
        con = self._con
        if con is not None:
            con.interrupt()

    def close(self) -> None:
        self.stop()
        if self._lock.acquire(timeout=5.0):  # a query DuckDB could not interrupt keeps its connection
            try:
                if self._con is not None:
                    self._con.close()
                    self._con = None
            finally:
                self._lock.release()

    def _rows(self, sql: str, params: Sequence = ()) -> list[dict]:
        with self._lock:
            if self._stopping:
                raise ExplorerError("the explorer is stopping")
            con = self._connection()
            with explained(self.run_dir, EXPLORED_VIEWS):
                cursor = con.execute(sql, list(params))
                names = [d[0] for d in cursor.description]
                return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def _connection(self) -> duckdb.DuckDBPyConnection:
        """The confined connection, with the view of the ingested prompts: opened again when their
        files appear (the view is an empty stub until then)."""
        now = time.monotonic()
        if self._con is None or now - self._checked_at > RECHECK_SECONDS:
            self._checked_at = now
            present = frozenset(name for name in DATA_FILES["prompts"] if (self.run_dir / name).is_file())
            if self._con is None or present != self._data:
                if self._con is not None:
                    self._con.close()
                    self._con = None
                self._con = connect_confined(self.run_dir, views=("prompts",))
                self._data = present
        return self._con

    def _step(self, table: str, step: int) -> str:
        """A FROM item of `table`'s rows of one step: its folder's files, with `iter` (none while the
        folder has no file of it: a step in progress, say)."""
        check_step(step)
        found = step_sql(self.run_dir, table, step)
        if found is not None:
            self._require_texts_fit(table, step)
            return found
        if table not in self._stubs:
            with duckdb.connect(":memory:") as con:  # (an empty table of the declared columns: no file)
                self._stubs[table] = empty_table_sql(con, table)
        return f"({self._stubs[table]})"

    def _require_texts_fit(self, table: str, step: int) -> None:
        """An ExplorerError when a text column of the step's files holds more than MAX_TEXT_BYTES once
        read (explorer_files.TextSizes)."""
        files = parquet_files(iteration_dir(self.run_dir, step) / table)
        column, size = self._text_sizes.largest(files, TEXT_COLUMNS)
        if size > MAX_TEXT_BYTES:
            raise ExplorerError(
                f"iter={step:06d}/{table}: its {column} holds {size / 2**20:,.0f} MiB of text once read, "
                f"more than the explorer reads ({MAX_TEXT_BYTES // 2**20} MiB); ppoflow query reads it"
            )

    def _columns(self, source: str) -> list[str]:
        return [row["column_name"] for row in self._rows(f"SELECT column_name FROM (DESCRIBE {source})")]

    def _samples_of(self, kind: str, step: int) -> str:
        """What a kind of sample is read from in one step: its columns under `r.`, its score where
        _SCORED_BY says."""
        if kind == "val":
            return f"{self._step('validation', step)} r"
        return f"{self._step('rollouts', step)} r LEFT JOIN {self._step('rewards', step)} w {_ROW_KEY}"

    # -- the run ---------------------------------------------------------------------------------

    def overview(self) -> dict:
        """The run's iterations (with training rollouts, with validation), data sources, metric
        names, the metrics shown by default, whether it is multi-turn, its Prefect flow runs, and
        the steps left out (a file that cannot be read). The metric names are those of the rows read
        so far (`prefetch`) and of the newest steps' files: the run's tables are not read whole."""
        self._connection()
        tables = self._steps.tables_by_step()
        train = sorted(step for step, held in tables.items() if "rollouts" in held)
        val = sorted(step for step, held in tables.items() if "validation" in held)
        sources = self._rows("SELECT DISTINCT data_source FROM prompts ORDER BY data_source")
        metrics = [c for c in self._metric_columns(train, val) if c not in ("iter", "step")]
        defaults = [m for m in metrics if m.startswith("val-core/")][:2]
        defaults += [m for m in DEFAULT_METRICS if m in metrics]
        return {
            "run": self.run_dir.name,
            "train_iterations": train,
            "val_iterations": val,
            "data_sources": [r["data_source"] for r in sources],
            "metrics": metrics,
            "default_metrics": defaults,
            "multi_turn": any("turns" in held for held in tables.values()),
            "flow_runs": read_flow_runs(self.run_dir),
            "token_columns": TOKEN_COLUMNS,
            "left_out": self._metrics.left_out(),
        }

    def open(self) -> None:
        """Open the run's confined connection (a run that cannot be read is an error now), reading
        none of its tables: the explorer of a long run starts as soon as that of a short one."""
        self._connection()

    def prefetch(self) -> None:
        """Read every step's metrics row (the plots' first look at a long run, done before it)."""
        self._metrics.rows(self._steps.steps_with("metrics"), stopping=lambda: self._stopping)

    def _metric_columns(self, train: list[int], val: list[int]) -> list[str]:
        """The metrics' names, in the order steps first have them: those of the rows read so far,
        and of the newest training and validated steps' files."""
        names: dict[str, None] = {}
        for row in self._metrics.known().values():
            names.update(dict.fromkeys(row))
        for step in {max(train, default=-1), max(val, default=-1)} - {-1}:
            source = step_sql(self.run_dir, "metrics", step)
            if source is not None:
                with contextlib.suppress(ValueError):  # damaged: named when the plots read its step
                    names.update(dict.fromkeys(self._columns(source)))
        return list(names)

    def metric_series(self, names: Sequence[str]) -> dict:
        """Each named metric by iteration (null where a step did not log it)."""
        rows = self._metrics.rows(self._steps.steps_with("metrics"), stopping=lambda: self._stopping)
        known = {name for row in rows.values() for name in row}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ExplorerError(f"no metric named {unknown[0][:200]!r} in this run")
        steps = sorted(rows)
        return {
            "iterations": steps,
            "series": {n: [rows[step].get(n) for step in steps] for n in names},
            "left_out": self._metrics.left_out(),
        }

    # -- samples ---------------------------------------------------------------------------------

    def samples(self, wanted: SampleFilter) -> dict:
        """One page of samples and how many match."""
        f = wanted.checked()
        score = _score(f.kind)
        where, params = ["TRUE"], []
        for condition, value in (
            ("r.data_source = ?", f.data_source),
            (f"{score} >= ?", f.min_score),
            (f"{score} <= ?", f.max_score),
            ("r.response_length >= ?", f.min_length),
            ("r.response_length <= ?", f.max_length),
        ):
            if value is not None:
                where.append(condition)
                params.append(value)
        if f.truncated is not None:
            where.append("(r.finish_reason = 'length') = ?")
            params.append(f.truncated)
        source, clause = self._samples_of(f.kind, f.iteration), " AND ".join(where)
        column = score if f.sort == "score" else f"r.{f.sort}"
        order = f"{column} {'DESC' if f.descending else 'ASC'} NULLS LAST"
        rows = self._rows(
            f"SELECT r.prompt_id, r.sample_idx, r.data_source, {score} AS score, r.response_length, "
            f"r.finish_reason, right(r.prompt_text, {LISTED_PROMPT_CHARS}) AS prompt_end, "
            f"left(r.response_text, {LISTED_RESPONSE_CHARS}) AS response_start, "
            "count(*) OVER () AS total "
            f"FROM {source} WHERE {clause} "
            f"ORDER BY {order}, r.prompt_id, r.sample_idx LIMIT ? OFFSET ?",
            [*params, f.page_rows, f.page * f.page_rows],
        )
        if rows:
            total = rows[0]["total"]
        else:  # past the last page: how many there are
            total = self._rows(f"SELECT count(*) AS n FROM {source} WHERE {clause}", params)[0]["n"]
        for row in rows:
            del row["total"]
        return {"total": total, "page": f.page, "page_rows": f.page_rows, "rows": rows}

    def sample(self, kind: str, iteration: int, prompt_id: str, sample_idx: int) -> dict:
        """One sample whole: texts, score and components, and for a training response its first
        SHOWN_TOKENS tokens with every per-token column (TOKEN_COLUMNS), its policy mask and turns."""
        check_kind(kind)
        key, by = [prompt_id, sample_idx], _SCORED_BY[kind]
        common = (
            "r.iter, r.prompt_id, r.sample_idx, r.data_source, r.response_length, r.finish_reason, "
            f"left(r.prompt_text, {SHOWN_TEXT_CHARS}) AS prompt_text, "
            f"left(r.response_text, {SHOWN_TEXT_CHARS}) AS response_text, "
            f"left({by}.ground_truth, {SHOWN_TEXT_CHARS}) AS ground_truth, "
            f"left({by}.error, {SHOWN_TEXT_CHARS}) AS error, "
            f"{_score(kind)} AS score, map_entries({by}.components) AS components"
        )
        if kind == "val":
            rows = self._rows(
                f"SELECT {common}, left(r.pred, {SHOWN_TEXT_CHARS}) AS pred "
                f"FROM {self._samples_of(kind, iteration)} {_WHERE_KEY}",
                key,
            )
            return self._finished(rows, kind, iteration, key)
        present = self._columns(self._step("rollouts", iteration))
        lists = ["r.response_ids", "r.rollout_log_probs", "r.old_log_probs"]
        lists += [f"r.{c}" for c in ("ref_log_probs", "response_mask") if c in present]
        lists += [f'a."{c}"' for c in ("values", "advantages", "returns", "kl", "token_level_rewards")]
        shown = ", ".join(f"{c}[1:{SHOWN_TOKENS}] AS {c.split('.')[1]}" for c in lists)
        scalars = "".join(f", r.{c}" for c in ("num_turns", "tool_calls") if c in present)
        rows = self._rows(
            f"SELECT {common}, {shown}, len(r.prompt_ids) AS prompt_tokens, r.policy_version{scalars} "
            f"FROM {self._samples_of(kind, iteration)} "
            f"LEFT JOIN {self._step('advantages', iteration)} a {_ROW_KEY} {_WHERE_KEY}",
            key,
        )
        sample = self._finished(rows, kind, iteration, key)
        sample["tokens"] = self._tokens.pieces(sample.pop("response_ids"))
        sample["ratio_old_to_rollout"] = ratios(sample.get("old_log_probs"), sample.get("rollout_log_probs"))
        length = len(sample["tokens"])
        sample["token_columns"] = {
            name: fitted(sample[name], length) for name in TOKEN_COLUMNS if sample.get(name) is not None
        }
        for name in TOKEN_COLUMNS:
            sample.pop(name, None)
        sample["turns"] = []
        if sample.get("response_mask") is not None:
            sample["response_mask"] = [bool(m) for m in fitted(sample["response_mask"], length)]
            sample["turns"] = self._turns(iteration, key)
        return sample

    def _finished(self, rows: list[dict], kind: str, iteration: int, key: list) -> dict:
        if not rows:
            prompt_id, sample_idx = key
            raise ExplorerError(
                f"no {kind} sample {prompt_id[:200]!r} #{sample_idx} in iteration {iteration}"
            )
        sample = rows[0]
        sample["kind"] = kind
        sample["components"] = {e["key"]: e["value"] for e in sample["components"] or []}
        return sample

    def _turns(self, iteration: int, key: list) -> list[dict]:
        """A response's turns, the first 1,000, each text cut to SHOWN_TEXT_CHARS."""
        texts = ", ".join(
            f"left({c}, {SHOWN_TEXT_CHARS}) AS {c}" for c in ("text", "arguments", "result", "error")
        )
        return self._rows(
            f"SELECT turn, call_index, role, {texts}, token_start, token_end, turn_end, tool_name, "
            f"tool_reward FROM {self._step('turns', iteration)} r {_WHERE_KEY} "
            "ORDER BY turn, call_index LIMIT 1000",
            key,
        )

    def across_iterations(self, kind: str, prompt_id: str, iterations: Sequence[int]) -> dict:
        """Every iteration that has `prompt_id`, and its responses there in each of `iterations`."""
        check_kind(kind)
        files = table_files(self.run_dir, "rollouts" if kind == "train" else "validation")
        found = []
        if files:  # (every step's files: the one look at a prompt that reads the whole run)
            every_step = listed_files_sql(None, files, union=True)
            found = self._rows(
                f"SELECT DISTINCT iter FROM ({every_step}) WHERE prompt_id = ? ORDER BY 1", [prompt_id]
            )
        shown = {}
        for iteration in iterations[:4]:
            rows = self._rows(
                f"SELECT r.sample_idx, {_score(kind)} AS score, r.response_length, r.finish_reason, "
                f"left(r.response_text, {SHOWN_TEXT_CHARS}) AS response_text "
                f"FROM {self._samples_of(kind, iteration)} WHERE r.prompt_id = ? "
                "ORDER BY r.sample_idx LIMIT 256",
                [prompt_id],
            )
            shown[str(iteration)] = rows
        return {"prompt_id": prompt_id, "iterations": [r["iter"] for r in found], "responses": shown}
