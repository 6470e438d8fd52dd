"""Writes train.jsonl and test.jsonl of this folder: single-digit addition in verl's row format.

    python data/arithmetic/generate.py        # rewrites both files; the output is always the same

The 100 problems "a + b" (a, b in 0..9) are shuffled with a fixed seed and split into 60 for
training and 40 held out for validation, so that validation asks only sums the policy never trained
on. Each row asks for the working and the answer after "####" and is scored by ppoflow's GSM8K
reward (data_source openai/gsm8k: the number after the last "#### " must equal the ground truth).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
HELD_OUT = 40
INSTRUCTION = "Calculate {a} + {b}. Format: {a} + {b} = <sum>, then a new line with #### <sum>."


def row(a: int, b: int, split: str, index: int) -> dict:
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": INSTRUCTION.format(a=a, b=b)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index},
    }


def write(folder: Path) -> None:
    """train.jsonl and test.jsonl in `folder`."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(0).shuffle(pairs)
    splits = {"test": pairs[:HELD_OUT], "train": pairs[HELD_OUT:]}
    for split, chosen in splits.items():
        lines = [json.dumps(row(a, b, split, i)) + "\n" for i, (a, b) in enumerate(chosen)]
        (folder / f"{split}.jsonl").write_text("".join(lines))


if __name__ == "__main__":
    write(HERE)
