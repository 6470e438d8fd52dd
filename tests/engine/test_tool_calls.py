"""Hermes tool calls parsed from untrusted model text: well-formed calls, and every malformed shape
becoming a MalformedCall with its reason (never an exception)."""

import pytest

from ppoflow.engine.tool_calls import MAX_CALL_CHARS, MalformedCall, ToolCall, parse_tool_calls


def test_calls_in_order_with_their_arguments():
    text = (
        'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
        '<tool_call>\n{"name": "lookup", "arguments": {"key": "a", "n": 2}}\n</tool_call><|im_end|>'
    )
    assert parse_tool_calls(text) == [
        ToolCall("calculator", {"expression": "2+3"}),
        ToolCall("lookup", {"key": "a", "n": 2}),
    ]


def test_no_call_is_an_empty_list():
    assert parse_tool_calls("The answer is 5.") == []


def test_arguments_given_as_a_json_string_are_parsed():
    call = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert call == [ToolCall("f", {"x": 1})]


def test_missing_arguments_are_an_empty_object():
    assert parse_tool_calls('<tool_call>{"name": "f"}</tool_call>') == [ToolCall("f", {})]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ("2+3", "not JSON"),
        ('{"name": "f", "arguments": {"x": NaN}}', "not JSON"),
        ('["f"]', "JSON object"),
        ('{"arguments": {}}', "'name'"),
        ('{"name": "", "arguments": {}}', "'name'"),
        ('{"name": 3, "arguments": {}}', "'name'"),
        ('{"name": "f", "arguments": [1]}', "JSON object"),
        ('{"name": "f", "arguments": "not json"}', "not JSON"),
        ("[" * 4000 + "]" * 4000, "nested too deeply"),
        ('{"name": "f", "arguments": {"x": "' + "a" * MAX_CALL_CHARS + '"}}', "characters"),
    ],
)
def test_malformed_calls_say_why(body, reason):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert isinstance(call, MalformedCall)
    assert reason in call.message
    assert len(call.raw) <= 200


def test_an_unclosed_call_is_one_malformed_call_after_the_closed_ones():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call> then <tool_call>{"name": "g"'
    first, second = parse_tool_calls(text)
    assert first == ToolCall("f", {})
    assert isinstance(second, MalformedCall) and second.message == "a tool call without its closing tag"


def test_thousands_of_opening_tags_are_one_malformed_call():
    (call,) = parse_tool_calls("<tool_call>" * 8000)  # one pass: the text is not scanned again per tag
    assert isinstance(call, MalformedCall) and len(call.raw) == 200


@pytest.mark.parametrize(
    "body",
    [
        r'{"name": "\udfff", "arguments": {}}',
        r'{"name": "calculator", "arguments": {"expression": "1+\ud800"}}',
    ],
)
def test_a_lone_surrogate_escape_is_a_malformed_call(body):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert isinstance(call, MalformedCall) and "lone surrogate" in call.message
