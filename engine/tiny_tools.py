"""The built-in tool task: two-digit addition with a calculator (`builtin:tiny-calculator`).

The tiny model (engine/tiny.py) cannot add two-digit numbers in its head, but it can call the
calculator tool in the hermes format and copy the result. Its tokenizer is the tiny character
tokenizer grown by the call and result markers: `<tool_call>`, `</tool_call>`, `<tool_response>`,
`</tool_response>`, and the fixed JSON around the expression, `{"name": "calculator", "arguments":
{"expression": "` and `"}}`, so a call is
`<tool_call>{"name": "calculator", "arguments": {"expression": "47 + 38"}}</tool_call><eos>`, the
tool turn `<tool_response>85</tool_response>`, and the answer `85<eos>`.

The warm start is a few seconds of supervised steps on a mix: most answers are given directly (a
two-digit sum the model mostly gets wrong), a few use the calculator. A policy sampled from it calls
the tool now and then; PPO/GRPO with multi-turn rollouts finds that calling it pays, and its accuracy
and tool-call rate rise together (benchmarks/tool_learning.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from .rewards import addition_components
from .tiny import AdditionProblem, build_tiny_tokenizer
from .turn_codec import RESPONSE_CLOSE, RESPONSE_OPEN

TOOL_ADDITION_DATA_SOURCE = "ppoflow/tool-addition"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CALL_PREFIX = '{"name": "calculator", "arguments": {"expression": "'
CALL_SUFFIX = '"}}'
MARKERS = (CALL_OPEN, CALL_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE, CALL_PREFIX, CALL_SUFFIX)
"""The tokens the tool tokenizer adds to the tiny one: each is one token (not a special token, so
decoded text keeps it)."""


def build_tiny_tool_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny character tokenizer with one token for each of MARKERS."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_tokens([AddedToken(m, normalized=False, special=False) for m in MARKERS])
    return tokenizer


@dataclass(frozen=True)
class TwoDigitProblem(AdditionProblem):
    """A two-digit "a + b = " problem; `expression` is what a call asks the calculator."""

    @property
    def expression(self) -> str:
        return f"{self.a} + {self.b}"


HELD_OUT = 100
"""Problems kept for validation (data/tool_addition/test.jsonl): never in the warm start."""


def two_digit_problems() -> tuple[list[TwoDigitProblem], list[TwoDigitProblem]]:
    """(held out, the rest): the 8,100 problems a + b with 10 ≤ a, b ≤ 99 in the order
    data/tool_addition/generate.py shuffles them (seed 0), the first HELD_OUT held out."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(0).shuffle(pairs)
    problems = [TwoDigitProblem(a, b) for a, b in pairs]
    return problems[:HELD_OUT], problems[HELD_OUT:]


def final_answer(response: str) -> str:
    """What a response answers: the text after its last tool result (all of it without one)."""
    return response.rsplit(RESPONSE_CLOSE, 1)[-1]


def tool_addition_components(solution_str: str, ground_truth: str) -> dict[str, float]:
    """The tool task's reward: the addition task's `correctness` and `format` of the final answer."""
    return addition_components(final_answer(solution_str), ground_truth)


def call_text(problem: TwoDigitProblem) -> str:
    return f"{CALL_OPEN}{CALL_PREFIX}{problem.expression}{CALL_SUFFIX}{CALL_CLOSE}"


def warm_start_tools(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    *,
    seed: int,
    steps: int = 500,
    tool_share: float = 0.8,
    call_share: float = 0.1,
    read_share: float = 0.5,
    batch_size: int = 32,
    lr: float = 1e-3,
) -> dict[str, float]:
    """Supervised steps on a mix of direct answers and calculator trajectories (`tool_share` of
    them), the loss on the model's tokens only (not the prompt, not the tool turn). Every calculator
    trajectory teaches the call's form and the copying of the result, but only `call_share` of all
    trajectories teach the choice to call (the loss of their first token, `<tool_call>`): the model
    knows how to use the tool, and rarely thinks of it. In `read_share` of the calculator
    trajectories the tool turn shows another number, which the answer repeats: the model learns to
    answer what the tool said, not to add (with the true sum only, it would learn sums of the
    problems it saw, and copy none on new ones). Deterministic for a seed. Returns the recipe."""
    _, problems = two_digit_problems()
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        batch = [rng.choice(problems) for _ in range(batch_size)]
        uses_tool = [rng.random() < tool_share for _ in batch]
        teaches_call = [tool and rng.random() < call_share / tool_share for tool in uses_tool]
        shown = [str(rng.randrange(20, 199)) if rng.random() < read_share else p.answer for p in batch]
        loss = _trajectory_loss(model, tokenizer, batch, uses_tool, teaches_call, shown)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()
    return {
        "steps": float(steps),
        "tool_share": tool_share,
        "call_share": call_share,
        "read_share": read_share,
    }


def _segments(problem: TwoDigitProblem, uses_tool: bool, shown: str) -> list[tuple[str, bool]]:
    """(text, learned) pieces of a trajectory after the prompt; `<eos>` ends each assistant turn.
    `shown`: the number the tool turn shows (and the answer repeats)."""
    if not uses_tool:
        return [(problem.answer, True)]
    return [
        (call_text(problem), True),
        (f"{RESPONSE_OPEN}{shown}{RESPONSE_CLOSE}", False),
        (shown, True),
    ]


def _trajectory_loss(model, tokenizer, problems, uses_tool, teaches_call, shown) -> torch.Tensor:
    rows, labels = [], []
    for problem, tool, call, number in zip(problems, uses_tool, teaches_call, shown, strict=True):
        ids = tokenizer(problem.prompt, add_special_tokens=False)["input_ids"]
        label = [-100] * len(ids)
        for text, learned in _segments(problem, tool, number):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            piece = piece + [tokenizer.eos_token_id] if learned else piece
            ids, label = ids + piece, label + (piece if learned else [-100] * len(piece))
        if tool and not call:
            label[len(tokenizer(problem.prompt, add_special_tokens=False)["input_ids"])] = -100
        rows.append(ids)
        labels.append(label)
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    targets = torch.full((len(rows), width), -100)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, label) in enumerate(zip(rows, labels, strict=True)):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        targets[i, : len(ids)] = torch.tensor(label)
        attention[i, : len(ids)] = 1
    return model(input_ids=input_ids, attention_mask=attention, labels=targets).loss
