"""Shared fixtures: the warm-started tiny model, built once per test session."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(int(os.environ.get("PPOFLOW_NUM_THREADS", "1")))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A saved, warm-started tiny addition model (HF directory with tokenizer)."""
    from ppoflow.engine.tiny import build_tiny_model, build_tiny_tokenizer, warm_start

    path = tmp_path_factory.mktemp("tiny-addition")
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, seed=1)
    warm_start(model, tokenizer, seed=1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
