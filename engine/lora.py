"""LoRA adapters through peft (verl's `*.model.lora_rank`, `lora_alpha`, `target_modules`).

A LoRA model is a peft `PeftModel` around a frozen base model: each targeted linear layer W gains
A (rank × in, random init) and B (out × rank, zero init) and computes W·x + (alpha / rank)·B·A·x, so
with B = 0 it is exactly the base. Only the adapters train. The reference policy is the same module
with its adapters off (`AdaptersOff`, verl's ref_in_actor): the base weights are held once. The
critic's value head gets no adapter and trains whole (peft's modules_to_save, which verl's TOKEN_CLS
task sets for it). Adapters are saved as peft saves them (`adapter_model.safetensors`,
`adapter_config.json`), so `peft.PeftModel.from_pretrained(base, directory)` loads them.

peft is imported only when LoRA is used (it takes a second to import).
"""

from __future__ import annotations

import contextlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .models import ModelLoadError, reading_model

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
VALUE_HEADS = ("classifier", "score")
"""Names of a token-classification model's head (peft's TOKEN_CLS modules_to_save): the critic's
value head, which trains whole and gets no adapter."""


@dataclass(frozen=True)
class LoraSpec:
    """The adapters of one model, in verl's names (`<model>.lora_rank`, …)."""

    rank: int
    alpha: int
    target_modules: str | tuple[str, ...]
    """'all-linear' (every linear layer but the output head), module names, or one regex."""
    exclude_modules: str | tuple[str, ...] | None
    seed: int
    """Seeds the random init of every A (trainer.seed); B starts at zero."""


def add_adapters(model: torch.nn.Module, spec: LoraSpec, *, value_head: bool = False) -> torch.nn.Module:
    """`model` (modified in place) inside a PeftModel with new adapters; only they (and a critic's
    value head, `value_head`) require gradients. The init consumes none of torch's global random
    stream."""
    from peft import LoraConfig, TaskType, get_peft_model

    exclude = _names(spec.exclude_modules)
    if value_head and not isinstance(exclude, str):
        exclude = [*VALUE_HEADS, *(exclude or [])]
    config = LoraConfig(
        task_type=TaskType.TOKEN_CLS if value_head else TaskType.CAUSAL_LM,
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=_names(spec.target_modules),
        exclude_modules=exclude,
        lora_dropout=0.0,
        bias="none",
    )
    with torch.random.fork_rng(devices=[]), _quiet_peft():
        torch.manual_seed(spec.seed)
        try:
            return get_peft_model(model, config)
        except ValueError as error:
            raise ModelLoadError(
                f"LoRA target_modules={_names(spec.target_modules)!r} cannot be applied to "
                f"{type(model).__name__} (its linear layers: {', '.join(linear_layer_names(model))}): "
                f"{str(error).splitlines()[0][:300]}"
            ) from error


@contextlib.contextmanager
def _quiet_peft():
    """Warnings of peft's that say nothing about the run: transformers' FutureWarning at peft's
    deprecated question (is_gradient_checkpointing) on every wrap, and the note that a saved config
    names another base path (a moved run; the base is checked by its digest instead)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        warnings.filterwarnings(
            "ignore", message=".*base_model_name_or_path. was renamed", category=UserWarning
        )
        yield


def _names(value: str | tuple[str, ...] | None) -> str | list[str] | None:
    return list(value) if isinstance(value, tuple) else value


def linear_layer_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of `model`'s linear layers (what target_modules may list)."""
    return sorted(
        {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    )


def is_adapted(model: torch.nn.Module) -> bool:
    """Whether `model` is a PeftModel (trains adapters)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def save_adapters(model: torch.nn.Module, directory: Path, *, base_model_path: str) -> None:
    """The adapters (and a critic's value head) as peft writes them: adapter_model.safetensors and
    adapter_config.json naming `base_model_path`. Written here rather than by peft's save_pretrained
    so that the files are a function of the weights and settings only (peft's lists its resolved
    target modules in set order, which varies between processes, and adds a model card)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    weights = {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    save_file(weights, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    config = model.peft_config["default"].to_dict()
    config |= {"base_model_name_or_path": base_model_path, "inference_mode": True}
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_adapters(model: torch.nn.Module, directory: Path, *, trainable: bool) -> torch.nn.Module:
    """`model` (the base, modified in place) with the adapters saved in `directory`, trainable or
    frozen. Reads the JSON config and the safetensors weights only (never a pickled `.bin`)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    directory = Path(directory)
    if not (directory / ADAPTER_CONFIG).is_file() or not (directory / ADAPTER_WEIGHTS).is_file():
        raise ModelLoadError(f"'{directory}' holds no LoRA adapters ({ADAPTER_CONFIG}, {ADAPTER_WEIGHTS})")
    with reading_model(directory, "LoRA adapters"):
        config = LoraConfig.from_pretrained(str(directory))
        config.inference_mode = not trainable
        with torch.random.fork_rng(devices=[]), _quiet_peft():  # the init is overwritten: no global draw
            adapted = get_peft_model(model, config)
        weights = load_file(directory / ADAPTER_WEIGHTS)
        expected = {k for k in adapted.state_dict() if ".lora_" in k or ".modules_to_save." in k}
        loaded = set_peft_model_state_dict(adapted, weights)
    if loaded.unexpected_keys or not weights or any(k in expected for k in loaded.missing_keys):
        raise ModelLoadError(
            f"LoRA adapters at '{directory}' do not fit {type(model).__name__}: "
            f"{len(loaded.unexpected_keys)} unexpected tensor(s) ({', '.join(loaded.unexpected_keys[:3])})"
        )
    return adapted


def merge_adapters(model: torch.nn.Module) -> torch.nn.Module:
    """The plain transformers model under the PeftModel `model`, its adapters merged into its
    weights (W + (alpha / rank)·B·A) and removed. In place: pass a copy (`copy.deepcopy`, or a
    model loaded for the purpose) to keep training the adapters."""
    return model.merge_and_unload()


class AdaptersOff(torch.nn.Module):
    """A PeftModel seen with its adapters off: the base model, sharing the adapted model's weights
    (verl computes the reference log-probs of a LoRA actor this way)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.module = model

    def forward(self, *args, **kwargs):
        with self.module.disable_adapter():
            return self.module(*args, **kwargs)


def trainable_parameters(model: torch.nn.Module) -> int:
    """Parameters that receive gradients (the adapters and a value head, or every weight)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
