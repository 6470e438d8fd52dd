"""What `ppoflow explore` shows, read from a run: its iterations and metrics, a page of samples
(training responses or validation answers) filtered, sorted and paged in DuckDB, one sample with its
tokens and per-token values, and one prompt's responses across iterations.

Every read goes through one confined, read-only connection (confined_query.connect_confined): the
views are defined from the run's files by ppoflow, never from SQL found in the run, and every value
that comes from a request is a bound parameter; a sort column or a metric name is checked against
the names that exist before it becomes an identifier. The connection opens no file for writing and
takes no lock, so training goes on beside it; it is opened again when a table gets its first files
(an empty table's view is a stub until then), so a run that is training shows new iterations.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb

from ppoflow.tasks.storage.catalog import checked_dir, tables_with_files
from ppoflow.tasks.storage.confined_query import connect_confined, explained
from ppoflow.tasks.storage.flow_runs import read_flow_runs
from ppoflow.tasks.storage.tables import step_of

__all__ = ["ExplorerError", "RunExplorer", "SampleFilter"]

EXPLORED_VIEWS = ("prompts", "rollouts", "rewards", "advantages", "validation", "metrics", "turns")
KINDS = ("train", "val")
SORTABLE = ("score", "response_length", "prompt_id", "sample_idx", "data_source", "finish_reason")
MAX_PAGE_ROWS = 200
LISTED_RESPONSE_CHARS = 160
LISTED_PROMPT_CHARS = 100
SHOWN_TEXT_CHARS = 20_000
"""A sample's prompt and response are cut to this many characters (a planted 10 MB text stays a
page); its tokens are all shown."""
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


class ExplorerError(ValueError):
    """A request the run cannot answer (an unknown iteration, a bad filter): said to the page."""


@dataclass(frozen=True)
class SampleFilter:
    """Which samples a page lists; every value is bound as a parameter."""

    kind: str = "train"
    iteration: int = 0
    data_source: str | None = None
    min_score: float | None = None
    max_score: float | None = None
    min_length: int | None = None
    max_length: int | None = None
    truncated: bool | None = None
    sort: str = "score"
    descending: bool = False
    page: int = 0
    page_rows: int = 50

    def checked(self) -> SampleFilter:
        if self.kind not in KINDS:
            raise ExplorerError(f"kind must be one of {', '.join(KINDS)}, not {self.kind!r}")
        if self.sort not in SORTABLE:
            raise ExplorerError(f"sort must be one of {', '.join(SORTABLE)}, not {self.sort!r}")
        if not 1 <= self.page_rows <= MAX_PAGE_ROWS:
            raise ExplorerError(f"page_rows must be 1–{MAX_PAGE_ROWS}, not {self.page_rows}")
        if self.page < 0:
            raise ExplorerError(f"page must be 0 or more, not {self.page}")
        for name in ("min_score", "max_score"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ExplorerError(f"{name} must be a finite number, not {value}")
        return self


_SAMPLE_SOURCES = {
    "train": "rollouts r LEFT JOIN rewards w USING (iter, prompt_id, sample_idx)",
    "val": "validation r",
}
"""What each kind of sample is read from; its columns under `r.` (the score unqualified)."""


class RunExplorer:
    """One run, read for the explorer; safe to call from several threads (one query at a time)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = checked_dir(run_dir)
        if not (self.run_dir / "config.yaml").is_file():
            raise ExplorerError(
                f"{self.run_dir} is not a ppoflow run directory (no config.yaml); a retraining "
                "directory's runs are its rounds' folders"
            )
        self._lock = threading.Lock()
        self._con: duckdb.DuckDBPyConnection | None = None
        self._tables: frozenset[str] = frozenset()
        self._checked_at = 0.0
        self._tokenizer = _Tokens(self.run_dir)

    def close(self) -> None:
        with self._lock:
            if self._con is not None:
                self._con.close()
                self._con = None

    def _rows(self, sql: str, params: Sequence = ()) -> list[dict]:
        with self._lock:
            con = self._connection()
            with explained(self.run_dir, EXPLORED_VIEWS):
                cursor = con.execute(sql, list(params))
                names = [d[0] for d in cursor.description]
                return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def _connection(self) -> duckdb.DuckDBPyConnection:
        now = time.monotonic()
        if self._con is None or now - self._checked_at > RECHECK_SECONDS:
            self._checked_at = now
            present = frozenset(tables_with_files(self.run_dir)) & set(EXPLORED_VIEWS)
            if self._con is None or present != self._tables:
                if self._con is not None:
                    self._con.close()
                    self._con = None
                self._con = connect_confined(self.run_dir, views=EXPLORED_VIEWS)
                self._tables = present
        return self._con

    def _steps_with(self, table: str) -> list[int]:
        """The steps whose folder holds files of `table`, as the views read them (folders named as
        ppoflow names them): the listing, not a scan of every row's file name."""
        steps = []
        for entry in os.scandir(self.run_dir):
            step = step_of(entry.name)
            if step is not None and any(Path(entry.path, table).glob("*.parquet")):
                steps.append(step)
        return sorted(steps)

    def _columns(self, view: str) -> list[str]:
        return [row["column_name"] for row in self._rows(f"SELECT column_name FROM (DESCRIBE {view})")]

    # -- the run ---------------------------------------------------------------------------------

    def overview(self) -> dict:
        """The run's iterations (with training rollouts, with validation), data sources, metric
        names, the metrics shown by default, whether it is multi-turn, and its Prefect flow runs."""
        train, val = self._steps_with("rollouts"), self._steps_with("validation")
        sources = self._rows("SELECT DISTINCT data_source FROM prompts ORDER BY data_source")
        metrics = [c for c in self._columns("metrics") if c not in ("iter", "step")]
        defaults = [m for m in metrics if m.startswith("val-core/")][:2]
        defaults += [m for m in DEFAULT_METRICS if m in metrics]
        return {
            "run": self.run_dir.name,
            "train_iterations": train,
            "val_iterations": val,
            "data_sources": [r["data_source"] for r in sources],
            "metrics": metrics,
            "default_metrics": defaults,
            "multi_turn": "turns" in self._tables,
            "flow_runs": read_flow_runs(self.run_dir),
        }

    def metric_series(self, names: Sequence[str]) -> dict:
        """Each named metric by iteration (null where a step did not log it)."""
        known = set(self._columns("metrics"))
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ExplorerError(f"no metric named {unknown[0]!r} in this run")
        selected = ", ".join(_ident(n) for n in names)
        rows = self._rows(f"SELECT iter{', ' if names else ''}{selected} FROM metrics ORDER BY iter")
        return {
            "iterations": [r["iter"] for r in rows],
            "series": {n: [_number(r[n]) for r in rows] for n in names},
        }

    # -- samples ---------------------------------------------------------------------------------

    def samples(self, wanted: SampleFilter) -> dict:
        """One page of samples and how many match."""
        f = wanted.checked()
        source = _SAMPLE_SOURCES[f.kind]
        where, params = ["r.iter = ?"], [f.iteration]
        for condition, value in (
            ("r.data_source = ?", f.data_source),
            ("score >= ?", f.min_score),
            ("score <= ?", f.max_score),
            ("r.response_length >= ?", f.min_length),
            ("r.response_length <= ?", f.max_length),
        ):
            if value is not None:
                where.append(condition)
                params.append(value)
        if f.truncated is not None:
            where.append("(r.finish_reason = 'length') = ?")
            params.append(f.truncated)
        clause = " AND ".join(where)
        total = self._rows(f"SELECT count(*) AS n FROM {source} WHERE {clause}", params)[0]["n"]
        order = f"{_sort_key(f.sort)} {'DESC' if f.descending else 'ASC'} NULLS LAST"
        rows = self._rows(
            f"SELECT r.prompt_id, r.sample_idx, r.data_source, score, r.response_length, "
            f"r.finish_reason, right(r.prompt_text, {LISTED_PROMPT_CHARS}) AS prompt_end, "
            f"left(r.response_text, {LISTED_RESPONSE_CHARS}) AS response_start "
            f"FROM {source} WHERE {clause} "
            f"ORDER BY {order}, r.prompt_id, r.sample_idx LIMIT ? OFFSET ?",
            [*params, f.page_rows, f.page * f.page_rows],
        )
        for row in rows:
            row["score"] = _number(row["score"])
        return {"total": total, "page": f.page, "page_rows": f.page_rows, "rows": rows}

    def sample(self, kind: str, iteration: int, prompt_id: str, sample_idx: int) -> dict:
        """One sample whole: texts, score and components, and for a training response its tokens
        with every per-token column (TOKEN_COLUMNS), its policy mask and its turns."""
        if kind not in KINDS:
            raise ExplorerError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
        key = [iteration, prompt_id, sample_idx]
        if kind == "val":
            rows = self._rows(
                f"SELECT iter, prompt_id, sample_idx, data_source, left(prompt_text, {SHOWN_TEXT_CHARS}) "
                f"AS prompt_text, left(response_text, {SHOWN_TEXT_CHARS}) AS response_text, ground_truth, "
                "score, map_entries(components) AS components, error, pred, response_length, finish_reason "
                "FROM validation WHERE iter = ? AND prompt_id = ? AND sample_idx = ?",
                key,
            )
            return self._finished(rows, kind, key)
        present = set(self._columns("rollouts"))
        optional = [c for c in ("ref_log_probs", "response_mask", "num_turns", "tool_calls") if c in present]
        rows = self._rows(
            "SELECT r.iter, r.prompt_id, r.sample_idx, r.data_source, "
            f"left(r.prompt_text, {SHOWN_TEXT_CHARS}) AS prompt_text, "
            f"left(r.response_text, {SHOWN_TEXT_CHARS}) AS response_text, r.prompt_ids, r.response_ids, "
            "r.rollout_log_probs, r.old_log_probs, r.response_length, r.finish_reason, r.policy_version, "
            + "".join(f"r.{c}, " for c in optional)
            + "w.ground_truth, w.score, map_entries(w.components) AS components, w.error, "
            'a."values", a.advantages, a.returns, a.kl, a.token_level_rewards '
            "FROM rollouts r LEFT JOIN rewards w USING (iter, prompt_id, sample_idx) "
            "LEFT JOIN advantages a USING (iter, prompt_id, sample_idx) "
            "WHERE r.iter = ? AND r.prompt_id = ? AND r.sample_idx = ?",
            key,
        )
        sample = self._finished(rows, kind, key)
        sample["tokens"] = self._tokenizer.pieces(sample.pop("response_ids"))
        sample["prompt_tokens"] = len(sample.pop("prompt_ids") or [])
        old, rollout = sample.get("old_log_probs"), sample.get("rollout_log_probs")
        sample["ratio_old_to_rollout"] = None
        if old and rollout:  # exp(old − rollout); 700 keeps a planted gap from overflowing
            pairs = zip(old, rollout, strict=True)
            sample["ratio_old_to_rollout"] = [math.exp(min(o - r, 700.0)) for o, r in pairs]
        sample["token_columns"] = {
            name: [_number(v) for v in sample.pop(name)]
            for name in TOKEN_COLUMNS
            if sample.get(name) is not None
        }
        for name in TOKEN_COLUMNS:
            sample.pop(name, None)
        sample["turns"] = self._turns(key) if sample.get("response_mask") is not None else []
        return sample

    def _finished(self, rows: list[dict], kind: str, key: list) -> dict:
        if not rows:
            iteration, prompt_id, sample_idx = key
            raise ExplorerError(f"no {kind} sample {prompt_id!r} #{sample_idx} in iteration {iteration}")
        sample = rows[0]
        sample["kind"] = kind
        sample["score"] = _number(sample["score"])
        sample["components"] = {e["key"]: _number(e["value"]) for e in sample["components"] or []}
        return sample

    def _turns(self, key: list) -> list[dict]:
        return self._rows(
            "SELECT turn, call_index, role, text, token_start, token_end, turn_end, tool_name, arguments, "
            "result, error, tool_reward FROM turns WHERE iter = ? AND prompt_id = ? AND sample_idx = ? "
            "ORDER BY turn, call_index",
            key,
        )

    def across_iterations(self, kind: str, prompt_id: str, iterations: Sequence[int]) -> dict:
        """Every iteration that has `prompt_id`, and its responses there in each of `iterations`."""
        if kind not in KINDS:
            raise ExplorerError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
        source = _SAMPLE_SOURCES[kind]
        found = self._rows(
            f"SELECT DISTINCT r.iter FROM {source} WHERE r.prompt_id = ? ORDER BY 1", [prompt_id]
        )
        shown = {}
        for iteration in iterations[:4]:
            shown[str(iteration)] = self._rows(
                f"SELECT r.sample_idx, score, r.response_length, r.finish_reason, "
                f"left(r.response_text, {SHOWN_TEXT_CHARS}) AS response_text FROM {source} "
                "WHERE r.iter = ? AND r.prompt_id = ? ORDER BY r.sample_idx",
                [iteration, prompt_id],
            )
            for row in shown[str(iteration)]:
                row["score"] = _number(row["score"])
        return {"prompt_id": prompt_id, "iterations": [r["iter"] for r in found], "responses": shown}


