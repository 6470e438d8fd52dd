"""Fixtures shared by the task tests."""

from __future__ import annotations

import pytest

from ppoflow.engine.tiny import build_tiny_tokenizer
from ppoflow.tasks.pipeline.states import ModelState

# The tiny tokenizer is one token per character; this template renders a chat as its contents only,
# so a message prompt is as many tokens as its text.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer_state(tmp_path_factory):
    """The built-in tiny model's tokenizer (as tiny_model_dir saves it, without the seconds of warm
    start) with a chat template, as a base-model state."""
    directory = tmp_path_factory.mktemp("chat-tokenizer")
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return ModelState(role="actor", lineage="test", step=0, checkpoint=str(directory))
