"""How a forward pass splits a batch's rows: micro-batches of a fixed number of rows, or (verl's
use_dynamic_bsz) of consecutive rows within a token budget; padded or packed (use_remove_padding,
engine/packing.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardBatching:
    """The micro-batches of one forward-only pass (old or reference log-probs, values), in verl's
    keys: *log_prob_micro_batch_size_per_gpu / forward_micro_batch_size_per_gpu, with
    *use_dynamic_bsz the *_max_token_len_per_gpu budget, and model.use_remove_padding."""

    micro_batch_size: int | None
    """Rows per pass without a token budget (None only with one)."""
    max_token_len: int | None = None
    """A token budget per pass (`micro_batches`), or None: micro_batch_size rows each."""
    remove_padding: bool = False
    """Each pass runs its rows packed into one sequence (engine/packing.py)."""

    @classmethod
    def of(cls, batching: ForwardBatching | int) -> ForwardBatching:
        """`batching` itself, or for an int that many padded rows per pass."""
        return batching if isinstance(batching, ForwardBatching) else cls(batching)


def micro_batches(
    rows: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    size: int | None,
    max_tokens: int | None,
    packed: bool = False,
    agree: Callable[[int], int] | None = None,
) -> list[torch.Tensor]:
    """`rows` (in order) as micro-batches: `size` rows each, or with a token budget (verl's
    use_dynamic_bsz) as many consecutive rows as keep the micro-batch within `max_tokens`. Packed
    (use_remove_padding), a micro-batch's tokens are the sum of its rows' lengths, as verl counts
    them; padded, they are rows × (its longest prompt + its longest response), the shape it runs at
    (`SequenceBatch.without_padding`). A row longer than the budget alone is an error. `agree`
    (the ranks of a worker group, each with as many rows): the count of budget micro-batches every
    rank runs, given this rank's (a sharded pass needs every rank; `split_to`)."""
    if max_tokens is None:
        if size is None:
            raise ValueError("micro-batches need a number of rows or a token budget")
        return list(rows.split(size))
    prompts = (prompt_mask[rows] != 0).sum(dim=1).tolist()
    responses = (response_mask[rows] != 0).sum(dim=1).tolist()
    cuts, start, longest_prompt, longest_response, total = [], 0, 0, 0, 0
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        if prompt + response > max_tokens:
            raise ValueError(
                f"a sequence of {prompt + response} tokens (prompt and response) does not fit the "
                f"micro-batch token budget of {max_tokens} (*max_token_len_per_gpu): raise it"
            )
        if packed:
            tokens = total + prompt + response
        else:
            tokens = (i - start + 1) * (max(longest_prompt, prompt) + max(longest_response, response))
        if i > start and tokens > max_tokens:
            cuts.append(i)
            start, longest_prompt, longest_response, total = i, prompt, response, prompt + response
        else:
            longest_prompt, longest_response = max(longest_prompt, prompt), max(longest_response, response)
            total += prompt + response
    micros = list(rows.tensor_split(cuts)) if cuts else [rows]
    return split_to(micros, agree(len(micros))) if agree is not None and len(rows) else micros


def split_to(micros: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    """`micros` (consecutive rows) as exactly `count` micro-batches, the rows still in order: the
    micro-batch with the most rows is halved until there are `count` (the first of equals). A part
    never holds more tokens than the micro-batch it came from, so a token budget still holds. The
    ranks of a worker group cut their shares by a budget each, then all run the largest count
    (every rank must take part in each sharded forward and backward pass)."""
    rows = sum(len(m) for m in micros)
    if not len(micros) <= count <= rows:
        raise ValueError(f"cannot split {len(micros)} micro-batches of {rows} rows into {count}")
    micros = list(micros)
    while len(micros) < count:
        widest = max(range(len(micros)), key=lambda i: len(micros[i]))
        half = micros[widest]
        micros[widest : widest + 1] = list(half.tensor_split(2))
    return micros
