"""A run's effective config: `config.yaml`, rewritten by every start of the run. When a start's config
differs from the one before, the one before is kept as `config.previous.yaml` and the keys that changed
are named: the stages that read them are computed again, and until the run has finished again its
steps were not all trained with the same config."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from ppoflow.conf.schema_checks import DERIVED
from ppoflow.conf.yaml_files import ConfigYamlLoader
from ppoflow.tasks.storage.regular_files import open_regular_file
from ppoflow.tasks.storage.tables import write_text_atomic

CONFIG = "config.yaml"
PREVIOUS_CONFIG = "config.previous.yaml"
MAX_CONFIG_BYTES = 1 << 20
"""A config.yaml larger than this was not written by ppoflow: it is replaced without comparing."""
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
        changed = {key for key in before.keys() | after.keys() if before.get(key) != after.get(key)}
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


def changes_line(changes: list[str]) -> str:
    """One line naming the changed keys (the first few)."""
    shown = "; ".join(changes[:SHOWN_CHANGES])
    more = f"; and {len(changes) - SHOWN_CHANGES} more" if len(changes) > SHOWN_CHANGES else ""
    return (
        f"the config differs from this run's last start ({shown}{more}): a stage whose settings changed "
        f"is computed again, with every stage after it ({PREVIOUS_CONFIG} holds the config before)"
    )


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
