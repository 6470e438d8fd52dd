"""Tools a policy can call during a multi-turn rollout, and ppoflow's built-in ones.

A tool is stateless, as in verl's tool agent loop (which creates and releases a tool instance around
every call): `execute(arguments, context)` gets the call's JSON arguments (untrusted: they come from
the model) and the trajectory's `ToolContext` (its prompt's ground truth and extra_info), and returns
a `ToolResult`: the text the model reads in the tool turn and an optional reward.

The built-in tools are pure functions and run in the generating process; a user's tool runs in a
worker process with a time limit (`tasks/models/tool_runner.py`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Protocol

from .gsm8k import compute_score
from .names import ToolResponseTruncateSide


@dataclass(frozen=True)
class ToolContext:
    """What a tool may know about the trajectory that calls it: its prompt's ground truth and
    extra_info (the prompt row's), and verl's `extra_info.tools_kwargs[<tool>].create_kwargs`."""

    ground_truth: str | None = None
    extra_info: dict[str, Any] = field(default_factory=dict)

    def create_kwargs(self, tool_name: str) -> dict[str, Any]:
        kwargs = self.extra_info.get("tools_kwargs", {})
        tool = kwargs.get(tool_name, {}) if isinstance(kwargs, dict) else {}
        create = tool.get("create_kwargs", {}) if isinstance(tool, dict) else {}
        return create if isinstance(create, dict) else {}


@dataclass(frozen=True)
class ToolResult:
    """A call's outcome: `text` for the model, `reward` for the rewards stage (None: none), `error`
    when the call failed (the text then says why)."""

    text: str
    reward: float | None = None
    error: str | None = None


class Tool(Protocol):
    name: str

    def execute(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult: ...


class ArgumentError(ValueError):
    """A call's arguments do not fit the tool (the message is shown to the model)."""


def string_argument(arguments: dict[str, Any], key: str, *, max_chars: int) -> str:
    value = arguments.get(key)
    if isinstance(value, int | float) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise ArgumentError(f"argument '{key}' must be a string")
    if len(value) > max_chars:
        raise ArgumentError(f"argument '{key}' has {len(value)} characters (at most {max_chars})")
    return value


# --- calculator ---------------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = Fraction(10) ** 30
"""No number in a calculation may exceed this in absolute value (no huge-number denial of service)."""
_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?)|(.))")


