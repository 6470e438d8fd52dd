"""The declared schema of every table a run writes, with a line of documentation per column and the
invariants DuckDB checks (STYLE.md rule 6). Column names are the engine's argument names.

Each invariant is a query over a view named like the table that must return zero rows. Iteration
tables are queried with their `iter` column (the catalog adds it from the `iter=NNNNNN` folder).
"""

from __future__ import annotations

import numbers

import pyarrow as pa

from ppoflow.tasks.storage.metric_docs import METRIC_DOCS, METRICS_DOC, metric_doc

__all__ = [
    "DATA_FILES",
    "INVARIANTS",
    "ITERATION_TABLES",
    "SCHEMAS",
    "STAGES",
    "TABLES",
    "TABLE_DOCS",
    "describe",
    "empty_table",
    "metric_doc",
    "metrics_table",
]


def doc_field(name: str, type_: pa.DataType, doc: str, *, nullable: bool = False) -> pa.Field:
    return pa.field(name, type_, nullable=nullable, metadata={b"doc": doc.encode()})


def _schema(table: str, *fields: pa.Field) -> pa.Schema:
    return pa.schema(fields, metadata={b"table": table.encode()})


_I32 = pa.list_(pa.int32())
_F32 = pa.list_(pa.float32())
_COMPONENTS = pa.map_(pa.string(), pa.float64())
_MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def _key() -> list[pa.Field]:
    return [
        doc_field("prompt_id", pa.string(), "Stable id of the prompt (prompts.prompt_id)."),
        doc_field("sample_idx", pa.int32(), "Index of this response among the prompt's n samples (0..n-1)."),
    ]


def _scored() -> list[pa.Field]:
    return [
        doc_field("ground_truth", pa.string(), "Reference answer the reward function compares against."),
        doc_field("score", pa.float64(), "Total reward of the response (what the advantage estimator sees)."),
        doc_field("components", _COMPONENTS, "Each named reward component (e.g. correct, format)."),
        doc_field("error", pa.string(), "Why scoring failed; null when it worked.", nullable=True),
        doc_field(
            "pred",
            pa.string(),
            "The answer the response gives, what maj@k votes on (verl's reward_extra_info 'pred'): the "
            "built-in rewards' extracted answer ('[INVALID]' when none), a custom function's 'pred' as "
            "text; null when it returns none.",
            nullable=True,
        ),
    ]


def _step() -> list[pa.Field]:
    return [
        doc_field("epoch", pa.int32(), "PPO epoch over this iteration's batch (0-based)."),
        doc_field("mini_batch", pa.int32(), "Mini-batch index within the epoch (one optimizer step each)."),
    ]


