"""`ppoflow export`: a run's actor checkpoint as plain Hugging Face directories to use elsewhere.

    OUT/model/     the whole model with its tokenizer (a LoRA checkpoint's adapters merged into the
                   base weights); loads with transformers' AutoModelForCausalLM.from_pretrained
    OUT/adapter/   a LoRA checkpoint only: its adapters, as peft saves them, with the tokenizer;
                   loads with peft's PeftModel.from_pretrained(base, OUT/adapter) (the base model is
                   named in adapter_config.json)

The checkpoint is checked against the digest its run recorded (trainer_state.json; a run's
checkpoint without it is refused unless exported --unverified) and a LoRA checkpoint's base model
against its lineage before anything is written; nothing is unpickled.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ppoflow.engine.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_adapters, merge_adapters
from ppoflow.engine.models import load_actor, load_tokenizer
from ppoflow.tasks.storage.checkpoints import TRAINER_STATE_FILE as STATE_FILE
from ppoflow.tasks.storage.checkpoints import (
    adapter_record,
    checkpoint_digest,
    directory_digest,
    holds_model,
    readable_as_the_umask_allows,
)
from ppoflow.tasks.storage.tables import read_json, saved_folders, step_of


class ExportError(ValueError):
    """A checkpoint that cannot be exported, with the reason."""


def actor_checkpoint(source: Path) -> Path:
    """The actor directory `source` names: a run directory (its newest actor checkpoint), a
    checkpoints/iter=NNNNNN folder, or an actor directory itself."""
    source = source.resolve()
    if (source / "checkpoints").is_dir():
        saved = [d for d in saved_folders(source / "checkpoints", "actor") if holds_model(d)]
        if not saved:
            raise ExportError(f"{source} has no actor checkpoint yet (checkpoints/iter=*/actor)")
        return saved[-1]
    if holds_model(source / "actor"):
        return source / "actor"
    if holds_model(source):
        return source
    raise ExportError(
        f"{source} is neither a run directory, a checkpoints/iter=NNNNNN folder nor an actor checkpoint"
    )


def export_actor(source: Path, out: Path, *, unverified: bool = False) -> dict[str, Path]:
    """Write OUT/model/ (and OUT/adapter/ for a LoRA checkpoint) from the actor `source` names;
    returns the folders written by form ("model", "adapter"). A checkpoint of a run whose recorded
    digest is gone is refused unless `unverified`."""
    actor = actor_checkpoint(source)
    _check_recorded_digest(actor, unverified)
    targets = {"model": out / "model"}
    record = adapter_record(actor)
    if record is not None:
        targets["adapter"] = out / "adapter"
    for target in targets.values():
        if target.exists():
            raise ExportError(f"{target} exists: remove it or export to another folder")
    tokenizer = load_tokenizer(actor if record is None else _base_dir(actor, record))
    if record is None:
        model = load_actor(actor)
    else:
        model = merge_adapters(load_adapters(load_actor(_base_dir(actor, record)), actor, trainable=False))
        _write(targets["adapter"], lambda d: _copy_adapter(actor, d, tokenizer))
    _write(targets["model"], lambda d: (model.save_pretrained(d), tokenizer.save_pretrained(d)))
    return targets


def _check_recorded_digest(actor: Path, unverified: bool) -> None:
    state_file = actor.parent / STATE_FILE
    if not state_file.is_file():
        if step_of(actor.parent.name) is None or actor.parent.parent.name != "checkpoints" or unverified:
            return  # an actor directory outside a checkpoint folder: nothing recorded to check against
        raise ExportError(
            f"{state_file}, which records the digest of {actor}, is missing: the checkpoint cannot be "
            "checked; `ppoflow export --unverified` exports it as it is"
        )
    try:
        recorded = (read_json(state_file).get("actor") or {}).get("digest")
    except (OSError, ValueError, AttributeError) as error:
        raise ExportError(f"{state_file} is not a ppoflow trainer state ({error})") from error
    if recorded is not None and checkpoint_digest(actor) != recorded:
        raise ExportError(
            f"{actor} was altered or truncated since its run saved it (digest mismatch); rerun "
            "`ppoflow train` on its run to rebuild it"
        )


def _base_dir(actor: Path, record: dict) -> Path:
    """The base model a LoRA checkpoint's adapters apply to, checked against its lineage."""
    base = record["base"]
    run_dir = actor.parent.parent.parent  # RUN/checkpoints/iter=k/actor
    directory = run_dir / base["checkpoint"]  # a relative path is the run's own copy
    try:
        intact = directory_digest(directory) == base["lineage"]
    except OSError:
        intact = False
    if not intact:
        raise ExportError(
            f"the base model of the LoRA checkpoint {actor} is not at {directory} as it was trained "
            "(missing or changed): its adapters need that exact model"
        )
    return directory


def _copy_adapter(actor: Path, directory: Path, tokenizer) -> None:
    for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        shutil.copyfile(actor / name, directory / name)
    tokenizer.save_pretrained(directory)


def _write(target: Path, fill) -> None:
    """`fill` a staging folder beside `target`, then rename it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        fill(staging)
        readable_as_the_umask_allows(staging)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
