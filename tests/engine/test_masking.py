import pytest
import torch

from ppoflow.engine.masking import (
    LOSS_AGG_MODES,
    Aggregation,
    agg_loss,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    mini_batch_aggregation,
)

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_masked_sum_and_mean_hand_numbers():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_sum(x, mask).item() == 7.0
    assert masked_mean(x, mask).item() == pytest.approx(7.0 / 3.0)
    torch.testing.assert_close(masked_sum(x, mask, dim=-1), torch.tensor([3.0, 4.0]))
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor([1.5, 4.0]))
    torch.testing.assert_close(masked_mean(x, mask, dim=0), torch.tensor([2.5, 2.0, 0.0]))


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float32])
def test_mask_dtype_does_not_matter(dtype):
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]]).to(dtype)
    assert masked_mean(x, mask).item() == pytest.approx(7.0 / 3.0)


def test_empty_mask_gives_zero_mean_not_nan():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[0, 0], [1, 0]])
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor([0.0, 3.0]))


def test_masked_positions_may_hold_nan_and_inf():
    x = torch.tensor([[1.0, float("nan")], [3.0, float("inf")]])
    mask = torch.tensor([[1, 0], [1, 0]])
    assert masked_sum(x, mask).item() == 4.0
    assert masked_mean(x, mask).item() == 2.0
    assert masked_var(x, mask).item() == pytest.approx(2.0)


def test_masked_var_is_unbiased_by_default():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 100.0])
    mask = torch.tensor([1, 1, 1, 1, 0])
    assert masked_var(x, mask).item() == pytest.approx(5.0 / 3.0)  # Σ(x − 2.5)² = 5, n − 1 = 3
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(1.25)


def test_masked_var_of_a_single_entry_is_zero():
    assert masked_var(torch.tensor([3.0, 7.0]), torch.tensor([0, 1])).item() == 0.0


def test_masked_whiten_hand_numbers_use_unbiased_variance():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, -50.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # μ = 2.5, unbiased σ² = 5/3, so σ = 1.29099 (the biased σ would be 1.11803 and give ±1.342 at the ends)
    whitened = masked_whiten(x, mask)
    valid = whitened[mask.bool()]
    torch.testing.assert_close(valid, torch.tensor([-1.161895, -0.387298, 0.387298, 1.161895]))
    shifted = masked_whiten(x, mask, shift_mean=False)[mask.bool()]
    torch.testing.assert_close(shifted, valid + 2.5)
    assert masked_mean(whitened, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert masked_var(whitened, mask).item() == pytest.approx(1.0, abs=1e-6)


def test_masked_whiten_leaves_masked_positions_transformed_not_zero():
    x = torch.tensor([1.0, 2.0, 3.0, 0.0])
    out = masked_whiten(x, torch.tensor([1, 1, 1, 0]))
    assert out[3].item() == pytest.approx(-2.0)  # (0 − 2) / 1


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 2.5),
        ("token-sum", 10.0),
        ("seq-mean-token-sum", 5.0),
        ("seq-mean-token-mean", 3.0),
        ("seq-mean-token-sum-norm", 10.0 / 6.0),
    ],
)
def test_agg_loss_vector_from_algorithms_md(mode, expected):
    assert agg_loss(LOSS, MASK, Aggregation(mode)).item() == pytest.approx(expected)
    assert agg_loss(LOSS, MASK, mini_batch_aggregation(MASK, mode)).item() == pytest.approx(expected)


def test_a_mini_batch_counts_its_valid_tokens_and_every_row():
    agg = mini_batch_aggregation(torch.cat([MASK, torch.zeros(1, 3, dtype=MASK.dtype)]), "token-mean")
    assert (agg.tokens, agg.rows) == (4.0, 3.0)
    empty = mini_batch_aggregation(torch.zeros(2, 3), "token-mean")
    assert (empty.tokens, empty.rows) == (1.0, 2.0)  # clamped: an all-masked mini-batch gives 0, not NaN


def test_in_training_an_empty_row_counts_in_the_seq_mean_modes_as_verl_trainer_passes_them():
    """verl's trainer passes global_batch_size = ppo_mini_batch_size × n, rows without a valid token
    included; without it (standalone) agg_loss counts the rows that have one."""
    loss = torch.cat([LOSS, torch.full((1, 3), 99.0)])
    mask = torch.cat([MASK, torch.zeros(1, 3, dtype=MASK.dtype)])
    trained = {
        mode: agg_loss(loss, mask, mini_batch_aggregation(mask, mode)).item() for mode in LOSS_AGG_MODES
    }
    alone = {mode: agg_loss(loss, mask, Aggregation(mode)).item() for mode in LOSS_AGG_MODES}
    assert trained == pytest.approx(
        {
            "token-mean": 2.5,
            "token-sum": 10.0,
            "seq-mean-token-sum": 10.0 / 3,
            "seq-mean-token-mean": 6.0 / 3,
            "seq-mean-token-sum-norm": 10.0 / 3 / 3,
        }
    )
    assert alone == pytest.approx(
        {
            "token-mean": 2.5,
            "token-sum": 10.0,
            "seq-mean-token-sum": 5.0,
            "seq-mean-token-mean": 3.0,
            "seq-mean-token-sum-norm": 10.0 / 6.0,
        }
    )
    assert (
        agg_loss(loss, torch.zeros(3, 3), mini_batch_aggregation(torch.zeros(3, 3), "token-mean")).item()
        == 0.0
    )


def test_seq_mean_token_sum_norm_divides_by_the_loss_scale_factor_not_the_batch_width():
    """verl divides by actor.loss_scale_factor, else the padded width, which its agent loop fixes at
    rollout.response_length: a constant, so the gradient's scale does not follow the longest response."""
    padded_loss = torch.cat([LOSS, torch.full((2, 2), 7.0)], dim=1)
    padded_mask = torch.cat([MASK, torch.zeros(2, 2, dtype=MASK.dtype)], dim=1)
    fixed = Aggregation("seq-mean-token-sum-norm", loss_scale_factor=16)
    assert agg_loss(padded_loss, padded_mask, fixed).item() == pytest.approx(10.0 / 2 / 16)
    assert agg_loss(LOSS, MASK, fixed).item() == pytest.approx(10.0 / 2 / 16)
    for mode in ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean"):
        assert agg_loss(padded_loss, padded_mask, Aggregation(mode)).item() == pytest.approx(
            agg_loss(LOSS, MASK, Aggregation(mode)).item()
        )
    assert agg_loss(padded_loss, padded_mask, Aggregation("seq-mean-token-sum-norm")).item() == pytest.approx(
        1.0
    )


def test_aggregation_counts_must_be_positive():
    with pytest.raises(ValueError, match="tokens"):
        Aggregation("token-mean", tokens=0.0)
    assert agg_loss(LOSS, MASK, Aggregation("token-mean", tokens=10.0)).item() == pytest.approx(1.0)
    assert agg_loss(LOSS, MASK, Aggregation("seq-mean-token-mean", rows=4.0)).item() == pytest.approx(1.5)


def test_unknown_mode_names_the_valid_choices():
    with pytest.raises(ValueError, match="token-mean.*seq-mean-token-sum-norm"):
        Aggregation("sum")
