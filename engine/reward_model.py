"""Training a reward model from labelled responses, and measuring how well it separates them.

A reward model (`models.load_reward_model`) scores a whole (prompt, response) sequence: its `score`
head at the last valid token (`forward.score_forward`). `models.reward_model_from_policy` starts one
from a causal LM (its backbone, a zero score head); `train_reward_model` fits it by pointwise binary
cross-entropy on responses labelled 1 (good) or 0 (bad): the simplest recipe that turns labels into
a reward signal (a preference, Bradley–Terry, recipe trains the same model on pairs).
"""

from __future__ import annotations

import torch

from .forward import SequenceBatch, score_forward

HEAD_LR_FACTOR = 10.0
"""The new score head starts from zero and learns at this multiple of the backbone's learning rate
(on the tiny addition task: held-out AUC 0.84 after 150 steps, against 0.78 at one learning rate)."""


def train_reward_model(
    model: torch.nn.Module,
    batch: SequenceBatch,
    labels: torch.Tensor,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> list[float]:
    """Fit `model` so that sigmoid(score) predicts `labels` (N,) in {0, 1}: `steps` AdamW steps
    (weight decay 0; the score head at HEAD_LR_FACTOR × lr) on the binary cross-entropy of
    `batch_size` rows drawn with replacement from `batch` (N rows), deterministic for a seed.
    Returns each step's loss; leaves the model in eval mode."""
    if len(batch) == 0:
        raise ValueError("no labelled responses to train the reward model on")
    generator = torch.Generator().manual_seed(seed)
    head = {id(p) for p in model.score.parameters()}
    trained = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in trained if id(p) not in head], "lr": lr},
        {"params": [p for p in trained if id(p) in head], "lr": lr * HEAD_LR_FACTOR},
    ]
    optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        rows = torch.randint(len(batch), (batch_size,), generator=generator)
        logits = score_forward(model, batch.select(rows))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels[rows].to(logits).float())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return losses


def separation_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC of `scores` (N,) for binary `labels` (N,): the share of (label 1, label 0) pairs whose
    1 scores higher, ties counting ½ (Mann–Whitney). 0.5 is chance, 1.0 separates them all."""
    positive, negative = scores[labels == 1], scores[labels == 0]
    if len(positive) == 0 or len(negative) == 0:
        raise ValueError("the AUC needs responses of both labels")
    diff = positive[:, None] - negative[None, :]
    return float(((diff > 0).double() + 0.5 * (diff == 0).double()).mean())
