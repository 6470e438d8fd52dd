"""A run's effective config: `config.yaml`, rewritten by every start of the run. When a start's config
differs from the one before, the one before is kept as `config.previous.yaml` and the keys that changed
are named: the stages that read them are computed again, and until the run has finished again its
steps were not all trained with the same config. A start that would make the run another one (another
actor model, other training data) is refused before anything is written: its steps would be replaced
in place, mixed with the old run's until it finished; so is one whose training data files were edited
since (data_sources.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from ppoflow.conf.schema_checks import DERIVED
from ppoflow.conf.yaml_files import ConfigYamlLoader
from ppoflow.tasks.storage.data_sources import data_changed
from ppoflow.tasks.storage.regular_files import open_regular_file
from ppoflow.tasks.storage.tables import write_text_atomic

CONFIG = "config.yaml"
PREVIOUS_CONFIG = "config.previous.yaml"
MAX_CONFIG_BYTES = 1 << 20
"""A config.yaml larger than this was not written by ppoflow: it is replaced without comparing."""
IDENTITY_KEYS = ("actor_rollout_ref.model.path", "data.train_files")
"""What a run is: a start that changes one of these trains another run (a validation-only run trains
no data: its train_files are not compared)."""
WHERE_KEYS = ("trainer.default_local_dir",)
"""Where the run is, not how it trains: a run copied or moved elsewhere changes it, and no stage
reads it, so it is not named among a start's changed keys."""
SHOWN_CHANGES = 6
SHOWN_VALUE_CHARS = 60


def record_config(run_dir: Path, config_yaml: str) -> list[str]:
    """Write `config_yaml` as the run's config.yaml; return each key whose value differs from the
    config.yaml it replaces ("key: old → new"), and keep that one as config.previous.yaml then."""
    path = run_dir / CONFIG
    previous_text = _read_previous(path)
    changes = []
    before, after = _parsed(previous_text), _parsed(config_yaml)
    if before is not None and after is not None:
        before, after = _flat(before), _flat(after)
        changed = {
            key
            for key in before.keys() | after.keys()
            if before.get(key) != after.get(key) and key not in WHERE_KEYS
        }
        followers = {  # keys that took their (changed) source's value, before and after
            key
            for key, sources in DERIVED.items()
            if any(
                source in changed
                and before.get(key) == before.get(source)
                and after.get(key) == after.get(source)
                for source in sources
            )
        }
        changes = [
            f"{key}: {_shown(before.get(key))} → {_shown(after.get(key))}"
            for key in sorted(changed - followers)  # critic.rollout_n with actor_rollout_ref.rollout.n
        ]
        if changes:
            write_text_atomic(run_dir / PREVIOUS_CONFIG, previous_text)
    write_text_atomic(path, config_yaml)
    return changes


class AnotherRun(ValueError):
    """The run directory holds steps of a run with another actor model or other training data."""


def require_same_run(run_dir: Path, config_yaml: str) -> None:
    """Refuse (AnotherRun, one line saying what to do) a start whose actor model or training data
    differ from those of the steps already in `run_dir`. Reads only: nothing of the run is changed."""
    if not _has_steps(run_dir) or _is_retraining_round(run_dir):
        return
    after = _parsed(config_yaml)
    if after is None:
        return
    after = _flat(after)
    before = _parsed(_read_previous(run_dir / CONFIG))
    if before is None:  # deleted, damaged or planted: which run the steps are is unknown
        kept = f" ({PREVIOUS_CONFIG} holds the one before its last change)" if _has_previous(run_dir) else ""
        raise AnotherRun(
            f"{run_dir} holds steps but no config.yaml of ppoflow's that says which run they are; this "
            f"start could replace them in place, so nothing was changed: if they are this start's run, put "
            f"its config.yaml back{kept}; else give this start a run directory of its own "
            f"({_own_directory(run_dir, after)}), or remove {run_dir} to start it over"
        )
    before = _flat(before)
    keys = [key for key in IDENTITY_KEYS if _as_list(before.get(key)) != _as_list(after.get(key))]
    trains = after.get("trainer.val_only") is not True
    if not trains:  # it trains on no data
        keys = [key for key in keys if key != "data.train_files"]
    changes = [f"{key}: {_shown(before.get(key))} → {_shown(after.get(key))}" for key in keys]
    files = after.get("data.train_files")
    same_files = trains and not keys and isinstance(files, str | list)
    if same_files and (content := data_changed(run_dir, "train", files)) is not None:  # same bytes?
        named = ", ".join(_as_list(files))
        changes.append(f"data.train_files: {named}, edited since the run's last start ({content})")
    if not changes:
        return
    changed = "; ".join(changes)
    raise AnotherRun(
        f"{run_dir} holds the steps of another run ({changed}); this start would replace them in place, "
        f"so nothing was changed: {'put back the data it trained on, or ' if not keys else ''}give it a run "
        f"directory of its own ({_own_directory(run_dir, after)}), or remove {run_dir} to start it over"
    )


