"""Stages 4 and 5: critic and actor updates → new model states (checkpoints) and one row per
optimizer step in iter=N/critic_update/ and iter=N/actor_update/."""

from __future__ import annotations

import pyarrow as pa
from prefect import task

from ppoflow.engine.update import (
    ActorUpdateSettings,
    CriticUpdateSettings,
    update_actor,
    update_critic,
)

from .batches import sequence_batch, token_tensor
from .common import ModelState, Run, StageResult, StageTimer, current_cache_key, digest_of, stage_cache_key
from .models import optim_settings, prune_checkpoints, remember, save_checkpoint, tokenizer_of, trainable
from .schemas import SCHEMAS
from .storage import ArtifactRef, read_table, stage_path, write_table

ACTOR_COLUMNS = (
    "pg_loss",
    "pg_clipfrac",
    "pg_clipfrac_lower",
    "ppo_kl",
    "entropy",
    "grad_norm",
    "lr",
    "kl_loss",
)
CRITIC_COLUMNS = ("vf_loss", "vf_clipfrac", "vpred_mean", "grad_norm", "lr")


def _training_rows(run: Run, rollouts: ArtifactRef, advantages: ArtifactRef, tokenizer):
    """The batch as trained on: rows repeated by train_weight (PF-PPO), else as generated."""
    table, adv = read_table(run.path, rollouts), read_table(run.path, advantages)
    weights = adv["train_weight"].to_pylist()
    order = [i for i, w in enumerate(weights) for _ in range(w)]
    table, adv = table.take(order), adv.take(order)
    batch = sequence_batch(table, tokenizer.pad_token_id)
    return table, adv, batch


def _step_table(steps: list[dict], role: str, columns: tuple[str, ...]) -> pa.Table:
    rows = [
        {
            "epoch": int(s["epoch"]),
            "mini_batch": int(s["mini_batch"]),
            **{c: s.get(f"{role}/{c}") for c in columns},
        }
        for s in steps
    ]
    return pa.Table.from_pylist(rows, schema=SCHEMAS[f"{role}_update"])


def _finish(
    run: Run, role: str, state: ModelState, value, step: int, tokenizer, trainer: dict, key: str, save: bool
) -> ModelState:
    value.scheduler.step()
    lineage = digest_of(state.lineage, key)
    checkpoint = None
    if save:
        checkpoint = save_checkpoint(run, role, step, value, tokenizer)
        prune_checkpoints(run, role, trainer[f"max_{role}_ckpt_to_keep"])
    new_state = ModelState(role, lineage, step, checkpoint)
    remember(run, new_state, value)
    return new_state


@task(name="update_critic", cache_key_fn=stage_cache_key)
def critic_update_stage(
    run: Run,
    step: int,
    critic: ModelState,
    rollouts: ArtifactRef,
    advantages: ArtifactRef,
    critic_config: dict,
    batching: dict,
    trainer: dict,
    total_steps: int,
    save: bool,
) -> tuple[StageResult, ModelState]:
    """Regress V(s_t) onto the returns (clipped value loss); one optimizer step per mini-batch."""
    timer, key = StageTimer(), current_cache_key()
    tokenizer = tokenizer_of(run, critic)
    table, adv, batch = _training_rows(run, rollouts, advantages, tokenizer)
    width = batch.response_ids.shape[1]
    value = trainable(run, critic, optim_settings(critic_config["optim"], total_steps))
    settings = CriticUpdateSettings(
        ppo_epochs=critic_config["ppo_epochs"],
        mini_batch_size=batching["critic_mini_batch_rows"],
        micro_batch_size=critic_config["ppo_micro_batch_size_per_gpu"],
        cliprange_value=critic_config["cliprange_value"],
        loss_agg_mode=critic_config["loss_agg_mode"],
        grad_clip=critic_config["grad_clip"],
        shuffle=critic_config["shuffle"],
        seed=step,
    )
    result = update_critic(
        value.model,
        value.optimizer,
        batch,
        values=token_tensor(adv, "values", width),
        returns=token_tensor(adv, "returns", width),
        settings=settings,
    )
    ref = write_table(
        _step_table(result.steps, "critic", CRITIC_COLUMNS),
        run.path,
        stage_path(step, "critic_update"),
        SCHEMAS["critic_update"],
    )
    new_state = _finish(run, "critic", critic, value, step, tokenizer, trainer, key, save)
    return StageResult("critic_update", (ref,), key, timer.seconds), new_state


@task(name="update_actor", cache_key_fn=stage_cache_key)
def actor_update_stage(
    run: Run,
    step: int,
    actor: ModelState,
    rollouts: ArtifactRef,
    advantages: ArtifactRef,
    actor_config: dict,
    temperature: float,
    batching: dict,
    trainer: dict,
    total_steps: int,
    save: bool,
) -> tuple[StageResult, ModelState]:
    """PPO policy update (clip, dual clip, optional KL loss and entropy bonus)."""
    timer, key = StageTimer(), current_cache_key()
    tokenizer = tokenizer_of(run, actor)
    table, adv, batch = _training_rows(run, rollouts, advantages, tokenizer)
    width = batch.response_ids.shape[1]
    value = trainable(run, actor, optim_settings(actor_config["optim"], total_steps))
    settings = ActorUpdateSettings(
        ppo_epochs=actor_config["ppo_epochs"],
        mini_batch_size=batching["actor_mini_batch_rows"],
        micro_batch_size=actor_config["ppo_micro_batch_size_per_gpu"],
        temperature=temperature,
        clip_ratio_low=actor_config["effective_clip_ratio_low"],
        clip_ratio_high=actor_config["effective_clip_ratio_high"],
        clip_ratio_c=actor_config["clip_ratio_c"],
        loss_agg_mode=actor_config["loss_agg_mode"],
        entropy_coeff=actor_config["entropy_coeff"],
        use_kl_loss=actor_config["use_kl_loss"],
        kl_loss_coef=actor_config["kl_loss_coef"],
        kl_loss_type=actor_config["kl_loss_type"],
        grad_clip=actor_config["grad_clip"],
        shuffle=actor_config["shuffle"],
        seed=step,
    )
    result = update_actor(
        value.model,
        value.optimizer,
        batch,
        old_log_probs=token_tensor(table, "old_log_probs", width),
        advantages=token_tensor(adv, "advantages", width),
        ref_log_probs=token_tensor(table, "ref_log_probs", width),
        settings=settings,
    )
    ref = write_table(
        _step_table(result.steps, "actor", ACTOR_COLUMNS),
        run.path,
        stage_path(step, "actor_update"),
        SCHEMAS["actor_update"],
    )
    new_state = _finish(run, "actor", actor, value, step, tokenizer, trainer, key, save)
    return StageResult("actor_update", (ref,), key, timer.seconds), new_state
