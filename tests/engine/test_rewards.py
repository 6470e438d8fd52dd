"""The addition task's composite reward."""

import math

import pytest

from ppoflow.engine.rewards import addition_components, combine_components

WEIGHTS = {"correctness": 0.9, "format": 0.1}


@pytest.mark.parametrize(
    ("response", "truth", "components", "score"),
    [
        ("7", "7", {"correctness": 1.0, "format": 1.0}, 1.0),
        (" 12 ", "12", {"correctness": 1.0, "format": 1.0}, 1.0),
        ("8", "7", {"correctness": 0.0, "format": 1.0}, 0.1),
        ("7 +", "7", {"correctness": 0.0, "format": 0.0}, 0.0),
        ("", "0", {"correctness": 0.0, "format": 0.0}, 0.0),
        ("07", "7", {"correctness": 1.0, "format": 1.0}, 1.0),
    ],
)
def test_addition_reward_components_and_weighted_score(response, truth, components, score):
    assert addition_components(response, truth) == components
    assert math.isclose(combine_components(components, WEIGHTS), score)


def test_weight_for_a_component_the_function_does_not_return_is_an_error():
    with pytest.raises(KeyError, match="reward weights name \\['fluency'\\]"):
        combine_components({"correctness": 1.0}, {"correctness": 0.9, "fluency": 0.1})


def test_non_finite_component_is_an_error():
    with pytest.raises(ValueError, match="'format' is nan"):
        combine_components({"correctness": 1.0, "format": float("nan")}, WEIGHTS)


def test_unweighted_components_do_not_count():
    assert combine_components({"correctness": 1.0, "format": 1.0, "extra": 5.0}, WEIGHTS) == 1.0