def _has_previous(run_dir: Path) -> bool:
    """Whether the run keeps a config.previous.yaml (written only when a start changed the config)."""
    return _read_previous(run_dir / PREVIOUS_CONFIG) is not None


def _own_directory(run_dir: Path, after: dict[str, Any]) -> str:
    """How this start gets a run directory of its own: a name after its model (never `run_dir`'s),
    or another trainer.default_local_dir when that is what chose the directory."""
    if after.get("trainer.default_local_dir") is not None:  # it decides the run directory
        return "set trainer.default_local_dir to another folder"
    name = _suggested_name(after.get("actor_rollout_ref.model.path"))
    if name == run_dir.name:
        name = f"{name}-2"
    return f"trainer.experiment_name={name} trains in runs/{name}; or set trainer.default_local_dir"


def _as_list(value: Any) -> Any:
    """A data file named alone or as a list of one is the same data."""
    return value if isinstance(value, list) else [value]


def _is_retraining_round(run_dir: Path) -> bool:
    """A retraining round (rounds/round=N of a retraining directory): the retrain flow names its data
    itself, and a round it runs again after an interruption takes in the files that came meanwhile."""
    from ppoflow.tasks.storage.retrain_tables import ROUNDS  # (duckdb, only when a run has steps)

    return run_dir.parent.name == ROUNDS and run_dir.name.startswith("round=")


def _has_steps(run_dir: Path) -> bool:
    """Whether a start has computed anything of a step in `run_dir`: an iter=k folder, or a
    checkpoints/iter=k folder (a run whose tables were deleted still has its models)."""
    for folder in (run_dir, run_dir / "checkpoints"):
        try:
            if any(entry.name.startswith("iter=") for entry in os.scandir(folder)):
                return True
        except OSError:
            continue
    return False


def _suggested_name(model_path: Any) -> str:
    """A run name after the actor model: builtin:smollm2-135m-instruct → smollm2-135m-instruct."""
    last = str(model_path or "").rstrip("/").rsplit("/", 1)[-1].rsplit(":", 1)[-1].lower()
    name = "".join(char if char.isalnum() or char in "._-" else "-" for char in last).strip(".-")
    return name[:64] or "another-run"


def changes_line(changes: list[str], *, validation_only: bool = False) -> str:
    """One line naming the changed keys (the first few) and what follows: a training start computes
    again each stage whose settings changed; a validation-only start (trainer.val_only) trains
    nothing: only the validation of its step runs again, and replaces that step's validation rows
    when its settings changed."""
    shown = "; ".join(changes[:SHOWN_CHANGES])
    more = f"; and {len(changes) - SHOWN_CHANGES} more" if len(changes) > SHOWN_CHANGES else ""
    effect = (
        "a validation-only start trains nothing: only the validation of its step runs, computed again "
        "if its settings changed"
        if validation_only
        else "a stage whose settings changed is computed again, with every stage after it"
    )
    before = f"{PREVIOUS_CONFIG} holds the config before"
    return f"the config differs from this run's last start ({shown}{more}): {effect} ({before})"


def _read_previous(path: Path) -> str | None:
    """The text of the config.yaml a previous start wrote; None when there is none, or when what is
    there is not a regular file of ppoflow's size (it is replaced as it is)."""
    try:
        descriptor = open_regular_file(path, os.O_RDONLY)
    except OSError:
        return None
    with os.fdopen(descriptor, "rb") as file:
        data = file.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        return None
    return data.decode("utf-8", errors="replace")


class _DataOnly(ConfigYamlLoader):
    """The config loader, refusing aliases: the file is the run's, and an alias of an alias of ...
    makes a small file a huge tree."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.YAMLError("an alias in a config ppoflow wrote without any")
        return super().compose_node(parent, index)


def _parsed(text: str | None) -> dict | None:
    """The config tree of `text`; None when there is none or it is not ppoflow's YAML."""
    if text is None:
        return None
    try:
        value = yaml.load(text, Loader=_DataOnly)  # noqa: S506 - a SafeLoader, with aliases refused
    except (yaml.YAMLError, RecursionError, ValueError, TypeError, OverflowError):  # 2024-13-45, …
        return None
    return value if isinstance(value, dict) else None


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat |= _flat(value, f"{name}.")
        else:
            flat[name] = value
    return flat


def _shown(value: Any) -> str:
    text = "(unset)" if value is None else yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    text = text.removesuffix("\n...").removesuffix("...").strip()
    return text if len(text) <= SHOWN_VALUE_CHARS else text[: SHOWN_VALUE_CHARS - 1] + "…"