SCHEMAS: dict[str, pa.Schema] = {
    "prompts": _schema(
        "prompts",
        doc_field("prompt_id", pa.string(), "Stable id of the prompt, unique across splits (set by ingest)."),
        doc_field("split", pa.string(), "'train' or 'val'."),
        doc_field("row_index", pa.int64(), "Row of the prompt in its source file (0-based)."),
        doc_field(
            "data_source", pa.string(), "Dataset name; selects the reward function and groups metrics."
        ),
        doc_field("ability", pa.string(), "Task category, as in verl's data format (e.g. 'math')."),
        doc_field(
            "prompt_text", pa.string(), "Raw text prompt; null when prompt_messages is set.", nullable=True
        ),
        doc_field(
            "prompt_messages",
            _MESSAGES,
            "Chat prompt (role, content); null for a text prompt.",
            nullable=True,
        ),
        doc_field("ground_truth", pa.string(), "Reference answer for the reward function."),
        doc_field(
            "extra_info", pa.string(), "verl's extra_info of the source row, as JSON text (keys sorted)."
        ),
    ),
    "rejects": _schema(
        "rejects",
        doc_field("source", pa.string(), "File the rejected record came from."),
        doc_field("line", pa.int64(), "Line (JSONL) or row (parquet) of the record in its source."),
        doc_field("reason", pa.string(), "Why the record was not turned into a prompt."),
        doc_field("raw", pa.string(), "The record as read, to help fix the source."),
    ),
    "rollouts": _schema(
        "rollouts",
        *_key(),
        doc_field(
            "group_id", pa.int32(), "Samples of one prompt in this batch share it (GRPO's baseline group)."
        ),
        doc_field("data_source", pa.string(), "Dataset name of the prompt."),
        doc_field(
            "prompt_text", pa.string(), "The prompt as rendered for the tokenizer (chat template applied)."
        ),
        doc_field("response_text", pa.string(), "Decoded response (special tokens removed)."),
        doc_field("prompt_ids", _I32, "Token ids of the prompt, unpadded."),
        doc_field("response_ids", _I32, "Token ids of the response, unpadded (EOS included when generated)."),
        doc_field("rollout_log_probs", _F32, "Per-token log-probs reported by the rollout engine."),
        doc_field("old_log_probs", _F32, "Per-token log-probs of the actor before this iteration's update."),
        doc_field(
            "ref_log_probs",
            _F32,
            "Per-token log-probs of the reference model; null without one.",
            nullable=True,
        ),
        doc_field("prompt_length", pa.int32(), "len(prompt_ids)."),
        doc_field(
            "response_length",
            pa.int32(),
            "len(response_ids); lists are unpadded (the response mask is all ones).",
        ),
        doc_field("finish_reason", pa.string(), "'stop' (EOS or stop string) or 'length' (max length hit)."),
        doc_field("policy_version", pa.int32(), "Iteration of the actor state that generated the response."),
        doc_field("seed", pa.int64(), "Sampling seed of this response."),
        doc_field(
            "baseline_response_ids",
            _I32,
            "ReMax: token ids of the prompt's greedy response (its reward is the baseline); null for "
            "other estimators.",
            nullable=True,
        ),
        doc_field(
            "baseline_response_text",
            pa.string(),
            "ReMax: the prompt's greedy response, decoded; null for other estimators.",
            nullable=True,
        ),
        doc_field(
            "response_mask",
            pa.list_(pa.int8()),
            "Multi-turn: per response token, 1 where the policy sampled it and 0 in a tool turn (log-probs "
            "are 0 there and no loss counts it); null for a single-turn response (all ones).",
            nullable=True,
        ),
        doc_field(
            "num_turns",
            pa.int32(),
            "Multi-turn: verl's num_turns (the prompt, each assistant turn and each tool turn); null for a "
            "single-turn response.",
            nullable=True,
        ),
        doc_field(
            "tool_calls",
            pa.int32(),
            "Multi-turn: tool calls the response made; null single-turn.",
            nullable=True,
        ),
        doc_field(
            "tool_reward",
            pa.float64(),
            "Multi-turn: the sum of the rewards its tool calls returned (reward component `tool`); null "
            "single-turn.",
            nullable=True,
        ),
        doc_field(
            "sum_pi_squared",
            _F32,
            "Per response token, Σ_v π(v | s_t)² from the old-log-prob pass (verl's sum_pi_squared: 1 for a "
            "certain next token, 1/V for a uniform one; 0 on tool tokens); null unless the optimal token "
            "baselines or actor.calculate_sum_pi_squared ask for it.",
            nullable=True,
        ),
    ),
    "filter_groups": _schema(
        "filter_groups",
        doc_field("prompt_id", pa.string(), "The prompt of the group (prompts.prompt_id)."),
        doc_field(
            "gen_batch",
            pa.int32(),
            "The generation batch that drew it: 0 is the step's own batch, 1… the further ones (a "
            "prompt not kept can be drawn again once the step has drawn every prompt).",
        ),
        doc_field("data_source", pa.string(), "Dataset name of the prompt."),
        doc_field("metric", pa.string(), "algorithm.filter_groups.metric: what must differ in the group."),
        doc_field("metric_values", pa.list_(pa.float64()), "Each response's metric, by sample_idx."),
        doc_field("response_texts", pa.list_(pa.string()), "The group's responses, by sample_idx."),
        doc_field("kept", pa.bool_(), "Trained on: the group's rows are in this step's rollouts."),
        doc_field(
            "reason",
            pa.string(),
            "'kept'; 'no spread' (every response has the same metric: the group gives no signal); "
            "'surplus' (it has a spread, but the step already had data.train_batch_size groups).",
        ),
    ),
    "turns": _schema(
        "turns",
        *_key(),
        doc_field("turn", pa.int32(), "Position after the prompt: assistant turns are even, tool turns odd."),
        doc_field(
            "call_index",
            pa.int32(),
            "Tool rows: the call's position in its assistant turn (a tool turn holds each call's "
            "result); null for assistant rows.",
            nullable=True,
        ),
        doc_field(
            "role",
            pa.string(),
            "'assistant' (the policy's tokens) or 'tool' (one call and its result).",
        ),
        doc_field(
            "text",
            pa.string(),
            "Assistant rows: the turn as generated (special tokens kept); tool rows: the result as the "
            "model read it (truncated to multi_turn.max_tool_response_length), '' when the tool turn did "
            "not fit in the response.",
        ),
        doc_field(
            "token_start",
            pa.int32(),
            "First response token of the turn (rollouts.response_ids[token_start:token_end]); the calls "
            "of one tool turn share its span.",
        ),
        doc_field("token_end", pa.int32(), "One past the turn's last response token."),
        doc_field(
            "turn_end",
            pa.string(),
            "Assistant rows: why the model's turn ended the way it did: 'tool_calls' (it called tools), "
            "'stop' (EOS without calls: the answer), 'length' (the response length ran out), "
            "'assistant_turn_limit' or 'user_turn_limit' (calls not run: a turn limit); null for tool rows.",
            nullable=True,
        ),
        doc_field(
            "tool_name",
            pa.string(),
            "Tool rows: the tool called; null for a malformed call.",
            nullable=True,
        ),
        doc_field(
            "arguments",
            pa.string(),
            "Tool rows: the call's arguments as JSON (the raw text, cut to 200 characters, of a malformed "
            "call).",
            nullable=True,
        ),
        doc_field(
            "result",
            pa.string(),
            "Tool rows: what the tool returned, before truncation.",
            nullable=True,
        ),
        doc_field(
            "error",
            pa.string(),
            "Tool rows: why the call failed (malformed, unknown tool, bad arguments, an exception, a "
            "timeout); null when it worked.",
            nullable=True,
        ),
        doc_field(
            "tool_reward",
            pa.float64(),
            "Tool rows: the reward the call returned, if any.",
            nullable=True,
        ),
        doc_field(
            "seconds",
            pa.float64(),
            "Tool rows: the call's wall time; assistant rows: the turn's share of its batch's generation "
            "time (not bit-identical across reruns).",
        ),
    ),
    "reward_model": _schema(
        "reward_model",
        *_key(),
        doc_field(
            "rm_score",
            pa.float64(),
            "The reward model's score of the response (reward component rm_score; verl's rm_scores).",
        ),
        doc_field(
            "input_length",
            pa.int32(),
            "Tokens the reward model read: the actor's prompt and response, or both re-tokenised for "
            "a reward model with its own tokenizer.",
        ),
        doc_field(
            "baseline_rm_score",
            pa.float64(),
            "ReMax: the reward model's score of the prompt's greedy response (rollouts."
            "baseline_response_text); null for other estimators.",
            nullable=True,
        ),
    ),
    "rewards": _schema(
        "rewards",
        *_key(),
        doc_field("data_source", pa.string(), "Dataset name; selects the reward function."),
        *_scored(),
        doc_field(
            "baseline_score",
            pa.float64(),
            "ReMax: the score of the prompt's greedy response (rollouts.baseline_response_text), the "
            "baseline b subtracted from the return; null for other estimators.",
            nullable=True,
        ),
    ),
    "advantages": _schema(
        "advantages",
        *_key(),
        doc_field(
            "values",
            _F32,
            "Critic values V(s_t) per response token; null for critic-free estimators.",
            nullable=True,
        ),
        doc_field(
            "token_level_rewards",
            _F32,
            "Score on the last token, minus the per-token KL penalty if in reward.",
        ),
        doc_field("advantages", _F32, "Per-token advantages as the actor loss uses them."),
        doc_field("returns", _F32, "Per-token returns (the critic's regression targets)."),
        doc_field("kl", _F32, "Per-token KL estimate of old vs ref policy, when computed.", nullable=True),
        doc_field(
            "train_weight", pa.int32(), "Times the row enters the update: 1, or PF-PPO's count (>= 0)."
        ),
        doc_field(
            "rollout_is_weights",
            _F32,
            "Decoupled rollout correction (algorithm.rollout_correction.rollout_is): each response token's "
            "importance weight π_old/π_rollout as truncated (or IcePop-zeroed) and normalised, which "
            "multiplies its loss; 0 on tool tokens; null without importance sampling.",
            nullable=True,
        ),
        doc_field(
            "rollout_rs_rejected",
            pa.list_(pa.bool_()),
            "Decoupled rejection sampling (rollout_correction.rollout_rs): per response token, true where "
            "it was rejected (no loss counts it, and the estimator skips it); null without rejection.",
            nullable=True,
        ),
        doc_field(
            "rollout_rs_rejected_by",
            pa.list_(pa.string()),
            "The rollout_rs criteria that rejected any of the response's tokens ([] when none did); null "
            "without rejection sampling.",
            nullable=True,
        ),
    ),
    "actor_update": _schema(
        "actor_update",
        *_step(),
        doc_field("pg_loss", pa.float64(), "Policy-gradient loss of the step."),
        doc_field(
            "pg_clipfrac",
            pa.float64(),
            "Fraction of tokens whose ratio was clipped (each loss mode's own sense of it); null for the "
            "loss modes that report none (gpg, kl_cov, dro, bypass_mode's reinforce).",
            nullable=True,
        ),
        doc_field(
            "pg_clipfrac_lower",
            pa.float64(),
            "Fraction clipped by dual-clip's lower bound (clip_ratio_c); null where the loss mode reports "
            "none.",
            nullable=True,
        ),
        doc_field(
            "ppo_kl",
            pa.float64(),
            "Mean approximate KL of the current policy vs old_log_probs (kl_cov: mean |log ρ|); null for "
            "gpg, which reports none.",
            nullable=True,
        ),
        doc_field("entropy", pa.float64(), "Mean token entropy of the current policy."),
        doc_field("grad_norm", pa.float64(), "Gradient norm before clipping."),
        doc_field("lr", pa.float64(), "Learning rate used for the step."),
        doc_field(
            "kl_loss", pa.float64(), "KL-to-reference loss when use_kl_loss; null otherwise.", nullable=True
        ),
        doc_field(
            "other_metrics",
            pa.map_(pa.string(), pa.float64()),
            "The step's other verl-named metrics, by name (bypass mode's rollout_corr/*); empty when none.",
        ),
    ),
    "critic_update": _schema(
        "critic_update",
        *_step(),
        doc_field("vf_loss", pa.float64(), "Value-function loss of the step."),
        doc_field("vf_clipfrac", pa.float64(), "Fraction of tokens whose value prediction was clipped."),
        doc_field("vpred_mean", pa.float64(), "Mean predicted value over response tokens."),
        doc_field("grad_norm", pa.float64(), "Gradient norm before clipping."),
        doc_field("lr", pa.float64(), "Learning rate used for the step."),
    ),
    "validation": _schema(
        "validation",
        *_key(),
        doc_field(
            "data_source", pa.string(), "Dataset name; validation scores are reported per data_source."
        ),
        doc_field("prompt_text", pa.string(), "The prompt as rendered for the tokenizer."),
        doc_field("response_text", pa.string(), "Decoded response."),
        doc_field("response_length", pa.int32(), "Number of response tokens."),
        doc_field("finish_reason", pa.string(), "'stop' or 'length'."),
        *_scored(),
        doc_field(
            "num_turns",
            pa.int32(),
            "Multi-turn: verl's num_turns of the answer (prompt, assistant, tool turns); null single-turn.",
            nullable=True,
        ),
        doc_field(
            "tool_calls",
            pa.int32(),
            "Multi-turn: tool calls the answer made; null single-turn.",
            nullable=True,
        ),
    ),
}

