"""Which prompts each training step uses (verl's epochs, shuffle, drop-last) and prompt truncation."""

import pytest

from ppoflow.engine.data import batch_rows, steps_per_epoch, truncate_prompt


def test_each_epoch_is_a_permutation_and_the_last_partial_batch_is_dropped():
    assert steps_per_epoch(10, 3) == 3
    seen = [batch_rows(10, 3, step, shuffle=True, seed=7) for step in (1, 2, 3)]
    rows = [r for _, batch in seen for r in batch]
    assert {e for e, _ in seen} == {0} and len(rows) == 9 == len(set(rows))
    epoch, _ = batch_rows(10, 3, 4, shuffle=True, seed=7)
    assert epoch == 1


def test_shuffle_is_seeded_and_differs_between_epochs():
    first = batch_rows(100, 10, 1, shuffle=True, seed=1)[1]
    assert first == batch_rows(100, 10, 1, shuffle=True, seed=1)[1]
    assert first != batch_rows(100, 10, 1, shuffle=True, seed=2)[1]
    assert first != batch_rows(100, 10, 11, shuffle=True, seed=1)[1]  # same position, next epoch
    assert batch_rows(100, 10, 3, shuffle=False, seed=1)[1] == list(range(20, 30))


def test_too_few_prompts_for_one_batch_is_a_clear_error():
    with pytest.raises(
        ValueError, match="5 training prompts cannot fill one batch of data.train_batch_size=8"
    ):
        batch_rows(5, 8, 1, shuffle=False, seed=0)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("left", [3, 4, 5, 6]), ("right", [1, 2, 3, 4]), ("middle", [1, 2, 5, 6]), ("error", None)],
)
def test_truncation_modes(mode, expected):
    assert truncate_prompt([1, 2, 3, 4, 5, 6], 4, mode) == expected
    assert truncate_prompt([1, 2], 4, mode) == [1, 2]
