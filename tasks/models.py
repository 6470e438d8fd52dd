"""Model states on disk and in memory: the base model, checkpoints, and the live-model cache.

Tasks hand each other `ModelState` references. Within one process the trained models stay in memory
(keyed by run, role and lineage), so consecutive stages never reload weights; a state that is not in
memory (a resumed run, a stage served from cache) is loaded from its checkpoint directory.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ppoflow.engine.models import load_actor, load_critic, load_reference, load_tokenizer
from ppoflow.engine.optim import OptimSettings, build_optimizer, resolve_warmup_steps

from .common import ModelState, Run
from .storage import timed_io


@dataclass
class Trainable:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


_LIVE: dict[tuple[str, str], tuple[str, Trainable]] = {}
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


def model_dir(run: Run, state: ModelState) -> Path:
    if state.checkpoint is None:
        raise FileNotFoundError(
            f"{state.role} state of step {state.step} was not saved (trainer.save_freq) and is not in memory"
        )
    return run.path / state.checkpoint


def tokenizer_of(run: Run, state: ModelState):
    """The tokenizer saved with `state` (every checkpoint carries the base model's tokenizer)."""
    return _tokenizer_at(str(model_dir(run, state)))


@functools.lru_cache(maxsize=8)
def _tokenizer_at(directory: str):
    return load_tokenizer(directory)


def trainable(run: Run, state: ModelState, settings: OptimSettings) -> Trainable:
    """The model, optimizer and LR schedule of `state`: from memory, else from its checkpoint."""
    live = _LIVE.get((run.run_dir, state.role))
    if live is not None and live[0] == state.lineage:
        return live[1]
    directory = model_dir(run, state)
    model = load_critic(directory) if state.role == "critic" else load_actor(directory)
    optimizer, scheduler = build_optimizer(model, settings)
    optim_file = directory.parent / f"{state.role}.optim.pt"
    if state.step > 0 and optim_file.is_file():
        saved = torch.load(optim_file, weights_only=True)
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
    result = Trainable(model, optimizer, scheduler)
    remember(run, state, result)
    return result


def remember(run: Run, state: ModelState, value: Trainable) -> None:
    """Keep only the newest state of each role in memory."""
    _LIVE[(run.run_dir, state.role)] = (state.lineage, value)


def reference_model(run: Run, state: ModelState) -> torch.nn.Module:
    """The frozen reference policy (the initial actor), loaded once per run."""
    key = (run.run_dir, state.lineage)
    if key not in _FROZEN:
        _FROZEN[key] = load_reference(model_dir(run, state))
    return _FROZEN[key]


def model_of(run: Run, state: ModelState) -> torch.nn.Module:
    """The model of `state` for inference only: the live one, else loaded from its checkpoint."""
    live = _LIVE.get((run.run_dir, state.role))
    if live is not None and live[0] == state.lineage:
        return live[1].model
    directory = model_dir(run, state)
    return load_critic(directory) if state.role == "critic" else load_actor(directory)


@timed_io
def save_checkpoint(run: Run, role: str, step: int, value: Trainable, tokenizer) -> str:
    """Write checkpoints/iter=NNNNNN/<role>/ (an HF directory with tokenizer) and <role>.optim.pt
    atomically; returns the directory relative to the run."""
    relative = f"checkpoints/iter={step:06d}/{role}"
    final = run.path / relative
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{role}.", dir=final.parent))
    try:
        value.model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        optim_tmp = final.parent / f".{role}.optim.pt.tmp"
        torch.save(
            {"optimizer": value.optimizer.state_dict(), "scheduler": value.scheduler.state_dict()}, optim_tmp
        )
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        os.replace(optim_tmp, final.parent / f"{role}.optim.pt")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return relative


def prune_checkpoints(run: Run, role: str, keep: int | None) -> None:
    """Delete all but the newest `keep` checkpoints of `role` (None keeps all, as verl)."""
    if keep is None or keep <= 0:
        return
    saved = sorted((run.path / "checkpoints").glob(f"iter=*/{role}"))
    for directory in saved[:-keep]:
        shutil.rmtree(directory, ignore_errors=True)
        (directory.parent / f"{role}.optim.pt").unlink(missing_ok=True)