TABLE_DOCS: dict[str, str] = {
    "prompts": "The ingested dataset, one row per prompt (`data/train.parquet`, `data/val.parquet`).",
    "rejects": "Source records that could not be ingested, with the reason (`data/rejects_<split>.parquet`).",
    "rollouts": "One row per generated response, with its tokens and log-probs (`iter=N/rollouts/`).",
    "turns": "Multi-turn runs: one row per assistant turn and per tool call of each response "
    "(`iter=N/turns/`).",
    "filter_groups": "Dynamic sampling (algorithm.filter_groups.enable): one row per prompt group generated, "
    "with its metric values and whether it was trained on (`iter=N/filter_groups/`).",
    "reward_model": "One row per response: the reward model's score, with reward_model.enable "
    "(`iter=N/reward_model/`).",
    "rewards": "One row per response: its score and reward components (`iter=N/rewards/`).",
    "advantages": "One row per response: per-token values, advantages, returns (`iter=N/advantages/`).",
    "actor_update": "One row per actor optimizer step (`iter=N/actor_update/`).",
    "critic_update": "One row per critic optimizer step (`iter=N/critic_update/`).",
    "validation": "One row per validation response with its score (`iter=N/validation/`).",
    "metrics": METRICS_DOC + " (`iter=N/metrics/`)",
}

