"""The run handle every stage receives: where the run's files are and the clock of their IO
(`RunFiles`, all that the pipeline's file handling needs), and where its models live (`Run.models`,
a `ModelPlacement`); and the run's life: opened (lock taken, leftovers cleared, config written, the
placement started) and closed once per run by the flow."""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from ppoflow.tasks.pipeline.placement import ModelPlacement
from ppoflow.tasks.storage.catalog import refresh_catalog
from ppoflow.tasks.storage.durability import wait_durable
from ppoflow.tasks.storage.lock import acquire_run_lock, release_run_lock
from ppoflow.tasks.storage.regular_files import make_run_directory, remove_stale_temp_files
from ppoflow.tasks.storage.run_config import record_config, require_same_run
from ppoflow.tasks.storage.tables import RESULTS_DIR, IOClock

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunFiles:
    """`run_dir` is absolute. Not part of cache keys, so a moved run keeps its cache; `recompute`
    (trainer.resume_mode=disable) makes every stage run again instead of resuming."""

    run_dir: str
    recompute: bool = False
    io: IOClock = field(default_factory=IOClock, compare=False, repr=False)
    """Seconds spent reading and writing the run's files."""
    config_changes: tuple[str, ...] = field(default=(), compare=False, repr=False)
    """The keys whose values differ from the run's previous start ("key: old → new")."""

    @property
    def path(self) -> Path:
        return Path(self.run_dir)


@dataclass(frozen=True)
class Run(RunFiles):
    """A run's files and where its models live."""

    models: ModelPlacement = field(kw_only=True, compare=False, repr=False)
    """The run's actor, critic, reference and reward model (`run.models.rollouts(...)`)."""


def open_run(
    run_dir: str | Path,
    config_yaml: str,
    models: ModelPlacement,
    *,
    recompute: bool = False,
    device: str = "cpu",
) -> Run:
    """Take the run directory's lock (one writer per run), clear what killed writes left behind,
    write its effective config (config.yaml; the Run's `config_changes` name what differs from the
    last start's), and start `models` (a worker group checks that every rank sees the run). A start
    of another actor model or other training data than the steps already there is refused first
    (run_config.AnotherRun). `recompute` (trainer.resume_mode=disable) runs every stage again; the
    models live on `device` (trainer.device)."""
    path = Path(run_dir).resolve()
    make_run_directory(path)
    if device == "cpu":  # DeepSpeed (imported by transformers' integrations too) would warn it found no GPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    acquire_run_lock(path)
    try:
        require_same_run(path, config_yaml)  # before anything of the run is changed
        _require_results_folder(path / RESULTS_DIR)
        remove_stale_temp_files(path)
        changes = record_config(path, config_yaml)
        run = Run(str(path), recompute=recompute, config_changes=tuple(changes), models=models)
        models.start(run)  # devices and shared storage are checked before any stage
    except BaseException:
        try:
            models.close()
        finally:
            release_run_lock(path)
        raise
    return run


def _require_results_folder(path: Path) -> None:
    """Stage results are kept in this folder; were it a file, Prefect would fail to keep any (in its
    log only) and the run would silently lose its resume."""
    if path.is_symlink():  # Prefect would write the run's stage results wherever it points
        raise OSError(
            errno.EPERM, "stage results are kept in a folder of the run, not a link; remove it", str(path)
        )
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "stage results are kept in a folder; remove this", str(path))


def finish_run(run: Run) -> Run:
    """Refresh the catalog once more (a fully cached run wrote no new iteration), once every file the
    run wrote is on disk (also those no step commits: a validation-only run's tables)."""
    with run.io.timing("sync"):
        wait_durable(run.path)
    refresh_catalog(run.path, clock=run.io)
    return run


def close_run(run: Run) -> None:
    """Stop the run's workers, wait for the fsyncs of its last files and release the run directory's
    lock (also after a failure)."""
    try:
        run.models.close()
    finally:
        try:  # after a failure: what the failed run wrote last is checked by digest if it is used
            wait_durable(run.path)
        except OSError as error:
            logger.warning("ppoflow: %s", error)
        finally:
            release_run_lock(run.path)


def set_torch_threads(num_threads: int | None) -> None:
    """trainer.num_threads: on a busy 2-core machine one thread can beat two; None keeps torch's choice."""
    if num_threads:
        import torch

        torch.set_num_threads(num_threads)
