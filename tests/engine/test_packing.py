"""use_remove_padding: a micro-batch's rows packed into one sequence give the padded pass's
log-probs, entropy, values, gradients and updates (float32, within 1e-5 for outputs, 1e-4 of a
gradient's norm, 1e-6 for weights after an update: other shapes round differently), also for LoRA
models, and a model that cannot keep packed sequences apart is refused."""

import copy

import pytest
import torch

from ppoflow.engine import packing
from ppoflow.engine.batching import ForwardBatching
from ppoflow.engine.forward import (
    SequenceBatch,
    compute_log_probs,
    compute_values,
    policy_forward,
    value_forward,
)
from ppoflow.engine.models import load_actor, load_critic
from ppoflow.engine.ppo import build_sequence_batch
from ppoflow.engine.update import update_actor, update_critic

from .settings import actor_settings, critic_settings

PROMPTS = [[5, 6], [7, 8, 9], [5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15], [9], [10, 11, 12]]
RESPONSES = [[11, 1], [14], [16, 17, 18, 19, 1], [17, 18, 1], [4, 4, 4, 4, 4, 4, 1], [6, 1]]


@pytest.fixture(scope="module")
def batch():
    return build_sequence_batch(PROMPTS, RESPONSES, pad_token_id=0)


def test_pack_lays_the_rows_valid_tokens_out_one_after_another():
    batch = SequenceBatch(
        prompt_ids=torch.tensor([[0, 5, 6], [7, 8, 9]]),
        prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
        response_ids=torch.tensor([[11, 1, 0], [14, 0, 0]]),
        response_mask=torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]),
    )
    packed = batch.packed()
    assert packed.input_ids.tolist() == [[5, 6, 11, 1, 7, 8, 9, 14]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert packed.cu_seq_lens.tolist() == [0, 4, 8]
    assert packed.cu_seq_lens.dtype == torch.int32
    # the position before each response token: 6 predicts 11, 11 predicts 1, 9 predicts 14
    assert packed.targets.tolist() == [1, 2, 6]
    assert packed.rows.tolist() == [0, 0, 1] and packed.columns.tolist() == [0, 1, 0]
    assert packed.unpack(torch.tensor([0.5, 1.5, 2.5])).tolist() == [[0.5, 1.5, 0.0], [2.5, 0.0, 0.0]]


def test_rows_that_cannot_be_packed_are_refused():
    ids = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="gap inside a response"):
        SequenceBatch(ids, torch.ones(1, 3), ids, torch.tensor([[1.0, 0.0, 1.0]])).packed()
    with pytest.raises(ValueError, match="without prompt tokens"):
        SequenceBatch(ids, torch.zeros(1, 3), ids, torch.ones(1, 3)).packed()


