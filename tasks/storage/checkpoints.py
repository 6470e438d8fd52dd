"""Checkpoint directories on disk: their layout (checkpoints/iter=N/<role>/ and <role>.optim/), their
digests, staged writing and pruning. Which model state a checkpoint holds, and checking it against
what the run recorded, is `pipeline.model_files`."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ppoflow.engine.lora import ADAPTER_CONFIG
from ppoflow.tasks.faults import inject_fault
from ppoflow.tasks.storage.durability import sync_later, sync_tree_later
from ppoflow.tasks.storage.regular_files import leads_outside, refuse_links_below, remove_from_run
from ppoflow.tasks.storage.tables import file_digest, saved_folders, step_of, timed_io


@dataclass
class Trainable:
    """A model with its optimizer and LR schedule: what a checkpoint holds."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


class StateUnavailable(FileNotFoundError):
    """A model state that is neither in memory nor in an intact checkpoint."""


TRAINER_STATE_FILE = "trainer_state.json"
"""In checkpoints/iter=N/: the run's state after step N (pipeline.trainer_state)."""


ADAPTER_RECORD = "ppoflow_adapter.json"
"""In a LoRA checkpoint, beside peft's two files: the base model its adapters apply to (role, lineage,
checkpoint as in ModelState) and the LoRA settings they were trained with."""


def holds_model(directory: Path) -> bool:
    """Whether `directory` holds a saved model: a Hugging Face model (config.json) or LoRA
    adapters (adapter_config.json)."""
    return (directory / "config.json").is_file() or (directory / ADAPTER_CONFIG).is_file()


def adapter_record(directory: Path) -> dict | None:
    """The ADAPTER_RECORD of a LoRA checkpoint; None for a checkpoint of whole weights."""
    path = directory / ADAPTER_RECORD
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    if not isinstance(record, dict) or not isinstance(record.get("base"), dict):
        raise ValueError(f"{path} is not a ppoflow adapter record")
    return record


def optimizer_dir(directory: Path) -> Path:
    """checkpoints/iter=k/<role>.optim/ beside the model directory: the optimizer state, one
    safetensors file per rank that saved it, and state.json."""
    return directory.parent / f"{directory.name}.optim"


def checkpoint_digest(directory: Path) -> str:
    """sha256 over a checkpoint's model directory: every file (weights, config, tokenizer)."""
    return "sha256:" + hashlib.sha256(directory_digest(directory).encode()).hexdigest()


def optimizer_digest(directory: Path) -> str:
    """sha256 over the optimizer state saved beside the model directory `directory`: every entry,
    dot-files included, since the reader takes every `*.safetensors` there. Each must be a regular
    file ppoflow wrote (a planted pipe would block the reader, a link read outside the run)."""
    folder = optimizer_dir(directory)
    if folder.is_symlink():
        raise OSError(f"{folder} is a link, not the folder ppoflow wrote")
    return "sha256:" + directory_digest(folder, every_entry=True)


def directory_digest(directory: Path, *, every_entry: bool = False) -> str:
    """sha256 over a model directory's files (config, tokenizer, weights; names and content
    digests; dot-files excluded): a base model's lineage. With `every_entry`, dot-files count too
    and anything that is not a regular file is an OSError."""
    h = hashlib.sha256()
    for path in sorted(Path(directory).iterdir()):
        regular = path.is_file() and not path.is_symlink()
        if every_entry and not regular:
            raise OSError(f"{path} is not a regular file")
        if not every_entry and (not path.is_file() or path.name.startswith(".")):
            continue
        h.update(path.name.encode())
        h.update(file_digest(path).encode())
    return h.hexdigest()


