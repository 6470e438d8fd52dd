"""Before the first iteration: the run directory, the base model, and the prompt tables."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from prefect import task

from ppoflow.engine.tiny import (
    ADDITION_DATA_SOURCE,
    all_addition_problems,
    build_tiny_model,
    build_tiny_tokenizer,
    sample_addition_problems,
    warm_start,
)

from .catalog import refresh_catalog
from .common import (
    ModelState,
    Run,
    StageResult,
    StageTimer,
    code_hash,
    current_cache_key,
    digest_of,
    stage_cache_key,
)
from .schemas import SCHEMAS
from .storage import write_table

BUILTIN_MODEL = "builtin:tiny-addition"
BUILTIN_DATA = "builtin:addition"
BUILTIN_TRAIN_ROWS = 2048


def open_run(run_dir: str | Path, config_yaml: str) -> Run:
    """Create the run directory and write its effective config (config.yaml)."""
    path = Path(run_dir).resolve()
    path.mkdir(parents=True, exist_ok=True)
    target = path / "config.yaml"
    fd, tmp = tempfile.mkstemp(dir=path, prefix=".config.")
    with os.fdopen(fd, "w") as handle:
        handle.write(config_yaml)
    os.replace(tmp, target)
    return Run(str(path))


def cache_root() -> Path:
    return Path(os.environ.get("PPOFLOW_CACHE", Path.home() / ".cache" / "ppoflow"))


def build_tiny_base(seed: int) -> Path:
    """The warm-started tiny model, built once per machine and seed (a few seconds of supervised
    steps) into the ppoflow cache ($PPOFLOW_CACHE, default ~/.cache/ppoflow)."""
    from ppoflow.engine import tiny

    target = cache_root() / f"tiny-addition-seed{seed}-{code_hash(tiny.__file__)}"
    if (target / "config.json").is_file():
        return target
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, seed=seed)
    report = warm_start(model, tokenizer, seed=seed)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny.", dir=target.parent))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / "warm_start.json").write_text(json.dumps(report))
    if target.exists():
        shutil.rmtree(staging)
    else:
        os.replace(staging, target)
    return target


@task(name="prepare_model", cache_key_fn=stage_cache_key)
def prepare_model(run: Run, model_path: str, seed: int) -> ModelState:
    """The initial actor (and reference): the built-in tiny model copied into the run, or a local
    Hugging Face directory used in place. Its lineage is a digest of its files."""
    if model_path == BUILTIN_MODEL:
        source = build_tiny_base(seed)
        relative = "model/base"
        if not (run.path / relative / "config.json").is_file():
            shutil.copytree(source, run.path / relative, dirs_exist_ok=True)
        directory = run.path / relative
        checkpoint = relative
    else:
        directory = Path(model_path).resolve()
        checkpoint = str(directory)
    return ModelState(role="actor", lineage=_directory_digest(directory), step=0, checkpoint=checkpoint)


def _directory_digest(directory: Path) -> str:
    """sha256 over the model's config, tokenizer and weight files (names and bytes)."""
    h = hashlib.sha256()
    for path in sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith(".")):
        h.update(path.name.encode())
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


@task(name="ingest_prompts", cache_key_fn=stage_cache_key)
def ingest_prompts(run: Run, files: str | list[str], split: str, source_digest: str) -> StageResult:
    """JSON/JSONL/parquet prompts (or the built-in task) → data/<split>.parquet."""
    timer = StageTimer()
    table = _builtin_prompts(split) if files == BUILTIN_DATA else _file_prompts(files, split)
    ref = write_table(table, run.path, f"data/{split}.parquet", SCHEMAS["prompts"])
    return StageResult("ingest", (ref,), current_cache_key(), timer.seconds)


def source_digest(files: str | list[str]) -> str:
    """Identity of the input files (their bytes), so an edited data file is a cache miss."""
    if files == BUILTIN_DATA:
        return BUILTIN_DATA
    h = hashlib.sha256()
    for name in [files] if isinstance(files, str) else files:
        h.update(Path(name).read_bytes())
    return h.hexdigest()


def _builtin_prompts(split: str) -> pa.Table:
    problems = (
        all_addition_problems() if split == "val" else sample_addition_problems(BUILTIN_TRAIN_ROWS, seed=0)
    )
    rows = [
        {
            "prompt_id": f"{split}-{i}",
            "split": split,
            "row_index": i,
            "data_source": ADDITION_DATA_SOURCE,
            "ability": "arithmetic",
            "prompt_text": p.prompt,
            "prompt_messages": None,
            "ground_truth": p.answer,
            "extra_info": json.dumps({"a": p.a, "b": p.b, "index": i}),
        }
        for i, p in enumerate(problems)
    ]
    return pa.Table.from_pylist(rows, schema=SCHEMAS["prompts"])


def _file_prompts(files: str | list[str], split: str) -> pa.Table:
    """verl's dataset schema: prompt (chat messages or text), data_source, ability,
    reward_model.ground_truth, extra_info."""
    records: list[dict] = []
    for name in [files] if isinstance(files, str) else files:
        records += _read_records(Path(name))
    rows = []
    for i, record in enumerate(records):
        prompt = record.get("prompt")
        reward_model = record.get("reward_model") or {}
        rows.append(
            {
                "prompt_id": f"{split}-{i}",
                "split": split,
                "row_index": i,
                "data_source": str(record.get("data_source", "unknown")),
                "ability": str(record.get("ability", "")),
                "prompt_text": prompt if isinstance(prompt, str) else None,
                "prompt_messages": list(prompt) if not isinstance(prompt, str) else None,
                "ground_truth": str(reward_model.get("ground_truth", "")),
                "extra_info": json.dumps(record.get("extra_info") or {}, default=str),
            }
        )
    return pa.Table.from_pylist(rows, schema=SCHEMAS["prompts"])


def _read_records(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        data = json.loads(text)
        return data if isinstance(data, list) else [data]
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def critic_state(base: ModelState) -> ModelState:
    """The initial critic: the base model's backbone with a new, zero value head."""
    return ModelState(
        role="critic", lineage=digest_of("critic", base.lineage), step=0, checkpoint=base.checkpoint
    )


def finish_run(run: Run) -> Run:
    """Refresh the catalog once more (a fully cached run wrote no new iteration)."""
    refresh_catalog(run.path)
    return run


def set_torch_threads(num_threads: int | None) -> None:
    """trainer.num_threads: on a busy 2-core machine one thread can beat two; None keeps torch's choice."""
    if num_threads:
        import torch

        torch.set_num_threads(num_threads)
