"""Padding-free forward passes (verl's use_remove_padding): a micro-batch's sequences packed into
one row, each with its own positions and causal attention.

A padded micro-batch of N (prompt, response) rows costs N × (longest prompt + longest response)
tokens in every linear layer; packed, it costs the sum of the rows' own lengths. verl packs with
flash-attention's variable-length kernel on GPU. Here the same packed row runs through
transformers' attention interface: `pack` gives the model input_ids and position_ids of one row
(positions restart at 0 for each sequence) and flash-attention's `cu_seq_lens_*` boundaries. A
model on flash_attention_2/3 uses them as verl does; a model on sdpa is switched to
`VARLEN_SDPA` (`use_packed_attention`), which runs causal SDPA on each sequence of the row
(transformers would otherwise build one mask over the whole packed row, whose attention then
costs (Σ lengths)² instead of Σ lengths²). Unpacked calls (generation) go to sdpa unchanged.

Outputs are read at the positions that predict each response token (`PackedBatch.targets`) and
put back into (N, T) tensors, zero elsewhere; they equal the padded pass's up to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

VARLEN_SDPA = "ppoflow_varlen_sdpa"
"""The attention implementation name `use_packed_attention` gives an sdpa model."""
NATIVE_VARLEN = ("flash_attention_2", "flash_attention_3")
"""transformers' implementations that take packed sequences by `cu_seq_lens_*` themselves."""
_PROBED: dict[tuple[type, type], str | None] = {}
"""Per (model class, class under its wrappers): None when packed outputs matched padded ones, else
why they did not."""


