"""The policy's forward pass runs the output head on the response positions only (transformers'
`logits_to_keep`): the same log-probs, entropy and gradients as the head on every position."""

import pytest
import torch

from ppoflow.engine import forward
from ppoflow.engine.models import load_actor
from ppoflow.engine.ppo import build_sequence_batch

PROMPTS = [[5, 6, 7], [5, 6, 7, 8, 9, 10], [8, 9, 10, 11], [12, 13]]
RESPONSES = [[11, 12, 13, 1], [14, 15], [16], [17, 18, 19]]


class WithoutLogitsToKeep(torch.nn.Module):
    """A causal LM whose forward takes no `logits_to_keep` (a model class of another library)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, use_cache):
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache
        )


def _pass(model, temperature):
    model.zero_grad(set_to_none=True)
    batch = build_sequence_batch(PROMPTS, RESPONSES, pad_token_id=0)
    log_probs, entropy = forward.policy_forward(model, batch, temperature=temperature, with_entropy=True)
    mask = batch.response_mask.bool()
    (log_probs[mask].sum() + entropy[mask].sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return log_probs.detach()[mask], entropy.detach()[mask], grads


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_on_response_positions_equals_head_on_every_position(tiny_model_dir, temperature):
    model = load_actor(tiny_model_dir)
    assert forward.keeps_logits(model)
    wrapped = WithoutLogitsToKeep(model)
    assert not forward.keeps_logits(wrapped)
    kept = _pass(model, temperature)
    every = _pass(wrapped, temperature)
    torch.testing.assert_close(kept[0], every[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(kept[1], every[1], rtol=0, atol=1e-6)
    assert kept[2].keys() == {k.removeprefix("model.") for k in every[2]}
    for name, grad in kept[2].items():
        torch.testing.assert_close(grad, every[2][f"model.{name}"], rtol=0, atol=1e-6)
