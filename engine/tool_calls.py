"""Tool calls in a model's text, in the hermes format (Qwen's and SmolLM2's chat templates, verl's
`multi_turn.format=hermes`): each call is a JSON object `{"name": ..., "arguments": {...}}` between
`<tool_call>` and `</tool_call>`.

The text comes from the model and is untrusted: a call is parsed as JSON only (never evaluated),
its size and nesting are bounded, and anything that is not a well-formed call becomes a
`MalformedCall` whose message is shown to the model as the tool turn's text (never an exception).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"

MAX_CALL_CHARS = 8192
"""Longest JSON text of one call; a longer one is malformed (its arguments are never parsed)."""
MAX_NAME_CHARS = 128
"""Longest tool name."""


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: a tool's name and its JSON-object arguments."""

    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False, sort_keys=True)


@dataclass(frozen=True)
class MalformedCall:
    """A `<tool_call>` block that is not a call; `message` says why (shown to the model)."""

    message: str
    raw: str


def parse_tool_calls(text: str) -> list[ToolCall | MalformedCall]:
    """The calls of one assistant turn, in order; [] when the turn makes none. An opening tag
    without its closing one (the turn ran out of tokens inside a call) is one malformed call. One
    pass over the text (each call is the text between an opening tag and the next closing one)."""
    calls: list[ToolCall | MalformedCall] = []
    start = text.find(OPEN)
    while start >= 0:
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:
            calls.append(MalformedCall("a tool call without its closing tag", text[start : start + 200]))
            break
        calls.append(_parse_one(text[start + len(OPEN) : end]))
        start = text.find(OPEN, end + len(CLOSE))
    return calls


def _parse_one(body: str) -> ToolCall | MalformedCall:
    raw = body.strip()
    if len(raw) > MAX_CALL_CHARS:
        return MalformedCall(f"a tool call of {len(raw)} characters (at most {MAX_CALL_CHARS})", raw[:200])
    try:
        value = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as error:
        return MalformedCall(f"a tool call that is not JSON: {_first_line(error)}", raw[:200])
    if not isinstance(value, dict):
        return MalformedCall("a tool call must be a JSON object with 'name' and 'arguments'", raw[:200])
    name, arguments = value.get("name"), value.get("arguments", {})
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
        return MalformedCall("a tool call needs a 'name' string", raw[:200])
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments, parse_constant=_no_constant)
        except (ValueError, RecursionError) as error:
            return MalformedCall(f"the arguments of '{name}' are not JSON: {_first_line(error)}", raw[:200])
    if not isinstance(arguments, dict):
        return MalformedCall(f"the arguments of '{name}' must be a JSON object", raw[:200])
    try:  # JSON's escapes can write lone surrogates (\ud800), which no UTF-8 text holds
        json.dumps([name, arguments], ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return MalformedCall("a tool call with an invalid \\u escape (a lone surrogate)", raw[:200])
    return ToolCall(name, arguments)


def _no_constant(token: str) -> None:
    raise ValueError(f"{token} is not JSON")


def _first_line(error: BaseException) -> str:
    if isinstance(error, RecursionError):
        return "nested too deeply"
    return str(error).splitlines()[0][:120]
