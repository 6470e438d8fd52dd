"""Applying one update to a model state, and rebuilding states that are not on disk.

An update stage and a replay run the very same `apply_update`, so a state rebuilt from its parent
checkpoint and the cached rollout/advantage tables is bit-identical to the one trained originally.
"""

from __future__ import annotations

from collections.abc import Callable

from ppoflow.engine.optim import OptimSettings
from ppoflow.engine.update import (
    ActorUpdateSettings,
    CriticUpdateSettings,
    UpdateResult,
    count_steps,
    update_actor,
    update_critic,
)

from .batches import sequence_batch, token_tensor
from .common import ModelState, Run, UpdateInputs
from .models import (
    StateUnavailable,
    Trainable,
    load_trainable,
    optim_settings,
    remember,
    tokenizer_of,
)
from .storage import read_table


def actor_settings(config: dict, batching: dict, temperature: float, step: int) -> ActorUpdateSettings:
    return ActorUpdateSettings(
        ppo_epochs=config["ppo_epochs"],
        mini_batch_size=batching["actor_mini_batch_rows"],
        micro_batch_size=config["ppo_micro_batch_size_per_gpu"],
        temperature=temperature,
        clip_ratio_low=config["effective_clip_ratio_low"],
        clip_ratio_high=config["effective_clip_ratio_high"],
        clip_ratio_c=config["clip_ratio_c"],
        loss_agg_mode=config["loss_agg_mode"],
        entropy_coeff=config["entropy_coeff"],
        use_kl_loss=config["use_kl_loss"],
        kl_loss_coef=config["kl_loss_coef"],
        kl_loss_type=config["kl_loss_type"],
        grad_clip=config["grad_clip"],
        shuffle=config["shuffle"],
        seed=step,
    )


def critic_settings(config: dict, batching: dict, step: int) -> CriticUpdateSettings:
    return CriticUpdateSettings(
        ppo_epochs=config["ppo_epochs"],
        mini_batch_size=batching["critic_mini_batch_rows"],
        micro_batch_size=config["ppo_micro_batch_size_per_gpu"],
        cliprange_value=config["cliprange_value"],
        loss_agg_mode=config["loss_agg_mode"],
        grad_clip=config["grad_clip"],
        shuffle=config["shuffle"],
        seed=step,
    )


def update_steps(role: str, inputs: UpdateInputs, n_rows: int) -> int:
    settings = _settings(role, inputs)
    return count_steps(n_rows, settings.mini_batch_size, settings.ppo_epochs)


def _settings(role: str, inputs: UpdateInputs):
    if role == "critic":
        return critic_settings(inputs.config, inputs.batching, inputs.step)
    return actor_settings(inputs.config, inputs.batching, inputs.temperature, inputs.step)


def apply_update(
    run: Run, role: str, inputs: UpdateInputs, value: Trainable, on_step: Callable[[int], None] | None = None
) -> UpdateResult:
    """Train `value` (the parent state, in place) on the step's rollouts and advantages, then step
    the LR schedule: PPO's policy update for the actor, value regression for the critic."""
    tokenizer = tokenizer_of(run, inputs.parent)
    table, adv = read_table(run.path, inputs.rollouts), read_table(run.path, inputs.advantages)
    order = [i for i, w in enumerate(adv["train_weight"].to_pylist()) for _ in range(w)]  # PF-PPO repeats
    table, adv = table.take(order), adv.take(order)
    batch = sequence_batch(table, tokenizer.pad_token_id)
    width = batch.response_ids.shape[1]
    settings = _settings(role, inputs)
    if role == "critic":
        result = update_critic(
            value.model,
            value.optimizer,
            batch,
            values=token_tensor(adv, "values", width),
            returns=token_tensor(adv, "returns", width),
            settings=settings,
            on_step=on_step,
        )
    else:
        result = update_actor(
            value.model,
            value.optimizer,
            batch,
            old_log_probs=token_tensor(table, "old_log_probs", width),
            advantages=token_tensor(adv, "advantages", width),
            ref_log_probs=token_tensor(table, "ref_log_probs", width),
            settings=settings,
            on_step=on_step,
        )
    value.scheduler.step()
    return result


def materialize(run: Run, state: ModelState, settings: OptimSettings) -> Trainable:
    """The trainable value of `state`: live, or from its intact checkpoint, or rebuilt by replaying
    its update on its (recursively materialized) parent; a clear error when none is possible.
    `settings` builds the optimizer whose saved state a checkpoint restores."""
    try:
        return load_trainable(run, state, settings)
    except StateUnavailable as missing:
        inputs = state.origin
        if inputs is None:
            raise
        try:
            value = materialize(run, inputs.parent, settings)
        except StateUnavailable as error:
            raise StateUnavailable(f"{missing}, and it cannot be rebuilt: {error}") from error
    apply_update(run, state.role, inputs, value)
    remember(run, state, value)
    return value


def replay_settings(state: ModelState) -> OptimSettings:
    """The optimizer settings recorded with the update that produced `state`."""
    return optim_settings(state.origin.config["optim"], state.origin.total_steps)
