"""The `rollouts` stage: sample responses for one step's prompts → iter=N/rollouts/part-00000.parquet."""

from __future__ import annotations

import pyarrow as pa
from prefect import task

from ppoflow.engine.data import batch_rows
from ppoflow.engine.rollout import SamplingParams
from ppoflow.tasks.faults import inject_fault
from ppoflow.tasks.observe.console import progress_bar
from ppoflow.tasks.pipeline.cache_keys import current_cache_key, stage_cache_key
from ppoflow.tasks.pipeline.placement import MultiTurnRequest, RolloutRequest
from ppoflow.tasks.pipeline.run import Run
from ppoflow.tasks.pipeline.settings import DataSettings, RolloutSettings
from ppoflow.tasks.pipeline.states import ModelState, StageResult, StageTimer, timing_values
from ppoflow.tasks.stages.dynamic_sampling import (
    GeneratedBatch,
    SamplingRequest,
    discard_staging,
    sample_dynamically,
)
from ppoflow.tasks.stages.prompt_rows import render_prompts
from ppoflow.tasks.stages.turns import tool_context, trajectory_columns, turns_table
from ppoflow.tasks.storage.schemas import SCHEMAS
from ppoflow.tasks.storage.tables import ArtifactRef, read_table, stage_path, write_table


@task(name="rollouts", task_run_name="rollouts-step{step}", cache_key_fn=stage_cache_key)
def rollouts(
    run: Run,
    step: int,
    actor: ModelState,
    reference: ModelState | None,
    prompts: ArtifactRef,
    data: DataSettings,
    settings: RolloutSettings,
) -> StageResult:
    """Sample rollout.n responses for each prompt of step `step` (the batch `data` picks), with
    rollout, old and ref log-probs; with dynamic sampling (settings.filter_groups), further batches
    until data.train_batch_size prompts have responses that differ (`sample_dynamically`). Reports
    verl's timers gen, old_log_prob and ref."""
    timer = StageTimer()
    table = read_table(run.path, prompts, clock=run.io)
    _, rows_ids = batch_rows(
        table.num_rows, data.train_batch_size, step, shuffle=data.shuffle, seed=data.seed
    )
    rollout_seed = settings.seed * 1_000_003 + step
    groups, measured = None, {}
    if settings.filter_groups is None:
        rows = table.take(rows_ids).to_pylist()
        batch = generate_batch(run, step, actor, reference, rows, settings, rollout_seed)
    else:
        request = SamplingRequest(step, actor, reference, prompts, data, settings, rollout_seed)
        batch, groups, measured = sample_dynamically(run, request, table, rows_ids, generate_batch)
    inject_fault("rollouts", step)
    written = {"rollouts": batch.rollouts, "turns": batch.turns, "filter_groups": groups}
    refs = tuple(
        write_table(rows, run.path, stage_path(step, name), SCHEMAS[name], clock=run.io)
        for name, rows in written.items()
        if rows is not None
    )
    if groups is not None:
        discard_staging(run, step)
    phases = dict(batch.seconds)
    seconds = timer.seconds  # read once: the timers add up to the stage's seconds
    phases["gen"] = seconds - sum(v for k, v in phases.items() if k != "gen")  # reading, writing too
    values = tuple(sorted(measured.items())) + timing_values(phases)
    return StageResult("rollouts", refs, current_cache_key(), seconds, values)


def generate_batch(
    run: Run,
    step: int,
    actor: ModelState,
    reference: ModelState | None,
    rows: list[dict],
    settings: RolloutSettings,
    seed: int,
    label: str = "generate",
) -> GeneratedBatch:
    """rollout.n responses to each prompt row of `rows` (prompts-table rows), sampled from `seed`,
    as rollouts (and turns) tables; group_id is the prompt's position in `rows`."""
    tokenizer = run.models.tokenizer(run, actor)
    tools = () if settings.multi_turn is None else tuple(t.schema for t in settings.multi_turn.tools)
    rendered = render_prompts(tokenizer, rows, settings.prompt_length, settings.truncation, tools)
    request = RolloutRequest(
        engine=settings.engine,
        n=settings.n,
        sampling=settings.sampling,
        seed=seed,
        generation_batch_size=settings.generation_batch_size,
        log_prob_batching=settings.log_prob_batching,
        ref_log_prob_batching=settings.ref_log_prob_batching,
        recompute_old_log_probs=settings.recompute_old_log_probs,
        sum_pi_squared=settings.sum_pi_squared,
        share_prompts=settings.share_prompts,
        vllm=settings.vllm,
        multi_turn=None
        if settings.multi_turn is None
        else MultiTurnRequest(
            settings.multi_turn,
            tuple(tool_context(row) for row in rows),
            chat=any(row["prompt_messages"] is not None for row in rows),
        ),
    )
    with progress_bar(f"step {step} {label}", total=len(rows) * settings.n) as progress:
        out = run.models.rollouts(run, actor, reference, [ids for _, ids in rendered], request, progress)
    texts = tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
    baseline_ids = _greedy_baseline(run, step, actor, [ids for _, ids in rendered], settings)
    baseline_texts = tokenizer.batch_decode(baseline_ids, skip_special_tokens=True) if baseline_ids else []
    columns = {
        "prompt_id": [rows[i]["prompt_id"] for i in out.prompt_index],
        "sample_idx": out.sample_index,
        "group_id": out.prompt_index,
        "data_source": [rows[i]["data_source"] for i in out.prompt_index],
        "prompt_text": [rendered[i][0] for i in out.prompt_index],
        "response_text": texts,
        "prompt_ids": [rendered[i][1] for i in out.prompt_index],
        "response_ids": out.response_ids,
        "rollout_log_probs": out.rollout_log_probs,
        "old_log_probs": out.old_log_probs,
        "ref_log_probs": out.ref_log_probs or [None] * len(texts),
        "prompt_length": [len(rendered[i][1]) for i in out.prompt_index],
        "response_length": [len(r) for r in out.response_ids],
        "finish_reason": out.finish_reasons,
        "policy_version": [actor.step] * len(texts),
        "seed": [seed] * len(texts),
        "baseline_response_ids": [baseline_ids[i] if baseline_ids else None for i in out.prompt_index],
        "baseline_response_text": [baseline_texts[i] if baseline_ids else None for i in out.prompt_index],
        **trajectory_columns(out.trajectories, len(texts)),
        "sum_pi_squared": out.sum_pi_squared or [None] * len(texts),
    }
    table = pa.Table.from_pydict(columns, schema=SCHEMAS["rollouts"])
    turns = None
    if out.trajectories is not None:
        turns = turns_table(columns["prompt_id"], out.sample_index, out.trajectories)
    return GeneratedBatch(table, turns, dict(out.seconds))


def _greedy_baseline(
    run: Run, step: int, actor: ModelState, prompt_ids: list[list[int]], settings: RolloutSettings
) -> list[list[int]]:
    """ReMax (settings.greedy_baseline): one greedy response per prompt, whose reward is the baseline
    of the prompt's sampled responses (verl's do_sample=False generation); [] otherwise. Its time
    counts in verl's gen timer, as in verl."""
    if not settings.greedy_baseline:
        return []
    greedy = SamplingParams.greedy(settings.sampling.max_new_tokens)
    with progress_bar(f"step {step} greedy baseline", total=len(prompt_ids)) as progress:
        out = run.models.generate(
            run,
            actor,
            prompt_ids,
            greedy,
            [0] * len(prompt_ids),  # greedy decoding draws nothing
            engine=settings.engine,
            batch_size=settings.generation_batch_size,
            vllm=settings.vllm,
            progress=progress,
        )
    return out.response_ids
