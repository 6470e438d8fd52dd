"""One PPO step: a plain function calling one task per stage (a subflow would cost ~1 s), then the
step's commit. Each stage's name is its task, its module in tasks/stages/, its folder under iter=k/
and its table."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from ppoflow.tasks.pipeline.cache_keys import key_for
from ppoflow.tasks.pipeline.commit import commit_step
from ppoflow.tasks.pipeline.results import run_stage
from ppoflow.tasks.pipeline.run import Run
from ppoflow.tasks.pipeline.settings import RewardKL, RunSettings, checkpoint_due
from ppoflow.tasks.pipeline.states import ModelState, StageResult, StepResults, TrainState
from ppoflow.tasks.stages.actor_update import actor_update
from ppoflow.tasks.stages.advantages import advantages
from ppoflow.tasks.stages.critic_update import critic_update
from ppoflow.tasks.stages.kl_control import next_kl_coef
from ppoflow.tasks.stages.metrics import metrics, validation_only_metrics
from ppoflow.tasks.stages.reward_model import reward_model
from ppoflow.tasks.stages.rewards import rewards
from ppoflow.tasks.stages.rollouts import rollouts
from ppoflow.tasks.stages.validation import validation
from ppoflow.tasks.storage.manifests import read_manifest
from ppoflow.tasks.storage.tables import ArtifactRef, iteration_dir


@dataclass(frozen=True)
class Datasets:
    train: StageResult | None  # None when only validating (trainer.val_only)
    val: StageResult

    def prompt_tables(self) -> dict[str, ArtifactRef]:
        """Split → its prompts table."""
        tables = {"train": self.train.ref} if self.train is not None else {}
        return tables | {"val": self.val.ref}


class ValidatedOtherwise(ValueError):
    """A validation-only start on a step this run trained and validated with other settings."""


def _validation_inputs(settings: RunSettings, step: int, actor: ModelState, data: Datasets) -> dict:
    return {
        "step": step,
        "actor": actor,
        "prompts": data.val.ref,
        "settings": settings.validation,
        "reward": settings.reward,
    }


def validate(
    run: Run, settings: RunSettings, step: int, actor: ModelState, data: Datasets
) -> tuple[StageResult, bool]:
    """The validation stage of `step`; returns (result, was_cached)."""
    return run_stage(validation, run, **_validation_inputs(settings, step, actor, data))


def validation_step(
    run: Run, settings: RunSettings, step: int, actor: ModelState, data: Datasets
) -> StageResult:
    """A step that validates `actor` and trains nothing: verl's validation before training (step 0, or
    the step a resumed model was trained to) or a validation-only run. Its validation and metrics
    stages are committed as step `step`; returns its metrics. A step this run directory trained (a run
    resumed from one of its own checkpoints) keeps its own metrics row and manifest: the validation's
    result is returned."""
    if (iteration_dir(run.path, step) / "rollouts").exists():
        _require_as_validated(run, settings, step, actor, data)
        return validate(run, settings, step, actor, data)[0]
    validated, _ = validate(run, settings, step, actor, data)
    recorded, _ = run_stage(validation_only_metrics, run, step=step, validation=validated)
    commit_step(run, step, [validated, recorded])
    return recorded


def _require_as_validated(
    run: Run, settings: RunSettings, step: int, actor: ModelState, data: Datasets
) -> None:
    """ValidatedOtherwise, before anything is validated, when the trained step's manifest names
    another validation (other settings, or none): its validation rows, rewritten, would no longer be
    those its metrics row was computed from."""
    stages = (read_manifest(run.path, step) or {}).get("stages")
    entry = stages.get("validation") if isinstance(stages, dict) else None
    recorded = entry.get("cache_key") if isinstance(entry, dict) else None
    if recorded == key_for(validation, _validation_inputs(settings, step, actor, data)):
        return
    how = "with other validation settings" if recorded else "without validating it"
    raise ValidatedOtherwise(
        f"a validation-only start validates step {step}, which this run trained {how}: its validation "
        f"rows would no longer match the step's metrics row, so nothing was validated; validate that "
        f"checkpoint in a run directory of its own (trainer.resume_mode=resume_path "
        f"trainer.resume_from_path={run.path}/checkpoints/iter={step:06d} and another "
        "trainer.experiment_name), or start with the validation settings of the run's last training start"
    )


def rollouts_inputs(settings: RunSettings, step: int, state: TrainState, data: Datasets) -> dict:
    """What the rollouts stage of `step` is called with, from the state the step starts from."""
    return {
        "step": step,
        "actor": state.actor,
        "reference": state.reference,
        "prompts": data.train.ref,
        "data": settings.data,
        "settings": settings.rollout,
    }


def starting_point(state: TrainState) -> dict:
    """What a step starts from, as its manifest records it: its model states' lineages and β."""
    models = {"actor": state.actor, "critic": state.critic, "reference": state.reference}
    lineages = {role: model.lineage if model is not None else None for role, model in models.items()}
    return json.loads(json.dumps(lineages | {"kl_coef": state.kl_coef}))


