"""`ppoflow diagnose`: the health checks a PPO practitioner does by eye on verl's training curves,
run over a run's metrics and per-iteration statistics of its raw rows (read with DuckDB), with the
findings rendered for the terminal. The checks and their thresholds live in diagnose_checks.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pyarrow as pa
import yaml

from ppoflow.tasks.observe.diagnose_checks import CHECKS
from ppoflow.tasks.observe.diagnose_run import SEVERITY_RANK, Finding, RunData
from ppoflow.tasks.storage.catalog import VIEWS
from ppoflow.tasks.storage.confined_query import connect_confined, explained
from ppoflow.tasks.storage.step_files import step_folders


class RunDirError(ValueError):
    """Not a run directory, or one without a finished iteration."""


class RunInProgress(RunDirError):
    """A run directory whose first iteration has not finished yet."""


class ValidationOnlyRun(RunDirError):
    """A run that validated a model and trained nothing (trainer.val_only): no metrics to diagnose."""


def _standard_error_over_prompts(table: str) -> str:
    """Per iteration, the standard error of the mean score with each prompt one draw: a prompt's n
    responses (GRPO's group, validation's val_kwargs.n) share it, so they are not n draws."""
    return (
        "SELECT iter, stddev_samp(m) / sqrt(count(*)) FROM "
        f"(SELECT iter, avg(score) AS m FROM {table} GROUP BY iter, prompt_id) GROUP BY iter"
    )


ROW_STATS = {
    "rewards/score_std": "SELECT iter, stddev_pop(score) FROM rewards GROUP BY iter",
    "rewards/score_mean": "SELECT iter, avg(score) FROM rewards GROUP BY iter",
    "rewards/score_range": "SELECT iter, max(score) - min(score) FROM rewards GROUP BY iter",
    "rewards/zero_spread_group_ratio": (
        "SELECT iter, avg((hi = lo)::DOUBLE) FROM (SELECT r.iter, max(w.score) hi, min(w.score) lo "
        "FROM rollouts r JOIN rewards w USING (iter, prompt_id, sample_idx) "
        "GROUP BY r.iter, r.group_id HAVING count(*) > 1) GROUP BY iter"
    ),
    "rollouts/truncated": "SELECT iter, avg((finish_reason = 'length')::DOUBLE) FROM rollouts GROUP BY iter",
    "rollouts/empty": "SELECT iter, avg((response_text = '')::DOUBLE) FROM rollouts GROUP BY iter",
    "advantages/returns_var": (
        "SELECT iter, var_pop(r) FROM (SELECT iter, unnest(returns) AS r FROM advantages) GROUP BY iter"
    ),
    "rewards/score_sem": _standard_error_over_prompts("rewards"),
    "validation/score_mean": "SELECT iter, avg(score) FROM validation GROUP BY iter",
    "validation/score_sem": _standard_error_over_prompts("validation"),
    "validation/score_range": "SELECT iter, max(score) - min(score) FROM validation GROUP BY iter",
    "actor_update/steps": "SELECT iter, count(*) FROM actor_update GROUP BY iter",
    "turns/tool_error_rate": (
        "SELECT iter, avg((error IS NOT NULL)::DOUBLE) FROM turns WHERE role = 'tool' GROUP BY iter"
    ),
    "turns/turn_limit_rate": (
        "SELECT iter, count(*) FILTER (WHERE turn_end IN ('assistant_turn_limit', 'user_turn_limit'))"
        "::DOUBLE / count(*) FILTER (WHERE role = 'assistant' AND turn = 0) FROM turns GROUP BY iter"
    ),
    "turns/unread_tool_turn_rate": (
        "SELECT iter, count(DISTINCT (prompt_id, sample_idx)) FILTER (WHERE role = 'tool' AND "
        "token_start = token_end)::DOUBLE / count(*) FILTER (WHERE role = 'assistant' AND turn = 0) "
        "FROM turns GROUP BY iter"
    ),
}
"""Per-iteration statistics of the raw rows that the metrics table does not hold (or holds only
from the update's side)."""


def load_run(run_dir: str | Path, *, require_metrics: bool = True, last: int | None = None) -> RunData:
    """The run's metrics, raw-row statistics and config; with `last`, of its newest `last` steps
    with metrics only. RunDirError when run_dir is not a run directory or its tables cannot be read
    (a damaged file); with require_metrics, also RunInProgress or ValidationOnlyRun when no training
    iteration has finished."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise RunDirError(f"{run_dir} does not exist")
    if not (run_dir / "config.yaml").is_file():
        raise RunDirError(f"{run_dir} is not a ppoflow run directory: it has no config.yaml")
    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise RunDirError(f"{run_dir / 'config.yaml'} cannot be read as the run's config: {error}") from None
    if not isinstance(config, dict):
        raise RunDirError(f"{run_dir / 'config.yaml'} is not the run's config: it holds no keys")
    with_metrics = [
        step for step, folder in step_folders(run_dir) if os.path.isdir(os.path.join(folder, "metrics"))
    ]
    read = with_metrics[-last:] if last and len(with_metrics) > last else None
    try:
        try:
            table, rows = _read(run_dir, read, unify=False)
        except ValueError as error:  # a file between a table's first and last lacks one of its columns
            if "schema mismatch" not in str(error):
                raise
            table, rows = _read(run_dir, read, unify=True)
    except ValueError as error:  # a damaged table file, a folder DuckDB cannot glob
        raise RunDirError(f"{run_dir}: cannot read the run's tables: {error}") from error
    iters = table["iter"].to_pylist()
    metrics = {
        name: _by_iter(zip(iters, table[name].to_pylist(), strict=True))
        for name in table.column_names
        if name not in ("iter", "step") and _numeric(table.schema.field(name).type)
    }
    window = (read[0], len(with_metrics)) if read else None
    run = RunData({k: v for k, v in metrics.items() if v}, rows, config, window)
    if require_metrics:
        require_iteration(run_dir, run)
    return run


def _read(run_dir: Path, steps: list[int] | None, *, unify: bool) -> tuple[pa.Table, dict]:
    """The metrics table and the per-iteration statistics of the raw rows (of `steps` only)."""
    with connect_confined(run_dir, steps=steps, unify=unify) as con, explained(run_dir.resolve(), VIEWS):
        table = con.sql("SELECT * FROM metrics ORDER BY iter").to_arrow_table()
        return table, {name: _by_iter(con.execute(sql).fetchall()) for name, sql in ROW_STATS.items()}


def require_iteration(run_dir: str | Path, run: RunData) -> None:
    """ValidationOnlyRun or RunInProgress when the run has no finished training iteration (the row of
    the validation before training is not one)."""
    if run.trained_iterations():
        return
    if validation_only(run):
        raise ValidationOnlyRun(
            f"{run_dir}: validation-only run: nothing to diagnose; see "
            f'`ppoflow query {run_dir} "SELECT * FROM validation"`'
        )
    raise RunInProgress(
        f"{run_dir}: no training step has finished yet (the run is in progress, or stopped before "
        "its first step finished)"
    )


def validation_only(run: RunData) -> bool:
    """trainer.val_only: a run that validates and trains nothing. (Validation rows and their metrics
    row are also what a run in progress has after step 0.)"""
    return bool(run.setting("trainer.val_only", False))


def _numeric(type_) -> bool:
    """A metric's column type: a number (a column of any other type is none of ppoflow's metrics)."""
    return pa.types.is_integer(type_) or pa.types.is_floating(type_) or pa.types.is_boolean(type_)


def _by_iter(pairs) -> dict[int, float]:
    return {int(i): float(v) for i, v in pairs if v is not None and math.isfinite(float(v))}


def diagnose(run: RunData) -> list[Finding]:
    """Every check's findings, the most severe first."""
    return sorted((f for check in CHECKS for f in check(run)), key=lambda f: -SEVERITY_RANK[f.severity])