class CalculatorTool:
    """`calculator(expression)`: exact arithmetic on decimal numbers with + − × ÷ and parentheses,
    parsed by a small recursive-descent parser (nothing is evaluated as Python). The result is an
    integer when it is one, else a decimal rounded to 6 places."""

    name = "calculator"
    schema = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 12 * (3 + 4)"}},
                "required": ["expression"],
            },
        },
    }

    def execute(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        expression = string_argument(arguments, "expression", max_chars=MAX_EXPRESSION_CHARS)
        return ToolResult(format_number(evaluate_arithmetic(expression)))


def format_number(value: Fraction) -> str:
    """An integer as itself; otherwise rounded half-even to 6 decimal places, exactly (no float), with
    trailing zeros dropped ("0" for what rounds to zero)."""
    if value.denominator == 1:
        return str(value.numerator)
    scaled = round(value * 10**6)  # Fraction's round: exact, half to even
    if scaled == 0:
        return "0"
    sign, digits = ("-" if scaled < 0 else ""), str(abs(scaled)).rjust(7, "0")
    whole, decimals = digits[:-6], digits[-6:].rstrip("0")
    return f"{sign}{whole}.{decimals}" if decimals else f"{sign}{whole}"


def evaluate_arithmetic(expression: str) -> Fraction:
    """The exact value of `expression`; ArgumentError for anything else (with where it failed)."""
    tokens = _tokens(expression)
    parser = _Arithmetic(tokens)
    value = parser.sum()
    if parser.position != len(tokens):
        raise ArgumentError(f"unexpected '{tokens[parser.position]}' in the expression")
    return value


def _tokens(expression: str) -> list[str | Fraction]:
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ArgumentError(f"an expression of {len(expression)} characters (at most {MAX_EXPRESSION_CHARS})")
    tokens: list[str | Fraction] = []
    for number, symbol in _TOKEN.findall(expression.rstrip()):
        if number:
            tokens.append(_bounded(Fraction(number)))
        elif symbol in "+-*/()×÷":
            tokens.append({"×": "*", "÷": "/"}.get(symbol, symbol))
        else:
            raise ArgumentError(f"'{symbol}' is not arithmetic (numbers, + - * / and parentheses)")
    if not tokens:
        raise ArgumentError("an empty expression")
    return tokens


def _bounded(value: Fraction) -> Fraction:
    if abs(value) > MAX_MAGNITUDE:
        raise ArgumentError("a number too large for the calculator")
    if value.denominator > MAX_MAGNITUDE:
        raise ArgumentError("a number with too many digits after the point for the calculator")
    return value


class _Arithmetic:
    """sum := product (('+'|'-') product)*; product := unary (('*'|'/') unary)*;
    unary := '-' unary | '(' sum ')' | number. Depth is bounded by the expression's length."""

    def __init__(self, tokens: list[str | Fraction]):
        self.tokens, self.position = tokens, 0

    def _peek(self) -> str | Fraction | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def _take(self) -> str | Fraction:
        token = self._peek()
        if token is None:
            raise ArgumentError("the expression ends too early")
        self.position += 1
        return token

    def sum(self) -> Fraction:
        value = self.product()
        while self._peek() in ("+", "-"):
            value = _bounded(value + self.product() if self._take() == "+" else value - self.product())
        return value

    def product(self) -> Fraction:
        value = self.unary()
        while self._peek() in ("*", "/"):
            if self._take() == "*":
                value = _bounded(value * self.unary())
            else:
                divisor = self.unary()
                if divisor == 0:
                    raise ArgumentError("division by zero")
                value = _bounded(value / divisor)
        return value

    def unary(self) -> Fraction:
        token = self._take()
        if token == "-":
            return -self.unary()
        if token == "+":
            return self.unary()
        if token == "(":
            value = self.sum()
            if self._peek() != ")":
                raise ArgumentError("a '(' without its ')'")
            self.position += 1
            return value
        if isinstance(token, Fraction):
            return token
        raise ArgumentError(f"unexpected '{token}' in the expression")


# --- GSM8K answer checker ------------------------------------------------------------------------


class Gsm8kAnswerTool:
    """verl's `Gsm8kTool` (`calc_gsm8k_reward(answer)`): the answer is scored against the prompt's
    ground truth with verl's flexible GSM8K rule; the model reads `Current parsed answer='…'
    reward=…`, and the call's reward is 0.0 for a right answer and −0.05 otherwise (verl's penalty
    for an answer that does not improve on the reward so far, which is 0 at every call since verl
    creates the tool afresh for each)."""

    name = "calc_gsm8k_reward"
    schema = {
        "type": "function",
        "function": {
            "name": "calc_gsm8k_reward",
            "description": "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, "
            "0.0 if parsed answer is incorrect or not correctly parsed)",
            "parameters": {
                "type": "object",
                "properties": {
                    "answer": {
                        "type": "string",
                        "description": "The model's answer to the GSM8K math problem, must be a digits",
                    }
                },
                "required": ["answer"],
            },
        },
    }

    def execute(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        answer = string_argument(arguments, "answer", max_chars=MAX_EXPRESSION_CHARS) if arguments else ""
        ground_truth = context.create_kwargs(self.name).get("ground_truth", context.ground_truth)
        if ground_truth is None:
            raise ArgumentError("this prompt has no ground truth to check an answer against")
        response = answer if answer.startswith("#### ") else "#### " + answer
        reward = compute_score(response, str(ground_truth), method="flexible", format_score=0.0, score=1.0)
        return ToolResult(f"Current parsed answer={answer!r} reward={reward!r}", 0.0 if reward > 0 else -0.05)


BUILTIN_TOOLS: dict[str, type] = {
    "ppoflow:calculator": CalculatorTool,
    "ppoflow:gsm8k_answer": Gsm8kAnswerTool,
    "verl.tools.gsm8k_tool.Gsm8kTool": Gsm8kAnswerTool,  # verl's class name in its example configs
}
"""Tool classes by the `class_name` a tool config gives them."""


def utf8_text(text: str) -> str:
    """`text` as UTF-8 can hold it: a lone surrogate (which a tool or a JSON escape can produce)
    written as its escape, so tokenizers and parquet take every result."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def truncate_tool_text(text: str, max_chars: int, side: ToolResponseTruncateSide) -> str:
    """verl's truncation of a tool response longer than `max_chars` characters: `left` keeps the
    start, `right` the end, `middle` both halves, with a marker where text was cut."""
    if len(text) <= max_chars:
        return text
    if side == "left":
        return text[:max_chars] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-max_chars:]
    half = max_chars // 2
    return text[:half] + "...(truncated)..." + (text[-half:] if half else "")
