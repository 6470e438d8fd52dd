"""Model states on disk: checkpoint directories, their digests, saving and pruning. Where models
live while the run trains is `host.ModelHost`."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ppoflow.tasks.faults import inject_fault
from ppoflow.tasks.storage.states import ModelState
from ppoflow.tasks.storage.tables import file_digest, leads_outside, remove_from_run, timed_io

if TYPE_CHECKING:
    from ppoflow.tasks.run import Run


@dataclass
class Trainable:
    """A model with its optimizer and LR schedule: what a checkpoint holds."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


class StateUnavailable(FileNotFoundError):
    """A model state that is neither in memory nor in an intact checkpoint."""


def model_dir(run: Run, state: ModelState) -> Path:
    if state.checkpoint is None:
        raise StateUnavailable(
            f"{state.role} state of step {state.step} was not saved (trainer.save_freq) and is not in memory"
        )
    return run.path / state.checkpoint


def optim_path(directory: Path) -> Path:
    """checkpoints/iter=k/<role>.optim.pt beside the model directory."""
    return directory.parent / f"{directory.name}.optim.pt"


def checkpoint_digest(directory: Path) -> str:
    """sha256 over a checkpoint: every file of its directory (weights, config, tokenizer) and its
    optimizer state."""
    h = hashlib.sha256(directory_digest(directory).encode())
    h.update(file_digest(optim_path(directory)).encode())
    return "sha256:" + h.hexdigest()


def directory_digest(directory: Path) -> str:
    """sha256 over a model directory's files (config, tokenizer, weights; names and content
    digests; dot-files excluded): a base model's lineage."""
    h = hashlib.sha256()
    for path in sorted(p for p in Path(directory).iterdir() if p.is_file() and not p.name.startswith(".")):
        h.update(path.name.encode())
        h.update(file_digest(path).encode())
    return h.hexdigest()


def state_files_intact(run: Run, state: ModelState) -> bool:
    """Whether the files a state names still hold what was recorded: a base model's directory its
    lineage, a saved update's checkpoint (in the run, not through a link) its digest. An update
    checkpoint that is gone is allowed when a newer checkpoint of the role exists (pruned by
    max_*_ckpt_to_keep; replay rebuilds it if ever needed); the newest one must be there, since the
    run names it as its output."""
    if state.checkpoint is None:
        return True
    directory = run.path / state.checkpoint
    try:
        if state.origin is None and state.step == 0:  # a base model: its lineage is its digest
            return state.role != "actor" or directory_digest(directory) == state.lineage
        if Path(state.checkpoint).is_absolute() or state.checkpoint_digest is None:
            return False  # an update saves its checkpoint in the run, with a digest
        if not directory.exists():
            return _newer_checkpoint_exists(run, state)
        if leads_outside(run.path / "checkpoints", directory):
            return False
        return checkpoint_digest(directory) == state.checkpoint_digest
    except OSError:
        return False


def _newer_checkpoint_exists(run: Run, state: ModelState) -> bool:
    for directory in (run.path / "checkpoints").glob(f"iter=*/{state.role}"):
        step = directory.parent.name.removeprefix("iter=")
        if step.isdigit() and int(step) > state.step and (directory / "config.json").is_file():
            return True
    return False


def verified_dir(run: Run, state: ModelState) -> Path:
    """The state's checkpoint directory, after checking its files against the recorded digest."""
    directory = model_dir(run, state)
    if not (directory / "config.json").is_file():
        raise StateUnavailable(f"checkpoint {directory} of the {state.role} at step {state.step} is missing")
    if state.checkpoint_digest is not None:
        try:
            actual = checkpoint_digest(directory)
        except OSError as error:
            raise StateUnavailable(f"checkpoint {directory} is incomplete: {error}") from error
        if actual != state.checkpoint_digest:
            raise StateUnavailable(f"checkpoint {directory} was altered or truncated (digest mismatch)")
    return directory


