"""Which model state a checkpoint holds: where a `ModelState`'s files are, whether they still hold
what the run recorded (digests), and saving or loading a state trained in this process. The folders'
layout and digests are `storage.checkpoints`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ppoflow.engine.lora import LoraSpec, save_adapters
from ppoflow.tasks.pipeline.states import ModelState
from ppoflow.tasks.storage.checkpoints import (
    ADAPTER_RECORD,
    OPTIMIZER_STATES_KEPT,
    StateUnavailable,
    Trainable,
    checkpoint_digest,
    directory_digest,
    holds_model,
    optimizer_digest,
    optimizer_dir,
    write_checkpoint,
)
from ppoflow.tasks.storage.optimizer_state import (
    OptimizerStateError,
    load_torch_optimizer,
    save_torch_optimizer,
)
from ppoflow.tasks.storage.pretrained_files import save_model_files
from ppoflow.tasks.storage.regular_files import leads_outside
from ppoflow.tasks.storage.tables import saved_folders, step_of

if TYPE_CHECKING:
    from ppoflow.tasks.pipeline.run import RunFiles


def model_dir(run: RunFiles, state: ModelState) -> Path:
    if state.checkpoint is None:
        raise StateUnavailable(
            f"{state.role} state of step {state.step} was not saved (trainer.save_freq) and is not in memory"
        )
    return run.path / state.checkpoint


def state_files_intact(run: RunFiles, state: ModelState) -> bool:
    """Whether the files a state names still hold what was recorded: a base model's directory its
    lineage, a saved update's checkpoint (in the run, not through a link) its digest, and its
    optimizer state its own. An update checkpoint that is gone is allowed when a newer checkpoint of
    the role exists (pruned by max_*_ckpt_to_keep; replay rebuilds it if ever needed), and so is its
    optimizer state (only the newest checkpoint of a role keeps one); the newest must be whole,
    since the run names it as its output and a resume trains it."""
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
        if checkpoint_digest(directory) != state.checkpoint_digest:
            return False
        if not optimizer_dir(directory).exists():
            return _newer_checkpoint_exists(run, state)
        return optimizer_digest(directory) == state.optimizer_digest
    except OSError:
        return False


def _newer_checkpoint_exists(run: RunFiles, state: ModelState) -> bool:
    saved = saved_folders(run.path / "checkpoints", state.role)
    return any(step_of(d.parent.name) > state.step and holds_model(d) for d in saved)


def verified_dir(run: RunFiles, state: ModelState) -> Path:
    """The state's model directory, after checking its files against the recorded digest."""
    directory = model_dir(run, state)
    if not holds_model(directory):
        raise StateUnavailable(f"checkpoint {directory} of the {state.role} at step {state.step} is missing")
    if state.checkpoint_digest is not None:
        _check_digest("checkpoint", directory, lambda: checkpoint_digest(directory), state.checkpoint_digest)
    return directory


def verified_optimizer_dir(run: RunFiles, state: ModelState) -> Path:
    """The optimizer state saved with `state` (to continue training it), checked like its weights."""
    model = verified_dir(run, state)
    directory = optimizer_dir(model)
    if not directory.is_dir():
        raise StateUnavailable(
            f"the optimizer state of the {state.role} at step {state.step} was not kept "
            f"(only the newest {OPTIMIZER_STATES_KEPT} checkpoints of a role keep it)"
        )
    _check_digest("optimizer state", directory, lambda: optimizer_digest(model), state.optimizer_digest)
    return directory


def _check_digest(name: str, directory: Path, digest: Callable[[], str], recorded: str | None) -> None:
    try:
        actual = digest()
    except OSError as error:
        raise StateUnavailable(f"{name} {directory} is incomplete: {error}") from error
    if actual != recorded:
        raise StateUnavailable(f"{name} {directory} was altered or truncated (digest mismatch)")


def save_checkpoint(
    run: RunFiles,
    role: str,
    step: int,
    value: Trainable,
    tokenizer,
    *,
    base: ModelState | None = None,
    lora: LoraSpec | None = None,
    clock=None,
) -> tuple[str, str, str]:
    """A model trained in this process: an HF directory with its tokenizer, or, for a LoRA model
    (`base`, `lora`), its adapters and ADAPTER_RECORD only (the tokenizer is the base's); and its
    optimizer state (loadable at any world size)."""

    def fill(directory: Path, optimizer_directory: Path) -> None:
        if base is None:
            save_model_files(value.model, tokenizer, directory)
        else:
            save_adapters(value.model, directory, base_model_path=str(model_dir(run, base)))
            record = {
                "base": {"role": base.role, "lineage": base.lineage, "checkpoint": base.checkpoint},
                "lora": None if lora is None else dataclasses.asdict(lora),
            }
            (directory / ADAPTER_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        save_torch_optimizer(optimizer_directory, value.model, value.optimizer, value.scheduler)

    return write_checkpoint(run.path, role, step, fill, clock=clock)


def load_optimizer_state(
    run: RunFiles, state: ModelState, model: torch.nn.Module, optimizer, scheduler
) -> None:
    """Restore the optimizer and LR schedule saved with `state` into this process's optimizer."""
    directory = verified_optimizer_dir(run, state)
    try:
        load_torch_optimizer(directory, model, optimizer, scheduler)
    except OptimizerStateError as error:
        raise StateUnavailable(str(error)) from error
