"""The multi-turn loop on hand-built trajectories: a scripted engine answers each context with a
fixed turn, a character codec makes every id a character, so each expected mask, log-prob and turn
row can be written down."""

from collections.abc import Sequence

import pytest
import torch

from ppoflow.engine.batching import ForwardBatching
from ppoflow.engine.forward import compute_log_probs
from ppoflow.engine.multi_turn import MultiTurnLimits, run_multi_turn, turn_seed
from ppoflow.engine.ppo import build_sequence_batch, place_scores, unpad
from ppoflow.engine.rollout import RolloutOutput, SamplingParams
from ppoflow.engine.tool_calls import ToolCall
from ppoflow.engine.tools import CalculatorTool, ToolContext, ToolResult

EOS = "$"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>$'


class CharCodec:
    def decode(self, ids: Sequence[int]) -> str:
        return "".join(map(chr, ids))

    def tool_turn(self, results: Sequence[str]) -> list[int]:
        return encode("".join(f"<r>{text}</r>" for text in results))


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


class ScriptedEngine:
    """Answers a context with the turn `script` gives the context's text after the prompt; each
    token's log-prob is −(its position in the turn + 1)/100. Records the seeds it was given."""

    def __init__(self, prompt: str, script: dict[str, str]):
        self.prompt, self.script, self.seeds = prompt, script, []

    def generate(self, prompt_ids, params, *, seeds, on_batch=None, on_tokens=None) -> RolloutOutput:
        self.seeds.append(list(seeds))
        out = RolloutOutput()
        for ids in prompt_ids:
            turn = encode(self.script["".join(map(chr, ids))[len(self.prompt) :]])[: params.max_new_tokens]
            stopped = chr(turn[-1]) == EOS if turn else False
            out.response_ids.append(turn)
            out.rollout_log_probs.append([-(k + 1) / 100 for k in range(len(turn))])
            out.finish_reasons.append("stop" if stopped else "length")
        return out


class BuiltinTools:
    """The built-in calculator run as ProcessToolRunner runs it, with unknown names refused."""

    def run(self, calls: Sequence[ToolCall], context: ToolContext) -> list[tuple[ToolResult, float]]:
        out = []
        for call in calls:
            if call.name == "calculator":
                out.append((CalculatorTool().execute(call.arguments, context), 0.0))
            else:
                out.append(
                    (ToolResult(f"Error: unknown tool {call.name}", error=f"unknown tool {call.name}"), 0.0)
                )
        return out


def run(script, limits: MultiTurnLimits, samples: int = 1, tools=None):
    """The trajectories of `samples` responses to the prompt "Q" under `script` (a dict, or an
    object whose lookup answers every context), with the built-in calculator unless `tools`."""
    engine = ScriptedEngine("Q", script)
    trajectories = run_multi_turn(
        engine,
        [encode("Q")] * samples,
        SamplingParams(max_new_tokens=limits.response_length),
        seeds=list(range(samples)),
        contexts=[ToolContext()] * samples,
        codec=CharCodec(),
        tools=tools or BuiltinTools(),
        limits=limits,
    )
    return engine, trajectories


def test_call_result_answer_masks_log_probs_and_turns():
    answer = "5$"
    tool = "<r>5</r>"
    engine, (t,) = run({"": CALL, CALL + tool: answer}, MultiTurnLimits(response_length=200))
    assert t.response_ids == encode(CALL + tool + answer)
    assert t.response_mask == [1] * len(CALL) + [0] * len(tool) + [1] * len(answer)
    assert t.log_probs == (
        [-(k + 1) / 100 for k in range(len(CALL))] + [0.0] * len(tool) + [-(k + 1) / 100 for k in range(2)]
    )
    assert (t.finish_reason, t.num_turns, t.tool_calls, t.assistant_turns, t.user_turns) == (
        "stop",
        4,
        1,
        2,
        1,
    )
    first, call, last = t.turns
    assert (first.role, first.turn, first.token_start, first.token_end, first.end) == (
        "assistant",
        0,
        0,
        len(CALL),
        "tool_calls",
    )
    assert (
        call.role,
        call.turn,
        call.call_index,
        call.tool_name,
        call.arguments,
        call.result,
        call.error,
    ) == ("tool", 1, 0, "calculator", '{"expression": "2+3"}', "5", None)
    assert (call.token_start, call.token_end) == (len(CALL), len(CALL) + len(tool))
    assert (last.turn, last.text, last.end) == (2, answer, "stop")
    assert engine.seeds == [[turn_seed(0, 0)], [turn_seed(0, 2)]]
    assert turn_seed(0, 0) == 0 and turn_seed(0, 2) != 0


@pytest.mark.parametrize(
    ("call", "error"),
    [
        ("<tool_call>2+3</tool_call>$", "not JSON"),
        ('<tool_call>{"name": "search", "arguments": {}}</tool_call>$', "unknown tool"),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>$', None),
    ],
)
def test_a_bad_call_is_an_error_turn_and_the_model_goes_on(call, error):
    tools = BuiltinTools()
    if error is None:  # the calculator's own refusal: the runner (tool_runner) makes it a result
        tools.run = lambda calls, context: [
            (ToolResult("Error: division by zero", error="division by zero"), 0.0)
        ]
        error = "division by zero"
    answer = "7$"

    class Script(dict):  # the call first, then the answer whatever the tool turn says
        def __getitem__(self, key):
            return call if key == "" else answer

    _, (t,) = run(Script(), MultiTurnLimits(response_length=300), tools=tools)
    tool_row = t.turns[1]
    assert tool_row.role == "tool" and error in tool_row.error and tool_row.text.startswith("Error")
    assert t.finish_reason == "stop" and t.turns[-1].text == answer
    assert sum(t.response_mask) == len(call) + len(answer)


