"""A model saved again as it trains: after the first save through transformers, the same files byte
for byte without it, and transformers again whenever the recipe may no longer hold."""

import json
from pathlib import Path

import pytest
import torch

from ppoflow.engine.models import load_actor, load_critic, load_tokenizer
from ppoflow.tasks.storage.pretrained_files import NOT_REPRODUCED, WEIGHTS_FILE, _recipes, save_model_files


def _transformers_saves(model, tokenizer, directory):
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _files(directory) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def _train(model, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.01)


class CountedSaves:
    """Counts the saves that go through transformers."""

    def __init__(self, model, monkeypatch):
        self.count = 0
        original = model.save_pretrained

        def counted(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(model, "save_pretrained", counted)


@pytest.fixture(params=["own head", "tied head"])
def model_dir(request, tiny_model_dir, tied_tiny_model_dir):
    """The embedded default's tiny model (its output head its own) and one whose head is tied to its
    embedding (SmolLM2's is): a later save must reproduce both."""
    return tiny_model_dir if request.param == "own head" else tied_tiny_model_dir


@pytest.mark.parametrize("load", [load_actor, load_critic], ids=["actor", "critic"])
def test_later_saves_write_what_transformers_writes_without_it(model_dir, tmp_path, monkeypatch, load):
    model, tokenizer = load(model_dir), load_tokenizer(model_dir)
    saves = CountedSaves(model, monkeypatch)
    for step in range(3):
        _train(model, seed=step)
        ours, theirs = tmp_path / f"ours-{step}", tmp_path / f"theirs-{step}"
        ours.mkdir(), theirs.mkdir()
        save_model_files(model, tokenizer, ours)
        _transformers_saves(model, tokenizer, theirs)
        assert _files(ours) == _files(theirs), step
    assert saves.count == 1 + 3  # the first save of save_model_files, and every _transformers_saves
    restored = load(tmp_path / "ours-2")
    pairs = zip(model.state_dict().values(), restored.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_a_changed_config_or_dtype_goes_through_transformers_again(model_dir, tmp_path, monkeypatch):
    model, tokenizer = load_actor(model_dir), load_tokenizer(model_dir)
    saves = CountedSaves(model, monkeypatch)
    other_tokenizer = load_tokenizer(model_dir)
    steps = [  # (what changes before the save, whether it goes through transformers)
        ("first save", lambda: None, True),
        ("weights only", lambda: _train(model, seed=1), False),
        ("config", lambda: setattr(model.config, "use_cache", not model.config.use_cache), True),
        ("generation config", lambda: setattr(model.generation_config, "max_new_tokens", 7), True),
        ("weights only, again", lambda: _train(model, seed=2), False),
        ("another tokenizer (saved by transformers every time)", lambda: None, False),
        ("dtype", lambda: model.to(torch.bfloat16), True),
        ("weights only, in bfloat16", lambda: _train(model, seed=3), False),
    ]
    for name, change, through_transformers in steps:
        change()
        if name.startswith("another tokenizer"):
            tokenizer = other_tokenizer
        ours, theirs = tmp_path / f"ours-{name}", tmp_path / f"theirs-{name}"
        ours.mkdir(), theirs.mkdir()
        before = saves.count
        save_model_files(model, tokenizer, ours)
        assert saves.count - before == through_transformers, name
        _transformers_saves(model, tokenizer, theirs)
        assert _files(ours) == _files(theirs), name


def test_a_model_whose_save_is_not_reproduced_always_goes_through_transformers(
    model_dir, tmp_path, monkeypatch
):
    """Weights of two dtypes, which safetensors orders by dtype first: no recipe."""
    model, tokenizer = load_actor(model_dir), load_tokenizer(model_dir)
    model.model.norm.to(torch.bfloat16)
    saves = CountedSaves(model, monkeypatch)
    for step in range(2):
        ours, theirs = tmp_path / f"ours-{step}", tmp_path / f"theirs-{step}"
        ours.mkdir(), theirs.mkdir()
        save_model_files(model, tokenizer, ours)
        _transformers_saves(model, tokenizer, theirs)
        assert _files(ours) == _files(theirs)
    assert saves.count == 2 + 2


@pytest.mark.parametrize("change", ["untied head", "added buffer", "added layer"])
def test_a_changed_state_dict_goes_through_transformers_again(
    tied_tiny_model_dir, tmp_path, monkeypatch, change
):
    """Entries the first save did not hold, or a head no longer tied to the embedding (its own memory:
    transformers then writes it), are written as transformers writes them."""
    model, tokenizer = load_actor(tied_tiny_model_dir), load_tokenizer(tied_tiny_model_dir)
    saves = CountedSaves(model, monkeypatch)
    (tmp_path / "first").mkdir()
    save_model_files(model, tokenizer, tmp_path / "first")
    if change == "untied head":
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
        with torch.no_grad():
            model.lm_head.weight.mul_(2)
    elif change == "added buffer":
        model.register_buffer("extra", torch.arange(3.0))
    else:
        model.value_head = torch.nn.Linear(model.config.hidden_size, 1)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir(), theirs.mkdir()
    save_model_files(model, tokenizer, ours)
    assert saves.count == 2
    _transformers_saves(model, tokenizer, theirs)
    assert _files(ours) == _files(theirs)


def _rewrites_weights(model, monkeypatch, rewrite):
    """`model.save_pretrained` followed by `rewrite(directory)`: what another transformers might write."""
    original = model.save_pretrained

    def save(directory, *args, **kwargs):
        original(directory, *args, **kwargs)
        rewrite(Path(directory))

    monkeypatch.setattr(model, "save_pretrained", save)


def _other_values(directory):
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / WEIGHTS_FILE)
    other = {name: t + 1 for name, t in tensors.items()}
    save_file(other, directory / WEIGHTS_FILE, metadata={"format": "pt"})


def _names_its_folder(directory):
    (directory / "notes.json").write_text(json.dumps({"saved_in": str(directory)}))


def _another_weights_file(directory):
    (directory / "extra_weights.safetensors").write_bytes((directory / WEIGHTS_FILE).read_bytes())


@pytest.mark.parametrize(
    "rewrite",
    [_other_values, _names_its_folder, _another_weights_file],
    ids=["other bytes", "names its folder", "another weights file"],
)
def test_a_first_save_ppoflow_does_not_reproduce_leaves_every_save_to_transformers(
    model_dir, tmp_path, monkeypatch, rewrite
):
    model, tokenizer = load_actor(model_dir), load_tokenizer(model_dir)
    _rewrites_weights(model, monkeypatch, rewrite)
    for step in range(3):
        _train(model, seed=step)
        ours, theirs = tmp_path / f"ours-{step}", tmp_path / f"theirs-{step}"
        ours.mkdir(), theirs.mkdir()
        save_model_files(model, tokenizer, ours)
        assert _recipes[model] == NOT_REPRODUCED
        _transformers_saves(model, tokenizer, theirs)
        if rewrite is _names_its_folder:  # each names its own folder
            (ours / "notes.json").write_text(json.dumps({"saved_in": str(theirs)}))
        assert _files(ours) == _files(theirs), step
