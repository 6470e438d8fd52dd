"""verl 0.9.1's validation metrics written out plainly, as the tests' reference: what
`verl/trainer/ppo/metric_utils.py` (`process_validation_metrics`, `bootstrap_metric`, `calc_maj_val`)
and `RayPPOTrainer._val_metrics_update` compute from one entry per validation sample. Independent of
ppoflow's vectorised version: one bootstrap per (prompt, variable, k), each reseeding numpy's global
generator with 42 and drawing the indices as verl does, and a vote count per draw."""

from __future__ import annotations

from collections import defaultdict

import numpy as np


def _bootstrap(values: list, k: int, reduce) -> tuple[float, float]:
    """verl's bootstrap_metric: 1000 draws of k items with replacement under np.random.seed(42); the
    mean and std (ddof 0) of `reduce` over the draws. numpy's global state is restored after."""
    saved = np.random.get_state()
    try:
        np.random.seed(42)
        draws = np.random.choice(len(values), size=(1000, k), replace=True)
    finally:
        np.random.set_state(saved)
    results = np.array([reduce([values[i] for i in draw]) for draw in draws], dtype=np.float64)
    return float(np.mean(results)), float(np.std(results))


def _majority(pairs: list[tuple[float, str]]) -> float:
    """verl's calc_maj_val: the first value of the answer given most often (ties: the answer seen first)."""
    by_answer: dict[str, list[float]] = {}
    for value, answer in pairs:
        by_answer.setdefault(answer, []).append(value)
    top = max(by_answer, key=lambda answer: len(by_answer[answer]))
    return by_answer[top][0]


def _sizes(n: int) -> list[int]:
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return [*sizes, n]


def _prompt_stats(values: list[float], preds: list | None) -> dict[str, float]:
    n = len(values)
    stats = {f"mean@{n}": float(np.mean(values))}
    if n == 1:
        return stats
    stats[f"std@{n}"] = float(np.std(values))
    for k in _sizes(n):
        for name, reduce in (("best", max), ("worst", min)):
            stats[f"{name}@{k}/mean"], stats[f"{name}@{k}/std"] = _bootstrap(values, k, reduce)
        if preds is not None and all(p is not None for p in preds):
            pairs = list(zip(values, preds, strict=True))
            stats[f"maj@{k}/mean"], stats[f"maj@{k}/std"] = _bootstrap(pairs, k, _majority)
    return stats


def verl_validation_metrics(
    data_sources: list[str], uids: list[str], variables: dict[str, list[float]], preds: list | None = None
) -> dict[str, float]:
    """`{val-core|val-aux}/<source>/<variable>/<metric>` as verl logs it. variables: name → one value per
    sample ("reward" and the reward's extra infos); preds: each sample's answer, or None."""
    groups: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, (source, uid) in enumerate(zip(data_sources, uids, strict=True)):
        groups[source][uid].append(i)
    metrics = {}
    for source, prompts in groups.items():
        collected: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for rows in prompts.values():
            answers = [preds[i] for i in rows] if preds is not None else None
            for var, values in variables.items():
                for name, value in _prompt_stats([values[i] for i in rows], answers).items():
                    collected[var][name].append(value)
        core = "acc" if "acc" in collected else "reward"
        for var, stats in collected.items():
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in stats)
            for name, values in stats.items():
                is_core = var == core and name.startswith(("mean", "maj", "best")) and f"@{n_max}" in name
                metrics[f"{'val-core' if is_core else 'val-aux'}/{source}/{var}/{name}"] = float(
                    np.mean(values)
                )
    return metrics