def test_assistant_turn_limit_ends_without_running_the_call():
    _, (t,) = run({"": CALL}, MultiTurnLimits(response_length=200, max_assistant_turns=1))
    assert [r.role for r in t.turns] == ["assistant"]
    assert t.turns[0].end == "assistant_turn_limit" and t.finish_reason == "stop"
    assert t.response_mask == [1] * len(CALL)


def test_user_turn_limit_stops_the_second_call():
    tool = "<r>5</r>"
    _, (t,) = run({"": CALL, CALL + tool: CALL}, MultiTurnLimits(response_length=300, max_user_turns=1))
    assert [r.role for r in t.turns] == ["assistant", "tool", "assistant"]
    assert t.turns[-1].end == "user_turn_limit" and t.user_turns == 1


def test_a_tool_turn_that_does_not_fit_ends_the_response_at_the_length_limit():
    limit = len(CALL) + 3  # "<r>5</r>" needs 8
    _, (t,) = run({"": CALL}, MultiTurnLimits(response_length=limit))
    assert t.finish_reason == "length" and t.response_ids == encode(CALL)
    tool = t.turns[1]
    assert (tool.text, tool.result, tool.token_start, tool.token_end) == ("", "5", len(CALL), len(CALL))


def test_the_budget_is_the_whole_response():
    tool = "<r>5</r>"
    limit = len(CALL) + len(tool) + 1  # one token left for the answer "5$"
    _, (t,) = run({"": CALL, CALL + tool: "5$"}, MultiTurnLimits(response_length=limit))
    assert len(t.response_ids) == limit and t.finish_reason == "length"
    assert t.turns[-1].end == "length" and t.turns[-1].text == "5"


def test_only_max_parallel_calls_run():
    two = CALL[:-1] + CALL
    tool = "<r>5</r>"
    _, (t,) = run({"": two, two + tool: "5$"}, MultiTurnLimits(response_length=400, max_parallel_calls=1))
    assert [r.role for r in t.turns] == ["assistant", "tool", "assistant"]
    _, (t,) = run(
        {"": two, two + tool + tool: "5$"}, MultiTurnLimits(response_length=400, max_parallel_calls=2)
    )
    assert [(r.role, r.call_index) for r in t.turns] == [
        ("assistant", None),
        ("tool", 0),
        ("tool", 1),
        ("assistant", None),
    ]


def test_tool_results_are_cut_as_verl_cuts_them():
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "123456 * 1000"}}</tool_call>$'
    tool = "<r>12...(truncated)...00</r>"
    _, (t,) = run(
        {"": call, call + tool: "ok$"}, MultiTurnLimits(response_length=400, max_tool_response_length=4)
    )
    assert t.turns[1].text == "12...(truncated)...00" and t.turns[1].result == "123456000"


def test_log_probs_of_a_multi_turn_batch_skip_tool_tokens_and_equal_the_full_pass():
    """compute_log_probs reads every token (tool ones too) and gives tool tokens 0: at the policy's
    tokens the values equal a pass that counts every token (the same attention)."""
    from ppoflow.engine.tiny import build_tiny_model, build_tiny_tokenizer

    model = build_tiny_model(build_tiny_tokenizer(), seed=0)
    prompt, response = [3, 4, 5], [6, 7, 8, 9, 10, 11]
    mask = [1, 1, 0, 0, 1, 1]
    masked = build_sequence_batch([prompt], [response], pad_token_id=0, response_masks=[mask])
    whole = build_sequence_batch([prompt], [response], pad_token_id=0)
    lp_masked = compute_log_probs(model, masked, temperature=1.0, batching=1)
    lp_whole = compute_log_probs(model, whole, temperature=1.0, batching=1)
    expected = lp_whole * torch.tensor([mask], dtype=torch.float32)
    torch.testing.assert_close(lp_masked, expected, rtol=0, atol=0)
    assert unpad(lp_masked, masked)[0][2:4] == [0.0, 0.0] and len(unpad(lp_masked, masked)[0]) == 6
    packed = compute_log_probs(
        model, masked, temperature=1.0, batching=ForwardBatching(1, None, remove_padding=True)
    )
    torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-5)


def test_the_score_goes_on_the_last_policy_token():
    mask = torch.tensor([[1.0, 1, 0, 0, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0]])
    placed = place_scores(torch.tensor([2.0, 3.0]), mask)
    assert placed.tolist() == [[0, 0, 0, 0, 2.0, 0, 0], [0, 0, 3.0, 0, 0, 0, 0]]


def test_a_tool_result_with_a_lone_surrogate_is_escaped_not_fatal():
    tools = BuiltinTools()
    tools.run = lambda calls, context: [(ToolResult("bad \udc80 text"), 0.0)]
    _, (t,) = run({"": CALL, CALL + "<r>bad \\udc80 text</r>": "ok$"}, MultiTurnLimits(300), tools=tools)
    assert t.turns[1].text == "bad \\udc80 text" and t.turns[1].result == "bad \\udc80 text"
    assert t.turns[-1].text == "ok$"