def first_step_not_continued(
    run: Run, settings: RunSettings, last: int, later: list[int], state: TrainState, data: Datasets
) -> int | None:
    """The first of `later` (the steps on disk after the run's last, `last`, in order) that was not
    trained on from `state` (the run's final state), step after step: each must be the next step,
    committed, and start from what the one before ended with. A step of an earlier start with another
    config, or of a start killed mid-step, breaks the chain; None when all continue it. A manifest
    written before steps recorded their states is judged by its rollouts stage's cache key (the
    actor's state only)."""
    expected: dict | None = starting_point(state)
    for step, wanted in zip(later, range(last + 1, last + 1 + len(later)), strict=True):
        try:
            manifest = read_manifest(run.path, step) if step == wanted else None
        except (OSError, ValueError):
            manifest = None
        if not isinstance(manifest, dict):
            return step
        if "started_from" in manifest:
            if expected is not None and manifest["started_from"] != expected:
                return step
        elif step == last + 1 and not _same_rollouts_key(manifest, settings, step, state, data):
            return step
        expected = manifest.get("ended_with")
    return None


def _same_rollouts_key(
    manifest: dict, settings: RunSettings, step: int, state: TrainState, data: Datasets
) -> bool:
    stages = manifest.get("stages")
    entry = stages.get("rollouts") if isinstance(stages, dict) else None
    recorded = entry.get("cache_key") if isinstance(entry, dict) else None
    return recorded == key_for(rollouts, rollouts_inputs(settings, step, state, data))


def ppo_iteration(
    run: Run, settings: RunSettings, step: int, state: TrainState, data: Datasets, epoch: int
) -> tuple[TrainState, StageResult, bool]:
    """The stages of training step `step`, whose batch comes from pass `epoch` (0-based), then its
    commit. Returns the next state, the metrics, and whether every stage was served from cache."""
    s = settings
    save = checkpoint_due(step, s.total_steps, s.save_freq)
    cached: list[bool] = []

    def stage(task, **parameters):
        result, was_cached = run_stage(task, run, **parameters)
        cached.append(was_cached)
        return result

    generated = stage(rollouts, **rollouts_inputs(s, step, state, data))
    model_scored = None
    if s.reward_model is not None:
        model_scored = stage(
            reward_model,
            step=step,
            actor=state.actor,
            rollouts=generated.ref,
            prompts=data.train.ref,
            settings=s.reward_model,
        )
    scored = stage(
        rewards,
        step=step,
        rollouts=generated.ref,
        prompts=data.train.ref,
        reward=s.reward,
        reward_model=model_scored.ref if model_scored is not None else None,
    )
    estimated = stage(
        advantages,
        step=step,
        actor=state.actor,
        critic=state.critic,
        rollouts=generated.ref,
        rewards=scored.ref,
        kl_coef=state.kl_coef,
        settings=s.advantages,
    )
    critic_result = actor_result = None
    critic, actor = state.critic, state.actor
    if critic is not None:
        critic_result, critic = stage(
            critic_update,
            step=step,
            critic=critic,
            rollouts=generated.ref,
            advantages=estimated.ref,
            settings=s.critic,
            save=save,
        )
    if step >= s.critic_warmup:  # verl: the actor updates once critic_warmup <= global step
        actor_result, actor = stage(
            actor_update,
            step=step,
            actor=actor,
            rollouts=generated.ref,
            advantages=estimated.ref,
            settings=s.actor,
            save=save,
        )
    for updated in (critic, actor):  # how to rebuild them, should their optimizer state be pruned
        run.models.history.remember(updated)
    validated = None
    if s.test_freq > 0 and (step % s.test_freq == 0 or step == s.total_steps):
        validated, was_cached = validate(run, s, step, actor, data)
        cached.append(was_cached)
    results = StepResults(
        rollouts=generated,
        reward_model=model_scored,
        rewards=scored,
        advantages=estimated,
        critic_update=critic_result,
        actor_update=actor_result,
        validation=validated,
    )
    current_kl = dict(estimated.values).get("current_kl")
    recorded = stage(
        metrics,
        step=step,
        epoch=epoch,
        stages=results,
        kl=RewardKL(state.kl_coef, current_kl),
        settings=s.metrics,
    )
    kl_coef = next_kl_coef(s.kl_control, state.kl_coef, current_kl, generated.ref.rows)
    ended = replace(state, actor=actor, critic=critic, kl_coef=kl_coef)
    states = {"started_from": starting_point(state), "ended_with": starting_point(ended)}
    commit_step(run, step, [*results.finished(), recorded], states)
    return ended, recorded, all(cached)
