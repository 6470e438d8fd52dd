"""The addition task's composite reward."""

import math

import pytest

from ppoflow.engine.rewards import (
    NO_ANSWER,
    InvalidRewardError,
    addition_answer,
    addition_components,
    answer_of_result,
    combine_components,
    error_rate,
    score_of_result,
)

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


def test_addition_answer_is_what_maj_votes_on():
    assert [addition_answer(r) for r in ("7", " 12 ", "07", "7 +", "", "1234")] == [
        "7",
        "12",
        "7",
        NO_ANSWER,
        NO_ANSWER,
        NO_ANSWER,
    ]


def test_a_custom_results_answer_is_its_pred_as_text():
    assert [answer_of_result(r) for r in (0.5, {"score": 1}, {"score": 1, "pred": 12}, {"pred": "x"})] == [
        None,
        None,
        "12",
        "x",
    ]


def test_weight_for_a_component_the_function_does_not_return_is_an_error():
    with pytest.raises(KeyError, match="reward weights name \\['fluency'\\]"):
        combine_components({"correctness": 1.0}, {"correctness": 0.9, "fluency": 0.1})


def test_non_finite_component_is_an_error():
    with pytest.raises(ValueError, match="'format' is nan"):
        combine_components({"correctness": 1.0, "format": float("nan")}, WEIGHTS)


def test_unweighted_components_do_not_count():
    assert combine_components({"correctness": 1.0, "format": 1.0, "extra": 5.0}, WEIGHTS) == 1.0


@pytest.mark.parametrize(
    ("result", "score", "components"),
    [
        (0.5, 0.5, {"score": 0.5}),
        (1, 1.0, {"score": 1.0}),
        (True, 1.0, {"score": 1.0}),
        ({"score": -1, "acc": False, "pred": "12"}, -1.0, {"score": -1.0, "acc": 0.0}),
    ],
)
def test_verl_result_convention(result, score, components):
    assert score_of_result(result) == (score, components)


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (float("nan"), "returned nan"),
        (float("inf"), "returned inf"),
        ("0.5", "returned '0.5' \\(str\\); expected a number or a dict"),
        (None, "returned None \\(NoneType\\)"),
        ({"acc": 1.0}, "without a numeric 'score' \\(keys: \\['acc'\\]\\)"),
        ({"score": "1"}, "without a numeric 'score'"),
        ({"score": 1.0, "f1": float("nan")}, "returned nan for 'f1'"),
    ],
)
def test_unusable_results_are_errors(result, message):
    with pytest.raises(InvalidRewardError, match=message):
        score_of_result(result)


def test_error_rate_is_the_share_of_rows_with_an_error():
    assert error_rate([None, "boom", None, "x"]) == 0.5
    assert error_rate([]) == 0.0


def test_every_built_in_reward_returns_the_components_weights_may_name():
    from ppoflow.engine.gsm8k import gsm8k_components
    from ppoflow.engine.names import BUILTIN_REWARD_COMPONENTS

    assert set(addition_components("7", "7")) == set(BUILTIN_REWARD_COMPONENTS)
    for method in ("strict", "flexible"):
        assert set(gsm8k_components("#### 7", "7", method)) == set(BUILTIN_REWARD_COMPONENTS)


def test_overlong_penalty_hand_numbers():
    """DAPO's overlong shaping: 0 until the last `buffer` tokens before the limit, then falling
    linearly to −penalty_factor at it (verl's DAPO reward manager)."""
    from types import SimpleNamespace

    from ppoflow.engine.rewards import overlong_penalty

    buffer = SimpleNamespace(buffer=4, penalty_factor=1.0, max_response_length=20)
    assert [overlong_penalty(n, buffer) for n in (10, 16, 17, 18, 20)] == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(20, SimpleNamespace(buffer=4, penalty_factor=0.5, max_response_length=20)) == -0.5
