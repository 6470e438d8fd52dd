"""Rebuilding engine tensors from the rollout and advantage tables (list columns → padded tensors)."""

from __future__ import annotations

import pyarrow as pa
import torch

from ppoflow.engine.forward import SequenceBatch
from ppoflow.engine.ppo import build_sequence_batch, pad_rows


def sequence_batch(rollouts: pa.Table, pad_token_id: int) -> SequenceBatch:
    return build_sequence_batch(
        rollouts["prompt_ids"].to_pylist(), rollouts["response_ids"].to_pylist(), pad_token_id=pad_token_id
    )


def token_tensor(table: pa.Table, column: str, width: int) -> torch.Tensor | None:
    """(N, width) float tensor of a list column; None when the column is all null."""
    values = table[column].to_pylist()
    if all(v is None for v in values):
        return None
    return pad_rows([v or [] for v in values], width)
