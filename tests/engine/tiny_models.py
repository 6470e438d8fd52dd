"""Tiny random transformers models of architectures whose KV cache is special, for the engine's
tests of shared prompts (the rollout's shared prefill, the update's shared prompt pass)."""

from __future__ import annotations

import torch


def tiny_minimax() -> torch.nn.Module:
    """MiniMax: its cache keeps linear-attention states beside the layers `reorder_cache` indexes."""
    from transformers import MiniMaxConfig, MiniMaxForCausalLM

    torch.manual_seed(0)
    config = MiniMaxConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        layer_types=["linear_attention", "full_attention"],
        block_size=4,
    )
    return MiniMaxForCausalLM(config).eval()
