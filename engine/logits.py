"""Token log-probabilities and entropy from logits, one (T, V) float temporary at a time.

Callers divide logits by the sampling temperature first. Inputs of three or more dimensions are processed
in chunks of leading rows small enough that the float temporaries stay bounded (verl 0.9.1
`logprobs_from_logits_v2` goes one row at a time). Half-precision logits are upcast to float32 per row,
and the results are float32; float32 and float64 logits keep their dtype.
"""

from collections.abc import Callable

import torch
from torch import Tensor


def _compute_dtype(logits: Tensor) -> torch.dtype:
    """float32 for half-precision logits, else the logits' own dtype."""
    return logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32


CHUNK_ELEMENTS = 1 << 24
"""Most logits elements one temporary may hold (64 MiB of float32)."""


def _per_row(fn: Callable[[Tensor], Tensor], logits: Tensor) -> Tensor:
    """fn over the last dimension of logits (…, V), in chunks of leading rows whose temporaries stay
    under CHUNK_ELEMENTS (one row at a time for large vocabularies, the whole batch for small ones)."""
    dtype = _compute_dtype(logits)
    if logits.dim() < 3:
        return fn(logits.to(dtype))
    rows = max(1, CHUNK_ELEMENTS // max(1, logits[0].numel()))
    return torch.cat([fn(chunk.to(dtype)) for chunk in logits.split(rows)])


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """log softmax(logits)[labels], as logits[labels] − logsumexp(logits).

    logits: (…, V), finite. labels: (…) integer token ids in [0, V).
    Returns (…): the log-probability of each label, with gradient to logits.
    """
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1).to(_compute_dtype(logits))
    return picked - _per_row(lambda z: torch.logsumexp(z, dim=-1), logits)


def _entropy(z: Tensor) -> Tensor:
    """logsumexp(z) − Σ softmax(z)·z over the last dimension."""
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy H = logsumexp(z) − Σ softmax(z)·z of the categorical distribution of each logits row.

    logits: (…, V), finite (a −inf logit would give 0·(−inf) = NaN). Returns (…), in nats.
    """
    return _per_row(_entropy, logits)
