"""The multi-turn side of the rollouts stage: the tools' context of a prompt row, the rollouts
table's multi-turn columns and the `turns` table (one row per assistant turn and per tool call)."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc

from ppoflow.engine.multi_turn import Trajectory
from ppoflow.engine.tools import ToolContext
from ppoflow.tasks.storage.schemas import SCHEMAS


def tool_context(row: dict) -> ToolContext:
    """A prompt row's ground truth and extra_info (a JSON object; anything else counts as none)."""
    try:
        extra = json.loads(row["extra_info"]) if row.get("extra_info") else {}
    except ValueError:
        extra = {}
    return ToolContext(row.get("ground_truth"), extra if isinstance(extra, dict) else {})


def trajectory_columns(trajectories: Sequence[Trajectory] | None, rows: int) -> dict[str, list]:
    """The rollouts table's response_mask, num_turns, tool_calls and tool_reward (null single-turn)."""
    if trajectories is None:
        return {name: [None] * rows for name in ("response_mask", "num_turns", "tool_calls", "tool_reward")}
    return {
        "response_mask": [t.response_mask for t in trajectories],
        "num_turns": [t.num_turns for t in trajectories],
        "tool_calls": [t.tool_calls for t in trajectories],
        "tool_reward": [float(sum(t.tool_rewards)) for t in trajectories],
    }


def turns_table(
    prompt_ids: Sequence[str], sample_index: Sequence[int], trajectories: Sequence[Trajectory]
) -> pa.Table:
    rows = [
        {
            "prompt_id": prompt_id,
            "sample_idx": sample,
            "turn": turn.turn,
            "call_index": turn.call_index,
            "role": turn.role,
            "text": turn.text,
            "token_start": turn.token_start,
            "token_end": turn.token_end,
            "turn_end": turn.end,
            "tool_name": turn.tool_name,
            "arguments": turn.arguments,
            "result": turn.result,
            "error": turn.error,
            "tool_reward": turn.reward,
            "seconds": turn.seconds,
        }
        for prompt_id, sample, trajectory in zip(prompt_ids, sample_index, trajectories, strict=True)
        for turn in trajectory.turns
    ]
    return pa.Table.from_pylist(rows, schema=SCHEMAS["turns"])


def turn_metrics(rollouts: pa.Table) -> dict[str, float]:
    """verl's num_turns/{min,max,mean} and tool_call_counts/{min,max,mean} of a multi-turn batch
    (rollouts or validation table; {} for single-turn rows)."""
    metrics: dict[str, float] = {}
    for column, name in (("num_turns", "num_turns"), ("tool_calls", "tool_call_counts")):
        if column not in rollouts.column_names or rollouts[column].null_count == len(rollouts):
            continue
        values = rollouts[column].drop_null()
        metrics |= {
            f"{name}/min": float(pc.min(values).as_py()),
            f"{name}/max": float(pc.max(values).as_py()),
            f"{name}/mean": float(pc.mean(values).as_py()),
        }
    return metrics