@timed_io
def write_checkpoint(run: Run, role: str, step: int, fill: Callable[[Path, Path], None]) -> tuple[str, str]:
    """Write checkpoints/iter=NNNNNN/<role>/ and <role>.optim.pt with `fill(model directory,
    optimizer file)`; returns (directory relative to the run, checkpoint digest). Files are staged
    and renamed into place; a crash in between leaves a checkpoint whose digest does not match,
    which is never used."""
    relative = f"checkpoints/iter={step:06d}/{role}"
    final = run.path / relative
    final.parent.mkdir(parents=True, exist_ok=True)
    for leftover in final.parent.glob(f".{role}.*"):  # staged by a process that was killed
        remove_from_run(run.path / "checkpoints", leftover)
    staging = Path(tempfile.mkdtemp(prefix=f".{role}.", dir=final.parent))
    optim_tmp = final.parent / f".{role}.optim.pt.tmp"
    try:
        fill(staging, optim_tmp)
        inject_fault("checkpoint", step)
        remove_from_run(run.path / "checkpoints", final)
        os.replace(staging, final)
        os.replace(optim_tmp, optim_path(final))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        optim_tmp.unlink(missing_ok=True)
        raise
    return relative, checkpoint_digest(final)


def save_checkpoint(
    run: Run, role: str, step: int, value: Trainable, tokenizer, *, clock=None
) -> tuple[str, str]:
    """A model trained in this process: an HF directory with its tokenizer, and its optimizer state
    keyed by parameter name (loadable at any world size)."""

    def fill(directory: Path, optimizer_file: Path) -> None:
        value.model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        state = {
            "optimizer": named_optimizer_state(value.model, value.optimizer),
            "scheduler": value.scheduler.state_dict(),
        }
        torch.save(state, optimizer_file)

    return write_checkpoint(run, role, step, fill, clock=clock)


def named_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """`optimizer.state_dict()` with each parameter named as in the model instead of numbered: the
    layout of torch.distributed's full optimizer state dict, which any world size can load."""
    names = {id(p): name for name, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    saved = optimizer.state_dict()
    return {
        "state": {order[i]: value for i, value in saved["state"].items()},
        "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in saved["param_groups"]],
    }


def numbered_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, named: dict) -> dict:
    """The inverse of `named_optimizer_state`, for `optimizer.load_state_dict`; a state whose names
    do not match the model's parameters is an error naming the first that differs."""
    names = {id(p): name for name, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    index = {name: i for i, name in enumerate(order)}
    saved_names = [n for g in named["param_groups"] for n in g["params"]]
    if sorted(saved_names) != sorted(order):
        differing = sorted(set(saved_names) ^ set(order))
        raise StateUnavailable(
            f"the saved optimizer state does not match the model's parameters ({differing[0]})"
        )
    return {
        "state": {index[name]: value for name, value in named["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in named["param_groups"]],
    }


def load_optimizer_state(directory: Path, model: torch.nn.Module, optimizer, scheduler) -> None:
    """Restore the optimizer and LR schedule saved beside `directory` (by parameter name; a file
    written by an earlier ppoflow numbers them instead)."""
    saved = torch.load(optim_path(directory), weights_only=True)
    state = saved["optimizer"]
    if any(isinstance(name, str) for g in state["param_groups"] for name in g["params"]):
        state = numbered_optimizer_state(model, optimizer, state)
    optimizer.load_state_dict(state)
    scheduler.load_state_dict(saved["scheduler"])


def prune_checkpoints(run: Run, role: str, keep: int | None) -> None:
    """Delete all but the newest `keep` checkpoints of `role` (None keeps all, as verl)."""
    if keep is None or keep <= 0:
        return
    root = run.path / "checkpoints"
    saved = sorted(root.glob(f"iter=*/{role}"))
    for directory in saved[:-keep]:
        if not leads_outside(root, directory):  # a planted link's target is not the run's
            remove_from_run(root, directory)
            remove_from_run(root, optim_path(directory))
