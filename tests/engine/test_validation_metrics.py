"""Validation metrics as verl 0.9.1 reports them: the expected numbers are verl's own
(`process_validation_metrics` and `_val_metrics_update` on these inputs) or worked out by hand, and
tests/verl_validation.py, a plain re-statement of verl's code, agrees with every one."""

import numpy as np
import pytest

from ppoflow.engine.validation_metrics import bootstrap_sizes, compute_validation_metrics, majority_values
from tests.verl_validation import verl_validation_metrics

# gsm8k: two prompts of 4 answers; addition: a prompt of 3 answers and one of 1 (mixed sizes).
SOURCES = ["gsm8k"] * 8 + ["addition"] * 4
PROMPTS = ["g1"] * 4 + ["g2"] * 4 + ["a1"] * 3 + ["a2"]
SCORES = [1.0, 0.1, 1.0, 0.0, 0.1, 0.1, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
FORMAT = [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
PREDS = ["72", "70", "72", "[INVALID]", "5", "5", "6", "[INVALID]", "7", "8", "8", "3"]
VERL = {  # verl 0.9.1's output for these inputs (infos: reward, format, pred)
    "val-core/gsm8k/reward/mean@4": 0.4125,
    "val-core/gsm8k/reward/best@4/mean": 0.82005,
    "val-core/gsm8k/reward/best@4/std": 0.321022902363044,
    "val-core/gsm8k/reward/maj@4/mean": 0.4304,
    "val-core/gsm8k/reward/maj@4/std": 0.40862217682320223,
    "val-aux/gsm8k/reward/std@4": 0.4412579461566196,
    "val-aux/gsm8k/reward/best@2/mean": 0.6295499999999999,
    "val-aux/gsm8k/reward/maj@2/mean": 0.4143,
    "val-aux/gsm8k/reward/worst@4/mean": 0.0576,
    "val-aux/gsm8k/format/maj@4/mean": 0.821,
    "val-aux/gsm8k/format/worst@2/std": 0.4958870839213298,
    "val-core/addition/reward/mean@3": 1 / 3,
    "val-core/addition/reward/best@3/mean": 0.716,
    "val-core/addition/reward/maj@3/mean": 0.284,
    "val-aux/addition/reward/mean@1": 1.0,
    "val-aux/addition/reward/best@2/mean": 0.574,
    "val-aux/addition/reward/worst@3/std": 0.18629009635512025,
}


def metrics(**overrides):
    inputs = {
        "data_sources": SOURCES,
        "group_keys": PROMPTS,
        "scores": SCORES,
        "components": [{"format": f} for f in FORMAT],
        "preds": PREDS,
    }
    return compute_validation_metrics(**(inputs | overrides))


def test_bootstrap_sizes_double_up_to_n():
    assert [bootstrap_sizes(n) for n in (1, 2, 3, 4, 5, 8, 12)] == [
        [],
        [2],
        [2, 3],
        [2, 4],
        [2, 4, 5],
        [2, 4, 8],
        [2, 4, 8, 12],
    ]


def test_majority_takes_the_first_value_of_the_most_frequent_answer():
    values = np.array([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9], [1.0, 1.1, 1.2]])
    votes = np.array([[0, 1, 1], [0, 1, 0], [0, 1, 2], [2, 1, 1]])
    # b twice → its first (0.2); a twice → 0.4; a three-way tie → the first answer (0.7); b → 1.1
    np.testing.assert_array_equal(majority_values(values, votes), [0.2, 0.4, 0.7, 1.1])


def test_the_numbers_are_verls():
    got = metrics()
    assert {k: got[k] for k in VERL} == pytest.approx(VERL, rel=1e-12, abs=0)
    variables = {"reward": SCORES, "format": FORMAT}
    assert got == verl_validation_metrics(SOURCES, PROMPTS, variables, PREDS)  # every metric, bit for bit


def test_hand_checks_and_sections():
    got = metrics()
    # g1's mean 2.1/4 and g2's 1.2/4; std@4 of g1 = sqrt(mean of squares − mean²)
    assert got["val-core/gsm8k/reward/mean@4"] == pytest.approx((2.1 / 4 + 1.2 / 4) / 2)
    g1 = np.array(SCORES[:4])
    assert np.std(g1) == pytest.approx(np.sqrt((g1**2).mean() - g1.mean() ** 2))
    # addition's format is 1 everywhere: every statistic is 1, every std 0
    assert {k: v for k, v in got.items() if k.startswith("val-aux/addition/format/") and "std" not in k} == {
        f"val-aux/addition/format/{name}": 1.0
        for name in ("mean@1", "mean@3", "best@2/mean", "best@3/mean", "worst@2/mean", "worst@3/mean")
        + ("maj@2/mean", "maj@3/mean")
    }
    core = sorted(k.removeprefix("val-core/gsm8k/") for k in got if k.startswith("val-core/gsm8k/"))
    assert core == ["reward/best@4/mean", "reward/best@4/std", "reward/maj@4/mean", "reward/maj@4/std"] + [
        "reward/mean@4"
    ]


def test_one_answer_per_prompt_gives_mean_at_1_only():
    got = compute_validation_metrics(
        data_sources=["gsm8k", "gsm8k", "math"],
        group_keys=["p1", "p2", "p3"],
        scores=[1.0, 0.0, 0.5],
        components=[{"format": 1.0}, {"format": 0.5}, {"format": 0.0}],
        preds=["1", "2", "3"],
    )
    assert got == pytest.approx(
        {
            "val-core/gsm8k/reward/mean@1": 0.5,
            "val-core/math/reward/mean@1": 0.5,
            "val-aux/gsm8k/format/mean@1": 0.75,
            "val-aux/math/format/mean@1": 0.0,
        }
    )


def test_a_prompt_with_a_missing_answer_has_no_majority_vote():
    """verl 0.9.1 votes only on prompts whose every answer has a pred: here only p1 does, whose two
    answers (and scores) agree, so every draw's majority value is 1.0; p2's would be 0.5 or 0."""
    got = compute_validation_metrics(
        data_sources=["s"] * 4,
        group_keys=["p1", "p1", "p2", "p2"],
        scores=[1.0, 1.0, 0.5, 0.0],
        components=[{}] * 4,
        preds=["4", "4", "4", None],
    )
    assert (got["val-core/s/reward/maj@2/mean"], got["val-core/s/reward/maj@2/std"]) == (1.0, 0.0)
    assert got["val-core/s/reward/mean@2"] == pytest.approx(0.625)
    assert "val-core/s/reward/maj@2/mean" not in compute_validation_metrics(
        ["s"] * 2, ["p1", "p1"], [1.0, 0.0], [{}] * 2, preds=None
    )


def test_an_acc_component_is_the_core_variable():
    got = compute_validation_metrics(
        data_sources=["s"] * 2,
        group_keys=["p", "p"],
        scores=[0.9, -1.0],
        components=[{"acc": 1.0}, {"acc": 0.0}],
    )
    assert got["val-core/s/acc/mean@2"] == 0.5 and got["val-aux/s/reward/mean@2"] == pytest.approx(-0.05)
    assert {k.split("/")[0] for k in got if "/reward/" in k} == {"val-aux"}


def test_components_must_name_the_same_variables_in_every_row():
    with pytest.raises(ValueError, match="components"):
        compute_validation_metrics(["a", "a"], ["p", "p"], [1.0, 0.0], [{"format": 1.0}, {"length": 1.0}])


def test_a_score_from_a_function_that_returns_a_number_is_also_verls_acc():
    """verl 0.9.1 records a float score as reward_extra_info["acc"]: acc becomes the core variable
    (val-core/<source>/acc/…, the same numbers reward had), reward moves to val-aux; a component
    named acc stays the component."""
    plain, as_acc = metrics(), metrics(score_as_acc=True)
    for name, value in plain.items():
        variable = name.split("/")[2]
        if variable == "reward" and name.startswith("val-core/"):
            assert as_acc[name.replace("/reward/", "/acc/")] == value
            assert as_acc[name.replace("val-core/", "val-aux/")] == value
            assert name not in as_acc
        else:
            assert as_acc[name] == value
            if variable == "reward":
                assert as_acc[name.replace("/reward/", "/acc/")] == value
    assert len(as_acc) == 2 * sum(name.split("/")[2] == "reward" for name in plain) + sum(
        name.split("/")[2] != "reward" for name in plain
    )
    own = [{"format": f, "acc": 1.0 - f} for f in FORMAT]
    assert metrics(components=own, score_as_acc=True) == metrics(components=own)
