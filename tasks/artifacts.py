"""Prefect artifacts of a training run (shown on the flow run's page in the UI): a table with one row
of headline metrics per iteration, a progress bar, and at the end a markdown summary with the
validation curve and where the data is, plus links to the run directory and the final checkpoint.

Created only inside a Prefect flow run; every other use of ppoflow leaves them out.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.context import FlowRunContext

from .console import EXAMPLE_QUERY, validation_score

TABLE_COLUMNS = (
    "critic/score/mean",
    "actor/ppo_kl",
    "actor/pg_clipfrac",
    "actor/entropy",
    "actor/grad_norm",
    "critic/vf_loss",
    "critic/vf_explained_var",
    "response_length/mean",
    "perf/time_per_step",
)
SPARK = "▁▂▃▄▅▆▇█"


def artifact_key(run_path: Path, what: str) -> str:
    """Prefect artifact keys allow lower-case letters, digits and dashes: '<run dir name>-<what>'."""
    slug = re.sub(r"[^a-z0-9]+", "-", run_path.name.lower()).strip("-") or "run"
    return f"ppoflow-{slug}-{what}"


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else float(f"{value:.5g}")
    return value


def sparkline(values: list[float]) -> str:
    """One character per value, scaled between the smallest and the largest."""
    if not values:
        return ""
    low, high = min(values), max(values)
    span = high - low or 1.0
    return "".join(SPARK[round((v - low) / span * (len(SPARK) - 1))] for v in values)


class PrefectArtifacts:
    """A tracking backend (see tasks/tracking.py) writing Prefect artifacts."""

    @staticmethod
    def active() -> bool:
        return FlowRunContext.get() is not None

    def __init__(self, run_path: Path, total: int):
        self.run_path, self.total = run_path, max(total, 1)
        self.rows: list[dict[str, Any]] = []
        self.progress_id = create_progress_artifact(
            0.0, key=artifact_key(run_path, "progress"), description=f"PPO iterations done of {total}"
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, "val": _rounded(validation_score(metrics))}
        row |= {name: _rounded(metrics.get(name)) for name in TABLE_COLUMNS}
        self.rows.append(row)
        create_table_artifact(
            self.rows,
            key=artifact_key(self.run_path, "metrics"),
            description=(
                f"Headline metrics per iteration of {self.run_path}; every metric: "
                f'`ppoflow query {self.run_path} "SELECT * FROM metrics ORDER BY step"`'
            ),
        )
        update_progress_artifact(self.progress_id, 100.0 * min(step, self.total) / self.total)

    def finish(self, summary: dict[str, Any]) -> None:
        create_markdown_artifact(
            summary_markdown(self.run_path, self.rows, summary),
            key=artifact_key(self.run_path, "summary"),
            description=f"ppoflow run {self.run_path}",
        )
        create_link_artifact(
            f"file://{self.run_path}", link_text="run directory", key=artifact_key(self.run_path, "run-dir")
        )
        if summary.get("actor_checkpoint"):
            create_link_artifact(
                f"file://{summary['actor_checkpoint']}",
                link_text="final actor checkpoint",
                key=artifact_key(self.run_path, "checkpoint"),
            )


def summary_markdown(run_path: Path, rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    curve = [(r["step"], r["val"]) for r in rows if r["val"] is not None]
    lines = [f"# ppoflow run `{run_path.name}`", ""]
    if curve:
        first, last = curve[0][1], curve[-1][1]
        best_step, best = max(curve, key=lambda c: c[1])
        lines += [
            f"Validation score {first:.3f} → {last:.3f} (best {best:.3f} at step {best_step})  "
            f"`{sparkline([v for _, v in curve])}`",
            "",
            "| step | validation score |",
            "|---:|---:|",
            *(f"| {step} | {value:.4f} |" for step, value in curve),
            "",
        ]
    lines += [
        "## Where the data is",
        "",
        f"- run directory: `{run_path}`",
        f"- final actor checkpoint: `{summary.get('actor_checkpoint')}`",
        f"- DuckDB catalog: `{run_path / 'catalog.duckdb'}`",
        f'- try: `ppoflow query {run_path} "{EXAMPLE_QUERY}"`',
    ]
    return "\n".join(lines) + "\n"
