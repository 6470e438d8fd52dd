"""`ppoflow reward-model` on a JSONL file of labelled responses: the saved model loads as a reward
model and its inputs are what a run feeds it; bad input is one line and exit 2."""

from __future__ import annotations

import json
import os

import torch

from ppoflow.cli import main
from ppoflow.engine.models import load_reward_model, load_tokenizer
from ppoflow.reward_model_command import _encoded, read_labelled

RECORDS = [
    {"prompt": "1 + 2 = ", "response": "3", "label": 1},
    {"prompt": "1 + 2 = ", "response": "4", "label": 0},
    {"prompt": "2 + 2 = ", "response": "4 + 1", "label": 0, "finish_reason": "length"},
] * 10


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_reward_model_trained_from_a_jsonl_file_is_saved_and_loads(tiny_model_dir, tmp_path, capsys):
    data, out = write(tmp_path / "labelled.jsonl", RECORDS), tmp_path / "rm"
    args = ["reward-model", "--data", str(data), "--base", str(tiny_model_dir), "--out", str(out)]
    assert main([*args, "--steps", "3", "--num-threads", "1"]) == 0
    printed = capsys.readouterr().out
    assert "3 steps on 27 labelled responses" in printed and "held out       3 responses · AUC" in printed
    model = load_reward_model(out)
    assert torch.count_nonzero(model.score.weight) > 0  # the zero head moved
    assert json.loads((out / "reward_model_training.json").read_text())["recipe"]["steps"] == 3
    umask = os.umask(0o077)
    os.umask(umask)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in [out, *out.iterdir()]}
    assert modes == {p: oct((0o777 if p == "rm" else 0o666) & ~umask) for p in modes}  # as the umask allows
    assert main([*args, "--steps", "3"]) == 2  # the folder is not overwritten
    assert "exists and is not an empty folder" in capsys.readouterr().err


def test_inputs_are_the_prompt_the_response_and_eos_unless_it_ran_into_the_limit(tiny_model_dir, tmp_path):
    tokenizer = load_tokenizer(tiny_model_dir)
    batch, labels = _encoded(tokenizer, read_labelled(write(tmp_path / "d.jsonl", RECORDS[:3])))
    texts = [
        tokenizer.decode(torch.cat([p[m > 0], r[n > 0]]))
        for p, m, r, n in zip(
            batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask, strict=True
        )
    ]
    assert texts == ["1 + 2 = 3<eos>", "1 + 2 = 4<eos>", "2 + 2 = 4 + 1"]
    assert labels.tolist() == [1.0, 0.0, 0.0]


def test_a_bad_line_is_named_with_its_file_and_number(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text(
        json.dumps(RECORDS[0]) + "\n" + json.dumps({"prompt": "1 + 1 = ", "response": "2"}) + "\n"
    )
    assert main(["reward-model", "--data", str(data), "--out", str(tmp_path / "rm")]) == 2
    assert f"{data}:2: not a JSON object with prompt, response and label" in capsys.readouterr().err
    write(data, [{**RECORDS[0], "label": 0.5}])
    assert main(["reward-model", "--data", str(data), "--out", str(tmp_path / "rm")]) == 2
    assert f"{data}:1: prompt must be text" in capsys.readouterr().err
