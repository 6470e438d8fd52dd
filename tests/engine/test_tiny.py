"""The built-in tiny model: tokenizer round trip, size, warm start."""

import json

import torch
from transformers import PreTrainedTokenizerFast

from ppoflow.engine.models import load_actor, load_tokenizer
from ppoflow.engine.tiny import (
    all_addition_problems,
    build_tiny_model,
    build_tiny_tokenizer,
    greedy_accuracy,
    sample_addition_problems,
)


def test_character_tokenizer_round_trips_through_save_pretrained(tmp_path):
    tokenizer = build_tiny_tokenizer()
    ids = tokenizer("7 + 8 = ")["input_ids"]
    assert len(ids) == len("7 + 8 = ")  # one token per character, spaces included
    assert tokenizer.decode(ids) == "7 + 8 = "
    build_tiny_model(tokenizer, seed=0).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    for reloaded in (load_tokenizer(tmp_path), PreTrainedTokenizerFast.from_pretrained(tmp_path)):
        assert reloaded("7 + 8 = ")["input_ids"] == ids
        assert reloaded.eos_token_id == tokenizer.eos_token_id
        assert reloaded.pad_token_id == tokenizer.pad_token_id
        assert reloaded.padding_side == "left"


def test_tiny_model_is_qwen2_style_and_about_half_a_million_parameters():
    model = build_tiny_model(build_tiny_tokenizer(), seed=0)
    assert model.config.model_type == "qwen2"
    assert 300_000 < sum(p.numel() for p in model.parameters()) < 700_000


def test_addition_problems():
    problems = all_addition_problems()
    assert len({p.prompt for p in problems}) == 100
    assert problems[37].prompt == "3 + 7 = " and problems[37].answer == "10"
    assert sample_addition_problems(5, seed=3) == sample_addition_problems(5, seed=3)


def test_warm_start_reaches_a_plausible_base(tiny_model_dir):
    """It stops at the first check at or above its target of 0.75 (checks are 10 steps apart, so a
    base may land above it), well before its step limit; the saved weights score what it reported."""
    tokenizer, model = load_tokenizer(tiny_model_dir), load_actor(tiny_model_dir)
    accuracy = greedy_accuracy(model, tokenizer, all_addition_problems())
    report = json.loads((tiny_model_dir / "warm_start.json").read_text())
    assert accuracy == report["accuracy"] and 0.75 <= accuracy <= 0.95
    assert report["steps"] < 1000  # seeds 1-32: 130-710 steps


def test_the_head_is_its_own_unless_tied():
    """The embedded default's output head has its own weights (an answer digit's update must not move
    how that digit is read in the prompts); the calculator model's is tied to the embedding."""
    tokenizer = build_tiny_tokenizer()
    own, tied = (build_tiny_model(tokenizer, seed=0, tie_embeddings=tie) for tie in (False, True))
    assert own.lm_head.weight.data_ptr() != own.model.embed_tokens.weight.data_ptr()
    assert not torch.equal(own.lm_head.weight, own.model.embed_tokens.weight)
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    assert not own.config.tie_word_embeddings and tied.config.tie_word_embeddings
