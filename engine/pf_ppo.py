"""PF-PPO batch resampling (Shen et al. 2024, "Policy Filtration in RLHF", arXiv:2409.06957), as verl 0.9.1.

The batch is resampled with replacement, each row drawn with probability ∝ a weight of its score; the
caller gathers every per-row tensor with the returned ids and records them.
"""

from typing import get_args

import torch
from torch import Tensor

from .names import PFReweightMethod

PF_REWEIGHT_METHODS: tuple[str, ...] = get_args(PFReweightMethod)
MIN_WEIGHT = 1e-8


def pf_ppo_weights(scores: Tensor, *, reweight_method: PFReweightMethod, weight_pow: float = 2.0) -> Tensor:
    """Unnormalised sampling weight of each row, clamped to ≥ 1e-8.

    scores: (N,) sequence scores s_i. "pow": |s_i|^weight_pow; "max_min": 1 for rows holding the batch's
    max or min score, else 0; "max_random": 0.4 for rows holding the max score, else 0.1. Returns (N,).
    """
    match reweight_method:
        case "pow":
            weights = scores.abs().pow(weight_pow)
        case "max_min":
            extreme = (scores == scores.max()) | (scores == scores.min())
            weights = extreme.to(scores.dtype)
        case "max_random":
            weights = torch.where(scores == scores.max(), 0.4, 0.1).to(scores.dtype)
        case _:
            raise ValueError(
                f"unknown pf_ppo reweight_method {reweight_method!r}; "
                f"valid choices: {', '.join(PF_REWEIGHT_METHODS)}"
            )
    return weights.clamp(min=MIN_WEIGHT)


def pf_ppo_resample_indices(
    scores: Tensor,
    *,
    reweight_method: PFReweightMethod,
    weight_pow: float = 2.0,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Draw N row ids with replacement, row i with probability ∝ `pf_ppo_weights(scores)[i]`.

    scores: (N,) sequence scores (Σ_t token_level_scores). generator: for reproducible draws; it must live
    on scores' device. Returns a LongTensor (N,) of row ids in [0, N).
    """
    weights = pf_ppo_weights(scores.float(), reweight_method=reweight_method, weight_pow=weight_pow)
    return torch.multinomial(weights, scores.shape[0], replacement=True, generator=generator)
