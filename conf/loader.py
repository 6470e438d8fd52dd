"""load_config: model defaults ← embedded default ← YAML file ← command-line overrides.

Every assignment is checked against the schema as it is read and remembered with the layer that
made it, so each error names the key, the layer, the bad value and what is expected."""

import copy
import difflib
import functools
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

import yaml
from pydantic import BaseModel, ValidationError

from .origins import KeyPath, origin_of, origin_under, where_set
from .path_checks import check_config_paths, is_link_loop, is_local, link_loop_error
from .schema import PPOFlowConfig, all_keys
from .schema_actor import ActorModelConfig
from .schema_checks import require_micro_batch_sizes
from .schema_common import ConfigError, first_non_finite, is_open_mapping, section_type
from .unsupported import check_supported
from .yaml_files import ConfigYamlLoader, read_config_text

EMBEDDED_DEFAULT = Path(__file__).with_name("embedded_default.yaml")
TINY_MODEL = ActorModelConfig.model_fields["path"].default
"""The built-in tiny model, the only one the embedded default is for."""


class Assignment(NamedTuple):
    """One key set by one layer."""

    path: KeyPath
    value: Any
    origin: str


def _uses_tiny_model(assignments: list[Assignment]) -> bool:
    """The embedded default tunes the built-in tiny model; a command line that points the actor at
    any other model (the built-in SmolLM2 too) gets verl's defaults instead of silently inheriting
    the tiny model's settings."""
    paths = [a.value for a in assignments if a.path == ("actor_rollout_ref", "model", "path")]
    return not paths or paths[-1] == TINY_MODEL


def load_config(
    config_path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    base: Literal["embedded", "verl"] = "embedded",
    check_paths: bool = True,
) -> PPOFlowConfig:
    """Build the effective config. The embedded default applies only with base="embedded", no
    config file and the built-in model; overrides are verl/Hydra style `a.b.c=value` (a leading
    + or ++ is accepted)."""
    if isinstance(overrides, str):  # a lone string would be read character by character
        raise TypeError("overrides must be a sequence of 'key=value' strings, not one string")
    if base not in ("embedded", "verl"):
        raise ConfigError(f"base={base!r}: expected 'embedded' or 'verl'")
    assignments: list[Assignment] = []
    if config_path is not None:
        assignments += _file_assignments(Path(config_path), "file")
    for number, text in enumerate(overrides, start=1):
        assignments += _override_assignments(number, text)
    if base == "embedded" and config_path is None and _uses_tiny_model(assignments):
        assignments = _file_assignments(EMBEDDED_DEFAULT, "embedded default") + assignments
    tree, origins = _merge(assignments)
    config = _validate(tree, origins)
    config._origins = {".".join(key): origin for key, origin in origins.items()}
    check_supported(config, lambda key: origin_under(key, origins))
    if check_paths:
        check_config_paths(config, origins)
    try:
        require_micro_batch_sizes(config)
    except ConfigError as error:
        hint = ""
        if config_path is not None and config.actor_rollout_ref.model.path == TINY_MODEL:
            hint = (
                f"; the built-in model's sizes are in conf/{EMBEDDED_DEFAULT.name}, which applies only "
                "without a config file: copy what your file needs from it"
            )
        raise ConfigError(f"{error}{where_set(error.keys, origins)}{hint}", keys=error.keys) from None
    return config


PATH_KEYS = {
    ("data", "train_files"),
    ("data", "val_files"),
    ("custom_reward_function", "path"),
    ("trainer", "resume_from_path"),
    ("actor_rollout_ref", "rollout", "multi_turn", "tool_config_path"),
}
"""Keys naming files, which a config file names relative to its own folder (an override: to the
working directory). They are stored absolute, so that the run's config.yaml reads back the same;
`~` is the home directory."""
MODEL_PATH_KEYS = {
    ("actor_rollout_ref", "model", "path"),
    ("actor_rollout_ref", "model", "tokenizer_path"),
    ("critic", "model", "path"),
    ("critic", "model", "tokenizer_path"),
    ("reward_model", "model", "path"),
    ("reward_model", "model", "input_tokenizer"),
}
"""Keys naming a model: a local path (read like PATH_KEYS when it exists there) or a Hugging Face id
(`org/name`, which a relative path can look like)."""