TABLES: tuple[str, ...] = tuple(TABLE_DOCS)
DATA_FILES: dict[str, tuple[str, ...]] = {
    "prompts": ("data/train.parquet", "data/val.parquet"),
    # one file per split; data/rejects.parquet holds both splits in runs written before the split
    "rejects": ("data/rejects_train.parquet", "data/rejects_val.parquet", "data/rejects.parquet"),
}
STAGES: tuple[str, ...] = (
    "rollouts",
    "reward_model",
    "rewards",
    "advantages",
    "actor_update",
    "critic_update",
    "validation",
    "metrics",
)
"""The stages of a training step that write a table: each one's name is its table, its folder under
iter=N/ and its manifest key."""
ITERATION_TABLES: tuple[str, ...] = (*STAGES, "turns", "filter_groups")
"""Tables under iter=N/: each stage's, and the rollouts stage's other tables, `turns` and
`filter_groups`."""


def _unique(table: str, *key: str) -> str:
    cols = ", ".join(key)
    return f"SELECT {cols}, count(*) AS n FROM {table} GROUP BY {cols} HAVING count(*) > 1"


def _lengths_differ(reference: str, *lists: str, nullable: tuple[str, ...] = ()) -> str:
    checks = [f"len({c}) IS DISTINCT FROM {reference}" for c in lists]
    checks += [f"({c} IS NOT NULL AND len({c}) <> {reference})" for c in nullable]
    return " OR ".join(checks)


