"""Prefect artifacts of a training run (shown on the flow run's page in the UI): a table with one row
of headline metrics per iteration and a progress bar, each one artifact updated in place as the run
trains, and at the end the markdown summary of
`ppoflow report` (validation curve, final metrics, diagnose findings, where the data is), plus links
to the run directory and the final checkpoint.

Created only inside a Prefect flow run; every other use of ppoflow leaves them out.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import time
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactUpdate
from prefect.context import FlowRunContext

from ppoflow.tasks.observe.console import validation_score
from ppoflow.tasks.observe.report import HEADLINE_METRICS, summary_markdown

logger = logging.getLogger(__name__)
TABLE_UPDATES = 100
PUBLISH_INTERVAL_S = 5.0
"""The table and the progress bar are sent to the Prefect server at most this often (and at the
end): a round trip per iteration would be a tenth of a short iteration."""


def artifact_key(run_path: Path, what: str) -> str:
    """Prefect artifact keys allow lower-case letters, digits and dashes: '<run dir name>-<hash of its
    path>-<what>', so two runs with the same folder name keep separate artifacts."""
    slug = re.sub(r"[^a-z0-9]+", "-", run_path.name.lower()).strip("-") or "run"
    digest = hashlib.sha256(str(run_path.resolve()).encode()).hexdigest()[:6]
    return f"ppoflow-{slug}-{digest}-{what}"


def publish_markdown(run_path: Path, what: str, text: str) -> None:
    """A markdown artifact on the current flow run's page (nothing outside a flow run)."""
    if PrefectArtifacts.active():
        create_markdown_artifact(
            text, key=artifact_key(run_path, what), description=f"ppoflow {what} {run_path}"
        )


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else float(f"{value:.5g}")
    return value


class PrefectArtifacts:
    """A tracking backend (see tasks/observe/tracking.py) writing Prefect artifacts."""

    @staticmethod
    def active() -> bool:
        return FlowRunContext.get() is not None

    def __init__(self, run_path: Path, total: int):
        self.run_path, self.total = run_path, max(total, 1)
        self.rows: list[dict[str, Any]] = []
        self.table_id: UUID | None = None
        self.published_rows, self.published_at = 0, time.monotonic()
        self.progress_id = create_progress_artifact(
            0.0, key=artifact_key(run_path, "progress"), description=f"PPO iterations done of {total}"
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, "val": _rounded(validation_score(metrics))}
        row |= {name: _rounded(metrics.get(name)) for name in HEADLINE_METRICS}
        self.rows.append(row)
        if step >= self.total or time.monotonic() - self.published_at >= PUBLISH_INTERVAL_S:
            self._publish(step)

    def _publish(self, step: int, *, whole_table: bool = False) -> None:
        # Each publication stores the whole table: past TABLE_UPDATES rows, publish every k-th step.
        every = math.ceil(self.total / TABLE_UPDATES)
        if whole_table or len(self.rows) <= TABLE_UPDATES or step % every == 0 or step >= self.total:
            self._publish_table()
            self.published_rows = len(self.rows)
        update_progress_artifact(self.progress_id, 100.0 * min(step, self.total) / self.total)
        self.published_at = time.monotonic()

    def _flush(self) -> None:
        """Publish what the last interval held back."""
        if len(self.rows) > self.published_rows:
            self._publish(self.rows[-1]["step"], whole_table=True)

    def _publish_table(self) -> None:
        """Created once, then updated in place (Prefect has no update function for tables; its API
        updates any artifact's data): one card on the run's page, not one per version."""
        if self.table_id is None:
            self.table_id = create_table_artifact(
                self.rows,
                key=artifact_key(self.run_path, "metrics"),
                description=(
                    f"Headline metrics per iteration of {self.run_path}; every metric: "
                    f'`ppoflow query {self.run_path} "SELECT * FROM metrics ORDER BY step"`'
                ),
            )
            return
        with get_client(sync_client=True) as client:  # a table's data is its rows as JSON
            client.update_artifact(self.table_id, ArtifactUpdate(data=json.dumps(self.rows)))

    def finish(self, summary: dict[str, Any]) -> None:
        self._flush()
        try:
            text = summary_markdown(self.run_path)
        except Exception as error:  # a summary that cannot be made must not fail a finished run
            logger.warning("ppoflow: no summary for %s: %s", self.run_path, error)
            text = f"# ppoflow run `{self.run_path}`\n\n(no summary: {error})\n"
        publish_markdown(self.run_path, "summary", text)
        create_link_artifact(
            f"file://{self.run_path}", link_text="run directory", key=artifact_key(self.run_path, "run-dir")
        )
        if summary.get("actor_checkpoint"):
            create_link_artifact(
                f"file://{summary['actor_checkpoint']}",
                link_text="final actor checkpoint",
                key=artifact_key(self.run_path, "checkpoint"),
            )

    def fail(self) -> None:
        """The table and progress show how far the run got."""
        try:
            self._flush()
        except Exception as error:  # the run's own failure is what must surface, not this one
            logger.warning("ppoflow: the last metrics were not published to Prefect: %s", error)
