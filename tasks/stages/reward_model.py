"""The `reward_model` stage: a learned reward model scores each response →
iter=N/reward_model/part-00000.parquet (rm_score per response), which the rewards stage weighs in as
the component `rm_score`.

The reward model reads the actor's own tokens when the two share a tokenizer (vocabulary and chat
template). Otherwise each response is re-tokenised for it, as verl's `_switch_chat_template`: a chat
prompt with the response as the assistant's turn, rendered by the reward model's chat template; a
text prompt followed by the response; cut on the right at max_length.
"""

from __future__ import annotations

import pyarrow as pa
from prefect import task

from ppoflow.engine.ppo import build_sequence_batch
from ppoflow.tasks.faults import inject_fault
from ppoflow.tasks.pipeline.cache_keys import current_cache_key, stage_cache_key
from ppoflow.tasks.pipeline.run import Run
from ppoflow.tasks.pipeline.settings import RewardModelSettings
from ppoflow.tasks.pipeline.states import ModelState, StageResult, StageTimer, timing_values
from ppoflow.tasks.storage.schemas import SCHEMAS
from ppoflow.tasks.storage.tables import ArtifactRef, read_table, stage_path, write_table


def same_tokenizer(actor_tokenizer, rm_tokenizer) -> bool:
    """Whether the reward model can read the actor's token ids as they are."""
    return (
        actor_tokenizer.get_vocab() == rm_tokenizer.get_vocab()
        and actor_tokenizer.chat_template == rm_tokenizer.chat_template
    )


def retokenised(rm_tokenizer, rows: list[dict], prompts: dict[str, dict], max_length: int) -> list[list[int]]:
    """Each row's (prompt, response_text) as the reward model's token ids (verl's
    _switch_chat_template; a text prompt, which verl does not take, is followed by the response)."""
    inputs = []
    for row in rows:
        prompt = prompts[row["prompt_id"]]
        if prompt["prompt_messages"] is not None:
            chat = [*prompt["prompt_messages"], {"role": "assistant", "content": row["response_text"]}]
            text = rm_tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False)
        else:
            text = prompt["prompt_text"] + row["response_text"]
        inputs.append(list(rm_tokenizer(text, add_special_tokens=False)["input_ids"])[:max_length])
    return inputs


@task(name="reward_model", task_run_name="reward_model-step{step}", cache_key_fn=stage_cache_key)
def reward_model(
    run: Run,
    step: int,
    actor: ModelState,
    rollouts: ArtifactRef,
    prompts: ArtifactRef,
    settings: RewardModelSettings,
) -> StageResult:
    """Score every rollout with the reward model: its score head at the last token of the prompt and
    response, and with ReMax each prompt's greedy response once, as verl scores its baseline batch
    (verl's timer: reward, shared with the rewards stage)."""
    timer = StageTimer()
    columns = ["prompt_id", "sample_idx", "prompt_ids", "response_ids", "response_text"]
    columns += ["baseline_response_ids", "baseline_response_text"]
    rows = read_table(run.path, rollouts, clock=run.io).select(columns).to_pylist()
    greedy = greedy_rows(rows)
    scored_rows = rows + list(greedy.values())
    actor_tokenizer = run.models.tokenizer(run, actor)
    rm_tokenizer = run.models.reward_tokenizer(settings.path, settings.digest)
    if same_tokenizer(actor_tokenizer, rm_tokenizer):
        prompt_ids = [row["prompt_ids"] for row in scored_rows]
        response_ids = [row["response_ids"] for row in scored_rows]
    else:
        table = read_table(run.path, prompts, clock=run.io)
        by_id = {
            r["prompt_id"]: r
            for r in table.select(["prompt_id", "prompt_text", "prompt_messages"]).to_pylist()
        }
        prompt_ids = retokenised(rm_tokenizer, scored_rows, by_id, settings.max_length)
        response_ids = [[] for _ in scored_rows]
    batch = build_sequence_batch(prompt_ids, response_ids, pad_token_id=rm_tokenizer.pad_token_id)
    scores = run.models.reward_scores(
        settings.path, settings.digest, batch, micro_batch_size=settings.micro_batch_size
    ).tolist()
    baseline = dict(zip(greedy, scores[len(rows) :], strict=True))
    inject_fault("reward_model", step)
    table = pa.Table.from_pydict(
        {
            "prompt_id": [row["prompt_id"] for row in rows],
            "sample_idx": [row["sample_idx"] for row in rows],
            "rm_score": scores[: len(rows)],
            "input_length": [len(prompt_ids[i]) + len(response_ids[i]) for i in range(len(rows))],
            "baseline_rm_score": [baseline.get(row["prompt_id"]) for row in rows],
        },
        schema=SCHEMAS["reward_model"],
    )
    ref = write_table(
        table, run.path, stage_path(step, "reward_model"), SCHEMAS["reward_model"], clock=run.io
    )
    seconds = timer.seconds
    return StageResult(
        "reward_model", (ref,), current_cache_key(), seconds, timing_values({"reward": seconds})
    )


def greedy_rows(rows: list[dict]) -> dict[str, dict]:
    """ReMax: each prompt's greedy response (rollouts.baseline_response_*) as a row to score, by
    prompt_id; empty when the rollouts have none."""
    greedy: dict[str, dict] = {}
    if rows and rows[0]["baseline_response_ids"] is not None:
        for row in rows:
            baseline = {
                "response_ids": row["baseline_response_ids"],
                "response_text": row["baseline_response_text"],
            }
            greedy.setdefault(row["prompt_id"], row | baseline)
    return greedy
