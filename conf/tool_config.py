"""multi_turn.tool_config_path: verl's tool config YAML, read and checked when the config loads.

    tools:
      - class_name: ppoflow:calculator          # or verl.tools.gsm8k_tool.Gsm8kTool, my_tools.py:Weather
        config: {type: native}                  # handed to a user's class; verl's `type` must be native
        tool_schema:                            # OpenAI function schema: its name is the tool's name
          type: function
          function: {name: calculator, description: ..., parameters: {...}}

A user's class is named as `file.py:Class` (the file relative to the YAML's folder) or
`module:Class` / verl's dotted `package.module.Class` (a module file found beside the YAML, never
elsewhere: what a config names does not depend on the folder it is run from). A name in ppoflow's own
namespace (`ppoflow:…`, `ppoflow.…`) or verl's (`verl.…`) is a built-in tool or an error. Nothing is
imported here: the file is only located (tasks/models/tool_runner.py imports it in the tool worker).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ppoflow.engine.names import BUILTIN_TOOL_CLASSES

from .schema_common import ConfigError

KEY = "actor_rollout_ref.rollout.multi_turn.tool_config_path"
BUILT_IN_NAMESPACES = ("ppoflow", "verl")
"""Module names whose tools are ppoflow's built-ins (BUILTIN_TOOL_CLASSES) or none: never a file."""
MAX_FILE_BYTES = 1 << 20
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_ATTRIBUTE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class ToolEntry:
    """One tool of the config, checked: built-in (`module_file` None) or a user's class."""

    name: str
    class_name: str
    schema: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)
    module_file: str | None = None
    attribute: str | None = None
    source_digest: str | None = None


def read_tool_config(path: str) -> list[ToolEntry]:
    """The tools of the YAML at `path`, or a ConfigError that says what is wrong and where."""
    file = Path(path)
    where = f"{KEY}={path}"
    if not file.is_file():
        raise ConfigError(f"{where}: no such file", keys=(KEY,))
    if file.stat().st_size > MAX_FILE_BYTES:
        raise ConfigError(f"{where}: larger than {MAX_FILE_BYTES} bytes", keys=(KEY,))
    try:
        data = yaml.safe_load(file.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: not YAML: {str(exc).splitlines()[0]}", keys=(KEY,)) from None
    tools = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(tools, list):
        raise ConfigError(f"{where}: expected a mapping with a list under 'tools'", keys=(KEY,))
    entries = [_entry(tool, f"{where}, tools[{i}]", file.parent) for i, tool in enumerate(tools)]
    names = [e.name for e in entries]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise ConfigError(f"{where}: two tools are named {duplicate!r}", keys=(KEY,))
    return entries


def _entry(tool: Any, where: str, folder: Path) -> ToolEntry:
    if not isinstance(tool, dict):
        raise ConfigError(f"{where}: expected a mapping with class_name and tool_schema", keys=(KEY,))
    unknown = sorted(set(map(str, tool)) - {"class_name", "config", "tool_schema"})
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown} (class_name, config, tool_schema)", keys=(KEY,))
    class_name, config, schema = tool.get("class_name"), tool.get("config") or {}, tool.get("tool_schema")
    if not isinstance(class_name, str) or not class_name.strip():
        raise ConfigError(f"{where}: class_name must name a tool class", keys=(KEY,))
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: config must be a mapping", keys=(KEY,))
    if config.get("type", "native") != "native":
        raise ConfigError(
            f"{where}: config.type={config['type']!r}: only native tools run (MCP and sandbox tools do not)",
            keys=(KEY,),
        )
    function = schema.get("function") if isinstance(schema, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(schema, dict) or schema.get("type") != "function" or not isinstance(name, str):
        raise ConfigError(
            f"{where}: tool_schema must be {{type: function, function: {{name: ..., parameters: ...}}}}",
            keys=(KEY,),
        )
    if not _NAME.fullmatch(name):
        raise ConfigError(f"{where}: tool name {name!r} (letters, digits, _ . -; at most 64)", keys=(KEY,))
    for part, value in (("config", config), ("tool_schema", schema)):
        try:  # what a chat template and a run's identity take: JSON values (YAML also has dates, …)
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise ConfigError(
                f"{where}: {part} holds a value that is not JSON: {error}", keys=(KEY,)
            ) from None
    if class_name in BUILTIN_TOOL_CLASSES:
        return ToolEntry(name, class_name, schema, config)
    if class_name.split(":")[0].split(".")[0] in BUILT_IN_NAMESPACES:
        raise ConfigError(
            f"{where}: class_name={class_name!r} is not one of ppoflow's built-in tools "
            f"({', '.join(BUILTIN_TOOL_CLASSES)}); a tool of your own is a class in a Python file beside "
            "the tool config ('my_tools.py:Weather')",
            keys=(KEY,),
        )
    module_file, attribute = _locate(class_name, where, folder)
    digest = hashlib.sha256(module_file.read_bytes()).hexdigest()
    return ToolEntry(name, class_name, schema, config, str(module_file), attribute, digest)


def _locate(class_name: str, where: str, folder: Path) -> tuple[Path, str]:
    """The Python file and class a user's class_name names."""
    module, sep, attribute = class_name.rpartition(":") if ":" in class_name else class_name.rpartition(".")
    if not sep or not module or not _ATTRIBUTE.fullmatch(attribute):
        builtins = ", ".join(sorted(BUILTIN_TOOL_CLASSES))
        raise ConfigError(
            f"{where}: class_name={class_name!r} is neither a built-in tool ({builtins}) nor "
            "'file.py:Class' / 'module:Class'",
            keys=(KEY,),
        )
    if module.endswith(".py"):
        candidates = [Path(module) if Path(module).is_absolute() else folder / module]
    else:
        relative = Path(*module.split("."))
        candidates = [folder / relative.with_suffix(".py"), folder / relative / "__init__.py"]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        raise ConfigError(
            f"{where}: class_name={class_name!r}: no file {candidates[0]} (a user's tool is a Python file "
            "beside the tool config)",
            keys=(KEY,),
        )
    return found.resolve(), attribute
