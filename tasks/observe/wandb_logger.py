"""trainer.logger=wandb: each iteration's metrics, the run's config and sample validation generations
to Weights & Biases, as verl's wandb backend does.

Without an API key (WANDB_API_KEY unset and no netrc entry for the wandb host) the run is offline: it
never touches the network and `wandb sync RUN_DIR/wandb/offline-run-*` uploads it later. Files go under
RUN_DIR/wandb/. WANDB_MODE=disabled turns it off; with a key, WANDB_MODE (default online) is wandb's.
"""

from __future__ import annotations

import netrc
import numbers
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import pyarrow.parquet as pq

from ppoflow.tasks.storage.regular_files import refuse_links_below
from ppoflow.tasks.storage.tables import stage_path

if TYPE_CHECKING:
    from ppoflow.tasks.pipeline.settings import TrackingSettings

GENERATIONS_KEY = "val/generations"
GENERATION_COLUMNS = ("prompt", "response", "score", "step")


def has_api_key(environ: dict[str, str] | None = None) -> bool:
    """WANDB_API_KEY is set, or the netrc file ($NETRC, else ~/.netrc) has a password for the wandb host."""
    environ = os.environ if environ is None else environ
    if environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    path = Path(environ.get("NETRC") or Path("~/.netrc").expanduser())
    try:
        entry = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def wandb_mode(environ: dict[str, str] | None = None) -> str:
    """offline without an API key (disabled when WANDB_MODE says so); with one, WANDB_MODE or online."""
    environ = os.environ if environ is None else environ
    requested = environ.get("WANDB_MODE")
    if not has_api_key(environ):
        return "disabled" if requested == "disabled" else "offline"
    return requested or "online"


class WandbLogger:
    """A tracking backend (see tasks/observe/tracking.py): one wandb run per training run."""

    def __init__(self, settings: TrackingSettings, run_path: Path):
        import wandb

        self.run_path = Path(run_path)
        self.run_path.mkdir(parents=True, exist_ok=True)
        for folder in ("wandb", ".wandb"):  # wandb writes into either; planted as a link, elsewhere
            refuse_links_below(self.run_path, self.run_path / folder)
        self.max_generations = settings.log_val_generations
        self._wandb = wandb
        self.run = wandb.init(
            project=settings.project_name,
            name=settings.experiment_name,
            config=dict(settings.config),
            dir=self.run_path,
            mode=wandb_mode(),
            reinit="finish_previous",  # a run left open by a failed training in this process
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        data: dict[str, Any] = {
            k: float(v) for k, v in metrics.items() if isinstance(v, numbers.Real) and not isinstance(v, bool)
        }
        if any(k.startswith(("val-core/", "val-aux/")) for k in metrics):
            table = self._generations(step)
            if table is not None:
                data[GENERATIONS_KEY] = table
        self.run.log(data, step=step)

    def finish(self, summary: dict[str, Any]) -> None:
        self.run.summary.update({k: v for k, v in summary.items() if v is not None})
        self.run.finish()

    def fail(self) -> None:
        self.run.finish(exit_code=1)

    def _generations(self, step: int):
        """The first trainer.log_val_generations validation rows of `step` as a wandb Table (verl's
        val/generations), read from the step's validation parquet; None when there is none."""
        path = self.run_path / stage_path(step, "validation")
        if self.max_generations <= 0 or not path.is_file():
            return None
        with pq.ParquetFile(path) as parquet:
            rows = parquet.read(columns=["prompt_text", "response_text", "score"])
        rows = rows.slice(0, self.max_generations).to_pylist()
        data = [[r["prompt_text"], r["response_text"], r["score"], step] for r in rows]
        return self._wandb.Table(columns=list(GENERATION_COLUMNS), data=data)
