"""The `actor_update` stage: PPO's policy update on one step's rollouts and advantages →
iter=N/actor_update/part-00000.parquet (one row per optimizer step) and the new actor state."""

from __future__ import annotations

from prefect import task

from ppoflow.tasks.pipeline.cache_keys import stage_cache_key
from ppoflow.tasks.pipeline.run import Run
from ppoflow.tasks.pipeline.settings import UpdateSettings
from ppoflow.tasks.pipeline.states import ModelState, StageResult, UpdateInputs
from ppoflow.tasks.stages.model_update import train_state
from ppoflow.tasks.storage.tables import ArtifactRef


@task(name="actor_update", task_run_name="actor_update-step{step}", cache_key_fn=stage_cache_key)
def actor_update(
    run: Run,
    step: int,
    actor: ModelState,
    rollouts: ArtifactRef,
    advantages: ArtifactRef,
    settings: UpdateSettings,
    save: bool,
) -> tuple[StageResult, ModelState]:
    """Clipped policy-gradient loss (dual clip, optional KL loss to the reference and entropy bonus),
    ppo_epochs × mini-batches, one optimizer step each (engine.update.update_actor); a checkpoint
    when `save` (verl's timer: update_actor)."""
    inputs = UpdateInputs(actor, step, rollouts, advantages, settings.update, settings.optim, settings.lora)
    return train_state(run, "actor", inputs, settings.keep_checkpoints, save)