def test_packed_log_probs_entropy_and_gradients_equal_the_padded_ones(tiny_model_dir, batch):
    model = load_actor(tiny_model_dir)
    weights = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
    outputs, grads = [], []
    for remove_padding in (False, True):
        model.zero_grad()
        log_probs, entropy = policy_forward(
            model, batch, temperature=0.7, with_entropy=True, remove_padding=remove_padding
        )
        ((log_probs + entropy) * weights * batch.response_mask).sum().backward()
        outputs.append((log_probs * batch.response_mask, entropy * batch.response_mask))
        grads.append([p.grad.clone() for p in model.parameters()])
    padded, packed = outputs
    assert torch.equal(packed[0] == 0, batch.response_mask == 0)  # zero exactly where there is no token
    torch.testing.assert_close(packed[0], padded[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(packed[1], padded[1], rtol=0, atol=1e-5)
    for a, b in zip(*grads, strict=True):  # a gradient sums over every token: within 1e-4 of its norm
        assert float((b - a).norm()) <= 1e-4 * float(a.norm()) + 1e-7


def test_packed_values_equal_the_padded_ones(tiny_model_dir, batch):
    critic = load_critic(tiny_model_dir)
    torch.nn.init.normal_(critic.score.weight, generator=torch.Generator().manual_seed(0))  # not all zero
    padded = value_forward(critic, batch) * batch.response_mask
    packed = value_forward(critic, batch, remove_padding=True)
    # values reach ~3 here: float32 kernels of other shapes round them within a few 1e-6 of that
    # (1.6e-5 seen on an AMD EPYC), so the tolerance is relative too
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)


def test_passes_by_token_budget_and_packed_equal_fixed_padded_ones(tiny_model_dir, batch):
    model, critic = load_actor(tiny_model_dir), load_critic(tiny_model_dir)
    torch.nn.init.normal_(critic.score.weight, generator=torch.Generator().manual_seed(0))
    fixed_log_probs = compute_log_probs(model, batch, temperature=1.0, batching=4)
    fixed_values = compute_values(critic, batch, batching=4)
    for batching in (
        ForwardBatching(4, remove_padding=True),
        ForwardBatching(1, max_token_len=12, remove_padding=True),  # a few rows per pass
        ForwardBatching(1, max_token_len=20, remove_padding=False),
    ):
        log_probs = compute_log_probs(model, batch, temperature=1.0, batching=batching)
        torch.testing.assert_close(log_probs, fixed_log_probs, rtol=0, atol=1e-5)
        # The random score head gives values near 7.7, 1.3e-5 apart between pass shapes: float32
        # rounding (1.7e-6 of the value).
        torch.testing.assert_close(
            compute_values(critic, batch, batching=batching), fixed_values, rtol=1e-5, atol=1e-5
        )


def _inputs_seen(model) -> list[dict]:
    seen: list[dict] = []
    model.register_forward_pre_hook(lambda _, args, kwargs: seen.append(kwargs), with_kwargs=True)
    return seen


def test_a_packed_pass_runs_each_micro_batch_as_one_row_of_its_tokens(tiny_model_dir, batch):
    model = load_actor(tiny_model_dir)
    compute_log_probs(model, batch, temperature=1.0, batching=ForwardBatching(3, remove_padding=True))
    seen = _inputs_seen(model)
    compute_log_probs(model, batch, temperature=1.0, batching=ForwardBatching(3, remove_padding=True))
    lengths = [len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    assert [tuple(kw["input_ids"].shape) for kw in seen] == [(1, sum(lengths[:3])), (1, sum(lengths[3:]))]
    assert "attention_mask" not in seen[0]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_updates_on_packed_micro_batches_equal_padded_updates(tiny_model_dir, batch, checkpointing):
    advantages = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(1))
    base = load_actor(tiny_model_dir)
    old = compute_log_probs(base, batch, temperature=1.0, batching=6)
    trained, metrics = [], []
    for remove_padding in (False, True):
        model = copy.deepcopy(base)
        settings = actor_settings(
            ppo_epochs=1, mini_batch_size=6, micro_batch_size=2, grad_clip=1e9, entropy_coeff=0.01,
            remove_padding=remove_padding, gradient_checkpointing=checkpointing,
        )  # fmt: skip
        result = update_actor(
            model, torch.optim.SGD(model.parameters(), lr=0.1), batch, old_log_probs=old,
            advantages=advantages, ref_log_probs=None, settings=settings, seed=0,
        )  # fmt: skip
        trained.append(model)
        metrics.append(result.mean_metrics())
    for (name, a), b in zip(trained[0].named_parameters(), trained[1].parameters(), strict=True):
        # weights up to ~2: an update's float32 rounding moves them a few ulp (1.3e-6 on an AMD EPYC)
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=name)
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):  # the norm is ~115: relative too
        assert metrics[1][key] == pytest.approx(metrics[0][key], abs=1e-5, rel=1e-6), key
    critic = load_critic(tiny_model_dir)
    values = compute_values(critic, batch, batching=6)
    returns = torch.randn(values.shape, generator=torch.Generator().manual_seed(2)) * batch.response_mask
    critics = []
    for remove_padding in (False, True):
        model = copy.deepcopy(critic)
        settings = critic_settings(
            ppo_epochs=1,
            mini_batch_size=6,
            micro_batch_size=4,
            grad_clip=1e9,
            remove_padding=remove_padding,
            gradient_checkpointing=checkpointing,
        )
        update_critic(
            model, torch.optim.SGD(model.parameters(), lr=0.1), batch, values=values, returns=returns,
            settings=settings, seed=0,
        )  # fmt: skip
        critics.append(model)
    for a, b in zip(critics[0].parameters(), critics[1].parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_unpacked_calls_are_unchanged_by_packed_attention(tiny_model_dir, batch):
    """A model switched to packed attention (which generation then runs through) gives the same
    padded outputs, bit for bit: unpacked calls are sdpa's own."""
    model = load_actor(tiny_model_dir).eval()
    inputs = batch.model_inputs()
    with torch.no_grad():
        before = model(**inputs, use_cache=False).logits
        policy_forward(model, batch, temperature=1.0, with_entropy=False, remove_padding=True)
        assert model.config._attn_implementation == packing.VARLEN_SDPA
        assert torch.equal(model(**inputs, use_cache=False).logits, before)


def test_an_attention_that_cannot_pack_is_refused_by_name(tiny_model_dir, batch):
    model = load_actor(tiny_model_dir)
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="use_remove_padding: Qwen2ForCausalLM runs attention as 'eager'"):
        policy_forward(model, batch, temperature=1.0, with_entropy=False, remove_padding=True)


