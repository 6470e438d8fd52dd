import math

import pytest
import torch

from ppoflow.engine.logits import entropy_from_logits, logprobs_from_logits


@pytest.mark.parametrize("shape", [(7,), (4, 7), (3, 4, 7)])
def test_logprobs_equal_log_softmax_gather(shape):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(shape, generator=gen, dtype=torch.float64)).requires_grad_(True)
    labels = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    got = logprobs_from_logits(logits, labels)
    (grad_got,) = torch.autograd.grad(got.sum(), logits)
    expected = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    (grad_expected,) = torch.autograd.grad(expected.sum(), logits)
    assert got.shape == shape[:-1]
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(grad_got, grad_expected)


def test_logprobs_of_bfloat16_logits_are_float32():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 11, generator=gen).to(torch.bfloat16)
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    got = logprobs_from_logits(logits, labels)
    assert got.dtype == torch.float32
    expected = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got, expected)


def test_logprobs_hand_number():
    # log softmax([0, ln 3])[1] = ln(3/4)
    logits = torch.tensor([[0.0, math.log(3.0)]])
    assert logprobs_from_logits(logits, torch.tensor([1])).item() == pytest.approx(math.log(0.75))


def test_entropy_of_uniform_logits_is_log_vocab():
    entropy = entropy_from_logits(torch.full((2, 3, 50), 1.7))
    torch.testing.assert_close(entropy, torch.full((2, 3), math.log(50.0)))


def test_entropy_of_a_two_point_distribution():
    # probabilities [1/4, 3/4]: H = −(¼ ln ¼ + ¾ ln ¾) = 0.562335
    logits = torch.tensor([0.0, math.log(3.0)])
    assert entropy_from_logits(logits).item() == pytest.approx(0.5623351446)


@pytest.mark.parametrize("shape", [(9,), (4, 9), (2, 3, 9)])
def test_entropy_equals_minus_sum_p_log_p(shape):
    logits = 4 * torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    log_p = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(entropy_from_logits(logits), -(log_p.exp() * log_p).sum(-1))


def test_entropy_of_bfloat16_logits_is_float32():
    logits = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    entropy = entropy_from_logits(logits)
    assert entropy.dtype == torch.float32
    log_p = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(entropy, -(log_p.exp() * log_p).sum(-1))
