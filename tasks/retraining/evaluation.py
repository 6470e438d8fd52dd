"""What the evaluate flow validates, and where: the champion of a retraining directory, a ppoflow
checkpoint folder (validated with the settings of the run that wrote it), or a Hugging Face model
directory."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ppoflow.engine.lora import ADAPTER_CONFIG
from ppoflow.tasks.retraining.rounds import read_champion
from ppoflow.tasks.storage.checkpoints import TRAINER_STATE_FILE as STATE_FILE
from ppoflow.tasks.storage.regular_files import refuse_links_below

CHAMPION = "champion"


@dataclass(frozen=True)
class EvaluationPlan:
    checkpoint: Path
    config_file: str | None
    overrides: list[str]
    run_dir: Path


def plan_evaluation(
    checkpoint: str, root: Path, config_file: str | None, overrides: list[str]
) -> EvaluationPlan:
    """The config and overrides of a validation-only run of `checkpoint`, written under
    root/evaluations/<name>-<hash>: the hash covers the checkpoint's path, the config file and the
    overrides, so evaluating another model or with other settings never overwrites an evaluation."""
    folder = _checkpoint_folder(checkpoint, root)
    if (folder / ADAPTER_CONFIG).is_file() and (folder.parent / STATE_FILE).is_file():
        folder = folder.parent  # a LoRA actor's adapters: validated from its checkpoint folder
    if (folder / STATE_FILE).is_file():  # a ppoflow checkpoint: its run's settings, its saved state
        run = folder.parent.parent
        config_file = config_file or str(run / "config.yaml")
        target = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={folder}"]
        name = f"{run.name}-{folder.name}"
    elif (folder / "config.json").is_file():  # a Hugging Face model directory
        target = [f"actor_rollout_ref.model.path={folder}"]
        name = f"{folder.parent.name}-{folder.name}"
    else:
        raise FileNotFoundError(
            f"checkpoint={checkpoint}: {folder} is neither a ppoflow checkpoint folder ({STATE_FILE}) "
            "nor a Hugging Face model directory (config.json)"
        )
    identity = json.dumps([str(folder), config_file, list(overrides)])
    digest = hashlib.sha256(identity.encode()).hexdigest()[:8]
    out = root / "evaluations" / f"{re.sub(r'[^A-Za-z0-9=._-]+', '-', name)}-{digest}"
    refuse_links_below(root, out)  # a planted evaluations/ link would take the run elsewhere
    return EvaluationPlan(
        folder,
        config_file,
        [*overrides, *target, "trainer.val_only=true", f"trainer.default_local_dir={out}"],
        out,
    )


def _checkpoint_folder(checkpoint: str, root: Path) -> Path:
    if checkpoint != CHAMPION:
        return Path(checkpoint).resolve()
    champion = read_champion(root)
    if champion is None:
        raise FileNotFoundError(f"no champion in {root} yet: run the retrain flow first (see promotions)")
    return Path(champion.checkpoint)


def evaluation_markdown(plan: EvaluationPlan, step: int, score: float) -> str:
    return (
        f"# Evaluation of `{plan.checkpoint}`\n\nvalidation score **{score:.4f}** (step {step}); "
        f'rows: `ppoflow query {plan.run_dir} "SELECT * FROM validation"`\n'
    )
