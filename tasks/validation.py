"""Stage 6: greedy (rollout.val_kwargs) answers to every validation prompt, scored →
iter=N/validation/part-00000.parquet and verl's `val-core/<data_source>/reward/mean@n` metrics."""

from __future__ import annotations

import pyarrow as pa
from prefect import task

from ppoflow.engine.metrics import compute_validation_metrics

from .common import ModelState, Run, StageResult, StageTimer, current_cache_key, stage_cache_key
from .console import progress_bar, show_generations
from .faults import inject_fault
from .models import model_of, tokenizer_of
from .reward import aligned_components, reward_error_metrics, score_rows
from .rollout import render_prompts, rollout_engine, sampling_params
from .schemas import SCHEMAS
from .storage import ArtifactRef, read_table, stage_path, write_table


@task(name="validate", task_run_name="validate-step{step}", cache_key_fn=stage_cache_key)
def validation_stage(
    run: Run,
    step: int,
    actor: ModelState,
    prompts: ArtifactRef,
    val_rollout: dict,
    truncation: str,
    reward: dict,
) -> StageResult:
    """Generate val_kwargs.n answers per validation prompt with the actor of `step` and score them."""
    timer = StageTimer()
    rows = read_table(run.path, prompts).to_pylist()
    tokenizer, model = tokenizer_of(run, actor), model_of(run, actor)
    rendered = render_prompts(tokenizer, rows, val_rollout["prompt_length"], truncation)
    n = val_rollout["val_kwargs"]["n"]
    engine = rollout_engine(val_rollout["name"], model, tokenizer)
    prompt_ids = [ids for _, ids in rendered for _ in range(n)]
    with progress_bar(f"step {step} validate", total=len(prompt_ids)) as progress:
        params = sampling_params(val_rollout, validation=True)
        out = engine.generate(prompt_ids, params, seed=step, on_batch=progress, on_tokens=progress.tokens)
    texts = tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
    index = [i for i in range(len(rows)) for _ in range(n)]
    generated = [
        {
            "prompt_id": rows[i]["prompt_id"],
            "sample_idx": j % n,
            "data_source": rows[i]["data_source"],
            "response_text": texts[j],
        }
        for j, i in enumerate(index)
    ]
    scored = score_rows(generated, {r["prompt_id"]: r for r in rows}, reward)
    table = pa.Table.from_pydict(
        {
            "prompt_id": scored["prompt_id"],
            "sample_idx": scored["sample_idx"],
            "data_source": scored["data_source"],
            "prompt_text": [rendered[i][0] for i in index],
            "response_text": texts,
            "response_length": [len(r) for r in out.response_ids],
            "finish_reason": out.finish_reasons,
            "ground_truth": scored["ground_truth"],
            "score": scored["score"],
            "components": scored["components"],
            "error": scored["error"],
        },
        schema=SCHEMAS["validation"],
    )
    inject_fault("validation", step)
    ref = write_table(table, run.path, stage_path(step, "validation"), SCHEMAS["validation"])
    show_generations(step, table.slice(0, val_rollout.get("log_generations", 0)).to_pylist())
    metrics = compute_validation_metrics(
        table["data_source"].to_pylist(),
        table["prompt_id"].to_pylist(),
        table["score"].to_pylist(),
        aligned_components(table),
    ) | reward_error_metrics(table, "val-aux/reward")
    return StageResult(
        "validation", (ref,), current_cache_key(), timer.seconds, tuple(sorted(metrics.items()))
    )
