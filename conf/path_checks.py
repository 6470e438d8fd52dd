"""The paths a config names, checked before anything runs: the run directory, the models (a Hugging
Face directory with config.json and a tokenizer, or a .gguf file), the reward model, the data files
and the reward function file. Each error names the key and the layer that set it."""

import errno
import os
from pathlib import Path

from .model_paths import local_model_path, reward_model_problem
from .origins import KeyPath, origin_of, where_set
from .schema import PPOFlowConfig
from .schema_checks import get_key
from .schema_common import ConfigError
from .schema_trainer import GLOB_CHARACTERS, TrainerConfig
from .tool_config import KEY as TOOL_CONFIG_KEY
from .tool_config import read_tool_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def check_config_paths(config: PPOFlowConfig, origins: dict[KeyPath, str]) -> None:
    _check_run_dir(config.trainer, origins)
    model = config.actor_rollout_ref.model
    _check_model(model.path, model.tokenizer_path, "actor_rollout_ref.model", origins)
    if config.use_critic:
        critic = config.critic.model
        _check_model(critic.path, critic.tokenizer_path, "critic.model", origins)
    if config.reward_model.enable:
        _check_reward_model(config.reward_model.model.path, origins)
    # trainer.val_only reads no training data (evaluating a checkpoint whose data has moved on).
    for key in ("data.val_files",) if config.trainer.val_only else ("data.train_files", "data.val_files"):
        files = get_key(config, key)
        for name in [files] if isinstance(files, str) else files:
            _require(name, key, "data file", origins, file=True)
    _require(
        config.custom_reward_function.path,
        "custom_reward_function.path",
        "reward function file",
        origins,
        file=True,
    )
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    if multi_turn.enable:
        _check_tools(multi_turn.tool_config_path, origins)


def _check_tools(path: str | None, origins: dict[KeyPath, str]) -> None:
    """A multi-turn run's tool config: a file that lists one tool at least (without one, every call
    the model makes is answered "unknown tool", and it learns not to call)."""
    no_tools = (
        f": a multi-turn rollout without tools answers every call the model makes with 'unknown tool'; "
        f"set {TOOL_CONFIG_KEY} to a tool config (docs/MULTI_TURN.md), or "
        f"actor_rollout_ref.rollout.multi_turn.enable=false{where_set([TOOL_CONFIG_KEY], origins)}"
    )
    if not path:
        raise ConfigError(
            f"actor_rollout_ref.rollout.multi_turn.enable=true and {TOOL_CONFIG_KEY} is unset{no_tools}",
            keys=(TOOL_CONFIG_KEY,),
        )
    _require(path, TOOL_CONFIG_KEY, "tool config file", origins, file=True)
    if not read_tool_config(path):
        raise ConfigError(
            f"{TOOL_CONFIG_KEY}={path} lists no tools (tools: []){no_tools}", keys=(TOOL_CONFIG_KEY,)
        )


def is_link_loop(path: Path | str) -> bool:
    """Whether following the links in `path` leads back to one of them (ELOOP, `ln -s loop loop`):
    such a path names nothing, and resolving it raises (RuntimeError up to Python 3.12, OSError after)."""
    try:
        os.stat(path)
    except OSError as error:
        return error.errno == errno.ELOOP
    return False


def link_loop_error(what: str, path: Path | str, key: str, where: str) -> ConfigError:
    return ConfigError(
        f"{what}'{path}' ({key}) is a symbolic link loop: a link on the way leads back to itself, so the "
        f"path names nothing; point {key} at the file or folder itself{where}",
        keys=(key,),
    )


