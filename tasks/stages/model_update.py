"""What the `actor_update` and `critic_update` stages share: train a model state on one step's
rollouts and advantages, record one row per optimizer step, save the new state when due."""

from __future__ import annotations

import pyarrow as pa

from ppoflow.tasks.faults import inject_fault
from ppoflow.tasks.models.replay import update_steps
from ppoflow.tasks.observe.console import progress_bar
from ppoflow.tasks.pipeline.cache_keys import current_cache_key, digest_of
from ppoflow.tasks.pipeline.run import Run
from ppoflow.tasks.pipeline.states import ModelState, StageResult, StageTimer, UpdateInputs, timing_values
from ppoflow.tasks.storage.checkpoints import prune_checkpoints, prune_optimizer_states
from ppoflow.tasks.storage.schemas import SCHEMAS
from ppoflow.tasks.storage.tables import stage_path, write_table

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
VERL_TIMERS = {"actor": "update_actor", "critic": "update_critic"}


def train_state(
    run: Run, role: str, inputs: UpdateInputs, keep_checkpoints: int | None, save: bool
) -> tuple[StageResult, ModelState]:
    """Train the parent state (from memory, its checkpoint, or replay), write iter=N/<role>_update/,
    save a checkpoint when `save` (keeping the newest `keep_checkpoints`); returns the stage result
    and the new state. The new state's lineage is its parent's and this stage's cache key."""
    stage = f"{role}_update"
    timer, key = StageTimer(), current_cache_key()
    try:  # the model is trained in place: if anything fails, it is no longer the parent state
        total = update_steps(inputs, inputs.rollouts.rows)
        tokenizer = run.models.tokenizer(run, inputs.parent)
        with progress_bar(f"step {inputs.step} {role} update", total=total) as progress:
            result = run.models.train(run, role, inputs, on_step=progress)
        inject_fault(stage, inputs.step)
        ref = write_table(
            _step_table(result.steps, role),
            run.path,
            stage_path(inputs.step, stage),
            SCHEMAS[stage],
            clock=run.io,
        )
        parent = inputs.parent
        base = parent.base or (parent.detached() if inputs.lora is not None else None)  # LoRA
        state = ModelState(role, digest_of(parent.lineage, key), inputs.step, None, origin=inputs, base=base)
        if save:
            checkpoint, digest, optimizer_digest = run.models.save(
                run, role, inputs.step, tokenizer, base, inputs.lora
            )
            prune_checkpoints(run.path, role, keep_checkpoints, inputs.step)
            prune_optimizer_states(run.path, role, inputs.step)
            # a saved parent need not carry its own history; an unsaved one must, to be rebuilt
            kept = parent.detached() if parent.checkpoint is not None else parent
            saved_inputs = UpdateInputs(**{**vars(inputs), "parent": kept})
            state = ModelState(
                role, state.lineage, inputs.step, checkpoint, digest, saved_inputs, optimizer_digest, base
            )
    except BaseException:
        run.models.drop(role)
        raise
    run.models.keep(state)
    seconds = timer.seconds
    return StageResult(stage, (ref,), key, seconds, timing_values({VERL_TIMERS[role]: seconds})), state


def _step_table(steps: list[dict], role: str) -> pa.Table:
    """One row per optimizer step: its columns, and (actor) every other metric in other_metrics."""
    named = {f"{role}/{c}" for c in COLUMNS[role]} | {"epoch", "mini_batch"}
    rows = []
    for s in steps:
        row = {"epoch": int(s["epoch"]), "mini_batch": int(s["mini_batch"])}
        row |= {c: s.get(f"{role}/{c}") for c in COLUMNS[role]}
        if role == "actor":
            row["other_metrics"] = sorted((k, float(v)) for k, v in s.items() if k not in named)
        rows.append(row)
    return pa.Table.from_pylist(rows, schema=SCHEMAS[f"{role}_update"])
