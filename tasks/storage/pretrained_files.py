"""A trained model's Hugging Face folder, saved again and again as it trains.

`save_pretrained` of the tiny model spends ~6 ms of Python (weight conversions, tied weights, shard
planning, config files) around ~2 ms of writing, and a run saves its actor and critic every step.
The first save of a model goes through transformers. ppoflow then writes the same weights itself
(`write_safetensors`) and compares the two: only where they are equal byte for byte does it keep a
recipe for that model, namely the weights file's tensor names and metadata, and the bytes of the
other files `save_pretrained` wrote (config, generation config). A later save of the same model
writes its weights by the recipe and the other files as they were, while the model's config and
generation config are unchanged, its state dict has the same entries, the saved ones with the same
dtype and shapes, and every entry the weights file leaves out still shares its memory with one the
file holds (a tied head; `save_pretrained` writes a head that is no longer tied). Anything else goes
through `save_pretrained` again (and learns again). A model whose first save ppoflow does not
reproduce is always saved by transformers. The tokenizer is saved by transformers every time
(0.4 ms).
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from ppoflow.tasks.storage.safetensors_files import (
    read_header,
    safetensors_chunks,
    streamable,
    write_safetensors,
)

WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class _Recipe:
    config: str
    generation_config: str | None
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    """The weights file's tensors (names, dtype, shape): the state dict's entries it holds."""
    entries: tuple[str, ...]
    """Every entry of the state dict, in order."""
    metadata: dict[str, str] | None
    files: dict[str, bytes]
    """Every other file of the folder, by name."""

    def weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The tensors to write for `model` by this recipe; None where the recipe no longer fits."""
        if _config_text(model) != self.config or _generation_text(model) != self.generation_config:
            return None
        state = model.state_dict()
        if tuple(state) != self.entries:
            return None
        tensors = {name: state[name] for name in self.tensors}
        for name, (dtype, shape) in self.tensors.items():
            if tensors[name].dtype != dtype or tuple(tensors[name].shape) != shape:
                return None
        if not _left_out_are_aliases(state, tensors) or not streamable(tensors, self.metadata):
            return None
        return tensors


NOT_REPRODUCED = "not reproduced"
"""A model whose first save ppoflow's writer did not reproduce: every save goes to transformers."""
_recipes: weakref.WeakKeyDictionary[torch.nn.Module, _Recipe | str] = weakref.WeakKeyDictionary()


def save_model_files(model: torch.nn.Module, tokenizer, directory: Path) -> None:
    """What `model.save_pretrained(directory)` and `tokenizer.save_pretrained(directory)` write, into
    the empty folder `directory`: by the model's recipe where it has one that fits, else through
    transformers (which may give it one)."""
    directory = Path(directory)
    recipe = _recipes.get(model)
    tensors = recipe.weights(model) if isinstance(recipe, _Recipe) else None
    if tensors is None:
        model.save_pretrained(directory)
        if recipe != NOT_REPRODUCED:
            _recipes[model] = _learn(model, directory) or NOT_REPRODUCED
    else:
        write_safetensors(directory / WEIGHTS_FILE, tensors, recipe.metadata)
        for name, data in recipe.files.items():
            (directory / name).write_bytes(data)
    tokenizer.save_pretrained(directory)


def _learn(model: torch.nn.Module, directory: Path) -> _Recipe | None:
    """The recipe for what transformers just wrote into `directory`, if ppoflow reproduces it: one
    weights file whose every byte `write_safetensors` writes the same, and other files that do not
    name the folder they are in."""
    entries = sorted(directory.iterdir())
    if not all(entry.is_file() and not entry.is_symlink() for entry in entries):
        return None
    names = [entry.name for entry in entries]
    others = [name for name in names if name != WEIGHTS_FILE]
    other_weights = [name for name in others if name.endswith((".safetensors", ".bin", ".index.json"))]
    if WEIGHTS_FILE not in names or other_weights:
        return None
    weights_path = directory / WEIGHTS_FILE
    with open(weights_path, "rb") as stream:
        read = read_header(stream)
    if read is None:
        return None
    _, header = read
    metadata = header.pop("__metadata__", None)
    state = model.state_dict()
    if not all(name in state for name in header):
        return None
    tensors = {name: state[name] for name in header}
    if not _left_out_are_aliases(state, tensors) or not streamable(tensors, metadata):
        return None
    if _stream_digest(tensors, metadata) != _file_digest(weights_path):
        return None
    files = {name: (directory / name).read_bytes() for name in others}
    paths = {str(directory).encode(), str(directory.resolve()).encode()}
    if any(path in data for path in paths for data in files.values()):
        return None
    return _Recipe(
        config=_config_text(model),
        generation_config=_generation_text(model),
        tensors={name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()},
        entries=tuple(state),
        metadata=metadata,
        files=files,
    )


def _left_out_are_aliases(state: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> bool:
    """Whether every entry of `state` that is not `saved` is a view of the same memory, shape and
    strides as a saved one (a weight tied to it)."""

    def view(t: torch.Tensor) -> tuple:
        return t.data_ptr(), t.shape, t.stride(), t.dtype

    views = {view(t) for t in saved.values()}
    return all(view(t) in views for name, t in state.items() if name not in saved)


def _stream_digest(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> str:
    """sha256 of the file `write_safetensors` would write, without writing it."""
    digest = hashlib.sha256()
    for chunk in safetensors_chunks(tensors, metadata):
        digest.update(chunk)
    return digest.hexdigest()


def _file_digest(path: Path) -> str:
    with open(path, "rb") as stream:
        return hashlib.file_digest(stream, "sha256").hexdigest()


def _config_text(model: torch.nn.Module) -> str:
    return model.config.to_json_string()


def _generation_text(model: torch.nn.Module) -> str | None:
    generation = getattr(model, "generation_config", None)
    return generation.to_json_string() if generation is not None else None