def _check_run_dir(trainer: TrainerConfig, origins: dict[KeyPath, str]) -> None:
    """The schema refuses glob characters in the configured run directory; a relative one also takes
    them from the directory it is run from, which only this machine knows."""
    key = "trainer.experiment_name" if trainer.default_local_dir is None else "trainer.default_local_dir"
    if is_link_loop(trainer.run_dir):
        raise link_loop_error("run directory ", trainer.run_dir, key, where_set([key], origins))
    resolved = trainer.run_dir.resolve()
    if any(char in str(resolved) for char in GLOB_CHARACTERS):
        raise ConfigError(
            f"run directory '{trainer.run_dir}' is '{resolved}' from this directory, which has glob "
            f"characters ({GLOB_CHARACTERS}): DuckDB reads the run's tables by glob; run from another "
            f"directory or set trainer.default_local_dir to one without them{where_set([key], origins)}"
        )


def is_local(path: str | None) -> bool:
    # builtin: names ppoflow's embedded assets; URLs (s3://, hdfs://) cannot be checked cheaply.
    return path is not None and not path.startswith("builtin:") and "://" not in path


def _require(
    path: str | None, key: str, what: str, origins: dict[KeyPath, str], *, file: bool = False
) -> None:
    """`path`, when local, exists; with `file`, as a regular file (reading a FIFO would wait forever,
    a folder fail late)."""
    if not is_local(path):
        return
    location = Path(str(path))
    if not location.exists():
        origin = origin_of(key, origins)
        relative = (
            " (a relative path in a config file is read from the file's folder)"
            if (origin.startswith("file "))
            else ""
        )
        raise ConfigError(f"{what} '{path}' ({key}) does not exist{relative}{where_set([key], origins)}")
    if file and not location.is_file():
        kind = "a folder" if location.is_dir() else "a pipe, socket or device"
        raise ConfigError(f"{what} '{path}' ({key}) is {kind}, not a file{where_set([key], origins)}")


def _check_reward_model(path: str | None, origins: dict[KeyPath, str]) -> None:
    """reward_model.model.path: a local (or cached) Hugging Face directory of a sequence classifier
    with one label, safetensors weights and a tokenizer (compared with the actor's)."""
    key = "reward_model.model.path"
    where = where_set([key], origins)
    if path is not None and (path.startswith("builtin:") or path.endswith(".gguf")):
        raise ConfigError(
            f"{key}={path}: a reward model is a Hugging Face model directory{where}", keys=(key,)
        )
    _check_model(path, path, "reward_model.model", origins)  # its own tokenizer: checked below
    if path is None or not is_local(path):
        return
    location = Path(local_model_path(path, key))
    problem = reward_model_problem(location)
    if problem is None and not any((location / name).is_file() for name in TOKENIZER_FILES):
        problem = "has no tokenizer (tokenizer.json / tokenizer_config.json) to compare with the actor's"
    if problem is not None:
        raise ConfigError(f"reward model '{path}' ({key}) {problem}{where}", keys=(key,))


def _check_model(
    path: str | None, tokenizer_path: str | None, section: str, origins: dict[KeyPath, str]
) -> None:
    key = f"{section}.path"
    try:
        path = None if path is None else local_model_path(path, key)
        tokenizer_key = f"{section}.tokenizer_path"
        tokenizer_path = None if tokenizer_path is None else local_model_path(tokenizer_path, tokenizer_key)
    except ConfigError as error:
        raise ConfigError(f"{error}{where_set(error.keys, origins)}") from None
    _require(path, key, "model path", origins)
    _require(tokenizer_path, f"{section}.tokenizer_path", "tokenizer path", origins)
    if not is_local(path):
        return
    where, location = where_set([key], origins), Path(str(path))
    if str(path).endswith(".gguf"):
        if not location.is_file():
            raise ConfigError(f"model path '{path}' ({key}) ends in .gguf but is not a file{where}")
        return
    if not location.is_dir():
        raise ConfigError(f"model path '{path}' ({key}) is neither a model directory nor a .gguf file{where}")
    if not (location / "config.json").is_file():
        raise ConfigError(
            f"model directory '{path}' ({key}) has no config.json: point {key} at a Hugging Face model "
            f"directory or a .gguf file{where}"
        )
    if tokenizer_path is None and not any((location / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            f"model directory '{path}' has no tokenizer (tokenizer.json / tokenizer_config.json); "
            f"set {section}.tokenizer_path{where}"
        )
