"""The `critic_update` stage: value regression on one step's returns →
iter=N/critic_update/part-00000.parquet (one row per optimizer step) and the new critic state."""

from __future__ import annotations

from prefect import task

from ppoflow.tasks.pipeline.cache_keys import stage_cache_key
from ppoflow.tasks.pipeline.run import Run
from ppoflow.tasks.pipeline.settings import UpdateSettings
from ppoflow.tasks.pipeline.states import ModelState, StageResult, UpdateInputs
from ppoflow.tasks.stages.model_update import train_state
from ppoflow.tasks.storage.tables import ArtifactRef


@task(name="critic_update", task_run_name="critic_update-step{step}", cache_key_fn=stage_cache_key)
def critic_update(
    run: Run,
    step: int,
    critic: ModelState,
    rollouts: ArtifactRef,
    advantages: ArtifactRef,
    settings: UpdateSettings,
    save: bool,
) -> tuple[StageResult, ModelState]:
    """Regress V(s_t) onto the returns with the clipped value loss, ppo_epochs × mini-batches, one
    optimizer step each (engine.update.update_critic); a checkpoint when `save` (verl's timer:
    update_critic)."""
    inputs = UpdateInputs(critic, step, rollouts, advantages, settings.update, settings.optim, settings.lora)
    return train_state(run, "critic", inputs, settings.keep_checkpoints, save)