@dataclass(frozen=True)
class PackedBatch:
    """A micro-batch's valid tokens as one row.

    input_ids, position_ids (1, L) with L the sum of the rows' prompt and response lengths;
    cu_seq_lens (N + 1,) int32 sequence boundaries in the row; targets (K,) the row positions whose
    outputs predict (or, for a critic, value the state before) the K valid response tokens;
    rows, columns (K,) where those tokens sit in the (N, T) response tensors."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seq_lens: torch.Tensor
    targets: torch.Tensor
    rows: torch.Tensor
    columns: torch.Tensor
    shape: tuple[int, int]
    """(N, T) of the response tensors the outputs go back into."""

    def model_inputs(self, device: torch.device | str) -> dict[str, torch.Tensor | int]:
        """The keyword arguments of a packed forward (no attention mask: positions and
        `cu_seq_lens_*` delimit the sequences, as for flash-attention's packed inputs)."""
        cu = self.cu_seq_lens.to(device)
        longest = int(self.cu_seq_lens.diff().max()) if len(self.cu_seq_lens) > 1 else 0
        return {
            "input_ids": self.input_ids.to(device),
            "position_ids": self.position_ids.to(device),
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": longest,
            "max_length_k": longest,
        }

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """(K,) per-target values as (N, T), zero at positions that are not response tokens. Keeps
        the graph."""
        out = values.new_zeros(self.shape)
        return out.index_put((self.rows.to(values.device), self.columns.to(values.device)), values)


def pack(prompt_ids, prompt_mask, response_ids, response_mask) -> PackedBatch:
    """The valid tokens of a left-padded prompt (N, P) and right-padded response (N, T) batch, row
    after row: each row's prompt tokens where prompt_mask ≠ 0, then its response tokens where
    response_mask ≠ 0 (a contiguous run from the first column, as the padded pass attends to)."""
    n, t = response_ids.shape
    prompt_valid, response_valid = prompt_mask != 0, response_mask != 0
    prompt_lens = prompt_valid.sum(dim=1)
    response_lens = response_valid.sum(dim=1)
    if bool((prompt_lens == 0).any()):
        raise ValueError("a row without prompt tokens cannot be packed: its first response token has none")
    leading = torch.arange(1, t + 1).clamp(max=response_lens[:, None])
    if not bool((response_valid.cumsum(dim=1) == leading).all()):
        raise ValueError("response_mask has a gap inside a response: packed sequences need contiguous ones")
    lengths = prompt_lens + response_lens
    tokens = torch.cat([prompt_ids, response_ids], dim=1)[torch.cat([prompt_valid, response_valid], dim=1)]
    starts = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    positions = torch.arange(int(starts[-1])) - torch.repeat_interleave(starts[:-1], lengths)
    rows = torch.repeat_interleave(torch.arange(n), response_lens)
    columns = torch.arange(int(response_lens.sum())) - torch.repeat_interleave(
        response_lens.cumsum(0) - response_lens, response_lens
    )
    targets = starts[:-1][rows] + prompt_lens[rows] - 1 + columns
    return PackedBatch(
        input_ids=tokens[None],
        position_ids=positions[None],
        cu_seq_lens=starts.to(torch.int32),
        targets=targets,
        rows=rows,
        columns=columns,
        shape=(n, t),
    )


def use_packed_attention(model: torch.nn.Module, inner: torch.nn.Module) -> None:
    """Make `inner` (the transformers model under `model`'s wrappers) attend within each packed
    sequence, and check once per model class that a packed pass equals a padded one.

    flash_attention_2/3 already do; sdpa is switched to `VARLEN_SDPA` (the same sdpa for unpacked
    calls). Any other implementation, or a model whose packed outputs differ (one that ignores
    position_ids or the packed boundaries), is refused: use_remove_padding would mix sequences."""
    implementation = inner.config._attn_implementation
    if implementation == "sdpa" and inner._can_set_attn_implementation():
        _register()
        inner.set_attn_implementation(VARLEN_SDPA)
    elif implementation not in (VARLEN_SDPA, *NATIVE_VARLEN):
        raise ValueError(
            f"use_remove_padding: {type(inner).__name__} runs attention as {implementation!r}, which "
            "cannot keep packed sequences apart (sdpa and flash_attention_2/3 can); set "
            "use_remove_padding=false"
        )
    classes = (type(model), type(inner))
    if classes not in _PROBED:
        _PROBED[classes] = _packed_mismatch(model, inner)
    mismatch = _PROBED[classes]
    if mismatch is not None:
        raise ValueError(f"use_remove_padding: {type(inner).__name__} {mismatch}; set it to false")


@torch.no_grad()
def _packed_mismatch(model: torch.nn.Module, inner: torch.nn.Module) -> str | None:
    """Why two short sequences packed give other outputs than the same two padded, or None when
    they agree to float rounding (relative 1e-3 of the largest output)."""
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        vocab = inner.config.get_text_config().vocab_size
        ids = (torch.arange(9) * 7919 + 11) % vocab
        lengths = (4, 5)
        mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
        padded_ids = torch.stack([torch.cat([ids[:1], ids[:4]]), ids[4:]])
        padded = model(
            input_ids=padded_ids.to(device),
            attention_mask=mask.to(device),
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0).to(device),
            use_cache=False,
        ).logits
        cu = torch.tensor([0, 4, 9], dtype=torch.int32)
        packed = model(
            input_ids=ids[None].to(device),
            position_ids=torch.cat([torch.arange(n) for n in lengths])[None].to(device),
            cu_seq_lens_q=cu.to(device),
            cu_seq_lens_k=cu.to(device),
            max_length_q=5,
            max_length_k=5,
            use_cache=False,
        ).logits
    finally:
        model.train(was_training)
    expected = torch.cat([padded[0, 1:], padded[1]]).float()
    got = packed[0].float()
    if got.shape != expected.shape:
        return f"gives packed outputs of shape {tuple(got.shape)}, not {tuple(expected.shape)}"
    error = float((got - expected).abs().max())
    if error > 1e-3 * max(1.0, float(expected.abs().max())):
        return f"mixes packed sequences (outputs differ from padded ones by {error:.3g})"
    return None


def varlen_sdpa_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention, run on each packed sequence alone when `cu_seq_lens_q` says
    where they are (causal, no mask: a sequence is whole); otherwise sdpa itself."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward as attend

    boundaries = kwargs.pop("cu_seq_lens_q", None)
    for name in ("cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(name, None)
    if boundaries is None or query.shape[0] != 1:
        return attend(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    lengths = boundaries.diff().tolist()
    pieces = zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2), strict=True)
    outputs = [attend(module, q, k, v, None, is_causal=True, **kwargs)[0] for q, k, v in pieces]
    return torch.cat(outputs, dim=1), None


def _register() -> None:
    """`VARLEN_SDPA` in transformers' attention and mask registries (its masks are sdpa's: unpacked
    calls need them, and a packed call's block mask is what sdpa itself would use)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
    AttentionMaskInterface.register(VARLEN_SDPA, sdpa_mask)
