"""Padding-free forward passes (verl's use_remove_padding): a micro-batch's sequences packed into
one row, each with its own positions and causal attention.

A padded micro-batch of N (prompt, response) rows costs N × (longest prompt + longest response)
tokens in every linear layer; packed, it costs the sum of the rows' own lengths. verl packs with
flash-attention's variable-length kernel on GPU. Here the packed row runs through transformers'
attention interface: `pack` gives the model input_ids and position_ids of one row (positions
restart at 0 for each sequence) and the sequence boundaries as flash-attention's `cu_seq_lens_*`
keywords (kept on the CPU: they are only split by). `use_packed_attention` switches an sdpa model
to `VARLEN_SDPA`, which runs SDPA on each sequence of the row alone, causal, and within a
sliding-window layer's window (transformers would otherwise build one mask over the whole packed
row, whose attention then costs (Σ lengths)² instead of Σ lengths², and whose (L, L) mask alone
is a GiB at 32k tokens: no mask is built for a packed pass, `packed_pass`). Unpacked calls
(generation) go to sdpa unchanged.

Outputs are read at the positions that predict each response token (`PackedBatch.targets`) and
put back into (N, T) tensors, zero elsewhere; they equal the padded pass's up to float rounding.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

VARLEN_SDPA = "ppoflow_varlen_sdpa"
"""The attention implementation name `use_packed_attention` gives an sdpa model."""
_PACKED_PASS: ContextVar[bool] = ContextVar("ppoflow_packed_pass", default=False)
"""Set while a packed forward pass builds its masks (`packed_pass`)."""
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
        `cu_seq_lens_*` delimit the sequences, as for flash-attention's packed inputs; the
        boundaries stay on the CPU, where `varlen_sdpa_attention` reads them without a sync)."""
        cu = self.cu_seq_lens
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


@contextmanager
def packed_pass() -> Iterator[None]:
    """A packed forward pass: the masks transformers would build for it are not built
    (`varlen_sdpa_attention` needs none)."""
    token = _PACKED_PASS.set(True)
    try:
        yield
    finally:
        _PACKED_PASS.reset(token)


def use_packed_attention(model: torch.nn.Module, inner: torch.nn.Module) -> None:
    """Make `inner` (the transformers model under `model`'s wrappers) attend within each packed
    sequence, and check once per model class that a packed pass equals a padded one.

    An sdpa model is switched to `VARLEN_SDPA` (the same sdpa for unpacked calls). Any other
    implementation, or a model whose packed outputs differ (one that ignores position_ids or the
    packed boundaries), is refused: use_remove_padding would mix sequences."""
    implementation = inner.config._attn_implementation
    if implementation == "sdpa" and not inner._can_set_attn_implementation():
        raise ValueError(
            f"use_remove_padding: {type(inner).__name__} does not take transformers' attention "
            "functions, so packed sequences cannot be kept apart; set use_remove_padding=false"
        )
    if implementation == "sdpa":
        _register()
        inner.set_attn_implementation(VARLEN_SDPA)
    elif implementation != VARLEN_SDPA:
        raise ValueError(
            f"use_remove_padding: {type(inner).__name__} runs attention as {implementation!r}, which "
            "cannot keep packed sequences apart (sdpa can); set use_remove_padding=false"
        )
    classes = (type(model), type(inner))
    if classes not in _PROBED:
        _PROBED[classes] = _packed_mismatch(model, inner)
    mismatch = _PROBED[classes]
    if mismatch is not None:
        raise ValueError(f"use_remove_padding: {type(inner).__name__} {mismatch}; set it to false")


@torch.no_grad()
def _packed_mismatch(model: torch.nn.Module, inner: torch.nn.Module) -> str | None:
    """Why two short sequences packed give other last hidden states than the same two padded, or
    None when they agree to float rounding (relative 1e-3 of the largest). Hidden states, not
    logits: a new critic's value head is 0, whatever its input."""
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
            output_hidden_states=True,
        ).hidden_states[-1]
        cu = torch.tensor([0, 4, 9], dtype=torch.int32)
        with packed_pass():
            packed = model(
                input_ids=ids[None].to(device),
                position_ids=torch.cat([torch.arange(n) for n in lengths])[None].to(device),
                cu_seq_lens_q=cu,
                cu_seq_lens_k=cu,
                max_length_q=5,
                max_length_k=5,
                use_cache=False,
                output_hidden_states=True,
            ).hidden_states[-1]
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
    where they are: causal, and in a sliding-window layer (the `sliding_window` keyword, as
    transformers passes it) each query sees only the window's last keys, as transformers' own mask
    (key > query − window); otherwise sdpa itself."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward as attend

    boundaries = kwargs.pop("cu_seq_lens_q", None)
    for name in ("cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(name, None)
    if boundaries is None or query.shape[0] != 1:
        return attend(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    window = kwargs.get("sliding_window")
    lengths = boundaries.diff().tolist()
    pieces = zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2), strict=True)
    outputs = []
    for (q, k, v), length in zip(pieces, lengths, strict=True):
        if window is not None and length > window:
            positions = torch.arange(length, device=q.device)
            offset = positions[:, None] - positions[None, :]  # query − key
            mask = (offset >= 0) & (offset < window)
            outputs.append(attend(module, q, k, v, mask[None, None], is_causal=False, **kwargs)[0])
        else:
            outputs.append(attend(module, q, k, v, None, is_causal=True, **kwargs)[0])
    return torch.cat(outputs, dim=1), None


def _varlen_mask(*args, **kwargs):
    """sdpa's masks for unpacked calls; none for a packed pass (`packed_pass`)."""
    from transformers.masking_utils import sdpa_mask

    return None if _PACKED_PASS.get() else sdpa_mask(*args, **kwargs)


def _register() -> None:
    """`VARLEN_SDPA` in transformers' attention and mask registries."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
    AttentionMaskInterface.register(VARLEN_SDPA, _varlen_mask)