def exit_code(findings: list[Finding]) -> int:
    """0 when nothing is a warning or worse, else 1 (the CLI keeps 2 for bad input)."""
    return 1 if any(SEVERITY_RANK[f.severity] >= SEVERITY_RANK["warning"] for f in findings) else 0


def _short(values: tuple, limit: int = 8) -> str:
    text = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in values]
    return ", ".join(text if len(text) <= limit else [*text[:3], "…", *text[-3:]])


def _span(iters: tuple[int, ...]) -> str:
    if not iters:
        return "config"
    return f"iter {iters[0]}" if len(iters) == 1 else f"iter {iters[0]}–{iters[-1]}"


def render_text(run_dir: str | Path, run: RunData, findings: list[Finding]) -> list[str]:
    """The terminal report, one string per line; each finding's block starts with its severity."""
    counts = {s: sum(f.severity == s for f in findings) for s in SEVERITY_RANK}
    iters = run.trained_iterations()
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no findings: nothing looks wrong"
    read = f"{len(iters)} iteration(s)"
    if run.window is not None:
        first, steps = run.window
        read = f"the newest {read} of {steps:,} steps (from step {first}; --last 0 reads every one)"
    lines = [f"{run_dir}: {read}, {run.setting('algorithm.adv_estimator', '?')}; {summary}"]
    for f in findings:
        lines += ["", f"{f.severity.upper():<9}{f.check}: {f.title}"]
        shown = [e for e in f.evidence if e.values]
        width = max((len(e.metric) for e in shown), default=0)
        for k, e in enumerate(shown):
            lines.append(
                f"  {'' if k else 'evidence':<9}{e.metric:<{width}}  {_span(e.iters)}: {_short(e.values)}"
            )
        lines += [f"  {'' if k else 'causes':<9}- {c}" for k, c in enumerate(f.causes)]
        lines += [
            f"  {'' if k else 'change':<9}{key}: {w}" for k, (key, w) in enumerate(f.config_keys.items())
        ]
    return lines
