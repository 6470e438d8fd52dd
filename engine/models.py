"""Actor, frozen reference, critic and reward models, loaded from a local path only.

The actor and reference are any Hugging Face causal LM directory. The critic is the same kind of
backbone with a scalar head on every position (`AutoModelForTokenClassification`, num_labels=1),
initialised from the actor's weights (head fresh) or from its own path; its dropout is forced to 0,
since a stochastic value head would make `values` and `vpreds` disagree on identical inputs. A
reward model is a sequence classifier with one label (`AutoModelForSequenceClassification`, a
`score` head) and safetensors weights, frozen (`forward.score_forward` reads it).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as transformers_logging

GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
SPECIAL_TOKENS = ("bos", "eos", "unk", "pad")

# ppoflow loads and saves checkpoints every iteration; transformers' per-load "Loading weights" and
# "Writing model shards" bars would bury the one line per iteration.
transformers_logging.disable_progress_bar()


class ModelLoadError(ValueError):
    """A model or tokenizer path that cannot be used, with the reason."""


def check_model_dir(path: str | Path, *, what: str = "model") -> Path:
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"{what} path '{path}' does not exist")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ModelLoadError(f"{what} path '{path}' is not a Hugging Face model directory (no config.json)")
    return path


@contextlib.contextmanager
def reading_model(path: Path, what: str):
    """Any failure to read a model directory becomes one ModelLoadError naming the file at fault
    (transformers' own error for a truncated weights file names none)."""
    try:
        yield
    except ModelLoadError:
        raise
    except Exception as error:
        detail = damaged_file(path) or f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
        raise ModelLoadError(f"{what} at '{path}' cannot be loaded: {detail}") from error


def damaged_file(path: Path) -> str | None:
    """'<file>: <why>' for the first file of the directory that cannot be read, or None."""
    from safetensors import safe_open

    for file in sorted(path.glob("*.json")):
        try:
            json.loads(file.read_text())
        except (OSError, ValueError) as error:
            return f"{file.name} is not valid JSON ({error})"
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(file, "pt"):  # checks the header covers the whole file
                pass
        except Exception as error:
            return f"{file.name} is truncated or not a safetensors file ({str(error).strip()[:200]})"
    return None


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved at `path`, with a pad token (EOS when the model has none)."""
    path = Path(path)
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"model directory '{path}' has no tokenizer ({', '.join(TOKENIZER_FILES)})")
    with reading_model(path, "tokenizer"):
        tokenizer = _tokenizer_class(path).from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def _tokenizer_class(path: Path):
    """A tokenizer saved from a bare `tokenizers` object (the tiny model's character tokenizer) must
    be reloaded as PreTrainedTokenizerFast: AutoTokenizer would pick the model type's tokenizer
    class (Qwen2Tokenizer), which swaps in its own pre-tokenizer and silently changes the ids."""
    config_file = path / "tokenizer_config.json"
    if config_file.is_file():
        saved_class = json.loads(config_file.read_text()).get("tokenizer_class")
        if saved_class in GENERIC_TOKENIZER_CLASSES:
            return PreTrainedTokenizerFast
    return AutoTokenizer


def load_actor(path: str | Path, *, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A causal LM from a local directory, in train mode with dropout off (PPO's ratio ρ must be 1
    on the first mini-batch, which dropout would break)."""
    path = check_model_dir(path, what="actor model")
    with reading_model(path, "actor model"):
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        _disable_dropout(config)
        return AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, local_files_only=True)


def load_reference(path: str | Path, *, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A frozen copy of the initial policy: eval mode, no gradients."""
    model = load_actor(path, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    return model


def load_critic(path: str | Path, *, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """LM backbone + scalar value head per position. From a saved critic directory the head is
    restored; from an actor directory it is new and zero-initialised, so the first values are 0
    everywhere and GAE starts from plain reward-to-go (deterministic, whatever the seed)."""
    path = check_model_dir(path, what="critic model")
    with reading_model(path, "critic model"):
        config = AutoConfig.from_pretrained(path, local_files_only=True, num_labels=1)
        _disable_dropout(config)
        config.classifier_dropout = 0.0
        config.hidden_dropout = 0.0
        with _quiet_transformers():  # the value head is missing from an actor directory, as intended
            critic, info = AutoModelForTokenClassification.from_pretrained(
                path, config=config, dtype=dtype, local_files_only=True, output_loading_info=True
            )
    head = critic.score
    if any(key.startswith("score.") for key in info["missing_keys"]):
        torch.nn.init.zeros_(head.weight)
        if head.bias is not None:
            torch.nn.init.zeros_(head.bias)
    return critic


def load_reward_model(path: str | Path, *, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The reward model at `path`: eval mode, frozen, dropout off. ModelLoadError when it is not a
    sequence classifier with one label and a trained `score` head, or has no safetensors weights
    (weight files are never unpickled)."""
    path = check_model_dir(path, what="reward model")
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(
            f"reward model at '{path}' has no *.safetensors weights (ppoflow does not unpickle weight files: "
            "save the model with save_pretrained, which writes safetensors)"
        )
    with reading_model(path, "reward model"):
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        _disable_dropout(config)
        config.classifier_dropout = 0.0
        with _quiet_transformers():
            model, info = AutoModelForSequenceClassification.from_pretrained(
                path,
                config=config,
                dtype=dtype,
                local_files_only=True,
                use_safetensors=True,
                output_loading_info=True,
            )
    head = getattr(model, "score", None)
    if not isinstance(head, torch.nn.Linear):
        raise ModelLoadError(f"reward model at '{path}' has no `score` head ({type(model).__name__})")
    if any(key.startswith("score.") for key in info["missing_keys"]):
        raise ModelLoadError(
            f"reward model at '{path}' has no trained score head in its weights (score.weight is missing): "
            "it is a language model, not a reward model"
        )
    if head.out_features != 1:
        raise ModelLoadError(
            f"reward model at '{path}' has {head.out_features} labels; a reward model has one (num_labels=1)"
        )
    model.eval()
    model.requires_grad_(False)
    return model


def reward_model_from_policy(
    path: str | Path, *, pad_token_id: int, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """A new reward model: the causal LM at `path` as backbone, a `score` head of one label set to
    zero (every score starts at 0), dropout off. `pad_token_id` is written into its config so that
    transformers' own pooling can batch the saved model too."""
    path = check_model_dir(path, what="reward model base")
    with reading_model(path, "reward model base"):
        config = AutoConfig.from_pretrained(path, local_files_only=True, num_labels=1)
        _disable_dropout(config)
        config.classifier_dropout = 0.0
        config.pad_token_id = pad_token_id
        with _quiet_transformers():  # the score head is missing from a causal LM, as intended
            model = AutoModelForSequenceClassification.from_pretrained(
                path, config=config, dtype=dtype, local_files_only=True
            )
    torch.nn.init.zeros_(model.score.weight)
    if model.score.bias is not None:
        torch.nn.init.zeros_(model.score.bias)
    return model


@contextlib.contextmanager
def _quiet_transformers():
    previous = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(previous)


def _disable_dropout(config) -> None:
    for name in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)


def convert_gguf(gguf_file: str | Path, out_dir: str | Path) -> None:
    """Dequantize a GGUF checkpoint into an ordinary float32 Hugging Face directory (weights,
    config, tokenizer and chat template) that every loader here, and vLLM, can read. Needs the
    `gguf` and `accelerate` packages (`pip install 'ppoflow[gguf]'`)."""
    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise ModelLoadError(f"GGUF file '{gguf_file}' does not exist")
    for package in ("gguf", "accelerate"):
        try:
            __import__(package)
        except ImportError as error:
            raise ModelLoadError(
                f"loading '{gguf_file.name}' needs the '{package}' package: pip install 'ppoflow[gguf]'"
            ) from error
    kwargs = {"gguf_file": gguf_file.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, dtype=torch.float32, **kwargs)
    _name_special_tokens(tokenizer, model.config)
    # Dequantized on load: drop the quantizer so the weights save as plain float32 safetensors.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _name_special_tokens(tokenizer: PreTrainedTokenizerBase, config) -> None:
    """Give a tokenizer converted from GGUF the BOS, EOS, unknown and pad tokens whose ids the GGUF
    file names (read into the model's config): transformers 5.17 converts a GGUF tokenizer with the
    BOS token as its EOS (SmolLM2's <|im_start|> instead of <|im_end|>) and no pad token, so rollouts
    would stop at <|im_start|> and pad with it; 5.24 converts them as the file says."""
    for name in SPECIAL_TOKENS:
        token_id = getattr(config, f"{name}_token_id", None)
        if isinstance(token_id, int) and 0 <= token_id < len(tokenizer):
            setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(token_id))
