"""GSM8K answer extraction and scoring as verl's `reward_score/gsm8k.py` does it: hand cases for both
methods (quirks included), every reference solution of the real train set scored against its own
ground truth, and the composite form equal to verl's float."""

from __future__ import annotations

import json
import math
import re

import pytest

from ppoflow.engine.gsm8k import (
    INSTRUCTION,
    SOLUTION_CLIP_CHARS,
    compute_score,
    extract_solution,
    ground_truth_of,
    gsm8k_components,
    verl_record,
)
from ppoflow.engine.rewards import combine_components
from tests.conftest import gsm8k_file

WEIGHTS = {"correctness": 0.9, "format": 0.1}


@pytest.fixture(scope="module")
def train_rows() -> list[dict]:
    path = gsm8k_file("train.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


LONG_TAIL = " Checking my work again." * 20  # over 300 characters, with "." as its only number-like runs


@pytest.mark.parametrize(
    ("solution", "truth", "strict", "flexible"),
    [
        ("#### 72", "72", "72", "72"),
        ("The answer is 1,234. #### 1,234", "1234", "1234", "1,234"),  # flexible keeps commas
        ("#### -5", "-5", "-5", "-5"),
        ("Half of 144 is 72, so 72 apples.\n#### 70", "72", "70", "70"),  # the final #### decides
        ("#### 70\nOn reflection:\n#### 72", "72", "72", "72"),  # the last #### is taken
        ("So she has 72 apples.", "72", None, "72"),  # no ####
        ("#### seventy-two", "72", None, None),  # #### followed by text
        ("#### 72" + LONG_TAIL, "72", None, "."),  # clipped away; flexible: verl's all-"." quirk
        ("x" * 1000 + "#### 72", "72", "72", "72"),  # long, but the answer is in the last 300
        ("#### $18", "18", None, "18"),  # "$" is outside the regex, verl's replace("$") never fires
        ("It costs $18.\n#### 18", "18", "18", "18"),
        ("#### 3.50", "3.5", "3.50", "3.50"),  # answers match as strings
        ("#### 72.", "72", "72.", "72."),
        ("#### ,", "0", "", ","),  # a match of punctuation only is an extracted (wrong) answer
        ("", "0", None, None),
    ],
)
def test_extraction_and_score_by_hand(solution, truth, strict, flexible):
    for method, expected in (("strict", strict), ("flexible", flexible)):
        assert extract_solution(solution, method) == expected, method
        components = gsm8k_components(solution, truth, method)
        assert components == {"correctness": float(expected == truth), "format": float(expected is not None)}
        verl = 0.0 if expected is None else 1.0 if expected == truth else 0.0
        assert compute_score(solution, truth, method) == verl


def test_only_the_last_300_characters_are_searched():
    fits = "#### 72" + "a" * (SOLUTION_CLIP_CHARS - len("#### 72"))
    assert len(fits) == SOLUTION_CLIP_CHARS and extract_solution(fits) == "72"
    assert extract_solution(fits + "a") is None  # the clip starts inside "####"


def test_compute_score_passes_verls_format_score_and_score():
    assert compute_score("#### 71", "72", format_score=0.1) == 0.1
    assert compute_score("#### 72", "72", format_score=0.1, score=2.0) == 2.0
    assert compute_score("no answer", "72", format_score=0.1) == 0.0
    with pytest.raises(ValueError, match="unknown GSM8K extraction method 'loose'"):
        extract_solution("#### 72", "loose")  # type: ignore[arg-type]


def test_ground_truth_and_record_follow_verls_preprocessing():
    answer = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 1,072"
    assert ground_truth_of(answer) == "1072"
    assert ground_truth_of("#### 5\n#### 6") == "5"  # verl's preprocessing takes the first (re.search)
    with pytest.raises(ValueError, match="no '#### <number>' line"):
        ground_truth_of("The answer is 5.")
    assert verl_record("How many?", answer, "train", 3) == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "How many? " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "1072"},
        "extra_info": {"split": "train", "index": 3, "answer": answer, "question": "How many?"},
    }
    assert INSTRUCTION == 'Let\'s think step by step and output the final answer after "####".'


def test_every_train_solution_scores_against_its_own_ground_truth(train_rows):
    assert len(train_rows) == 7473
    failed = [
        r["answer"] for r in train_rows if compute_score(r["answer"], ground_truth_of(r["answer"])) != 1.0
    ]
    print(f"strict: {len(train_rows) - len(failed)} of {len(train_rows)} reference solutions score 1.0")
    assert len(failed) <= 0.001 * len(train_rows)
    # A reference solution may only fail when it breaks the rule: its last "#### <number>" is not
    # within the last 300 characters, or it has none.
    for answer in failed:
        tail = answer[-SOLUTION_CLIP_CHARS:]
        assert not re.search(r"#### \-?[0-9\.\,]+", tail), answer[-80:]


def test_composite_form_equals_verls_float(train_rows):
    """Weights {correctness: 1 - f, format: f} give compute_score(format_score=f); the default
    weights give verl's score with format_score=0.1."""
    responses = []
    for i, row in enumerate(train_rows[:400]):
        other = train_rows[i + 1]["answer"]
        truth = ground_truth_of(row["answer"])
        responses += [
            (row["answer"], truth),  # correct
            (other, truth),  # another problem's solution: usually wrong
            (row["answer"].replace("####", "The answer is"), truth),  # no ####: strict finds none
            (row["answer"][: len(row["answer"]) // 2], truth),  # cut short
        ]
    outcomes = set()
    for method in ("strict", "flexible"):
        for f in (0.0, 0.1, 0.25):
            weights = {"correctness": 1.0 - f, "format": f}
            for solution, truth in responses:
                components = gsm8k_components(solution, truth, method)
                expected = compute_score(solution, truth, method, format_score=f)
                assert math.isclose(combine_components(components, weights), expected), (solution, method)
                outcomes.add((components["correctness"], components["format"]))
        for solution, truth in responses:
            components = gsm8k_components(solution, truth, method)
            expected = compute_score(solution, truth, method, format_score=0.1)
            assert math.isclose(combine_components(components, WEIGHTS), expected)
    assert outcomes == {(1.0, 1.0), (0.0, 1.0), (0.0, 0.0)}  # every branch was exercised
