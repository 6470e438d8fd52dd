"""The built-in tools: the calculator's exact arithmetic and its refusals, verl's GSM8K answer tool,
and verl's truncation of long tool responses."""

import re
from fractions import Fraction

import pytest

from ppoflow.engine.tools import (
    ArgumentError,
    CalculatorTool,
    Gsm8kAnswerTool,
    ToolContext,
    evaluate_arithmetic,
    truncate_tool_text,
)


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("2+3", "5"),
        ("47 + 38", "85"),
        ("12 * (3 + 4)", "84"),
        ("-(2 - 5) * 2", "6"),
        ("7 / 2", "3.5"),
        ("1 / 3", "0.333333"),
        ("2 × 3 ÷ 4", "1.5"),
        ("0.1 + 0.2", "0.3"),
        ("((((1))))", "1"),
        ("100000000000.1", "100000000000.1"),  # exact: no float on the way
        ("1234567890123.45 + 0.01", "1234567890123.46"),
        ("-1/3000000", "0"),  # rounds to zero: no "-0"
        ("0.0000015", "0.000002"),  # half to even at the sixth place
        ("0.0000025", "0.000002"),
        ("-7/2", "-3.5"),
    ],
)
def test_calculator_results(expression, value):
    assert CalculatorTool().execute({"expression": expression}, ToolContext()).text == value


def test_numbers_are_exact_fractions():
    assert evaluate_arithmetic("0.1 + 0.2") == Fraction(3, 10)


@pytest.mark.parametrize(
    ("arguments", "reason"),
    [
        ({"expression": "__import__('os')"}, "not arithmetic"),
        ({"expression": "2 ** 3"}, "unexpected"),
        ({"expression": "1 / 0"}, "division by zero"),
        ({"expression": "(1 + 2"}, "without its ')'"),
        ({"expression": "1 +"}, "ends too early"),
        ({"expression": ""}, "empty"),
        ({"expression": "9" * 40}, "too large"),
        ({"expression": "1." + "1" * 40}, "too many digits after the point"),
        ({"expression": "99999999999 * 99999999999 * 99999999999"}, "too large"),
        ({"expression": "1+" * 150 + "1"}, "characters"),
        ({"expression": ["1"]}, "must be a string"),
        ({}, "must be a string"),
    ],
)
def test_calculator_refuses_what_is_not_bounded_arithmetic(arguments, reason):
    with pytest.raises(ArgumentError, match=re.escape(reason)):
        CalculatorTool().execute(arguments, ToolContext())


def test_deep_parentheses_within_the_length_limit_do_not_overflow_the_stack():
    assert evaluate_arithmetic("(" * 99 + "1" + ")" * 99) == 1


def test_gsm8k_tool_scores_as_verl_does():
    context = ToolContext(ground_truth="72")
    right = Gsm8kAnswerTool().execute({"answer": "72"}, context)
    assert (right.text, right.reward) == ("Current parsed answer='72' reward=1.0", 0.0)
    wrong = Gsm8kAnswerTool().execute({"answer": "#### 70"}, context)
    assert (wrong.text, wrong.reward) == ("Current parsed answer='#### 70' reward=0.0", -0.05)
    assert Gsm8kAnswerTool().execute({"answer": 72}, context).reward == 0.0


def test_gsm8k_tool_reads_verls_create_kwargs_ground_truth_first():
    context = ToolContext(
        ground_truth="1",
        extra_info={"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}},
    )
    assert Gsm8kAnswerTool().execute({"answer": "72"}, context).reward == 0.0


def test_truncation_sides_are_verls():
    text = "abcdefghij"
    assert truncate_tool_text(text, 20, "middle") == text
    assert truncate_tool_text(text, 4, "left") == "abcd...(truncated)"
    assert truncate_tool_text(text, 4, "right") == "(truncated)...ghij"
    assert truncate_tool_text(text, 4, "middle") == "ab...(truncated)...ij"