def _absolute(assignment: Assignment, folder: Path) -> Assignment:
    """A path-valued assignment with `~` expanded and a relative path joined to `folder` (a config
    file's real folder, or the working directory for an override), links resolved. A model key keeps
    a value that names no local path (a Hugging Face id)."""
    model = assignment.path in MODEL_PATH_KEYS

    def resolve(name: Any) -> Any:
        if not isinstance(name, str) or not is_local(name):
            return name
        path = Path(os.path.expanduser(name))  # "~someone" of no such user stays as written
        if not path.is_absolute():
            path = folder / path
        if is_link_loop(path):  # Path.resolve raises on it
            key = ".".join(assignment.path)
            raise link_loop_error("", path, key, f" [{key}: {assignment.origin}]")
        if model and not path.exists():
            return name
        return str(path.resolve())

    if assignment.path not in PATH_KEYS | MODEL_PATH_KEYS:
        return assignment
    value = assignment.value
    resolved = [resolve(v) for v in value] if isinstance(value, list) else resolve(value)
    return assignment._replace(value=resolved)


def _file_assignments(path: Path, kind: str) -> list[Assignment]:
    text = read_config_text(path)
    try:
        data = yaml.load(text, Loader=ConfigYamlLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"cannot parse YAML file '{path}': {exc}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ConfigError(f"YAML file '{path}' must map keys to values, but holds a {type(data).__name__}")
    folder = path.resolve().parent  # a linked config file names paths from where it really lives
    assignments = list(_assignments((), data, f"{kind} '{path}'"))
    _refuse_keys_set_twice(assignments, path)
    return [_absolute(a, folder) for a in assignments]


def _refuse_keys_set_twice(assignments: list[Assignment], path: Path) -> None:
    """One file sets each key once: `data.train_batch_size: 16` beside `data: {train_batch_size: 32}`
    is a key set twice that YAML itself cannot see (the loader refuses the plain repeats)."""
    seen: set[KeyPath] = set()
    for assignment in assignments:
        if assignment.path in seen:
            raise ConfigError(
                f"YAML file '{path}' sets '{'.'.join(assignment.path)}' twice (once as a dotted key, "
                "once under its section): keep one"
            )
        seen.add(assignment.path)


def _override_assignments(number: int, text: str) -> list[Assignment]:
    origin = f"command-line override #{number} '{text}'"
    key, sep, raw = text.partition("=")
    key = key.strip().removeprefix("++").removeprefix("+")  # Hydra's add / force-add: plain sets here
    if not sep or not key:
        raise ConfigError(f"{origin} is not of the form key=value (e.g. trainer.total_epochs=15)")
    try:
        value = yaml.load(raw, Loader=ConfigYamlLoader)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or exc
        raise ConfigError(f"cannot parse the value {raw!r} of {origin}: {problem}") from None
    return [_absolute(a, Path.cwd()) for a in _assignments(tuple(key.split(".")), value, origin)]


def _assignments(raw: KeyPath, value: Any, origin: str) -> Iterator[Assignment]:
    """Split a (possibly nested, possibly dotted) setting into checked leaf assignments."""
    path, kind = _resolve(raw, origin)
    if kind == "section":
        if value is None:  # `critic:` with every child commented out
            return
        if not isinstance(value, dict):
            example = ".".join((*path, next(iter(_section_at(path).model_fields))))
            raise ConfigError(
                f"'{'.'.join(path) or '<root>'}' is a section, not a value ({origin}): got {value!r}; "
                f"set its keys instead, e.g. {example}=…"
            )
        for key, sub in value.items():
            yield from _assignments((*path, *str(key).split(".")), sub, origin)
    elif kind == "mapping" and isinstance(value, dict):
        # Free-form entries merge key by key across layers, as in Hydra; their keys are not split.
        for key, sub in value.items():
            yield from _assignments((*path, str(key)), sub, origin)
    else:
        if kind == "mapping":
            _require_finite(path, value, origin)
        yield Assignment(path, value, origin)


def _require_finite(path: KeyPath, value: Any, origin: str) -> None:
    """A free-form entry has no type to refuse nan or ±inf, so it is checked here, where its full
    key and its layer are known."""
    if first_non_finite(value) is not None:
        wanted = "a finite number" if isinstance(value, float) else "finite numbers only"
        raise ConfigError(f"invalid value {value!r} for '{'.'.join(path)}' ({origin}): expected {wanted}")


def _resolve(raw: KeyPath, origin: str) -> tuple[KeyPath, str]:
    """The canonical path of a key and its kind: section, value, or mapping (inside a dict field)."""
    model: type[BaseModel] = PPOFlowConfig
    path: list[str] = []
    for index, part in enumerate(raw):
        name = getattr(model, "key_aliases", {}).get(part, part)
        field = model.model_fields.get(name)
        if field is None:
            raise _unknown_key(raw, origin, path, model)
        path.append(name)
        sub = section_type(field)
        if sub is not None:
            model = sub
            continue
        rest = raw[index + 1 :]
        if is_open_mapping(field):
            return (*path, *rest), "mapping"
        if rest:
            raise ConfigError(
                f"unknown key '{'.'.join(raw)}' ({origin}): '{'.'.join(path)}' is a value, not a section"
            )
        return tuple(path), "value"
    return tuple(path), "section"


def _section_at(path: KeyPath) -> type[BaseModel]:
    model: type[BaseModel] = PPOFlowConfig
    for name in path:
        model = section_type(model.model_fields[name]) or model
    return model


def _unknown_key(raw: KeyPath, origin: str, prefix: list[str], model: type[BaseModel]) -> ConfigError:
    typed = ".".join(raw)
    suggestion = suggest_key(typed)
    if suggestion is not None:
        hint = f"did you mean '{suggestion}'?"
    else:
        where = f"under '{'.'.join(prefix)}'" if prefix else "at the top level"
        hint = f"valid keys {where}: {', '.join(model.model_fields)}"
    return ConfigError(f"unknown key '{typed}' ({origin}); {hint}")


@functools.cache
def _known_keys() -> tuple[str, ...]:
    return tuple(all_keys())


def suggest_key(typed: str) -> str | None:
    """The valid dotted key closest to a mistyped one, judged on the full path and on the last
    segment (so `critic.lr` finds `critic.optim.lr`), or None when nothing is close."""
    last = typed.rsplit(".", 1)[-1]

    def score(candidate: str) -> float:
        full = difflib.SequenceMatcher(None, typed, candidate).ratio()
        tail = difflib.SequenceMatcher(None, last, candidate.rsplit(".", 1)[-1]).ratio()
        return (full + tail) / 2

    best = max(_known_keys(), key=score)
    return best if score(best) >= 0.6 else None


def _merge(assignments: list[Assignment]) -> tuple[dict[str, Any], dict[KeyPath, str]]:
    """Apply assignments in order (later layers win); remember who set each key."""
    tree = _mapping_defaults(PPOFlowConfig)
    origins: dict[KeyPath, str] = {}
    for path, value, origin in assignments:
        node = tree
        for name in path[:-1]:
            if not isinstance(node.get(name), dict):
                node[name] = {}
            node = node[name]
        node[path[-1]] = value
        origins = {key: who for key, who in origins.items() if key[: len(path)] != path}
        origins[path] = origin
    return tree, origins


def _mapping_defaults(model: type[BaseModel]) -> dict[str, Any]:
    # Free-form dict fields start from their defaults, so that setting one entry keeps the others.
    tree: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        sub = section_type(field)
        if sub is not None and (child := _mapping_defaults(sub)):
            tree[name] = child
        elif is_open_mapping(field):
            tree[name] = copy.deepcopy(field.get_default(call_default_factory=True))
    return tree


def _validate(tree: dict[str, Any], origins: dict[KeyPath, str]) -> PPOFlowConfig:
    try:
        return PPOFlowConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, origins)) from None