def _finite_unless_error(table: str) -> str:
    return (
        f"SELECT iter, prompt_id, sample_idx, score FROM {table} "
        "WHERE error IS NULL AND (score IS NULL OR NOT isfinite(score))"
    )


def _finish_reason(table: str) -> str:
    return (
        f"SELECT iter, prompt_id, sample_idx, finish_reason FROM {table} "
        "WHERE finish_reason IS NULL OR finish_reason NOT IN ('stop', 'length')"
    )


INVARIANTS: dict[str, list[str]] = {
    "prompts": [
        _unique("prompts", "prompt_id"),
        "SELECT prompt_id FROM prompts WHERE (prompt_text IS NULL) = (prompt_messages IS NULL)",
    ],
    "rejects": [],
    "rollouts": [
        _unique("rollouts", "iter", "prompt_id", "sample_idx"),
        "SELECT iter, prompt_id, sample_idx FROM rollouts WHERE "
        + _lengths_differ(
            "response_length",
            "response_ids",
            "old_log_probs",
            "rollout_log_probs",
            nullable=("ref_log_probs", "sum_pi_squared"),
        ),
        "SELECT iter, prompt_id, sample_idx FROM rollouts "
        "WHERE len(prompt_ids) IS DISTINCT FROM prompt_length",
        "SELECT iter, prompt_id, sample_idx FROM rollouts WHERE response_mask IS NOT NULL AND "
        "(len(response_mask) <> response_length OR list_sum(response_mask) = 0)",
        _finish_reason("rollouts"),
        "SELECT iter, prompt_id FROM rollouts GROUP BY iter, prompt_id HAVING count(DISTINCT group_id) > 1",
        "SELECT iter, prompt_id FROM rollouts GROUP BY iter, prompt_id "
        "HAVING count(DISTINCT baseline_response_ids) > 1",
    ],
    "reward_model": [
        _unique("reward_model", "iter", "prompt_id", "sample_idx"),
        "SELECT iter, prompt_id, sample_idx FROM reward_model "
        "WHERE rm_score IS NULL OR NOT isfinite(rm_score)",
        "SELECT iter, prompt_id FROM reward_model GROUP BY iter, prompt_id "
        "HAVING count(DISTINCT baseline_rm_score) > 1",
    ],
    "turns": [
        _unique("turns", "iter", "prompt_id", "sample_idx", "turn", "call_index"),
        "SELECT iter, prompt_id, sample_idx, turn FROM turns WHERE role NOT IN ('assistant', 'tool') "
        "OR (role = 'tool') <> (call_index IS NOT NULL) OR token_start > token_end OR token_start < 0",
    ],
    "rewards": [
        _unique("rewards", "iter", "prompt_id", "sample_idx"),
        _finite_unless_error("rewards"),
        "SELECT iter FROM rewards GROUP BY iter HAVING count(baseline_score) NOT IN (0, count(*))",
    ],
    "advantages": [
        _unique("advantages", "iter", "prompt_id", "sample_idx"),
        "SELECT iter, prompt_id, sample_idx FROM advantages WHERE "
        + _lengths_differ("len(token_level_rewards)", "advantages", "returns", nullable=('"values"', "kl")),
        "SELECT iter, prompt_id, sample_idx FROM advantages WHERE train_weight IS NULL OR train_weight < 0",
        "SELECT iter, prompt_id, sample_idx FROM advantages WHERE "
        + _lengths_differ("len(token_level_rewards)", nullable=("rollout_is_weights", "rollout_rs_rejected")),
        "SELECT iter, prompt_id, sample_idx FROM advantages WHERE (rollout_rs_rejected IS NULL) <> "
        "(rollout_rs_rejected_by IS NULL) OR list_bool_or(rollout_rs_rejected) "
        "<> (len(rollout_rs_rejected_by) > 0)",
    ],
    "filter_groups": [
        _unique("filter_groups", "iter", "gen_batch", "prompt_id"),
        _unique("(SELECT * FROM filter_groups WHERE kept)", "iter", "prompt_id"),  # kept once a step
        "SELECT iter, prompt_id FROM filter_groups WHERE kept <> (reason = 'kept') "
        "OR reason NOT IN ('kept', 'no spread', 'surplus') OR len(metric_values) <> len(response_texts)",
        "SELECT iter, prompt_id FROM filter_groups WHERE reason = 'no spread' "
        "AND list_max(metric_values) <> list_min(metric_values)",
    ],
    "actor_update": [_unique("actor_update", "iter", "epoch", "mini_batch")],
    "critic_update": [_unique("critic_update", "iter", "epoch", "mini_batch")],
    "validation": [
        _unique("validation", "iter", "prompt_id", "sample_idx"),
        _finish_reason("validation"),
        _finite_unless_error("validation"),
    ],
    "metrics": [_unique("metrics", "iter")],
}

