"""List columns of the run's tables → padded tensors, read from Arrow's flat buffers: the same tensors
as padding each row's Python list, for chunked columns, null rows and empty rows."""

from __future__ import annotations

import pyarrow as pa
import torch

from ppoflow.engine.ppo import build_sequence_batch, pad_rows
from ppoflow.tasks.storage.tensors import length_mask, padded_column, sequence_batch, token_tensor

F32 = pa.list_(pa.float32())


def _chunked(rows: list, type_: pa.DataType) -> pa.ChunkedArray:
    return pa.chunked_array([pa.array(rows[:2], type_), pa.array(rows[2:], type_)])


def test_a_float_column_pads_like_its_python_rows_with_nulls_as_empty_rows():
    rows = [[0.1, 0.2], None, [], [1e-8, -3.5, 7.25]]
    table = pa.table({"x": _chunked(rows, F32)})
    expected = pad_rows([r or [] for r in rows], 4)
    assert torch.equal(padded_column(table, "x", 4), expected)
    assert torch.equal(token_tensor(table, "x", 4), expected)
    assert token_tensor(pa.table({"x": pa.array([None, None], F32)}), "x", 4) is None


def test_sequence_batch_pads_prompts_left_and_responses_right_like_the_engine():
    prompts, responses = [[3, 4, 5], [6], [7, 8]], [[9], [10, 11, 2], [2]]
    table = pa.table(
        {
            "prompt_ids": _chunked(prompts, pa.list_(pa.int32())),
            "response_ids": _chunked(responses, pa.list_(pa.int32())),
        }
    )
    got, want = (
        sequence_batch(table, pad_token_id=0),
        build_sequence_batch(prompts, responses, pad_token_id=0),
    )
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert getattr(got, name).dtype == getattr(want, name).dtype, name


def test_length_mask_marks_the_first_length_positions():
    mask = length_mask(pa.chunked_array([pa.array([2, 0], pa.int32()), pa.array([3], pa.int32())]), 3)
    assert mask.tolist() == [[1, 1, 0], [0, 0, 0], [1, 1, 1]]
