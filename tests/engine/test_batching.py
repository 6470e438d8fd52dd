"""Micro-batches of a pass: fixed rows, or consecutive rows within a token budget counted as the
pass runs them (padded: rows × the widest row; packed: the sum of the rows' lengths)."""

import pytest
import torch

from ppoflow.engine.batching import micro_batches, split_to

# prompt and response lengths of 8 rows: (3, 2) (5, 1) (2, 4) (4, 4) (1, 1) (6, 2) (2, 2) (3, 3)
PROMPTS = [3, 5, 2, 4, 1, 6, 2, 3]
RESPONSES = [2, 1, 4, 4, 1, 2, 2, 3]


def _masks():
    width_p, width_r = max(PROMPTS), max(RESPONSES)
    prompt = torch.tensor([[0] * (width_p - p) + [1] * p for p in PROMPTS])
    response = torch.tensor([[1.0] * r + [0.0] * (width_r - r) for r in RESPONSES])
    return prompt, response


def _cut(budget, *, packed, size=1):
    prompt, response = _masks()
    micros = micro_batches(torch.arange(8), prompt, response, size=size, max_tokens=budget, packed=packed)
    return [m.tolist() for m in micros]


def test_fixed_micro_batches_take_size_rows_in_order():
    assert _cut(None, packed=False, size=3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert _cut(None, packed=True, size=3) == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_a_padded_budget_counts_rows_times_the_widest_prompt_and_response():
    # 0-1: 2 × (5 + 2) = 14 (with row 2: 3 × (5 + 4) = 27); 2-3: 2 × (4 + 4) = 16 (with 4: 24);
    # 4-5: 2 × (6 + 2) = 16 (with 6: 24); 6-7: 2 × (3 + 3) = 12
    assert _cut(16, packed=False) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert _cut(10_000, packed=False) == [list(range(8))]


def test_a_packed_budget_counts_the_sum_of_the_rows_lengths():
    # lengths 5 6 6 8 2 8 4 6: 5+6 = 11 (+6 = 17); 6+8+2 = 16 (+8 = 24); 8+4 = 12 (+6 = 18); 6
    assert _cut(16, packed=True) == [[0, 1], [2, 3, 4], [5, 6], [7]]
    assert _cut(sum(PROMPTS) + sum(RESPONSES), packed=True) == [list(range(8))]


@pytest.mark.parametrize("packed", [False, True])
def test_a_row_longer_than_the_budget_is_an_error_naming_both(packed):
    with pytest.raises(ValueError, match="a sequence of 8 tokens .* token budget of 7"):
        _cut(7, packed=packed)


@pytest.mark.parametrize("packed", [False, True])
def test_every_row_is_in_one_micro_batch_and_each_cut_was_needed(packed):
    prompt, response = _masks()
    lengths = [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]

    def tokens(rows):
        if packed:
            return sum(lengths[i] for i in rows)
        return len(rows) * (max(PROMPTS[i] for i in rows) + max(RESPONSES[i] for i in rows))

    for budget in range(8, 60):
        micros = _cut(budget, packed=packed)
        assert sum(micros, []) == list(range(8))
        assert all(tokens(m) <= budget for m in micros)
        assert all(tokens(a + b[:1]) > budget for a, b in zip(micros, micros[1:], strict=False))


def test_split_to_halves_the_largest_micro_batch_until_there_are_as_many_as_asked():
    micros = [torch.arange(0, 5), torch.arange(5, 7), torch.arange(7, 8)]
    assert [m.tolist() for m in split_to(micros, 3)] == [[0, 1, 2, 3, 4], [5, 6], [7]]
    assert [m.tolist() for m in split_to(micros, 4)] == [[0, 1, 2], [3, 4], [5, 6], [7]]
    assert [m.tolist() for m in split_to(micros, 5)] == [[0, 1], [2], [3, 4], [5, 6], [7]]
    assert [m.tolist() for m in split_to(micros, 8)] == [[i] for i in range(8)]
    with pytest.raises(ValueError, match="cannot split 3 micro-batches of 8 rows into 9"):
        split_to(micros, 9)
    with pytest.raises(ValueError, match="into 2"):
        split_to(micros, 2)


def test_split_to_keeps_a_token_budget():
    prompt, response = _masks()
    for budget in range(8, 40):
        micros = micro_batches(torch.arange(8), prompt, response, size=None, max_tokens=budget, packed=False)
        for count in range(len(micros), 9):
            for part in split_to(micros, count):
                rows = part.tolist()
                assert len(rows) * (max(PROMPTS[i] for i in rows) + max(RESPONSES[i] for i in rows)) <= budget
