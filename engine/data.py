"""Which prompts each training step uses, and prompt-length handling. Pure functions."""

from __future__ import annotations

import random

from .names import Truncation


def steps_per_epoch(n_rows: int, batch_size: int) -> int:
    """Full batches per pass over the data (the last partial batch is dropped, as verl does)."""
    return n_rows // batch_size


def batch_rows(n_rows: int, batch_size: int, step: int, *, shuffle: bool, seed: int) -> tuple[int, list[int]]:
    """(epoch, row indices) of training step `step` (1-based). Each epoch is a fresh permutation
    seeded by (seed, epoch), so any step's batch is known without replaying the ones before it."""
    per_epoch = steps_per_epoch(n_rows, batch_size)
    if per_epoch == 0:
        raise ValueError(
            f"{n_rows} training prompts cannot fill one batch of data.train_batch_size={batch_size}"
        )
    epoch, position = divmod(step - 1, per_epoch)
    order = list(range(n_rows))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return epoch, order[position * batch_size : (position + 1) * batch_size]


def truncate_prompt(ids: list[int], max_length: int, mode: Truncation) -> list[int] | None:
    """Fit a prompt into `max_length` tokens per `data.truncation`; None when mode is "error"
    and the prompt is too long (the caller reports it)."""
    if len(ids) <= max_length:
        return ids
    match mode:
        case "error":
            return None
        case "left":
            return ids[-max_length:]
        case "right":
            return ids[:max_length]
        case "middle":
            head = max_length // 2
            return ids[:head] + ids[len(ids) - (max_length - head) :]
        case _:
            raise ValueError(f"unknown truncation {mode!r}: expected error, left, right or middle")
