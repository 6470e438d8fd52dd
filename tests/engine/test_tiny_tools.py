"""The built-in calculator task: its tokenizer's markers survive a save and reload with the same ids,
its held-out problems are the data files' (never in the warm start), and its reward reads the
answer after the last tool result."""

import json
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from ppoflow.engine.tiny_tools import (
    MARKERS,
    TwoDigitProblem,
    build_tiny_tool_tokenizer,
    call_text,
    final_answer,
    tool_addition_components,
    two_digit_problems,
)
from ppoflow.engine.tool_calls import ToolCall, parse_tool_calls

DATA = Path(__file__).resolve().parents[2] / "data" / "tool_addition"


def test_each_marker_is_one_token_and_keeps_its_id_after_a_reload(tmp_path):
    tokenizer = build_tiny_tool_tokenizer()
    text = call_text(TwoDigitProblem(47, 38)) + "<tool_response>85</tool_response>85"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len("47 + 38") + len("8585") + len(MARKERS)
    tokenizer.save_pretrained(tmp_path)
    reloaded = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    assert reloaded(text, add_special_tokens=False)["input_ids"] == ids
    assert reloaded.decode(ids, skip_special_tokens=True) == text  # markers are not special: kept
    assert parse_tool_calls(reloaded.decode(ids)) == [ToolCall("calculator", {"expression": "47 + 38"})]


def test_the_held_out_problems_are_the_validation_files_and_not_trained_on():
    held_out, rest = two_digit_problems()
    rows = [json.loads(line) for line in (DATA / "test.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [p.prompt for p in held_out]
    assert [r["reward_model"]["ground_truth"] for r in rows] == [p.answer for p in held_out]
    train = {json.loads(line)["prompt"] for line in (DATA / "train.jsonl").read_text().splitlines()}
    assert not train & {p.prompt for p in held_out} and len(rest) == 8000


def test_the_reward_reads_the_answer_after_the_last_tool_result():
    call = call_text(TwoDigitProblem(47, 38))
    assert final_answer(f"{call}<tool_response>85</tool_response>85") == "85"
    assert tool_addition_components(f"{call}<tool_response>85</tool_response>85", "85") == {
        "correctness": 1.0,
        "format": 1.0,
    }
    assert tool_addition_components(f"{call}<tool_response>85</tool_response>86", "85")["correctness"] == 0.0
    assert tool_addition_components("85", "85")["correctness"] == 1.0  # answered without the tool
    assert tool_addition_components(call, "85") == {"correctness": 0.0, "format": 0.0}  # never answered
