"""Model states on disk and in memory: the base model, checkpoints, and the live-model cache.

Tasks hand each other `ModelState` references. Within one process the trained models stay in memory
(keyed by run, role and lineage), so consecutive stages never reload weights; a state that is not in
memory (a resumed run, a stage served from cache) is loaded from its checkpoint directory.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ppoflow.engine.models import load_actor, load_critic, load_reference, load_tokenizer
from ppoflow.engine.optim import OptimSettings, build_optimizer, resolve_warmup_steps

from .common import ModelState, Run
from .faults import inject_fault
from .storage import file_digest, leads_outside, remove_from_run, timed_io


@dataclass
class Trainable:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


_LIVE: dict[tuple[str, str], tuple[str, Trainable]] = {}
_DEVICE = ["cpu"]


def set_device(device: str) -> None:
    """trainer.device: where models live ("cpu" or "cuda"); batches follow the model."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but torch sees no CUDA device; use trainer.device=cpu")
    _DEVICE[0] = device


def _placed(model: torch.nn.Module) -> torch.nn.Module:
    return model.to(_DEVICE[0])


_FROZEN: dict[tuple[str, str], torch.nn.Module] = {}


def optim_settings(optim: dict, total_steps: int) -> OptimSettings:
    """OptimSettings from a verl `*.optim` config section (as a dict)."""
    warmup = resolve_warmup_steps(optim["lr_warmup_steps"], optim["lr_warmup_steps_ratio"], total_steps)
    return OptimSettings(
        lr=optim["lr"],
        weight_decay=optim["weight_decay"],
        betas=tuple(optim["betas"]),
        warmup_steps=warmup,
        total_steps=total_steps,
        warmup_style=optim["warmup_style"],
        min_lr_ratio=optim["min_lr_ratio"],
    )


class StateUnavailable(FileNotFoundError):
    """A model state that is neither in memory nor in an intact checkpoint."""


def schedule_horizon(config: dict, total_steps: int) -> int:
    """The training length the LR schedule depends on: total_steps for cosine decay or a warmup given
    as a ratio (optim.total_training_steps is set to it, as verl does), else 0, so that training
    longer does not invalidate the cached updates of a constant schedule (resuming at an epoch
    boundary with more epochs reuses every finished step)."""
    optim = config["optim"]
    depends = optim["warmup_style"] == "cosine" or (
        optim["lr_warmup_steps"] <= 0 and optim["lr_warmup_steps_ratio"] > 0
    )
    return total_steps if depends else 0


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


def _verified_dir(run: Run, state: ModelState) -> Path:
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


def live_value(run: Run, state: ModelState) -> Trainable | None:
    live = _LIVE.get((run.run_dir, state.role))
    return live[1] if live is not None and live[0] == state.lineage else None


def tokenizer_of(run: Run, state: ModelState):
    """The tokenizer saved with `state`, or with its nearest saved ancestor (training never
    changes the tokenizer, and every checkpoint carries the base model's)."""
    while state.checkpoint is None and state.origin is not None:
        state = state.origin.parent
    return _tokenizer_at(str(model_dir(run, state)))


@functools.lru_cache(maxsize=8)
def _tokenizer_at(directory: str):
    return load_tokenizer(directory)


def load_trainable(run: Run, state: ModelState, settings: OptimSettings) -> Trainable:
    """The model, optimizer and LR schedule of `state`: from memory, else from its intact checkpoint
    (raises StateUnavailable otherwise; `tasks.training.materialize` then replays)."""
    live = live_value(run, state)
    if live is not None:
        return live
    directory = _verified_dir(run, state)
    model = _placed(load_critic(directory) if state.role == "critic" else load_actor(directory))
    optimizer, scheduler = build_optimizer(model, settings)
    if state.step > 0:
        saved = torch.load(optim_path(directory), weights_only=True)
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
    result = Trainable(model, optimizer, scheduler)
    remember(run, state, result)
    return result


def forget(run: Run, role: str) -> None:
    """Drop the in-memory model of `role` (after a failed update left it half-trained)."""
    _LIVE.pop((run.run_dir, role), None)


def remember(run: Run, state: ModelState, value: Trainable) -> None:
    """Keep only the newest state of each role in memory."""
    _LIVE[(run.run_dir, state.role)] = (state.lineage, value)


def reference_model(run: Run, state: ModelState) -> torch.nn.Module:
    """The frozen reference policy (the initial actor), loaded once per run."""
    key = (run.run_dir, state.lineage)
    if key not in _FROZEN:
        _FROZEN[key] = _placed(load_reference(model_dir(run, state)))
    return _FROZEN[key]


def model_of(run: Run, state: ModelState) -> torch.nn.Module:
    """The model of `state` for inference: the live one, else its intact checkpoint, else rebuilt
    by replaying the updates since the last intact checkpoint."""
    live = live_value(run, state)
    if live is not None:
        return live.model
    try:
        directory = _verified_dir(run, state)
    except StateUnavailable:
        if state.origin is None:
            raise
        from .training import materialize, replay_settings  # training builds on this module

        return materialize(run, state, replay_settings(state)).model
    return _placed(load_critic(directory) if state.role == "critic" else load_actor(directory))


@timed_io
def save_checkpoint(run: Run, role: str, step: int, value: Trainable, tokenizer) -> tuple[str, str]:
    """Write checkpoints/iter=NNNNNN/<role>/ (an HF directory with tokenizer) and <role>.optim.pt;
    returns (directory relative to the run, checkpoint digest). Files are staged and renamed into
    place; a crash in between leaves a checkpoint whose digest does not match, which is never used."""
    relative = f"checkpoints/iter={step:06d}/{role}"
    final = run.path / relative
    final.parent.mkdir(parents=True, exist_ok=True)
    for leftover in final.parent.glob(f".{role}.*"):  # staged by a process that was killed
        remove_from_run(run.path / "checkpoints", leftover)
    staging = Path(tempfile.mkdtemp(prefix=f".{role}.", dir=final.parent))
    optim_tmp = final.parent / f".{role}.optim.pt.tmp"
    try:
        value.model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        state = {"optimizer": value.optimizer.state_dict(), "scheduler": value.scheduler.state_dict()}
        torch.save(state, optim_tmp)
        inject_fault("checkpoint", step)
        remove_from_run(run.path / "checkpoints", final)
        os.replace(staging, final)
        os.replace(optim_tmp, optim_path(final))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        optim_tmp.unlink(missing_ok=True)
        raise
    return relative, checkpoint_digest(final)


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