@timed_io("checkpoints")
def write_checkpoint(
    run_dir: Path, role: str, step: int, fill: Callable[[Path, Path], None]
) -> tuple[str, str, str]:
    """Write checkpoints/iter=NNNNNN/<role>/ and <role>.optim/ with `fill(model directory,
    optimizer directory)`; returns (model directory relative to the run, its digest, the optimizer
    state's digest). Both are staged and renamed into place; a crash in between leaves files whose
    digests do not match, which are never used. Their files are fsynced in the background, and the
    step's commit waits for them (durability.py)."""
    relative = f"checkpoints/iter={step:06d}/{role}"
    final = run_dir / relative
    root = run_dir / "checkpoints"
    refuse_links_below(root, final.parent)
    final.parent.mkdir(parents=True, exist_ok=True)
    for leftover in final.parent.glob(f".{role}.*"):  # staged by a process that was killed
        remove_from_run(root, leftover)
    staging = Path(tempfile.mkdtemp(prefix=f".{role}.", dir=final.parent))
    optim_staging = Path(tempfile.mkdtemp(prefix=f".{role}.optim.", dir=final.parent))
    try:
        fill(staging, optim_staging)
        readable_as_the_umask_allows(staging, optim_staging)
        inject_fault("checkpoint", step)
        remove_from_run(root, final)
        remove_from_run(root, optimizer_dir(final))
        os.replace(staging, final)
        os.replace(optim_staging, optimizer_dir(final))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(optim_staging, ignore_errors=True)
        raise
    sync_checkpoint_later(final)
    return relative, checkpoint_digest(final), optimizer_digest(final)


def sync_checkpoint_later(directory: Path) -> None:
    """Queue the fsync of a checkpoint's model and optimizer folders, their files first, then of their
    entries in iter=k/ and in checkpoints/ (durability.py)."""
    sync_tree_later(directory)
    sync_tree_later(optimizer_dir(directory))
    sync_later([directory.parent, directory.parent.parent])


def readable_as_the_umask_allows(*folders: Path) -> None:
    """Filled staging folders and their files given the modes the umask allows, like every other
    run file, before they are renamed into place: mkdtemp makes a folder private to its owner (and
    copytree gives it its source's mode), and safetensors' save_file (transformers' saves, and
    ppoflow's where it does not stream the tensors itself) writes a weights or optimizer file under
    a private temporary name (0600) and renames it."""
    umask = _umask()
    for folder in folders:
        os.chmod(folder, 0o777 & ~umask)
        for entry in os.scandir(folder):
            if entry.is_file(follow_symlinks=False):
                os.chmod(entry.path, 0o666 & ~umask)


def _umask() -> int:
    """The process's umask, read without changing it where the system says it (Linux): to read it,
    os.umask must set one, and a file another thread creates meanwhile gets that one."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o077)  # the strictest while it is read
    os.umask(umask)
    return umask


OPTIMIZER_STATES_KEPT = 2
"""Checkpoints of a role that keep their optimizer state: the newest, which a resume trains, and the
one before it, from which a damaged newest is trained again."""


def prune_optimizer_states(run_dir: Path, role: str, step: int) -> None:
    """Delete the optimizer state of every checkpoint of `role` up to `step` (the one just saved)
    but the newest OPTIMIZER_STATES_KEPT (an older state that is ever trained again is rebuilt by
    replay). Later steps on disk are an earlier start's, not newer than this one."""
    root = run_dir / "checkpoints"
    for directory in _up_to(saved_folders(root, f"{role}.optim"), step)[:-OPTIMIZER_STATES_KEPT]:
        if not leads_outside(root, directory):
            remove_from_run(root, directory)


def prune_checkpoints(run_dir: Path, role: str, keep: int | None, step: int) -> None:
    """Delete all but the newest `keep` checkpoints of `role` up to `step` (the one just saved;
    None keeps all, as verl)."""
    if keep is None or keep <= 0:
        return
    root = run_dir / "checkpoints"
    for directory in _up_to(saved_folders(root, role), step)[:-keep]:
        if not leads_outside(root, directory):  # a planted link's target is not the run's
            remove_from_run(root, directory)
            remove_from_run(root, optimizer_dir(directory))


def _up_to(folders: list[Path], step: int) -> list[Path]:
    """The checkpoints/iter=k/<name> folders of steps k <= `step`."""
    return [folder for folder in folders if (step_of(folder.parent.name) or 0) <= step]
