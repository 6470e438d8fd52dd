"""Rule rewards as weighted sums of named components.

`reward = Σ_k w_k · component_k` (the seed's `w1·correctness + w2·format + …`). Each component is a
number in [0, 1] and is stored and reported on its own, so a run shows *why* its score moved.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

_NUMBER = re.compile(r"\d{1,3}")


def addition_components(solution_str: str, ground_truth: str) -> dict[str, float]:
    """The built-in addition task: `format` = the response is a bare number (after stripping
    whitespace); `correctness` = that number equals the ground truth."""
    answer = solution_str.strip()
    well_formed = _NUMBER.fullmatch(answer) is not None
    correct = well_formed and int(answer) == int(ground_truth)
    return {"correctness": float(correct), "format": float(well_formed)}


def combine_components(components: Mapping[str, float], weights: Mapping[str, float]) -> float:
    """Σ weights[k] · components[k]. Every weighted component must be present and finite, so a
    typo in a weight name is an error rather than a silent zero."""
    missing = sorted(set(weights) - set(components))
    if missing:
        raise KeyError(
            f"reward weights name {missing}, but the reward function returned only {sorted(components)}"
        )
    total = 0.0
    for name, weight in weights.items():
        value = float(components[name])
        if not math.isfinite(value):
            raise ValueError(f"reward component '{name}' is {value}")
        total += weight * value
    return total