def _describe(exc: ValidationError, origins: dict[KeyPath, str]) -> str:
    """One line per bad key (a union type reports several expectations for one key)."""
    lines: dict[str, str] = {}
    expected: dict[str, list[str]] = {}
    for error in exc.errors():
        original = (error.get("ctx") or {}).get("error")
        if isinstance(original, ConfigError):
            lines[str(original)] = f"{original}{where_set(original.keys, origins)}"
            continue
        key = _loc_key(error["loc"])
        expected.setdefault(key, []).append(_expectation(error))
        origin = origin_of(key, origins)
        wanted = " or ".join(text.removeprefix("expected ") for text in expected[key])
        lines[key] = f"invalid value {error['input']!r} for '{key}' ({origin}): expected {wanted}"
    return "\n".join(lines.values())


def _expectation(error: Any) -> str:
    if error["type"] == "literal_error":
        return f"expected one of {error['ctx']['expected']}"
    return error["msg"].removeprefix("Value error, ").replace("Input should be", "expected", 1)


def _loc_key(loc: tuple[int | str, ...]) -> str:
    """The dotted key a pydantic error location points at (dropping union tags and list indexes)."""
    model: type[BaseModel] | None = PPOFlowConfig
    parts: list[str] = []
    for index, item in enumerate(loc):
        field = model.model_fields.get(item) if model and isinstance(item, str) else None
        if field is None:
            break
        parts.append(str(item))
        model = section_type(field)
        if model is None:
            if is_open_mapping(field) and index + 1 < len(loc):
                parts.append(str(loc[index + 1]))
            break
    return ".".join(parts)
