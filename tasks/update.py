"""Stages 4 and 5: critic and actor updates → new model states (checkpoints) and one row per
optimizer step in iter=N/critic_update/ and iter=N/actor_update/."""

from __future__ import annotations

import pyarrow as pa
from prefect import task

from .common import (
    ModelState,
    Run,
    StageResult,
    StageTimer,
    UpdateInputs,
    current_cache_key,
    digest_of,
    stage_cache_key,
)
from .console import progress_bar
from .faults import inject_fault
from .models import forget, optim_settings, prune_checkpoints, remember, save_checkpoint, tokenizer_of
from .schemas import SCHEMAS
from .storage import ArtifactRef, stage_path, write_table
from .training import apply_update, materialize, update_steps

COLUMNS = {
    "actor": (
        "pg_loss",
        "pg_clipfrac",
        "pg_clipfrac_lower",
        "ppo_kl",
        "entropy",
        "grad_norm",
        "lr",
        "kl_loss",
    ),
    "critic": ("vf_loss", "vf_clipfrac", "vpred_mean", "grad_norm", "lr"),
}


def _step_table(steps: list[dict], role: str) -> pa.Table:
    rows = [
        {
            "epoch": int(s["epoch"]),
            "mini_batch": int(s["mini_batch"]),
            **{c: s.get(f"{role}/{c}") for c in COLUMNS[role]},
        }
        for s in steps
    ]
    return pa.Table.from_pylist(rows, schema=SCHEMAS[f"{role}_update"])


def run_update(
    run: Run, role: str, inputs: UpdateInputs, trainer: dict, save: bool
) -> tuple[StageResult, ModelState]:
    """Materialize the parent state, train it, write the step table, save when due."""
    timer, key = StageTimer(), current_cache_key()
    value = materialize(run, inputs.parent, optim_settings(inputs.config["optim"], inputs.total_steps))
    try:  # the model is trained in place: if anything fails, it is no longer the parent state
        total = update_steps(role, inputs, inputs.rollouts.rows)
        with progress_bar(f"step {inputs.step} {role} update", total=total) as progress:
            result = apply_update(run, role, inputs, value, on_step=progress)
        inject_fault(f"{role}_update", inputs.step)
        ref = write_table(
            _step_table(result.steps, role),
            run.path,
            stage_path(inputs.step, f"{role}_update"),
            SCHEMAS[f"{role}_update"],
        )
        parent = inputs.parent
        state = ModelState(role, digest_of(parent.lineage, key), inputs.step, None, origin=inputs)
        if save:
            checkpoint, digest = save_checkpoint(run, role, inputs.step, value, tokenizer_of(run, parent))
            prune_checkpoints(run, role, trainer[f"max_{role}_ckpt_to_keep"])
            # a saved parent need not carry its own history; an unsaved one must, to be rebuilt
            kept = parent.detached() if parent.checkpoint is not None else parent
            saved_inputs = UpdateInputs(**{**vars(inputs), "parent": kept})
            state = ModelState(role, state.lineage, inputs.step, checkpoint, digest, origin=saved_inputs)
    except BaseException:
        forget(run, role)
        raise
    remember(run, state, value)
    return StageResult(f"{role}_update", (ref,), key, timer.seconds), state


@task(name="update_critic", task_run_name="update_critic-step{step}", cache_key_fn=stage_cache_key)
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
    inputs = UpdateInputs(critic, step, rollouts, advantages, critic_config, batching, 1.0, total_steps)
    return run_update(run, "critic", inputs, trainer, save)


@task(name="update_actor", task_run_name="update_actor-step{step}", cache_key_fn=stage_cache_key)
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
    inputs = UpdateInputs(actor, step, rollouts, advantages, actor_config, batching, temperature, total_steps)
    return run_update(run, "actor", inputs, trainer, save)
