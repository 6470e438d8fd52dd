"""GSM8K as verl prepares and scores it: `verl/utils/reward_score/gsm8k.py` (answer extraction and
`compute_score`) and `examples/data_preprocess/gsm8k.py` (raw {question, answer} → verl's row).

verl's behaviour is reproduced as is, quirks included, so that scores compare one to one:

- Only the last 300 characters of a response are searched (`_SOLUTION_CLIP_CHARS`).
- strict: the last `#### <number>` match, commas removed. verl also removes "$", which its regex can
  never capture, so "#### $18" has no answer. A match can be all punctuation: "#### ," gives "" and
  "#### ." gives ".", which count as an extracted (wrong) answer, as in verl.
- flexible: the last run of digits, ".", "," (with an optional "-") that is not "."; commas are kept,
  so "1,234" never equals the ground truth "1234". When every run is ".", verl's loop variable is
  left on the first of them and "." is returned (a wrong answer, not none).
- Answers match as strings: "3.50" ≠ "3.5", "72." ≠ "72".
- The ground truth (preprocessing) is the *first* `#### <number>` of the reference solution, commas
  removed, without clipping; scoring takes the *last* within the clip. GSM8K answers have one.
"""

from __future__ import annotations

import re

from .names import Gsm8kMethod

GSM8K_DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SOLUTION_CLIP_CHARS = 300


_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def extract_solution(solution_str: str, method: Gsm8kMethod = "strict") -> str | None:
    """The answer verl reads from a response, or None when there is none (see the module notes)."""
    tail = solution_str[-SOLUTION_CLIP_CHARS:]
    match method:
        case "strict":
            solutions = _STRICT.findall(tail)
            return solutions[-1].replace(",", "").replace("$", "") if solutions else None
        case "flexible":
            candidates = _NUMBER.findall(tail)
            valid = [c for c in candidates if c not in ("", ".")]
            if valid:
                return valid[-1]
            return candidates[0] if candidates else None
        case _:
            raise ValueError(f"unknown GSM8K extraction method {method!r}; use 'strict' or 'flexible'")


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: Gsm8kMethod = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """verl's GSM8K score: `score` when the extracted answer equals ground_truth (as strings),
    `format_score` when an answer was extracted but differs, 0 when none was."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score


def gsm8k_components(
    solution_str: str, ground_truth: str, method: Gsm8kMethod = "strict"
) -> dict[str, float]:
    """ppoflow's composite form: `correctness` = the extracted answer equals ground_truth, `format`
    = an answer was extracted. With weights {correctness: 1 - f, format: f} the weighted sum is
    verl's `compute_score(..., format_score=f)`."""
    answer = extract_solution(solution_str, method)
    return {
        "correctness": float(answer is not None and answer == ground_truth),
        "format": float(answer is not None),
    }


def ground_truth_of(answer: str) -> str:
    """The reference answer of a GSM8K solution as verl's preprocessing extracts it: the first
    `#### <number>`, commas removed. ValueError when there is none (verl asserts)."""
    found = _STRICT.search(answer)
    if found is None:
        raise ValueError("the GSM8K answer has no '#### <number>' line")
    return found.group(1).replace(",", "")


def verl_record(question: str, answer: str, split: str, index: int) -> dict:
    """One raw GSM8K row ({question, answer}) as verl's examples/data_preprocess/gsm8k.py writes it."""
    return {
        "data_source": GSM8K_DATA_SOURCE,
        "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth_of(answer)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }
