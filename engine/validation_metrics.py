"""Validation metrics as verl 0.9.1 reports them: `process_validation_metrics` (metric_utils.py) and the
trainer's naming (`RayPPOTrainer._val_metrics_update`).

Inputs are one entry per validation sample (N samples: a prompt's n = val_kwargs.n answers). Each
variable — "reward" (the score), each reward component, as verl's reward_extra_info keys — is
summarised per prompt, then averaged over a data source's prompts (in order of first appearance):

    mean@n, std@n                 of the prompt's n values (std with ddof 0, as np.std), std when n > 1
    best@k/{mean,std}             bootstrap: 1000 draws of k of the n values with replacement; the
    worst@k/{mean,std}            mean and std (ddof 0) over draws of each draw's max, min, and the
    maj@k/{mean,std}              value of its majority answer (the answer most draws share; ties go to
                                  the answer seen first in the draw, whose first value is taken)

for k = 2, 4, 8, … below n, and n itself. maj@k needs an answer (`pred`) for every sample of the
prompt; a prompt with a missing one has no maj@k (verl 0.9.1). Every (n, k) uses the same draws:
numpy's legacy generator seeded with 42 (`RandomState(42).choice(n, (1000, k))`, which is what
verl's `np.random.seed(42); np.random.choice(...)` draws), so the numbers equal verl's.
Section: `val-core` for the core variable ("acc" when a component has that name, else "reward") and
its mean@, best@ and maj@ metrics at the source's largest n for that variable; `val-aux` otherwise.
A reward function that returns a number has its score recorded as "acc" too (`score_as_acc`), as
verl 0.9.1's reward managers do (`reward_extra_info["acc"] = score`): its headline is then
`val-core/<source>/acc/mean@n`, with `reward` (the same values) in val-aux.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np

BOOTSTRAP_SEED = 42
"""verl's `process_validation_metrics(seed=42)`."""
BOOTSTRAP_DRAWS = 1000
"""verl's n_bootstrap."""


def bootstrap_sizes(n: int) -> list[int]:
    """The k of best@k, worst@k and maj@k for a prompt with n samples: 2, 4, 8, … below n, then n;
    none for n ≤ 1."""
    if n <= 1:
        return []
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return [*sizes, n]


def majority_values(values: np.ndarray, votes: np.ndarray) -> np.ndarray:
    """Per draw, the value of the first sample whose answer is the draw's majority (verl's
    `calc_maj_val`: the most frequent answer, ties to the one that appears first).

    values: (D, k) float, the drawn samples' values. votes: (D, k) int, their answers as codes.
    Returns (D,). The earliest position whose answer has the draw's largest count holds the first
    occurrence of the answer that appears first among the most frequent ones.
    """
    counts = (votes[:, :, None] == votes[:, None, :]).sum(axis=2)
    first = np.argmax(counts == counts.max(axis=1, keepdims=True), axis=1)
    return values[np.arange(len(values)), first]


class _Draws:
    """The bootstrap indices (BOOTSTRAP_DRAWS, k) into n samples, drawn once per (n, k) per call."""

    def __init__(self, seed: int):
        self.seed, self.cache = seed, {}

    def __call__(self, n: int, k: int) -> np.ndarray:
        if (n, k) not in self.cache:
            rng = np.random.RandomState(self.seed)
            self.cache[(n, k)] = rng.choice(n, size=(BOOTSTRAP_DRAWS, k), replace=True)
        return self.cache[(n, k)]


def _mean_std(name: str, per_draw: np.ndarray) -> dict[str, float]:
    return {f"{name}/mean": float(np.mean(per_draw)), f"{name}/std": float(np.std(per_draw))}


def prompt_metrics(values: np.ndarray, votes: np.ndarray | None, draws: _Draws) -> dict[str, float]:
    """One prompt's statistics of one variable. values: (n,) float; votes: (n,) int answer codes, or
    None when some sample has no answer (no maj@k then)."""
    n = len(values)
    out = {f"mean@{n}": float(np.mean(values))}
    if n < 2:
        return out
    out[f"std@{n}"] = float(np.std(values))
    for k in bootstrap_sizes(n):
        index = draws(n, k)
        drawn = values[index]
        out |= _mean_std(f"best@{k}", drawn.max(axis=1)) | _mean_std(f"worst@{k}", drawn.min(axis=1))
        if votes is not None:
            out |= _mean_std(f"maj@{k}", majority_values(drawn, votes[index]))
    return out


def _vote_codes(preds: Sequence[str | None]) -> np.ndarray | None:
    """Answers as integer codes (equal answers, equal codes); None when one is missing."""
    if any(p is None for p in preds):
        return None
    codes: dict[str, int] = {}
    return np.array([codes.setdefault(p, len(codes)) for p in preds])


def _sample_n(name: str) -> int:
    """k of a metric name such as best@4/mean."""
    return int(name.split("@")[1].split("/")[0])


def _section(var: str, core_var: str, name: str, n_max: int) -> str:
    core = var == core_var and name.startswith(("mean", "maj", "best")) and _sample_n(name) == n_max
    return "val-core" if core else "val-aux"


def compute_validation_metrics(
    data_sources: Sequence[str],
    group_keys: Sequence[str],
    scores: Sequence[float],
    components: Sequence[Mapping[str, float]],
    preds: Sequence[str | None] | None = None,
    *,
    seed: int = BOOTSTRAP_SEED,
    score_as_acc: bool = False,
) -> dict[str, float]:
    """verl's validation metrics, `{val-core|val-aux}/<data_source>/<variable>/<metric>` (module notes).

    data_sources, group_keys: (N,) each sample's dataset and prompt. scores: (N,) its reward.
    components: (N,) its reward components (the same names in every row), each a variable of its own.
    preds: (N,) its answer for majority voting (None: no answer); None for no maj@k at all.
    score_as_acc: the scores come from a function that returns a number: also the variable "acc"
    (unless a component has that name).
    """
    names = list(components[0]) if components else []
    if len(components) != len(scores) or any(c.keys() != components[0].keys() for c in components):
        raise ValueError("components must hold one dict per score, all with the same keys")
    variables = {"reward": np.asarray(scores, dtype=np.float64)}
    if score_as_acc and "acc" not in names:
        variables["acc"] = variables["reward"]
    variables |= {name: np.array([c[name] for c in components], dtype=np.float64) for name in names}
    prompts: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, (source, key) in enumerate(zip(data_sources, group_keys, strict=True)):
        prompts[source][key].append(i)
    draws, metrics = _Draws(seed), {}
    for source, by_prompt in prompts.items():
        per_var: dict[str, dict[str, list[float]]] = {var: defaultdict(list) for var in variables}
        for rows in by_prompt.values():
            votes = _vote_codes([preds[i] for i in rows]) if preds is not None else None
            for var, values in variables.items():
                for name, value in prompt_metrics(values[rows], votes, draws).items():
                    per_var[var][name].append(value)
        core_var = "acc" if "acc" in variables else "reward"
        for var, stats in per_var.items():
            n_max = max(_sample_n(name) for name in stats)
            for name, values in stats.items():
                section = _section(var, core_var, name, n_max)
                metrics[f"{section}/{source}/{var}/{name}"] = float(np.mean(values))
    return metrics
