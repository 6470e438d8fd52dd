"""LoRA adapters (engine/lora.py) on the tiny model: new adapters leave the base's outputs exactly as
they were and are all that trains; the adapters-off view is the base, sharing its weights; saved
adapters load with peft itself; merged weights give the adapted model's outputs."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from ppoflow.engine.forward import compute_log_probs, compute_values
from ppoflow.engine.lora import (
    AdaptersOff,
    LoraSpec,
    add_adapters,
    load_adapters,
    merge_adapters,
    save_adapters,
    trainable_parameters,
)
from ppoflow.engine.models import ModelLoadError, load_actor, load_critic
from ppoflow.engine.optim import build_optimizer
from ppoflow.engine.ppo import build_sequence_batch
from ppoflow.engine.update import update_actor

from .settings import actor_settings, optim_settings

SPEC = LoraSpec(rank=8, alpha=16, target_modules="all-linear", exclude_modules=None, seed=1)
ADAPTER_PARAMETERS = 3 * 8 * (2 * (128 + 128) + 2 * (128 + 64) + 3 * (128 + 256))
"""The tiny model: 3 layers; rank 8 × (in + out) of q_proj, o_proj (128 → 128), k_proj, v_proj
(128 → 64), gate_proj, up_proj (128 → 256) and down_proj (256 → 128) = 49,152."""


@pytest.fixture
def batch():
    """Four prompts with responses of unequal length (padding included)."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [6]]
    responses = [[3, 4, 1], [5], [7, 8], [9, 10, 11, 1]]
    return build_sequence_batch(prompts, responses, pad_token_id=0)


def _log_probs(model, batch, micro_batch_size=4):
    return compute_log_probs(model, batch, temperature=1.0, batching=micro_batch_size)


