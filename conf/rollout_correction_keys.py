"""The syntax of verl's algorithm.rollout_correction thresholds and rejection criteria: parsed here, at
load, into numbers, so that a bad one is a ConfigError naming its key (the math takes the numbers:
engine/rollout_correction.py)."""

from __future__ import annotations

from typing import get_args

from ppoflow.engine.names import RolloutRSOption

RS_OPTIONS: tuple[str, ...] = get_args(RolloutRSOption)


def parse_is_threshold(spec: float | str) -> tuple[float, float | None]:
    """rollout_is_threshold → (upper, lower or None): a number u, or 'lower_upper' (IcePop)."""
    if isinstance(spec, bool):
        raise ValueError("a number or 'lower_upper', not a boolean")
    if isinstance(spec, int | float):
        upper, lower = float(spec), None
    else:
        text = spec.strip()
        if "_" in text:
            low_text, _, high_text = text.partition("_")
            lower, upper = _number(low_text, spec), _number(high_text, spec)
        else:
            upper, lower = _number(text, spec), None
    if not upper > 0:
        raise ValueError(f"the upper bound must be > 0, got {upper}")
    if lower is not None and not 0 < lower <= upper:
        raise ValueError(f"'lower_upper' needs 0 < lower ≤ upper, got {spec!r}")
    return upper, lower


def rs_options(spec: str) -> tuple[str, ...]:
    """rollout_rs → its criteria, in order, duplicates dropped."""
    options: list[str] = []
    for option in (part.strip() for part in spec.split(",")):
        if not option:
            continue
        if option not in RS_OPTIONS:
            raise ValueError(
                f"unknown rejection criterion {option!r}; valid choices: {', '.join(RS_OPTIONS)}"
            )
        if option not in options:
            options.append(option)
    if not options:
        raise ValueError(f"at least one criterion ({', '.join(RS_OPTIONS)})")
    return tuple(options)


def parse_rs_thresholds(
    options: tuple[str, ...], spec: float | str | None
) -> tuple[tuple[str, float, float | None], ...]:
    """(option, upper, lower) per criterion from rollout_rs_threshold: one value for all, or one per
    criterion; *_k1 criteria take 'lower_upper' ratio bounds (u alone: 1/u to u), the others an upper
    bound."""
    if spec is None:
        raise ValueError("it is not set: give a bound for every criterion (or one for all)")
    parts = (
        [str(spec)] if isinstance(spec, int | float) else [p.strip() for p in spec.split(",") if p.strip()]
    )
    if len(parts) not in (1, len(options)):
        raise ValueError(
            f"rollout_rs_threshold has {len(parts)} values for {len(options)} rollout_rs criteria: give "
            "one for all, or one per criterion"
        )
    parts = parts * len(options) if len(parts) == 1 else parts
    criteria = []
    for option, part in zip(options, parts, strict=True):
        if option.endswith("k1"):
            if "_" in part:
                low_text, _, high_text = part.partition("_")
                lower, upper = _number(low_text, part), _number(high_text, part)
            else:
                upper = _number(part, part)
                lower = 1.0 / upper if upper > 0 else upper
            if not (lower > 0 and upper > 0 and lower <= upper):
                raise ValueError(f"{option} needs ratio bounds 0 < lower ≤ upper, got {part!r}")
            criteria.append((option, upper, lower))
        else:
            if "_" in part:
                raise ValueError(f"{option} takes one upper bound, not {part!r}")
            upper = _number(part, part)
            if not upper > 0:
                raise ValueError(f"{option} needs an upper bound > 0, got {part!r}")
            criteria.append((option, upper, None))
    return tuple(criteria)


def _number(text: str, spec: object) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"not a number in {spec!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"a finite number, got {spec!r}")
    return value
