"""Where a model path points: a local directory or .gguf file, a built-in model, or a Hugging Face
model id found in the local Hugging Face cache (offline, as `from_pretrained` resolves ids). Nothing
is downloaded at run time."""

import os
import re
from pathlib import Path

from .schema_common import ConfigError

HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""`organisation/name`, the shape of a Hugging Face model id."""


def local_model_path(path: str, key: str = "actor_rollout_ref.model.path") -> str:
    """The path to load `path` from: itself (a local path or a built-in name), or the cached
    snapshot of a Hugging Face model id. A ConfigError saying how to get the model otherwise."""
    if path.startswith("builtin:") or "://" in path or Path(path).exists() or not HF_ID.match(path):
        return path
    cached = _cached_snapshot(path)
    if cached is not None:
        return str(cached)
    raise ConfigError(
        f"model path '{path}' ({key}) is not a local directory, and the Hugging Face model of that id is "
        f"not in the local cache ({_cache_dir()}); nothing is downloaded at run time. Download it where "
        f"there is internet (`hf download {path}`, or `huggingface-cli download {path}`) and bring the "
        "cache or the model folder here, point the key at a local model directory or .gguf file, or "
        "use builtin:smollm2-135m-instruct",
        keys=(key,),
    )


def _cached_snapshot(repo_id: str) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json", cache_dir=_cache_dir())
    return Path(found).parent if isinstance(found, str) else None


def _cache_dir() -> str:
    """HF_HUB_CACHE (or HF_HOME/hub), read now: the environment may change after import."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")
