"""Applying one update to a model (`run_update`): a placement's `train` calls it for the actor and
critic update stages, and again when it rebuilds a state that is not on disk, so a rebuilt state is
bit-identical to the one trained originally (same parent, same cached rollout and advantage tables,
same settings)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ppoflow.engine.forward import SequenceBatch
from ppoflow.engine.update import (
    CriticUpdateSettings,
    Stepper,
    UpdateResult,
    count_steps,
    update_actor,
    update_critic,
)
from ppoflow.tasks.pipeline.states import UpdateInputs
from ppoflow.tasks.storage.tables import IOClock, read_table
from ppoflow.tasks.storage.tensors import sequence_batch, token_tensor


def update_steps(inputs: UpdateInputs, n_rows: int) -> int:
    """Optimizer steps the update takes (for progress)."""
    return count_steps(n_rows, inputs.settings.mini_batch_size, inputs.settings.ppo_epochs)


def run_update(
    run_dir: str | Path,
    role: str,
    inputs: UpdateInputs,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    pad_token_id: int,
    *,
    stepper: Stepper | None = None,
    on_step: Callable[[int], None] | None = None,
    clock: IOClock | None = None,
) -> UpdateResult:
    """Train `model` (the parent state of `inputs`, in place) on the step's rollouts and advantages,
    then step the LR schedule: PPO's policy update for the actor, value regression for the critic.
    The mini-batch order is seeded by the step. On one rank of a worker group (`stepper`: its
    strategy) or in this process (`host.ModelHost`)."""
    rollouts = read_table(Path(run_dir), inputs.rollouts, clock=clock)
    advantages = read_table(Path(run_dir), inputs.advantages, clock=clock)
    order = [i for i, w in enumerate(advantages["train_weight"].to_pylist()) for _ in range(w)]  # PF-PPO
    rollouts, advantages = rollouts.take(order), advantages.take(order)
    batch = sequence_batch(rollouts, pad_token_id)
    width = batch.response_ids.shape[1]
    rejected = _optional_tokens(advantages, "rollout_rs_rejected", width)
    if rejected is not None:  # decoupled rejection sampling: those tokens train neither model
        batch = SequenceBatch(
            batch.prompt_ids,
            batch.prompt_mask,
            batch.response_ids,
            batch.response_mask * (1.0 - rejected),
            batch.attended,
        )
    if role == "critic":
        if not isinstance(inputs.settings, CriticUpdateSettings):
            raise TypeError(
                f"a critic update needs CriticUpdateSettings, got {type(inputs.settings).__name__}"
            )
        result = update_critic(
            model,
            optimizer,
            batch,
            values=token_tensor(advantages, "values", width),
            returns=token_tensor(advantages, "returns", width),
            settings=inputs.settings,
            seed=inputs.step,
            on_step=on_step,
            stepper=stepper,
        )
    else:
        result = update_actor(
            model,
            optimizer,
            batch,
            old_log_probs=token_tensor(rollouts, "old_log_probs", width),
            advantages=token_tensor(advantages, "advantages", width),
            ref_log_probs=token_tensor(rollouts, "ref_log_probs", width),
            settings=inputs.settings,
            seed=inputs.step,
            rollout_is_weights=_optional_tokens(advantages, "rollout_is_weights", width),
            on_step=on_step,
            stepper=stepper,
        )
    scheduler.step()
    return result


def _optional_tokens(table, column: str, width: int) -> torch.Tensor | None:
    """`token_tensor` of a column that tables written before it existed lack."""
    return token_tensor(table, column, width) if column in table.column_names else None