def _trained(model):
    """The adapters moved off their init (B = 0 would leave every output unchanged)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return model


def test_new_adapters_leave_the_base_outputs_unchanged_and_only_they_train(tiny_model_dir, batch):
    base = load_actor(tiny_model_dir)
    adapted = add_adapters(load_actor(tiny_model_dir), SPEC)
    assert torch.equal(_log_probs(adapted, batch, 1), _log_probs(base, batch, 1))  # B = 0
    trainable = [name for name, p in adapted.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    assert trainable_parameters(adapted) == ADAPTER_PARAMETERS
    assert not any("lm_head" in name for name in trainable)  # all-linear spares the output head


def test_adapter_init_is_seeded_and_draws_nothing_from_torchs_random_stream(tiny_model_dir):
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    first = add_adapters(load_actor(tiny_model_dir), SPEC)
    assert torch.equal(torch.rand(3), expected)
    again = add_adapters(load_actor(tiny_model_dir), SPEC)
    other = add_adapters(load_actor(tiny_model_dir), LoraSpec(8, 16, "all-linear", None, seed=2))
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    weights = [dict(m.named_parameters())[name] for m in (first, again, other)]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])


def test_the_critics_value_head_trains_whole_beside_its_adapters(tiny_model_dir, batch):
    critic = add_adapters(load_critic(tiny_model_dir), SPEC, value_head=True)
    head = [name for name, p in critic.named_parameters() if p.requires_grad and ".lora_" not in name]
    assert sorted(head) == [
        "base_model.model.score.modules_to_save.default.bias",
        "base_model.model.score.modules_to_save.default.weight",
    ]
    assert trainable_parameters(critic) == ADAPTER_PARAMETERS + 128 + 1  # the head: 128 weights, 1 bias
    assert torch.equal(compute_values(critic, batch, batching=4), torch.zeros(4, 4))  # zero head


def test_adapters_off_is_the_base_model_on_the_same_weights(tiny_model_dir, batch):
    base = load_actor(tiny_model_dir)
    adapted = _trained(add_adapters(load_actor(tiny_model_dir), SPEC))
    reference = AdaptersOff(adapted)
    assert (_log_probs(adapted, batch) - _log_probs(base, batch)).abs().max() > 1e-3
    assert torch.equal(_log_probs(reference, batch, 1), _log_probs(base, batch, 1))
    # a whole batch takes peft's layers another way through the same matmuls: float32 rounding
    assert torch.allclose(_log_probs(reference, batch), _log_probs(base, batch), atol=1e-5, rtol=0)
    shared = {p.data_ptr() for p in adapted.parameters()}
    assert all(p.data_ptr() in shared for p in reference.parameters())  # no second copy
    assert adapted.training and all(m.disable_adapters is False for m in _lora_layers(adapted))


def _lora_layers(model):
    return [m for m in model.modules() if hasattr(m, "disable_adapters") and hasattr(m, "lora_A")]


def test_saved_adapters_are_peft_files_that_peft_loads_as_the_same_policy(tiny_model_dir, batch, tmp_path):
    adapted = _trained(add_adapters(load_actor(tiny_model_dir), SPEC))
    (tmp_path / "a").mkdir()
    save_adapters(adapted, tmp_path / "a", base_model_path=str(tiny_model_dir))
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    saved = load_file(tmp_path / "a/adapter_model.safetensors")
    assert sum(t.numel() for t in saved.values()) == ADAPTER_PARAMETERS  # adapters only
    expected = _log_probs(adapted, batch)
    by_peft = PeftModel.from_pretrained(load_actor(tiny_model_dir), str(tmp_path / "a"))
    assert torch.equal(_log_probs(by_peft, batch), expected)
    reloaded = load_adapters(load_actor(tiny_model_dir), tmp_path / "a", trainable=True)
    assert torch.equal(_log_probs(reloaded, batch), expected)
    assert trainable_parameters(reloaded) == ADAPTER_PARAMETERS
    (tmp_path / "b").mkdir()
    save_adapters(reloaded, tmp_path / "b", base_model_path=str(tiny_model_dir))
    for name in ("adapter_config.json", "adapter_model.safetensors"):  # a function of the weights
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_merged_weights_give_the_adapted_policy_on_a_plain_model(tiny_model_dir, batch):
    adapted = _trained(add_adapters(load_actor(tiny_model_dir), SPEC))
    merged = merge_adapters(copy.deepcopy(adapted))
    assert type(merged).__name__ == "Qwen2ForCausalLM" and not _lora_layers(merged)
    # W + 2·B·A summed into the weights once rounds differently from 2·B·(A·x) added per forward: a
    # few float32 ulps of each log-prob (1.1e-5 at -12.1, 1e-6 of it, on the tiny model); a merge
    # that lost or doubled an adapter is off by 1e-2 or more
    assert torch.allclose(_log_probs(merged, batch), _log_probs(adapted, batch), atol=1e-5, rtol=1e-5)
    assert _lora_layers(adapted)  # merged into a copy: the adapted model still trains adapters


def test_target_modules_that_match_no_layer_name_the_layers_there_are(tiny_model_dir):
    with pytest.raises(ModelLoadError, match=r"target_modules=\['qkv'\].*k_proj, lm_head, o_proj, q_proj"):
        add_adapters(load_actor(tiny_model_dir), LoraSpec(8, 16, ("qkv",), None, 1))


def test_a_folder_without_adapters_or_with_truncated_ones_is_refused(tiny_model_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="holds no LoRA adapters"):
        load_adapters(load_actor(tiny_model_dir), tmp_path, trainable=False)
    save_adapters(add_adapters(load_actor(tiny_model_dir), SPEC), tmp_path, base_model_path="base")
    weights = tmp_path / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:500])
    with pytest.raises(ModelLoadError, match="adapter_model.safetensors is truncated"):
        load_adapters(load_actor(tiny_model_dir), tmp_path, trainable=False)


def test_adapters_train_the_same_with_gradient_checkpointing(tiny_model_dir, batch):
    """model.enable_gradient_checkpointing reaches the model under peft's wrapper: the adapters come
    out bit for bit the same, and the model is left without checkpointing."""
    advantages = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(2))
    trained = []
    for checkpointing in (False, True):
        model = add_adapters(load_actor(tiny_model_dir), SPEC)
        optimizer, _ = build_optimizer(model, optim_settings(lr=1e-2))
        old = _log_probs(model, batch)
        settings = actor_settings(mini_batch_size=4, micro_batch_size=2, gradient_checkpointing=checkpointing)
        update_actor(
            model,
            optimizer,
            batch,
            old_log_probs=old,
            advantages=advantages,
            ref_log_probs=None,
            settings=settings,
            seed=0,
        )
        assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        trained.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
    plain, checkpointed = trained
    assert all(torch.equal(plain[name], checkpointed[name]) for name in plain)
    assert any(
        not torch.equal(plain[name], torch.zeros_like(plain[name])) for name in plain if "lora_B" in name
    )
