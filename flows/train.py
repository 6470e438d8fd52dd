"""The `ppo-train` flow: prepare the model and data, then one PPO iteration per training step."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime

from prefect import flow
from prefect.runtime import flow_run
from prefect.settings import PREFECT_API_URL

from ppoflow.conf import load_config
from ppoflow.flows.iteration import Datasets, first_step_not_continued, ppo_iteration, validation_step
from ppoflow.tasks.models.machine import require_machine
from ppoflow.tasks.models.placement import place_models
from ppoflow.tasks.observe.console import report_iteration, report_run, say
from ppoflow.tasks.observe.tracking import Tracking
from ppoflow.tasks.pipeline.model_files import verified_dir
from ppoflow.tasks.pipeline.plan import run_plan, total_training_steps
from ppoflow.tasks.pipeline.results import run_stage
from ppoflow.tasks.pipeline.run import Run, close_run, finish_run, open_run, set_torch_threads
from ppoflow.tasks.pipeline.settings import RunPlan, RunSettings, StartPlan
from ppoflow.tasks.pipeline.states import ModelState, StageResult, TrainState
from ppoflow.tasks.pipeline.trainer_state import (
    data_position,
    newest_trainer_state,
    record_trainer_state,
    resume_state,
)
from ppoflow.tasks.stages.prepare_model import (
    critic_state,
    model_source,
    prepare_model,
    require_same_tokenizer,
)
from ppoflow.tasks.stages.prompts import prompts, require_full_batch, source_digest
from ppoflow.tasks.stages.rewards import require_builtin_rewards
from ppoflow.tasks.stages.user_code import check_user_code
from ppoflow.tasks.storage.data_sources import data_changed, record_sources
from ppoflow.tasks.storage.flow_runs import TEMPORARY_SERVER_ENV, record_flow_run
from ppoflow.tasks.storage.run_config import changes_line
from ppoflow.tasks.storage.superseded import SUPERSEDED, set_aside_steps, steps_after


@flow(name="ppo-train", log_prints=False)
def ppo_train(config_file: str | None = None, overrides: list[str] | None = None) -> dict:
    """Train with PPO (or GRPO and relatives) as configured.

    Args:
        config_file: YAML file of overrides in verl's key names, e.g. conf/gsm8k_cpu.yaml (None: the
            embedded default, when the actor is the built-in model).
        overrides: Dotted key=value overrides applied on top, e.g. ["trainer.total_training_steps=5",
            "actor_rollout_ref.actor.optim.lr=1e-4"].
    """
    return train(run_plan(load_config(config_file, overrides or [])))


@flow(name="ppo-train", log_prints=False, validate_parameters=False)
def ppo_train_planned(plan: RunPlan, user_code_checked: bool = False) -> dict:
    """Train the run `plan` describes (`ppoflow train`, which has loaded the config already, and
    checked the user's reward function and tools when `user_code_checked`)."""
    return train(plan, user_code_checked=user_code_checked)


def train(plan: RunPlan, *, user_code_checked: bool = False) -> dict:
    require_machine(plan.placement.device, plan.rollout_engine)  # before the run directory
    if not user_code_checked:
        check_user_code(plan)
    set_torch_threads(plan.num_threads)
    run = open_run(
        plan.run_dir,
        plan.config_yaml,
        place_models(plan.placement),
        recompute=plan.recompute,
        device=plan.placement.device,
    )
    if flow_run.id is not None:
        record_flow_run(run.path, _this_flow_run())
    for warning in plan.warnings:
        say(f"ppoflow: {warning}")
    if run.config_changes:
        say(f"ppoflow: {changes_line(list(run.config_changes), validation_only=plan.start.val_only)}")
    try:
        return _train(run, plan)
    finally:
        close_run(run)


def _this_flow_run() -> dict:
    """The flow run training now, as RUN_DIR/flow_runs.json records it: its link into Prefect's UI is
    of use only on a lasting server (not ppoflow's temporary one, nor Prefect's in-process one)."""
    return {
        "id": str(flow_run.id),
        "name": flow_run.name,
        "flow": flow_run.flow_name,
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "ui_url": flow_run.ui_url,
        "temporary_server": bool(os.environ.get(TEMPORARY_SERVER_ENV)) or not PREFECT_API_URL.value(),
    }


def _train(run: Run, plan: RunPlan) -> dict:
    start = plan.start
    base, _ = run_stage(
        prepare_model,
        run,
        model_path=start.actor_path,
        seed=start.seed,
        source=model_source(start.actor_path),
    )
    val_only = start.val_only  # verl: validate the model as it is, train nothing
    critic_base = _critic_base(run, start, base) if start.critic_path is not None else None  # before ingest
    data = _datasets(run, plan, base)
    first, state = _starting_state(run, start, base, critic_base)
    total = first - 1 if val_only else total_training_steps(plan.data, data.train.ref.rows)
    settings = plan.with_total_steps(total).settings
    require_builtin_rewards(run, settings.reward, data.prompt_tables())
    tracking = Tracking(plan.tracking, run.path, total)
    history = []

    def record(step: int, result, seconds: float | None) -> None:
        metrics = report_iteration(step, total, result, seconds=seconds)
        history.append(metrics | {"step": step})
        tracking.log(step, {k: v for k, v in metrics.items() if k != "wall_time"})

    try:
        if val_only or settings.val_before_train:  # verl validates a resumed model too, at its step
            record(first - 1, validation_step(run, settings, first - 1, state.actor, data), None)
        for step in range(first, total + 1):
            position = data_position(
                data.train.ref.rows,
                step,
                train_batch_size=settings.data.train_batch_size,
                shuffle=settings.data.shuffle,
                seed=settings.data.seed,
            )
            started = time.perf_counter()
            state, metrics, cached = ppo_iteration(run, settings, step, state, data, position["epoch"])
            record_trainer_state(run, step, state, position)
            record(step, metrics, None if cached else time.perf_counter() - started)
        if not val_only:
            _set_aside_steps_not_continued(run, settings, total, state, data)
        finished = finish_run(run)  # waits for the last files' fsyncs, which can fail
    except BaseException:
        tracking.fail()
        raise
    summary = report_run(finished, state.actor, history, validation_only=val_only) | {
        "io_seconds": run.io.seconds,
        "io_seconds_by_kind": dict(run.io.by_kind),
    }
    if data.train is not None:
        summary |= {
            "train_rows": int(data.train.value("rows")),
            "train_rejected": int(data.train.value("rejected")),
        }
    tracking.finish(summary)
    return summary


def _datasets(run: Run, plan: RunPlan, base: ModelState) -> Datasets:
    """The ingested prompts (no training split when only validating), checked to fill one batch."""
    sources = plan.data

    def ingest(files: str | list[str], split: str) -> StageResult:
        digest = source_digest(files)
        if split == "val" and (content := data_changed(run.path, split, files, digest)) is not None:
            say(
                f"ppoflow: data.val_files were edited since this run's last start ({content}): each "
                "validation is computed again"
            )
        result, _ = run_stage(
            prompts,
            run,
            files=files,
            split=split,
            source_digest=digest,
            data=sources.train if split == "train" else sources.val,
            tokenizer_state=base,
        )
        record_sources(run.path, split, files, digest)
        return result

    train = None if sources.train_files is None else ingest(sources.train_files, "train")
    if train is not None:
        require_full_batch(train, sources.train_files, sources.train_batch_size)
    return Datasets(train=train, val=ingest(sources.val_files, "val"))


def _set_aside_steps_not_continued(
    run: Run, settings: RunSettings, last: int, state: TrainState, data: Datasets
) -> None:
    """Steps after `last` that do not continue this run's final state (an earlier start trained them
    with another config, or was killed among them) are moved to superseded/, so that nothing takes
    them for this run's; steps that continue it (the same config, trained further before) stay for a
    longer run to reuse."""
    later = steps_after(run.path, last)
    first = first_step_not_continued(run, settings, last, later, state, data) if later else None
    if first is None:
        return
    moved = [step for step in later if step >= first]
    steps = f"steps {first}–{moved[-1]}"
    try:
        stamp = set_aside_steps(run.path, moved)
    except OSError as error:
        say(f"ppoflow: {steps} do not continue this run, but could not be moved aside: {error}")
        return
    say(
        f"ppoflow: {steps} of an earlier start do not continue this run's step {first - 1}: moved to "
        f"{SUPERSEDED}/{stamp}/ (their checkpoints to checkpoints/{SUPERSEDED}/{stamp}/)"
    )


def _critic_base(run: Run, start: StartPlan, base: ModelState) -> ModelState:
    """The critic's backbone: the actor's base model, or critic.model.path when it names another."""
    path = start.critic_path
    if path == start.actor_path:
        return base
    critic_base, _ = run_stage(
        prepare_model, run, model_path=path, seed=start.seed, source=model_source(path, "critic.model.path")
    )
    require_same_tokenizer(run, base, critic_base, path)
    return critic_base


def _starting_state(
    run: Run, start: StartPlan, base: ModelState, critic_base: ModelState | None
) -> tuple[int, TrainState]:
    """(first step, models and β): the base models, or a saved checkpoint: resume_mode=resume_path's, or
    for a validation-only start in auto mode the run's newest."""
    state = TrainState(
        actor=base,
        critic=critic_state(critic_base) if critic_base is not None else None,
        reference=base if start.use_reference else None,
        kl_coef=start.kl_coef,
    )
    checkpoint = start.resume_from_path if start.resume_mode == "resume_path" else None
    where = None
    if start.val_only and start.resume_mode == "auto":
        # verl's auto mode loads the newest checkpoint before validating it; a training start needs
        # none of that: its finished steps are replayed from their cached stages.
        checkpoint = newest_trainer_state(run.path)
        where = f"the run's newest checkpoint, {checkpoint} (trainer.val_only, resume_mode auto)"
    if checkpoint is None:
        return 1, state
    first, state = resume_state(
        checkpoint, state, run_dir=run.path, train=not start.val_only, lora=dict(start.lora), where=where
    )
    if start.val_only:  # its validation may come from cache: the model it names is checked all the same
        verified_dir(run, state.actor)
    return first, state
