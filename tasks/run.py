"""The run handle every stage receives: where the run's files are, where its models live, and the
clock of its file IO. Created once per run by the flow (`stages.prepare_model.open_run`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ppoflow.tasks.models.host import ModelHost
from ppoflow.tasks.storage.tables import IOClock


@dataclass(frozen=True)
class Run:
    """`run_dir` is absolute. Not part of cache keys, so a moved run keeps its cache; `recompute`
    (trainer.resume_mode=disable) makes every stage run again instead of resuming."""

    run_dir: str
    recompute: bool = False
    models: ModelHost = field(default_factory=ModelHost, compare=False, repr=False)
    """Where the run's actor, critic and reference live (`run.models.model(state)`)."""
    io: IOClock = field(default_factory=IOClock, compare=False, repr=False)
    """Seconds spent reading and writing the run's files."""

    @property
    def path(self) -> Path:
        return Path(self.run_dir)
