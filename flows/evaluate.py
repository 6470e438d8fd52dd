"""The `evaluate` flow: validation only, on the champion of a retraining directory or on any
checkpoint, with the settings of the run that trained it."""

from __future__ import annotations

import re
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from ppoflow.conf import load_config
from ppoflow.flows.train import train
from ppoflow.tasks.artifacts import artifact_key
from ppoflow.tasks.retrain import read_champion
from ppoflow.tasks.trainer_state import STATE_FILE

CHAMPION = "champion"


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
    folder = _checkpoint_folder(checkpoint, root)
    if (folder / STATE_FILE).is_file():  # a ppoflow checkpoint: its run's settings, its saved state
        config_file = config_file or str(folder.parent.parent / "config.yaml")
        target = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={folder}"]
        name = f"{folder.parent.parent.name}-{folder.name}"
    elif (folder / "config.json").is_file():  # a Hugging Face model directory
        target = [f"actor_rollout_ref.model.path={folder}"]
        name = folder.name
    else:
        raise FileNotFoundError(
            f"checkpoint={checkpoint}: {folder} is neither a ppoflow checkpoint folder ({STATE_FILE}) "
            "nor a Hugging Face model directory (config.json)"
        )
    out = root / "evaluations" / re.sub(r"[^A-Za-z0-9=._-]+", "-", name)
    cfg = load_config(
        config_file,
        [*(overrides or []), *target, "trainer.val_only=true", f"trainer.default_local_dir={out}"],
    )
    summary = train(cfg)
    step, score = summary["validation"][-1]
    result = {"checkpoint": str(folder), "step": step, "val_score": score, "run_dir": summary["run_dir"]}
    if flow_run.id:
        create_markdown_artifact(
            f"# Evaluation of `{folder}`\n\nvalidation score **{score:.4f}** (step {step}); "
            f'rows: `ppoflow query {out} "SELECT * FROM validation"`\n',
            key=artifact_key(root, "evaluation"),
            description=f"ppoflow evaluation of {folder}",
        )
    return result


def _checkpoint_folder(checkpoint: str, root: Path) -> Path:
    if checkpoint != CHAMPION:
        return Path(checkpoint).resolve()
    champion = read_champion(root)
    if champion is None:
        raise FileNotFoundError(f"no champion in {root} yet: run the retrain flow first (see promotions)")
    return Path(champion.checkpoint)
