"""Writes train.jsonl and test.jsonl of this folder: two-digit addition for the calculator tool task.

    python data/tool_addition/generate.py     # rewrites both files; the output is always the same

The 8,100 problems "a + b" (a, b in 10..99) are shuffled with a fixed seed; the first 100 are held
out for validation and the next 2,000 are the training prompts. Each prompt is the text "a + b = ",
data_source ppoflow/tool-addition: the built-in reward checks the final answer (the text after the
last tool result) against the sum (engine/tiny_tools.py).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
HELD_OUT = 100
TRAIN = 2000


def row(a: int, b: int, split: str, index: int) -> dict:
    return {
        "data_source": "ppoflow/tool-addition",
        "prompt": f"{a} + {b} = ",
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index, "a": a, "b": b},
    }


def write(folder: Path) -> None:
    """train.jsonl and test.jsonl in `folder`."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(0).shuffle(pairs)
    splits = {"test": pairs[:HELD_OUT], "train": pairs[HELD_OUT : HELD_OUT + TRAIN]}
    for split, chosen in splits.items():
        lines = [json.dumps(row(a, b, split, i)) + "\n" for i, (a, b) in enumerate(chosen)]
        (folder / f"{split}.jsonl").write_text("".join(lines))


if __name__ == "__main__":
    write(HERE)
