"""Rebuilding engine tensors from the rollout and advantage tables (list columns → padded tensors),
straight from Arrow's flat values and offsets, without a Python list per row."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import torch

from ppoflow.engine.forward import SequenceBatch
from ppoflow.engine.rollout import pad_flat


def _flat(column: pa.ChunkedArray, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A list column's values, concatenated, and each row's length (0 for a null row)."""
    lists = column.combine_chunks()
    lengths = pc.list_value_length(lists).fill_null(0).to_numpy(zero_copy_only=False)
    flat = lists.flatten().to_numpy(zero_copy_only=False)
    # torch.tensor copies: Arrow's buffers are read-only
    return torch.tensor(flat, dtype=dtype), torch.tensor(lengths, dtype=torch.long)


def sequence_batch(rollouts: pa.Table, pad_token_id: int) -> SequenceBatch:
    """Prompts padded on the left, responses on the right, both with the pad token. A multi-turn
    table's `response_mask` (0 on tool tokens) is the batch's loss mask, every response token
    attended; a null row's mask is all ones."""
    prompt_ids, prompt_lengths = _flat(rollouts["prompt_ids"], torch.long)
    response_ids, response_lengths = _flat(rollouts["response_ids"], torch.long)
    prompts, prompt_mask = pad_flat(
        prompt_ids, prompt_lengths, int(prompt_lengths.max()), pad_token_id, left=True
    )
    responses, response_mask = pad_flat(
        response_ids, response_lengths, int(response_lengths.max()) if len(rollouts) else 0, pad_token_id
    )
    loss_mask = policy_mask(rollouts, responses.shape[1])
    if loss_mask is None:
        return SequenceBatch(prompts, prompt_mask.long(), responses, response_mask.float())
    return SequenceBatch(prompts, prompt_mask.long(), responses, loss_mask, response_mask.float())


def policy_mask(rollouts: pa.Table, width: int) -> torch.Tensor | None:
    """(N, width) float: a multi-turn table's `response_mask` (1 on the policy's tokens, 0 on tool
    tokens; a null row all ones over its response_length); None for a single-turn table (the mask
    is 1 on every response token, `length_mask`)."""
    if "response_mask" not in rollouts.column_names or rollouts["response_mask"].null_count == len(rollouts):
        return None
    masks = rollouts["response_mask"].combine_chunks()
    whole = pa.array([[1] * n for n in rollouts["response_length"].to_pylist()], type=masks.type)
    filled = pc.if_else(masks.is_null(), whole, masks)
    return padded_column(pa.table({"mask": filled}), "mask", width)


def padded_column(table: pa.Table, column: str, width: int) -> torch.Tensor:
    """(N, width) float32 tensor of a list column, 0 past each row's end and in null rows."""
    flat, lengths = _flat(table[column], torch.float32)
    return pad_flat(flat, lengths, width, 0.0)[0]


def token_tensor(table: pa.Table, column: str, width: int) -> torch.Tensor | None:
    """`padded_column`, or None when the column is all null."""
    if table[column].null_count == len(table):
        return None
    return padded_column(table, column, width)


def length_mask(lengths: pa.ChunkedArray, width: int) -> torch.Tensor:
    """(N, width) float mask, 1 on the first `length` positions of each row."""
    counts = torch.tensor(lengths.to_numpy(), dtype=torch.long)
    return (torch.arange(width) < counts[:, None]).float()
