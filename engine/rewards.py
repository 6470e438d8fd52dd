"""Rule rewards as weighted sums of named components.

`reward = Σ_k w_k · component_k` (the seed's `w1·correctness + w2·format + …`). Each component is a
number in [0, 1] and is stored and reported on its own, so a run shows *why* its score moved.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

_NUMBER = re.compile(r"\d{1,3}")
NO_ANSWER = "[INVALID]"
"""The answer (`pred`) of a response from which the built-in rewards extract none; one answer like
any other in majority voting (verl's math_dapo reward says the same for a response without one)."""


def addition_components(solution_str: str, ground_truth: str) -> dict[str, float]:
    """The built-in addition task: `format` = the response is a bare number (after stripping
    whitespace); `correctness` = that number equals the ground truth."""
    answer = solution_str.strip()
    well_formed = _NUMBER.fullmatch(answer) is not None
    correct = well_formed and int(answer) == int(ground_truth)
    return {"correctness": float(correct), "format": float(well_formed)}


def addition_answer(solution_str: str) -> str:
    """The built-in addition task's answer (`pred`, what maj@k votes on): the number a well-formed
    response gives, without leading zeros, else NO_ANSWER."""
    answer = solution_str.strip()
    return str(int(answer)) if _NUMBER.fullmatch(answer) else NO_ANSWER


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


class InvalidRewardError(ValueError):
    """A reward function returned something that is not a usable reward."""


def score_of_result(result: object) -> tuple[float, dict[str, float]]:
    """verl's convention for what a custom `compute_score` returns, as (score, components).

    A number is the score (and the component "score"). A dict's "score" key is the score; every
    numeric value in it (the score included) is a component, other values (strings, …) are dropped.
    The score and every component must be finite; anything else raises InvalidRewardError.
    """
    if isinstance(result, Mapping):
        score = _number(result.get("score"))
        if score is None:
            raise InvalidRewardError(
                f"returned a dict without a numeric 'score' (keys: {sorted(map(str, result))})"
            )
        components = {str(k): v for k, v in ((k, _number(v)) for k, v in result.items()) if v is not None}
    else:
        score = _number(result)
        if score is None:
            raise InvalidRewardError(
                f"returned {_preview(result)} ({type(result).__name__}); "
                "expected a number or a dict with a numeric 'score'"
            )
        components = {"score": score}
    for name, value in components.items():
        if not math.isfinite(value):
            raise InvalidRewardError(f"returned {value}" + ("" if name == "score" else f" for '{name}'"))
    return score, components


def answer_of_result(result: object) -> str | None:
    """A custom `compute_score` result's answer for majority voting: a dict's "pred" (verl's
    reward_extra_info key), as text; None when it has none."""
    pred = result.get("pred") if isinstance(result, Mapping) else None
    return None if pred is None else str(pred)


def error_rate(errors: Sequence[str | None]) -> float:
    """Share of rows whose scoring failed (a non-null error); 0.0 for no rows."""
    return sum(e is not None for e in errors) / len(errors) if errors else 0.0


def _number(value: object) -> float | None:
    """`value` as a float when it is a real number (bool, int, float, a numpy or 0-d torch scalar)."""
    if isinstance(value, str | bytes) or not hasattr(type(value), "__float__"):
        return None
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _preview(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def overlong_penalty(length: int, settings) -> float:
    """DAPO's overlong reward shaping (verl's DAPO reward manager): with buffer b, penalty factor f and
    response limit L_max, a response of `length` tokens gets min(0, −(length − (L_max − b)) / b · f):
    0 until the last b tokens, then falling linearly to −f at L_max. `settings`: buffer,
    penalty_factor, max_response_length."""
    exceed = length - (settings.max_response_length - settings.buffer)
    return min(-exceed / settings.buffer * settings.penalty_factor, 0.0)
