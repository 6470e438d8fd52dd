"""Loading actor, reference and critic from a local path, and the errors for bad paths."""

import json
import shutil

import pytest
import torch

from ppoflow.engine.forward import compute_values
from ppoflow.engine.models import ModelLoadError, load_actor, load_critic, load_reference, load_tokenizer
from ppoflow.engine.ppo import build_sequence_batch


def test_critic_from_actor_directory_has_zero_head_and_no_dropout(tiny_model_dir):
    critic = load_critic(tiny_model_dir)
    assert critic.dropout.p == 0.0
    assert torch.count_nonzero(critic.score.weight) == 0
    actor = load_actor(tiny_model_dir)
    for name, param in critic.model.state_dict().items():
        assert torch.equal(param, actor.model.state_dict()[name]), name


def test_critic_values_are_deterministic_in_train_mode_and_restored_after_save(tiny_model_dir, tmp_path):
    tokenizer, critic = load_tokenizer(tiny_model_dir), load_critic(tiny_model_dir)
    torch.nn.init.normal_(critic.score.weight, std=0.1)
    batch = build_sequence_batch(
        [tokenizer("1 + 2 = ")["input_ids"]] * 3, [[5, 1], [6, 1], [5]], pad_token_id=tokenizer.pad_token_id
    )
    critic.train()
    first = compute_values(critic, batch, batching=2)
    # Dropout is off: the same call in train mode gives the same bits (same shapes, same machine).
    assert torch.equal(first, compute_values(critic, batch, batching=2))
    # Another micro-batch size runs CPU kernels of another shape, which may round differently
    # (Intel vs AMD): the math is the contract there, to float32 precision.
    torch.testing.assert_close(compute_values(critic, batch, batching=3), first, rtol=1e-5, atol=1e-6)
    critic.save_pretrained(tmp_path)
    reloaded = load_critic(tmp_path)
    assert torch.equal(reloaded.score.weight, critic.score.weight)
    assert torch.allclose(compute_values(reloaded, batch, batching=3), first)


def test_reference_is_frozen(tiny_model_dir):
    reference = load_reference(tiny_model_dir)
    assert not reference.training
    assert not any(p.requires_grad for p in reference.parameters())


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="actor model path '.*nowhere' does not exist"):
        load_actor(tmp_path / "nowhere")


def test_directory_without_config_is_not_a_model(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_actor(tmp_path)


def test_model_directory_without_tokenizer_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ModelLoadError, match="has no tokenizer"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("load", [load_actor, load_critic, load_reference])
def test_a_truncated_weights_file_is_one_error_naming_the_file(tiny_model_dir, tmp_path, load):
    shutil.copytree(tiny_model_dir, tmp_path / "model")
    weights = tmp_path / "model/model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(ModelLoadError) as raised:
        load(tmp_path / "model")
    message = str(raised.value)
    assert "model.safetensors is truncated or not a safetensors file" in message
    assert str(tmp_path / "model") in message and "\n" not in message


def test_a_broken_config_is_one_error_naming_the_file(tiny_model_dir, tmp_path):
    shutil.copytree(tiny_model_dir, tmp_path / "model")
    (tmp_path / "model/config.json").write_text('{"model_type": "qwen2", ')
    with pytest.raises(ModelLoadError, match="config.json is not valid JSON"):
        load_actor(tmp_path / "model")