class _DropsPositions(torch.nn.Module):
    """A model that ignores position_ids and packed boundaries (as a model outside transformers'
    attention interface would): packed sequences then attend to each other."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, **kwargs):
        for name in ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
            kwargs.pop(name, None)
        return self.module(**kwargs)


def test_a_model_that_mixes_packed_sequences_is_refused(tiny_model_dir, batch):
    model = _DropsPositions(load_actor(tiny_model_dir))
    with pytest.raises(ValueError, match="mixes packed sequences"):
        policy_forward(model, batch, temperature=1.0, with_entropy=False, remove_padding=True)


def test_packed_passes_of_a_lora_model_and_its_adapters_off_view_equal_padded_ones(tiny_model_dir, batch):
    from ppoflow.engine.lora import AdaptersOff, LoraSpec, add_adapters

    spec = LoraSpec(rank=8, alpha=16, target_modules="all-linear", exclude_modules=None, seed=1)
    model = add_adapters(load_actor(tiny_model_dir), spec)
    with torch.no_grad():  # the adapters off their init, so that they change the outputs
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    for view in (model, AdaptersOff(model)):
        padded = compute_log_probs(view, batch, temperature=1.0, batching=6)
        packed = compute_log_probs(
            view, batch, temperature=1.0, batching=ForwardBatching(6, remove_padding=True)
        )
        torch.testing.assert_close(packed, padded, rtol=0, atol=1e-5)
    assert not torch.allclose(
        compute_log_probs(model, batch, temperature=1.0, batching=6),
        compute_log_probs(AdaptersOff(model), batch, temperature=1.0, batching=6),
    )


def test_a_sliding_window_layer_sees_only_its_window_in_a_packed_pass(tiny_model_dir):
    """A sequence longer than the window (15 tokens, window 6): each query sees the window's last
    keys, as transformers' own sliding-window mask makes the padded pass do."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(tiny_model_dir).to_dict()
    config = {key: value for key, value in config.items() if key != "layer_types"}
    config |= {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 0}
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config)).eval()
    assert set(model.config.layer_types) == {"sliding_attention"}
    batch = build_sequence_batch(
        [[5, 6, 7, 8, 9, 10, 11, 12], [7, 8, 9]], [[11, 12, 13, 14, 15, 16, 1], [14, 1]], pad_token_id=0
    )
    with torch.no_grad():
        padded, _ = policy_forward(model, batch, temperature=1.0, with_entropy=False)
        packed, _ = policy_forward(model, batch, temperature=1.0, with_entropy=False, remove_padding=True)
        whole, _ = policy_forward(
            transformers.Qwen2ForCausalLM(
                transformers.Qwen2Config(**(config | {"use_sliding_window": False}))
            )
            .eval()
            .requires_grad_(False),
            batch,
            temperature=1.0,
            with_entropy=False,
        )
    torch.testing.assert_close(packed * batch.response_mask, padded * batch.response_mask, rtol=0, atol=1e-5)
    assert not torch.allclose(padded, whole)  # (other weights; the window matters only with its mask)


def test_a_packed_pass_builds_no_attention_mask(tiny_model_dir, batch):
    """A packed pass needs no (L, L) mask (at a 32k-token budget, a GiB): none reaches the attention."""
    from transformers import AttentionInterface

    model = load_actor(tiny_model_dir)
    compute_log_probs(model, batch, temperature=1.0, batching=ForwardBatching(6, remove_padding=True))
    masks = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        masks.append((attention_mask, "cu_seq_lens_q" in kwargs))
        return packing.varlen_sdpa_attention(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(packing.VARLEN_SDPA, spy)
    try:
        compute_log_probs(model, batch, temperature=1.0, batching=ForwardBatching(6, remove_padding=True))
        compute_log_probs(model, batch, temperature=1.0, batching=6)  # unpacked: sdpa's mask
    finally:
        AttentionInterface.register(packing.VARLEN_SDPA, packing.varlen_sdpa_attention)
    layers = model.config.num_hidden_layers
    assert [(m is None, packed) for m, packed in masks] == [(True, True)] * layers + [(False, False)] * layers


def test_a_critic_that_mixes_packed_sequences_is_refused_though_its_new_head_gives_zeros(
    tiny_model_dir, batch
):
    critic = _DropsPositions(load_critic(tiny_model_dir))
    assert not critic.module.score.weight.any()  # a new value head: every value is 0, packed or not
    with pytest.raises(ValueError, match="mixes packed sequences"):
        value_forward(critic, batch, remove_padding=True)
