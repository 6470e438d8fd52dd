"""checkpoints/iter=k/trainer_state.json: what besides the weights a resume from a checkpoint needs
(the global step, the KL coefficient β for the next step, the data position, the model states)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ppoflow.engine.data import batch_rows
from ppoflow.tasks.storage.checkpoints import optimizer_dir
from ppoflow.tasks.storage.states import ModelState, TrainState
from ppoflow.tasks.storage.tables import read_json, write_json_atomic

if TYPE_CHECKING:
    from ppoflow.tasks.run import Run

STATE_FILE = "trainer_state.json"


def _saved(run: Run, state: ModelState | None) -> dict | None:
    if state is None or state.checkpoint is None:
        return None
    return {
        "lineage": state.lineage,
        "step": state.step,
        "digest": state.checkpoint_digest,
        "optimizer_digest": state.optimizer_digest,
        "checkpoint": str(run.path / state.checkpoint),
    }


def record_trainer_state(run: Run, step: int, state: TrainState, data_position: dict) -> None:
    """Write the trainer state beside the step's checkpoints (only steps that saved one; unless the
    file already holds it, so a step served from cache rewrites nothing)."""
    folder = run.path / f"checkpoints/iter={step:06d}"
    if not (folder / "actor").is_dir() and not (folder / "critic").is_dir():
        return
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
    write_json_atomic(folder / STATE_FILE, record)


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


def resume_state(checkpoint_dir: str | Path, initial: TrainState) -> tuple[int, TrainState]:
    """(next step, state) to continue from a saved `checkpoints/iter=k` folder of any run."""
    folder = Path(checkpoint_dir).resolve()
    path = folder / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"trainer.resume_from_path={checkpoint_dir}: no {STATE_FILE} there; point it at a "
            "checkpoints/iter=NNNNNN folder of a ppoflow run"
        )
    saved = read_json(path)

    def restored(role: str, current: ModelState | None) -> ModelState | None:
        info = saved.get(role)
        if current is None or info is None:
            return current
        if not Path(info["checkpoint"]).is_dir():
            raise FileNotFoundError(
                f"trainer.resume_from_path={checkpoint_dir}: the {role} checkpoint it names, "
                f"{info['checkpoint']}, is gone (pruned by max_{role}_ckpt_to_keep?)"
            )
        if info["step"] > 0 and not optimizer_dir(Path(info["checkpoint"])).is_dir():
            raise FileNotFoundError(
                f"trainer.resume_from_path={checkpoint_dir}: the {role} optimizer state is not there "
                "(a run keeps it with the newest checkpoint of each role only); resume from that "
                "run's last checkpoints/iter=NNNNNN folder"
            )
        return ModelState(
            role,
            info["lineage"],
            info["step"],
            info["checkpoint"],
            info["digest"],
            optimizer_digest=info.get("optimizer_digest"),
        )

    state = TrainState(
        actor=restored("actor", initial.actor),
        critic=restored("critic", initial.critic),
        reference=initial.reference,
        kl_coef=saved["kl_coef"],
    )
    return saved["global_step"] + 1, state
