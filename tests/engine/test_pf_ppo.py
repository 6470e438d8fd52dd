import pytest
import torch

from ppoflow.engine.pf_ppo import pf_ppo_resample_indices, pf_ppo_weights

DRAWS = 20_000  # rows per pattern repeat: the pattern is tiled so one call draws 4·DRAWS samples


def draw_frequencies(pattern, method, **kwargs):
    """Share of draws landing on each position of a score pattern tiled DRAWS times."""
    scores = torch.tensor(pattern).repeat(DRAWS)
    ids = pf_ppo_resample_indices(
        scores, reweight_method=method, generator=torch.Generator().manual_seed(0), **kwargs
    )
    assert ids.shape == scores.shape
    assert ids.dtype == torch.long
    counts = torch.bincount(ids % len(pattern), minlength=len(pattern))
    return (counts / counts.sum()).tolist()


def test_pow_weights_hand_numbers():
    weights = pf_ppo_weights(torch.tensor([1.0, -2.0, 0.0, 3.0]), reweight_method="pow")
    torch.testing.assert_close(weights, torch.tensor([1.0, 4.0, 1e-8, 9.0]))
    cubed = pf_ppo_weights(torch.tensor([-2.0, 0.5]), reweight_method="pow", weight_pow=3.0)
    torch.testing.assert_close(cubed, torch.tensor([8.0, 0.125]))


def test_pow_sampling_distribution():
    frequencies = draw_frequencies([1.0, -2.0, 0.0, 3.0], "pow")
    assert frequencies == pytest.approx([1 / 14, 4 / 14, 0.0, 9 / 14], abs=0.01)


def test_max_min_never_draws_middle_rows():
    pattern = [0.0, 0.5, 1.0, 0.2, 1.0]
    weights = pf_ppo_weights(torch.tensor(pattern), reweight_method="max_min")
    torch.testing.assert_close(weights, torch.tensor([1.0, 1e-8, 1.0, 1e-8, 1.0]))
    frequencies = draw_frequencies(pattern, "max_min")
    assert frequencies[1] == 0.0
    assert frequencies[3] == 0.0
    assert frequencies == pytest.approx([1 / 3, 0.0, 1 / 3, 0.0, 1 / 3], abs=0.01)


def test_max_random_sampling_distribution():
    weights = pf_ppo_weights(torch.tensor([1.0, 0.0, -1.0, 1.0]), reweight_method="max_random")
    torch.testing.assert_close(weights, torch.tensor([0.4, 0.1, 0.1, 0.4]))
    assert draw_frequencies([1.0, 0.0, -1.0, 1.0], "max_random") == pytest.approx(
        [0.4, 0.1, 0.1, 0.4], abs=0.01
    )


def test_same_generator_seed_gives_same_draws():
    scores = torch.tensor([0.1, 0.9, 0.4, 0.7])
    first = pf_ppo_resample_indices(scores, reweight_method="pow", generator=torch.Generator().manual_seed(5))
    again = pf_ppo_resample_indices(scores, reweight_method="pow", generator=torch.Generator().manual_seed(5))
    assert first.tolist() == again.tolist()
    assert all(0 <= i < 4 for i in first.tolist())


def test_unknown_method_names_the_valid_choices():
    with pytest.raises(ValueError, match="pow.*max_min.*max_random"):
        pf_ppo_resample_indices(torch.ones(3), reweight_method="softmax")
