"""trainer.logger: where each iteration's metrics go besides the metrics table (always written) and
the console line (always printed). verl's `Tracking` with the same backend names.

A backend has `log(step, metrics)`, `finish(summary)` and `fail()`; `Tracking` fans out to the configured ones
and to the Prefect artifacts when the run happens inside a Prefect flow run.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ppoflow.tasks.pipeline.settings import TrackingSettings


class Backend(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def finish(self, summary: dict[str, Any]) -> None: ...

    def fail(self) -> None: ...


def _backends(settings: TrackingSettings, run_path: Path, total: int) -> list[Backend]:
    backends: list[Backend] = []
    if "wandb" in settings.loggers:
        from ppoflow.tasks.observe.wandb_logger import WandbLogger  # wandb is imported only when asked for

        backends.append(WandbLogger(settings, run_path))
    from ppoflow.tasks.observe.artifacts import PrefectArtifacts

    if PrefectArtifacts.active():
        backends.append(PrefectArtifacts(run_path, total))
    return backends


class Tracking:
    """All configured metric sinks of one training run."""

    def __init__(self, settings: TrackingSettings, run_path: Path, total: int):
        self.backends = _backends(settings, run_path, total)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for backend in self.backends:
            backend.log(step, metrics)

    def finish(self, summary: dict[str, Any]) -> None:
        for backend in self.backends:
            backend.finish(summary)

    def fail(self) -> None:
        """The run raised: close what stays open (a wandb run is marked failed)."""
        for backend in self.backends:
            backend.fail()
