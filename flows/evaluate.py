"""The `evaluate` flow: validation only, on the champion of a retraining directory or on any
checkpoint, with the settings of the run that trained it."""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from ppoflow.conf import load_config
from ppoflow.flows.train import train
from ppoflow.tasks.observe.artifacts import publish_markdown
from ppoflow.tasks.pipeline.plan import run_plan
from ppoflow.tasks.retraining.evaluation import CHAMPION, evaluation_markdown, plan_evaluation


@flow(name="evaluate", log_prints=False)
def evaluate(
    checkpoint: str = CHAMPION,
    run_dir: str = "runs/retrain",
    config_file: str | None = None,
    overrides: list[str] | None = None,
) -> dict:
    """Validate one model and train nothing.

    Args:
        checkpoint: 'champion' (of run_dir), a ppoflow checkpoints/iter=NNNNNN folder, or a Hugging
            Face model directory.
        run_dir: Retraining directory (for 'champion'); the evaluation is written under its
            evaluations/ folder.
        config_file: YAML file of overrides; None uses the config of the run that wrote the checkpoint.
        overrides: Dotted key=value overrides applied on top, e.g. data.val_files=[my_val.jsonl].
    """
    root = Path(run_dir).resolve()
    plan = plan_evaluation(checkpoint, root, config_file, list(overrides or []))
    summary = train(run_plan(load_config(plan.config_file, plan.overrides)))
    step, score = summary["validation"][-1]
    publish_markdown(root, "evaluation", evaluation_markdown(plan, step, score))
    return {
        "checkpoint": str(plan.checkpoint),
        "step": step,
        "val_score": score,
        "run_dir": summary["run_dir"],
    }
