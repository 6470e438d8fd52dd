"""actor.use_prefix_grouper: the rows of a micro-batch that hold the same prompt share one forward
pass of it (`shared_prompt_logits`), through the KV cache. The model sees the prompt once per
distinct prompt; log-probs, entropy, gradients and whole updates equal those of every row run
whole, within float rounding (other shapes)."""

import copy

import pytest
import torch

from ppoflow.engine import forward
from ppoflow.engine.forward import policy_forward, response_logits, shared_prompt_logits
from ppoflow.engine.models import load_actor
from ppoflow.engine.ppo import build_sequence_batch
from ppoflow.engine.update import gradient_checkpointing, update_actor

from .settings import actor_settings
from .tiny_models import tiny_minimax

# two prompts × three responses, as GRPO's rollout.n = 3; the second prompt is shorter (left
# padding), the responses end at different lengths (right padding)
PROMPTS = [[5, 6, 7, 8, 9]] * 3 + [[10, 11, 12]] * 3
RESPONSES = [[13, 14, 1], [15, 1], [16, 17, 18, 19], [2], [3, 4, 1], [13, 15, 17, 1]]


def _batch():
    return build_sequence_batch(PROMPTS, RESPONSES, pad_token_id=0)


def _calls(model) -> list[tuple[int, int]]:
    """(rows, columns) of the input_ids of every forward call of `model` from now on."""
    seen: list[tuple[int, int]] = []
    model.register_forward_pre_hook(
        lambda _, args, kwargs: seen.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    return seen


def test_each_prompt_runs_once_and_the_logits_are_those_of_whole_rows(tiny_model_dir):
    model, batch = load_actor(tiny_model_dir), _batch()
    calls = _calls(model)
    whole = response_logits(model, batch, temperature=0.7)
    shared = shared_prompt_logits(model, batch, temperature=0.7)
    # whole rows: 6 × (5 + 4); shared: the 2 prompts but their last token, then each row's last
    # prompt token and its first 3 response tokens (the 4th predicts nothing)
    assert calls == [(6, 9), (2, 4), (6, 4)]
    assert shared.shape == whole.shape == (6, 4, model.config.vocab_size)
    torch.testing.assert_close(shared, whole, rtol=0, atol=1e-5)


def test_gradients_and_entropy_equal_those_of_whole_rows(tiny_model_dir, monkeypatch):
    """In float64, with float64 logits (the engine would round them to float32): within 3e-7 of
    each tensor's largest gradient (measured 1.5e-7 on a 2-core Intel Xeon: transformers computes the
    rotary angles in float32, and other shapes round them differently); float32 differs by about 1e-5."""
    monkeypatch.setattr(forward, "_scaled", lambda logits, temperature: logits / temperature)
    model, batch = load_actor(tiny_model_dir).double(), _batch()
    weights = torch.randn(
        batch.response_mask.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    outputs, grads = [], []
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        log_probs, entropy = policy_forward(
            model, batch, temperature=1.0, with_entropy=True, share_prompts=share
        )
        ((log_probs + 0.1 * entropy) * weights * batch.response_mask).sum().backward()
        outputs.append((log_probs.detach(), entropy.detach()))
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    for got, expected in zip(outputs[1], outputs[0], strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-9)
    for name, expected in grads[0].items():
        assert (grads[1][name] - expected).abs().max() <= 3e-7 * expected.abs().max(), name
    assert any(bool(g.abs().sum() > 0) for g in grads[1].values())


def test_an_update_with_shared_prompts_equals_one_without(tiny_model_dir):
    """Two epochs of SGD, micro-batches of 3 (each one prompt's responses), float32: parameters
    within 1e-5, metrics within 1e-5 relative or 5e-5."""
    batch = _batch()
    generator = torch.Generator().manual_seed(1)
    advantages = torch.randn(batch.response_mask.shape, generator=generator) * batch.response_mask
    base = load_actor(tiny_model_dir)
    old = forward.compute_log_probs(base, batch, temperature=1.0, batching=6)
    actors, metrics, calls = [], [], []
    for share in (True, False):
        actor = copy.deepcopy(base)
        calls.append(_calls(actor))
        metrics.append(
            update_actor(
                actor,
                torch.optim.SGD(actor.parameters(), lr=0.1),
                batch,
                old_log_probs=old,
                advantages=advantages,
                ref_log_probs=None,
                settings=actor_settings(
                    ppo_epochs=2, mini_batch_size=6, micro_batch_size=3, grad_clip=1e9, share_prompts=share
                ),
                seed=0,
            ).mean_metrics()
        )
        actors.append(actor)
    assert calls[0] == [(1, 4), (3, 4), (1, 2), (3, 4)] * 2  # per micro-batch: its prompt, its rows
    assert calls[1] == [(3, 9), (3, 7)] * 2
    for (name, a), b in zip(actors[0].named_parameters(), actors[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)  # measured: up to 4.4e-6
    assert not torch.equal(next(actors[0].parameters()), next(base.parameters()))
    for key in ("actor/pg_loss", "actor/entropy", "actor/ppo_kl", "actor/grad_norm"):
        # the second epoch's log-probs carry the parameters' last bits, amplified: measured 1.7e-5
        # apart in ppo_kl (-1.22) and 6.6e-6 in entropy (0.59), parameters 1.5e-7 apart
        assert metrics[0][key] == pytest.approx(metrics[1][key], rel=1e-5, abs=5e-5), key


def test_log_prob_passes_share_prompts_too(tiny_model_dir):
    """The old- and reference-log-prob passes (no gradient, eval mode): micro-batches of 3, each one
    prompt's responses, run as its prompt once and its rows on the cache."""
    model, batch = load_actor(tiny_model_dir), _batch()
    calls = _calls(model)
    shared = forward.compute_log_probs(model, batch, temperature=0.7, batching=3, share_prompts=True)
    assert calls == [(1, 4), (3, 4), (1, 2), (3, 4)]
    whole = forward.compute_log_probs(model, batch, temperature=0.7, batching=3)
    torch.testing.assert_close(shared, whole, rtol=0, atol=1e-5)
    assert bool((shared[batch.response_mask == 0] == 0).all())


def test_prompt_groups_tell_a_pad_id_token_from_padding():
    """[0, 4, 5] (token 0 is the pad id here) and [4, 5] padded to [0, 4, 5] are different prompts."""
    prompts = [[3, 4], [0, 4, 5], [3, 4], [4, 5], [0, 4, 5]]
    batch = build_sequence_batch(prompts, [[5]] * 5, pad_token_id=0)
    assert batch.prompt_ids[1].tolist() == batch.prompt_ids[3].tolist() == [0, 4, 5]
    firsts, rows = forward._prompt_groups(batch)
    assert len(firsts) == 3 and len(rows) == 5
    for row, group in enumerate(rows.tolist()):
        assert prompts[int(firsts[group])] == prompts[row]
    distinct = build_sequence_batch([[3, 4], [0, 4, 5], [4, 5]], [[5]] * 3, pad_token_id=0)
    assert forward._prompt_groups(distinct) is None


@pytest.mark.parametrize(
    "prompts",
    [
        [[5, 6, 7], [8, 9, 10], [11, 12, 13]],  # no two rows share a prompt
        [[5], [5], [6, 7]],  # a prompt of one token leaves nothing to share before its last token
    ],
    ids=["distinct", "one-token"],
)
def test_nothing_is_shared_where_no_prompt_is_repeated_or_a_prompt_is_one_token(tiny_model_dir, prompts):
    batch = build_sequence_batch(prompts, [[13, 1]] * len(prompts), pad_token_id=0)
    assert shared_prompt_logits(load_actor(tiny_model_dir), batch, temperature=1.0) is None


def test_the_update_runs_whole_rows_under_gradient_checkpointing_and_log_prob_passes_share(tiny_model_dir):
    """transformers keeps no cache when it recomputes activations in training; in eval mode (the
    log-prob passes) it does."""
    model = load_actor(tiny_model_dir).train()
    calls = _calls(model)
    with gradient_checkpointing(model, True):
        assert shared_prompt_logits(model, _batch(), temperature=1.0) is None
        log_probs, _ = policy_forward(
            model, _batch(), temperature=1.0, with_entropy=False, share_prompts=True
        )
        assert log_probs.shape == (6, 4)
        assert calls == [(6, 9)]
        forward.compute_log_probs(model, _batch(), temperature=1.0, batching=6, share_prompts=True)
    assert calls[1:] == [(2, 4), (6, 4)]


def _tiny(kind: str, **special):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        kind,
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        pad_token_id=0,
        **special,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


HYBRIDS = {
    # a DynamicCache whose layers keep a recurrent state: a continuation of several tokens starts
    # Jamba's Mamba layers from no state, and Qwen3-Next's gated delta rule updates it in place
    "jamba": dict(
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=2,
        num_experts_per_tok=1,
        mamba_d_state=4,
        mamba_d_conv=3,
        mamba_expand=2,
        mamba_dt_rank=4,
        use_mamba_kernels=False,
    ),
    "qwen3_next": dict(
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=3,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        decoder_sparse_step=1,
    ),
}


@pytest.mark.parametrize("kind", sorted(HYBRIDS))
def test_a_cache_with_recurrent_state_runs_whole_rows(kind, monkeypatch):
    model = _tiny(kind, **HYBRIDS[kind])
    monkeypatch.setattr(forward, "_UNSHARED", set())
    assert shared_prompt_logits(model, _batch(), temperature=1.0) is None
    assert type(model) in forward._UNSHARED


def test_rotary_frequencies_that_depend_on_the_length_run_whole_rows():
    """Phi-3.5's longrope picks its factors from each call's length: a prompt-only pass could rotate
    the prompt's keys with other factors than a pass over the whole row."""
    rope = {"rope_theta": 10000.0, "original_max_position_embeddings": 8}
    longrope = _tiny(
        "phi3",
        original_max_position_embeddings=8,
        rope_parameters=rope | {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [4.0] * 4},
    )
    assert shared_prompt_logits(longrope, _batch(), temperature=1.0) is None
    dynamic = _tiny("llama", rope_parameters={"rope_theta": 10000.0, "rope_type": "dynamic", "factor": 2.0})
    assert shared_prompt_logits(dynamic, _batch(), temperature=1.0) is None
    plain = _tiny("phi3")
    shared = shared_prompt_logits(plain, _batch(), temperature=1.0)
    torch.testing.assert_close(shared, response_logits(plain, _batch(), temperature=1.0), rtol=0, atol=1e-5)


def test_a_cache_other_than_dynamic_cache_runs_whole_rows(monkeypatch):
    """MiniMax's cache keeps linear-attention states that `reorder_cache` does not index: its rows
    run whole, and the class is remembered, so later micro-batches do not try."""
    model = tiny_minimax()
    monkeypatch.setattr(forward, "_UNSHARED", set())
    calls = _calls(model)
    batch = _batch()
    assert shared_prompt_logits(model, batch, temperature=1.0) is None
    assert type(model) in forward._UNSHARED
    log_probs, _ = policy_forward(model, batch, temperature=1.0, with_entropy=False, share_prompts=True)
    expected, _ = policy_forward(model, batch, temperature=1.0, with_entropy=False)
    assert calls == [(2, 4), (6, 9), (6, 9)]  # the one try, then whole rows
    assert torch.equal(log_probs, expected)


@pytest.mark.parametrize(
    ("overrides", "shares"),
    [
        (["actor_rollout_ref.actor.use_prefix_grouper=true"], True),
        ([], False),  # verl's default
        (
            [
                "actor_rollout_ref.actor.use_prefix_grouper=true",
                "trainer.n_gpus_per_node=2",
                "actor_rollout_ref.actor.strategy=fsdp2",
                "critic.strategy=fsdp2",
            ],
            False,  # sharded ranks run every row whole (conf/effects.py)
        ),
    ],
)
def test_the_config_key_turns_sharing_on_in_one_process(overrides, shares):
    from ppoflow.conf import load_config
    from ppoflow.tasks.pipeline.plan import run_settings

    from .settings import MICRO

    cfg = load_config(None, [*MICRO, *overrides], base="verl", check_paths=False)
    assert run_settings(cfg, total_steps=1).actor.update.share_prompts is shares
