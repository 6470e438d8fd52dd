"""The `validation` stage: val_kwargs.n answers (greedy by default) to every validation prompt, scored
→ iter=N/validation/part-00000.parquet, one row per answer, and verl's validation metrics
(`val-core/<data_source>/acc/mean@n` for a reward function that returns a number, as verl names it,
else `…/reward/mean@n`; with n > 1 best@k, worst@k, maj@k: engine/validation_metrics.py)."""

from __future__ import annotations

import pyarrow as pa
from prefect import task

from ppoflow.engine.rollout import sample_seed
from ppoflow.engine.validation_metrics import compute_validation_metrics
from ppoflow.tasks.faults import inject_fault
from ppoflow.tasks.observe.console import progress_bar, show_generations
from ppoflow.tasks.pipeline.cache_keys import current_cache_key, stage_cache_key
from ppoflow.tasks.pipeline.placement import MultiTurnRequest
from ppoflow.tasks.pipeline.run import Run
from ppoflow.tasks.pipeline.settings import RewardSettings, ValidationSettings
from ppoflow.tasks.pipeline.states import ModelState, StageResult, StageTimer, timing_values
from ppoflow.tasks.stages.prompt_rows import render_prompts
from ppoflow.tasks.stages.rewards import aligned_components, reward_error_metrics, score_rows
from ppoflow.tasks.stages.turns import tool_context, trajectory_columns, turn_metrics
from ppoflow.tasks.storage.schemas import SCHEMAS
from ppoflow.tasks.storage.tables import ArtifactRef, read_table, stage_path, write_table


def validation_seed(seed: int | None, step: int, prompt_index: int, sample_index: int) -> int:
    """The random stream of validation answer j to prompt i at `step`: from the run's sampling seed when
    validation samples (`ValidationSettings.seed`), so that a rerun or a resume draws the same answers."""
    if seed is None:  # greedy: nothing is drawn
        return sample_seed(step, prompt_index, sample_index)
    return sample_seed(seed * 1_000_003 + step, -1 - prompt_index, sample_index)


def returns_a_number(reward: RewardSettings, components: list[dict[str, float]]) -> bool:
    """Whether the scores come from a reward function that returns a number, which verl records as
    `acc` too: a built-in reward (verl's own, GSM8K's compute_score, return a float; ppoflow's
    components are the parts of it) or a custom function whose rows have no components (it returned a
    float, or a dict with its score alone)."""
    return reward.custom_function is None or not (components and components[0])


@task(name="validation", task_run_name="validation-step{step}", cache_key_fn=stage_cache_key)
def validation(
    run: Run,
    step: int,
    actor: ModelState,
    prompts: ArtifactRef,
    settings: ValidationSettings,
    reward: RewardSettings,
) -> StageResult:
    """Generate val_kwargs.n answers per validation prompt with the actor of `step` and score them
    (verl's timer: testing)."""
    timer = StageTimer()
    rows = read_table(run.path, prompts, clock=run.io).to_pylist()
    tokenizer = run.models.tokenizer(run, actor)
    tools = () if settings.multi_turn is None else tuple(t.schema for t in settings.multi_turn.tools)
    rendered = render_prompts(tokenizer, rows, settings.prompt_length, settings.truncation, tools)
    n = settings.n
    prompt_ids = [ids for _, ids in rendered for _ in range(n)]
    seeds = [validation_seed(settings.seed, step, i, j) for i in range(len(rendered)) for j in range(n)]
    with progress_bar(f"step {step} validate", total=len(prompt_ids)) as progress:
        out = run.models.generate(
            run,
            actor,
            prompt_ids,
            settings.sampling,
            seeds,
            engine=settings.engine,
            batch_size=settings.generation_batch_size,
            vllm=settings.vllm,
            progress=progress,
            multi_turn=None
            if settings.multi_turn is None
            else MultiTurnRequest(
                settings.multi_turn,
                tuple(tool_context(rows[i]) for i in range(len(rows)) for _ in range(n)),
                chat=any(row["prompt_messages"] is not None for row in rows),
            ),
        )
    texts = tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
    index = [i for i in range(len(rows)) for _ in range(n)]
    turn_columns = trajectory_columns(out.trajectories, len(texts))
    generated = [
        {
            "prompt_id": rows[i]["prompt_id"],
            "sample_idx": j % n,
            "data_source": rows[i]["data_source"],
            "response_text": texts[j],
            "response_length": len(out.response_ids[j]),
            "tool_reward": turn_columns["tool_reward"][j],
            "num_turns": turn_columns["num_turns"][j],
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
            "pred": scored["pred"],
            "num_turns": turn_columns["num_turns"],
            "tool_calls": turn_columns["tool_calls"],
        },
        schema=SCHEMAS["validation"],
    )
    inject_fault("validation", step)
    ref = write_table(table, run.path, stage_path(step, "validation"), SCHEMAS["validation"], clock=run.io)
    show_generations(step, table.slice(0, settings.log_generations).to_pylist())
    components = aligned_components(table)
    metrics = compute_validation_metrics(
        table["data_source"].to_pylist(),
        table["prompt_id"].to_pylist(),
        table["score"].to_pylist(),
        components,
        table["pred"].to_pylist(),
        score_as_acc=returns_a_number(reward, components),
    ) | reward_error_metrics(table, "val-aux/reward")
    metrics |= {f"val-aux/{name}": value for name, value in turn_metrics(table).items()}
    seconds = timer.seconds
    values = tuple(sorted(metrics.items())) + timing_values({"testing": seconds})
    return StageResult("validation", (ref,), current_cache_key(), seconds, values)
