"""Writes train.jsonl and test.jsonl of this folder: GSM8K as verl's multi-turn tool example prepares
it (examples/data_preprocess/gsm8k_multiturn_w_tool.py), from the raw files in ../gsm8k.

    python data/gsm8k_tool/generate.py                 # the first 256 training and 64 test problems
    python data/gsm8k_tool/generate.py --all           # every problem (about 14 MB)

Each row has verl's system prompt (solve step by step, check the answer with the calc_gsm8k_reward
tool, finish with `#### <answer>`) and the user's question with verl's instruction, and
extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth, which the tool scores against.
Two additions for a small model: verl's chat template (Qwen's) lists the tool's schema in the system
prompt and SmolLM2's does not, so the system prompt states the tool and the hermes call format as
Qwen's template writes them; and one worked conversation (the first training problem: its solution,
a call, the tool's reply, the final answer) comes before the question, without which
SmolLM2-135M-Instruct never calls the tool (0 of 32 samples; 11 of 32 with it).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
RAW = HERE.parent / "gsm8k"
INSTRUCTION = "Let's think step by step and output the final answer after `####`."
SYSTEM = (
    "You are a math expert. You are given a question and you need to solve it step by step. "
    "Reasoning step by step before any tool call. "
    "You should use the `calc_gsm8k_reward` tool after step by step solving the question, "
    "before generate final answer at least once and refine your answer if necessary. "
    "Put your final answer in the format of `#### <answer>`."
)
TOOL = {
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
TOOLS_TEXT = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(TOOL)
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def solution(answer: str) -> str:
    found = re.search(r"#### (\-?[0-9\.\,]+)", answer)
    if found is None:
        raise ValueError(f"no '#### <number>' in {answer[-80:]!r}")
    return found.group(1).replace(",", "")


DEMONSTRATION = [
    {
        "role": "user",
        "content": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
        "in May. How many clips did Natalia sell altogether in April and May? " + INSTRUCTION,
    },
    {
        "role": "assistant",
        "content": "In May she sold 48 / 2 = 24 clips. Altogether she sold 48 + 24 = 72 clips.\n<tool_call>\n"
        '{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}\n</tool_call>',
    },
    {"role": "tool", "content": "Current parsed answer='72' reward=1.0"},
    {"role": "assistant", "content": "#### 72"},
]
"""The first training problem, solved: the rows below start from the second."""


def row(question: str, answer: str, split: str, index: int) -> dict:
    truth = solution(answer)
    return {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "system", "content": SYSTEM + TOOLS_TEXT},
            *DEMONSTRATION,
            {"role": "user", "content": question + " " + INSTRUCTION},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {
            "split": split,
            "index": index,
            "answer": answer,
            "question": question,
            "need_tools_kwargs": True,
            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}},
        },
    }


def write(folder: Path, counts: dict[str, int | None]) -> None:
    for split, count in counts.items():
        raw = [json.loads(line) for line in (RAW / f"{split}.jsonl").read_text().splitlines() if line.strip()]
        first = 1 if split == "train" else 0  # the demonstration's problem is not asked
        chosen = raw[first:] if count is None else raw[first : first + count]
        rows = [row(r["question"], r["answer"], split, first + i) for i, r in enumerate(chosen)]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="every problem, not the first 256 and 64")
    args = parser.parse_args()
    write(HERE, {"train": None, "test": None} if args.all else {"train": 256, "test": 64})
