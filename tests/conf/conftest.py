"""Fixtures shared by the config tests."""

import pytest


@pytest.fixture
def model_dir(tmp_path):
    """A directory that passes the model checks: config.json and a tokenizer file."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "tokenizer.json").write_text("{}")
    return path
