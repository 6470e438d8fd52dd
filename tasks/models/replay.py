"""Applying one update to a model: the actor and critic update stages call it, and so does
`ModelHost` when it rebuilds a state that is not on disk, so a rebuilt state is bit-identical to the
one trained originally (same parent, same cached rollout and advantage tables, same settings)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ppoflow.engine.update import (
    CriticUpdateSettings,
    Stepper,
    UpdateResult,
    count_steps,
    update_actor,
    update_critic,
)
from ppoflow.tasks.storage.checkpoints import Trainable
from ppoflow.tasks.storage.states import ModelState, UpdateInputs
from ppoflow.tasks.storage.tables import IOClock, read_table
from ppoflow.tasks.storage.tensors import sequence_batch, token_tensor

if TYPE_CHECKING:
    from ppoflow.tasks.run import Run


class UpdateHistory:
    """The update that produced each model state this run has seen, by lineage. A state handed on
    after its checkpoint was saved carries no history (the checkpoint stands in for it), but once its
    optimizer state is pruned (only the newest checkpoints keep one) the checkpoint cannot be trained
    on: the state is then rebuilt by replaying its update from its parent, and so on back to a state
    that can be loaded, at worst the base model. The flow remembers every update stage's state, cached
    or computed, so that chain is known."""

    def __init__(self) -> None:
        self._origins: dict[str, UpdateInputs] = {}

    def remember(self, state: ModelState | None) -> None:
        while state is not None and state.origin is not None and state.lineage not in self._origins:
            self._origins[state.lineage] = state.origin
            state = state.origin.parent

    def origin_of(self, state: ModelState) -> UpdateInputs | None:
        """The update that produced `state`; None for a base model (or a state never seen)."""
        return state.origin or self._origins.get(state.lineage)


def update_steps(inputs: UpdateInputs, n_rows: int) -> int:
    """Optimizer steps the update takes (for progress)."""
    return count_steps(n_rows, inputs.settings.mini_batch_size, inputs.settings.ppo_epochs)


def apply_update(
    run: Run,
    role: str,
    inputs: UpdateInputs,
    value: Trainable,
    tokenizer,
    on_step: Callable[[int], None] | None = None,
) -> UpdateResult:
    """Train `value` (the parent state, in place) on the step's rollouts and advantages, then step
    the LR schedule: PPO's policy update for the actor, value regression for the critic. The
    mini-batch order is seeded by the step."""
    return run_update(
        run.path,
        role,
        inputs,
        value.model,
        value.optimizer,
        value.scheduler,
        tokenizer.pad_token_id,
        on_step=on_step,
        clock=run.io,
    )


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
    """`apply_update` on one rank of a worker group (`stepper`: its strategy), or in this process."""
    rollouts = read_table(Path(run_dir), inputs.rollouts, clock=clock)
    advantages = read_table(Path(run_dir), inputs.advantages, clock=clock)
    order = [i for i, w in enumerate(advantages["train_weight"].to_pylist()) for _ in range(w)]  # PF-PPO
    rollouts, advantages = rollouts.take(order), advantages.take(order)
    batch = sequence_batch(rollouts, pad_token_id)
    width = batch.response_ids.shape[1]
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
            on_step=on_step,
            stepper=stepper,
        )
    scheduler.step()
    return result
