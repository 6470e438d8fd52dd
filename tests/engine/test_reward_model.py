"""Reward models: the score at the last valid token (as transformers' own classifier computes it on an
unpadded row), loading errors, the AUC, and the labelled addition data."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSequenceClassification

from ppoflow.engine.forward import compute_scores
from ppoflow.engine.models import ModelLoadError, load_reward_model, load_tokenizer, reward_model_from_policy
from ppoflow.engine.ppo import build_sequence_batch
from ppoflow.engine.reward_model import separation_auc
from ppoflow.engine.rewards import addition_components
from ppoflow.engine.tiny import labelled_addition_responses


@pytest.fixture(scope="module")
def reward_dir(tiny_model_dir, tmp_path_factory):
    """A reward model from the tiny policy with a random (untrained) score head, saved."""
    tokenizer = load_tokenizer(tiny_model_dir)
    model = reward_model_from_policy(tiny_model_dir, pad_token_id=tokenizer.pad_token_id)
    assert torch.count_nonzero(model.score.weight) == 0  # a new head scores everything 0
    torch.manual_seed(0)
    torch.nn.init.normal_(model.score.weight, std=0.5)
    directory = tmp_path_factory.mktemp("reward-model")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def rows(tokenizer):
    """Prompts of different lengths after left padding ("9 + 10 = " is longest), responses that end
    with EOS or not."""
    prompts = [tokenizer(p)["input_ids"] for p in ("1 + 2 = ", "9 + 10 = ", "3 + 4 = ")]
    eos = [tokenizer.eos_token_id]
    responses = [
        tokenizer("3")["input_ids"] + eos,
        tokenizer("19")["input_ids"],
        tokenizer(" 9")["input_ids"] + eos,
    ]
    return prompts, responses


def test_score_is_the_classifier_output_at_the_last_valid_token(reward_dir):
    tokenizer = load_tokenizer(reward_dir)
    prompts, responses = rows(tokenizer)
    batch = build_sequence_batch(prompts, responses, pad_token_id=tokenizer.pad_token_id)
    scores = compute_scores(load_reward_model(reward_dir), batch, micro_batch_size=2)
    plain = AutoModelForSequenceClassification.from_pretrained(reward_dir).eval()
    with torch.no_grad():  # transformers' own pooling, one unpadded row at a time
        expected = [
            plain(torch.tensor([p + r])).logits.item() for p, r in zip(prompts, responses, strict=True)
        ]
    torch.testing.assert_close(scores, torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert len(set(scores.tolist())) == 3


def test_padding_and_micro_batches_do_not_change_the_score(reward_dir):
    tokenizer = load_tokenizer(reward_dir)
    model = load_reward_model(reward_dir)
    prompts, responses = rows(tokenizer)
    batch = build_sequence_batch(prompts, responses, pad_token_id=tokenizer.pad_token_id)
    first = compute_scores(model, batch, micro_batch_size=3)
    batch.prompt_ids[batch.prompt_mask == 0] = 7  # garbage where the masks are 0
    batch.response_ids[batch.response_mask == 0] = 9
    torch.testing.assert_close(compute_scores(model, batch, micro_batch_size=3), first, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compute_scores(model, batch, micro_batch_size=1), first, rtol=1e-5, atol=1e-6)


def test_a_language_model_or_a_two_label_classifier_is_not_a_reward_model(
    tiny_model_dir, reward_dir, tmp_path
):
    with pytest.raises(ModelLoadError, match="no trained score head .*not a reward model"):
        load_reward_model(tiny_model_dir)
    two = tmp_path / "two"
    AutoModelForSequenceClassification.from_pretrained(
        reward_dir, num_labels=2, ignore_mismatched_sizes=True
    ).save_pretrained(two)
    with pytest.raises(ModelLoadError, match="has 2 labels; a reward model has one"):
        load_reward_model(two)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((reward_dir / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="no \\*.safetensors weights .*does not unpickle"):
        load_reward_model(pickled)


def test_a_truncated_weights_file_is_named(reward_dir, tmp_path):
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (damaged / name).write_bytes((reward_dir / name).read_bytes())
    weights = load_file(reward_dir / "model.safetensors")
    save_file(weights, damaged / "model.safetensors")
    data = (damaged / "model.safetensors").read_bytes()
    (damaged / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors is truncated"):
        load_reward_model(damaged)


def test_auc_hand_numbers():
    labels = torch.tensor([1, 0, 1, 0])
    assert separation_auc(torch.tensor([3.0, 1.0, 2.0, 0.0]), labels) == 1.0
    assert separation_auc(torch.tensor([0.0, 1.0, 2.0, 3.0]), labels) == 0.25  # pairs (2>1): 1 of 4
    assert separation_auc(torch.tensor([1.0, 1.0, 1.0, 1.0]), labels) == 0.5  # ties count ½
    with pytest.raises(ValueError, match="both labels"):
        separation_auc(torch.tensor([1.0, 2.0]), torch.tensor([1, 1]))


def test_labelled_addition_responses_are_labelled_by_correctness():
    records = labelled_addition_responses(400, seed=3)
    assert records == labelled_addition_responses(400, seed=3)
    for r in records:
        truth = str(sum(int(n) for n in r["prompt"].split(" = ")[0].split(" + ")))
        assert r["label"] == addition_components(r["response"], truth)["correctness"], r
    assert 0.4 < sum(r["label"] for r in records) / len(records) < 0.6
    rambling = [r for r in records if r["finish_reason"] == "length"]
    assert rambling and all(len(r["response"]) == 4 for r in rambling)
