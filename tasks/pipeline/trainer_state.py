"""checkpoints/iter=k/trainer_state.json: what besides the weights a resume from a checkpoint needs
(the global step, the KL coefficient β for the next step, the data position, the model states)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ppoflow.engine.data import batch_rows
from ppoflow.engine.lora import LoraSpec
from ppoflow.tasks.pipeline.states import ModelState, TrainState
from ppoflow.tasks.storage.checkpoints import (
    OPTIMIZER_STATES_KEPT,
    TRAINER_STATE_FILE,
    adapter_record,
    optimizer_dir,
)
from ppoflow.tasks.storage.regular_files import refuse_links_below
from ppoflow.tasks.storage.tables import read_json, saved_folders, write_json_atomic

if TYPE_CHECKING:
    from ppoflow.tasks.pipeline.run import RunFiles

STATE_FILE = TRAINER_STATE_FILE


def _saved(run: RunFiles, state: ModelState | None) -> dict | None:
    if state is None or state.checkpoint is None:
        return None
    return {
        "lineage": state.lineage,
        "step": state.step,
        "digest": state.checkpoint_digest,
        "optimizer_digest": state.optimizer_digest,
        "checkpoint": str(run.path / state.checkpoint),
    }


def record_trainer_state(run: RunFiles, step: int, state: TrainState, data_position: dict) -> None:
    """Write the trainer state beside the step's checkpoints (only steps that saved one; unless the
    file already holds it, so a step served from cache rewrites nothing)."""
    folder = run.path / f"checkpoints/iter={step:06d}"
    if not (folder / "actor").is_dir() and not (folder / "critic").is_dir():
        return
    refuse_links_below(run.path / "checkpoints", folder)
    record = {
        "global_step": step,
        "kl_coef": state.kl_coef,  # β for step + 1 (verl does not save it; a resume must not reset it)
        "data": data_position,
        "actor": _saved(run, state.actor),
        "critic": _saved(run, state.critic),
    }
    try:
        if read_json(folder / STATE_FILE) == json.loads(json.dumps(record)):
            return
    except (OSError, ValueError):
        pass
    write_json_atomic(folder / STATE_FILE, record, clock=run.io)


def data_position(n_rows: int, step: int, *, train_batch_size: int, shuffle: bool, seed: int) -> dict:
    """Epoch and position in it of `step` (for the record: each step's batch is a function of the
    step number and the shuffle seed, so nothing else is needed to continue the data stream)."""
    epoch, _ = batch_rows(n_rows, train_batch_size, step, shuffle=shuffle, seed=seed)
    per_epoch = n_rows // train_batch_size
    return {
        "epoch": epoch,
        "position": (step - 1) % per_epoch + 1,
        "steps_per_epoch": per_epoch,
        "shuffle": shuffle,
        "seed": seed,
    }


def newest_trainer_state(run_dir: Path) -> Path | None:
    """The newest checkpoints/iter=NNNNNN folder of `run_dir` that holds a trainer state (what verl's
    resume_mode=auto loads), None when none does."""
    found = saved_folders(run_dir / "checkpoints", STATE_FILE)  # oldest step first
    return found[-1].parent if found else None


ARCHITECTURE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
"""config.json keys a checkpoint to resume from must share with the configured model."""


def resume_state(
    checkpoint_dir: str | Path,
    initial: TrainState,
    *,
    run_dir: Path,
    train: bool = True,
    lora: dict[str, LoraSpec | None] | None = None,
    where: str | None = None,
) -> tuple[int, TrainState]:
    """(next step, state) to continue from a saved `checkpoints/iter=k` folder of any run (moved or
    renamed runs too). With `train`, each model's optimizer state must be there; a role's LoRA
    adapters (`lora`) must be those its checkpoint holds, on the configured base model."""
    lora = lora or {}
    folder = Path(checkpoint_dir).resolve()
    path = folder / STATE_FILE
    where = where or f"trainer.resume_from_path={checkpoint_dir}"
    if not path.is_file():
        raise FileNotFoundError(
            f"{where}: no {STATE_FILE} there; point it at a checkpoints/iter=NNNNNN folder of a ppoflow run"
        )
    try:
        saved = read_json(path)
        state = TrainState(
            actor=_restored(where, folder, saved, "actor", initial.actor, train, run_dir, lora.get("actor")),
            critic=_restored(
                where, folder, saved, "critic", initial.critic, train, run_dir, lora.get("critic")
            ),
            reference=initial.reference,
            kl_coef=float(saved["kl_coef"]),
        )
        return int(saved["global_step"]) + 1, state
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        if isinstance(error, FileNotFoundError | ResumeRefused):
            raise
        raise ValueError(
            f"{where}: {path} is not a ppoflow trainer state ({type(error).__name__}: {error})"
        ) from None


class ResumeRefused(ValueError):
    """A checkpoint folder that cannot be resumed from as configured."""


def _restored(
    where: str,
    folder: Path,
    saved: dict,
    role: str,
    current: ModelState | None,
    train: bool,
    run_dir: Path,
    lora: LoraSpec | None,
) -> ModelState | None:
    info = saved.get(role)
    if current is None or info is None:
        return current
    checkpoint = Path(info["checkpoint"])
    beside = folder.parent / checkpoint.parent.name / role  # where the run is now
    # A checkpoint saved at this very step is beside this file: a copied run's file still names the
    # original's folder, whose model must not stand in for a copy's deleted one. One of an earlier
    # step may be another run's (resumed from it): the folder named, else the one beside.
    if checkpoint.parent.name == folder.name or not checkpoint.is_dir():
        if not beside.is_dir():
            raise FileNotFoundError(
                f"{where}: the {role} checkpoint it names is not there, at {beside} "
                f"(pruned by max_{role}_ckpt_to_keep, or deleted?)"
            )
        checkpoint = beside
    if train and int(info["step"]) > 0 and not optimizer_dir(checkpoint).is_dir():
        raise ResumeRefused(
            f"{where}: the {role} optimizer state is not there (a run keeps it with the newest "
            f"{OPTIMIZER_STATES_KEPT} checkpoints of each role only); resume from a later "
            "checkpoints/iter=NNNNNN folder of that run"
        )
    base = _adapter_base(where, role, checkpoint, current, lora)
    if base is None:
        _check_same_architecture(
            where, role, checkpoint, run_dir / current.checkpoint if current.checkpoint else None
        )
    return ModelState(
        role,
        str(info["lineage"]),
        int(info["step"]),
        str(checkpoint),
        info["digest"],
        optimizer_digest=info.get("optimizer_digest"),
        base=base,
    )


LORA_KEYS = {
    "rank": "lora_rank",
    "alpha": "lora_alpha",
    "target_modules": "target_modules",
    "exclude_modules": "exclude_modules",
}
"""LoraSpec fields a LoRA checkpoint must share with the config to continue (and their keys)."""


def _adapter_base(
    where: str, role: str, checkpoint: Path, current: ModelState, lora: LoraSpec | None
) -> ModelState | None:
    """The configured base model when `checkpoint` holds LoRA adapters of it (None when it holds
    whole weights); refused when the checkpoint and the LoRA config do not fit together."""
    section = "actor_rollout_ref.model" if role == "actor" else "critic.model"
    record = adapter_record(checkpoint)
    if record is None:
        if lora is not None:
            raise ResumeRefused(
                f"{where}: that {role} holds whole weights, but {section}.lora_rank={lora.rank}: LoRA "
                f"trains adapters on the base model; resume it with {section}.lora_rank=0"
            )
        return None
    trained = record.get("lora") or {}
    if lora is None:
        raise ResumeRefused(
            f"{where}: that {role} holds LoRA adapters (rank {trained.get('rank')}): resume it with "
            f"{section}.lora_rank={trained.get('rank')} and lora_alpha={trained.get('alpha')}"
        )
    if record["base"].get("lineage") != current.lineage:
        raise ResumeRefused(
            f"{where}: that {role}'s adapters were trained on another base model than {section}.path"
        )
    for field, key in LORA_KEYS.items():
        ours = list(v) if isinstance(v := getattr(lora, field), tuple) else v
        if trained.get(field) != ours:
            raise ResumeRefused(
                f"{where}: that {role}'s adapters have {key}={trained.get(field)!r}, but "
                f"{section}.{key}={ours!r}: set it to theirs"
            )
    return current


def _check_same_architecture(where: str, role: str, checkpoint: Path, configured: Path | None) -> None:
    """The checkpoint must be of the configured model (the reference policy and the tokenizer are)."""
    if configured is None:
        return
    try:
        theirs = json.loads((checkpoint / "config.json").read_text())
        ours = json.loads((configured / "config.json").read_text())
    except (OSError, ValueError):
        return  # the checkpoint's own digest check names a damaged file
    differing = [k for k in ARCHITECTURE_KEYS if theirs.get(k) != ours.get(k)]
    if differing:
        key = differing[0]
        raise ResumeRefused(
            f"{where}: that {role} is another model than actor_rollout_ref.model.path "
            f"({key} {theirs.get(key)} there, {ours.get(key)} configured)"
        )