def _sort_key(name: str) -> str:
    return "score" if name == "score" else f"r.{name}"


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _number(value):
    """A float that JSON can carry: NaN and infinities as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class _Tokens:
    """The text of each token id, from the run's own tokenizer.json (model/base, as ppoflow copied
    it), read as data by the tokenizers library; ids are shown as `<id>` when there is none."""

    def __init__(self, run_dir: Path):
        self._run_dir = run_dir
        self._tokenizer = None
        self._loaded = False
        self._cache: dict[int, str] = {}

    def pieces(self, ids: Sequence[int] | None) -> list[str]:
        tokenizer = self._load()
        out = []
        for token_id in ids or []:
            piece = self._cache.get(token_id)
            if piece is None:
                piece = f"<{token_id}>" if tokenizer is None else _piece(tokenizer, token_id)
                self._cache[token_id] = piece
            out.append(piece)
        return out

    def _load(self):
        if not self._loaded:
            self._loaded = True
            path = self._run_dir / "model/base/tokenizer.json"
            try:
                if path.resolve().is_relative_to(self._run_dir) and path.is_file():
                    from tokenizers import Tokenizer

                    self._tokenizer = Tokenizer.from_file(str(path))
            except Exception:  # a damaged or planted file: ids are shown instead
                self._tokenizer = None
        return self._tokenizer


def _piece(tokenizer, token_id: int) -> str:
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if text and "\ufffd" not in text:
        return text
    return tokenizer.id_to_token(token_id) or f"<{token_id}>"
