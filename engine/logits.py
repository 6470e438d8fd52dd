"""Token log-probabilities and entropy from logits, with bounded float temporaries.

Callers divide logits by the sampling temperature first. Inputs of three or more dimensions are processed
in chunks of leading rows small enough that the float temporaries stay bounded (verl 0.9.1
`logprobs_from_logits_v2` goes one row at a time). Half-precision logits are upcast to float32 per chunk,
and the results are float32; float32 and float64 logits keep their dtype.

The log-probabilities' backward pass is written out (`_TokenLogProbs`): autograd's own graph for
`logits[labels] − logsumexp(logits)` makes four (…, V) temporaries in the backward pass, besides the
saved logits (the softmax, its product with the gradient, the scattered label gradient and their sum),
at the moment a training step's memory peaks; this one makes the gradient in a single (…, V) buffer.
For float32 and float64 logits it is the same arithmetic, bit for bit.
"""

from collections.abc import Callable

import torch
from torch import Tensor


def _compute_dtype(logits: Tensor) -> torch.dtype:
    """float32 for half-precision logits, else the logits' own dtype."""
    return logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32


CHUNK_ELEMENTS = 1 << 24
"""Most logits elements one temporary may hold (64 MiB of float32)."""


def _row_chunks(logits: Tensor) -> int:
    """Leading rows per chunk of logits (…, V), three or more dimensions, whose temporaries stay
    under CHUNK_ELEMENTS."""
    return max(1, CHUNK_ELEMENTS // max(1, logits[0].numel()))


def _per_row(fn: Callable[[Tensor], Tensor], logits: Tensor) -> Tensor:
    """fn over the last dimension of logits (…, V), in chunks of leading rows whose temporaries stay
    under CHUNK_ELEMENTS (one row at a time for large vocabularies, the whole batch for small ones)."""
    dtype = _compute_dtype(logits)
    if logits.dim() < 3:
        return fn(logits.to(dtype))
    return torch.cat([fn(chunk.to(dtype)) for chunk in logits.split(_row_chunks(logits))])


def _logsumexp(z: Tensor) -> Tensor:
    return torch.logsumexp(z, dim=-1)


class _TokenLogProbs(torch.autograd.Function):
    """log softmax(logits)[labels] with a backward pass of one (…, V) buffer: the gradient
    g · (onehot(labels) − softmax(logits)), computed chunk by chunk in place."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor) -> Tensor:
        index = labels.unsqueeze(-1)
        picked = logits.gather(-1, index).squeeze(-1).to(_compute_dtype(logits))
        normalizer = _per_row(_logsumexp, logits)
        ctx.save_for_backward(logits, index, normalizer)
        return picked - normalizer

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        logits, index, normalizer = ctx.saved_tensors
        dtype = _compute_dtype(logits)
        grad_logits = torch.empty_like(logits)
        tensors = (grad_logits, logits, normalizer, grad, index)
        if logits.dim() >= 3:
            rows = _row_chunks(logits)
            chunks = zip(*(t.split(rows) for t in tensors), strict=True)
        else:
            chunks = [tensors]
        for out, z, lse, g, idx in chunks:
            # −g · exp(z − logsumexp z), then + g at the label: autograd's two terms, in its order;
            # in the gradient's own memory unless half-precision logits need a float32 temporary
            term = out if out.dtype == dtype else torch.empty_like(out, dtype=dtype)
            torch.sub(z, lse.unsqueeze(-1), out=term).exp_().mul_(-g.unsqueeze(-1))
            term.scatter_add_(-1, idx, g.unsqueeze(-1).to(dtype))
            if term is not out:
                out.copy_(term)
        return grad_logits, None


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """log softmax(logits)[labels], as logits[labels] − logsumexp(logits).

    logits: (…, V), finite. labels: (…) integer token ids in [0, V).
    Returns (…): the log-probability of each label, with gradient to logits.
    """
    if logits.requires_grad and torch.is_grad_enabled():
        return _TokenLogProbs.apply(logits, labels)
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1).to(_compute_dtype(logits))
    return picked - _per_row(_logsumexp, logits)


def _entropy(z: Tensor) -> Tensor:
    """logsumexp(z) − Σ softmax(z)·z over the last dimension."""
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def _entropy_no_grad(z: Tensor) -> Tensor:
    """`_entropy` with the product taken in place: one (…, V) temporary instead of two."""
    return torch.logsumexp(z, dim=-1) - torch.softmax(z, dim=-1).mul_(z).sum(dim=-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy H = logsumexp(z) − Σ softmax(z)·z of the categorical distribution of each logits row.

    logits: (…, V), finite (a −inf logit would give 0·(−inf) = NaN). Returns (…), in nats.
    """
    with_grad = logits.requires_grad and torch.is_grad_enabled()
    return _per_row(_entropy if with_grad else _entropy_no_grad, logits)


def _sum_pi_squared(z: Tensor) -> Tensor:
    return torch.softmax(z, dim=-1).square().sum(dim=-1)


def sum_pi_squared_from_logits(logits: Tensor) -> Tensor:
    """Σ_v softmax(logits)_v² of each logits row (…, V) → (…), without gradient: verl's
    sum_pi_squared, the collision probability of the next token (1 for a certain one, 1/V for a
    uniform one)."""
    with torch.no_grad():
        return _per_row(_sum_pi_squared, logits)