_STEP = doc_field(
    "step", pa.int64(), "Global training step (the iteration number when one update per iteration)."
)


def metrics_table(metrics: dict[str, float], step: int) -> pa.Table:
    """One row: `step` (int64) first, then every metric as a float64 column, sorted by name."""
    for reserved in ("step", "iter"):
        if reserved in metrics:
            raise ValueError(f"metric name {reserved!r} is reserved (step is a column; iter is the folder)")
    columns = {"step": pa.array([int(step)], pa.int64())}
    for name in sorted(metrics):
        value = metrics[name]
        if not name or not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise ValueError(f"metric {name!r} must be a named real number, got {value!r}")
        columns[name] = pa.array([float(value)], pa.float64())
    fields = [_STEP] + [_metric_field(n) for n in columns if n != "step"]
    return pa.table(columns, schema=pa.schema(fields, metadata={b"table": b"metrics"}))


def _metric_field(name: str) -> pa.Field:
    doc = metric_doc(name)
    return pa.field(name, pa.float64(), metadata={b"doc": doc.encode()} if doc else None)


def empty_table(name: str) -> pa.Table:
    """A zero-row table with the declared columns (metrics: only `step`)."""
    if name == "metrics":
        return pa.schema([_STEP], metadata={b"table": b"metrics"}).empty_table()
    return _schema_of(name).empty_table()


def describe(table_name: str) -> str:
    """Markdown documentation of a table: what a row is, its columns, and its invariants."""
    lines = [f"### {table_name}", "", TABLE_DOCS[_known(table_name)], ""]
    schema = empty_table(table_name).schema
    if table_name in ITERATION_TABLES:
        schema = schema.insert(0, doc_field("iter", pa.int32(), "Iteration (from the iter=NNNNNN folder)."))
    lines += ["| column | type | nullable | doc |", "|---|---|---|---|"]
    for field in schema:
        doc = _cell((field.metadata or {}).get(b"doc", b"").decode())
        lines.append(f"| `{field.name}` | `{field.type}` | {'yes' if field.nullable else 'no'} | {doc} |")
    if table_name == "metrics":
        lines += ["", "Metric columns, by name pattern:", "", "| metric | doc |", "|---|---|"]
        lines += [f"| `{name}` | {_cell(doc)} |" for name, doc in METRIC_DOCS.items()]
    if INVARIANTS[table_name]:
        lines += ["", "Invariants (each query returns no rows):", ""]
        lines += [f"- `{sql}`" for sql in INVARIANTS[table_name]]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _known(name: str) -> str:
    if name not in TABLE_DOCS:
        raise KeyError(f"unknown table {name!r}; tables: {', '.join(TABLES)}")
    return name


def _schema_of(name: str) -> pa.Schema:
    _known(name)
    return SCHEMAS[name]
