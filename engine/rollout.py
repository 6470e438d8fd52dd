"""Rollout engines: generate responses and the log-probs of the sampled tokens.

`RolloutEngine` is the seam: the `transformers` implementation below runs anywhere (CPU or GPU);
a vLLM engine would implement the same protocol (and be imported lazily, only when configured).

Conventions (ALGORITHMS.md): prompts are left-padded; a response stops at the first EOS, which is
part of the response (its mask is 1); `rollout_log_probs[t]` is log softmax(logits / temperature) at
the sampled token, *before* top-k / top-p filtering, which is what the trainer recomputes as
`old_log_probs`, so the two differ only by numerics (KV cache vs full forward).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import accumulate, chain
from typing import Protocol

import torch

from .forward import cache_keyword, keeps_logits
from .names import FinishReason


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. `top_k <= 0` and `top_p >= 1` disable those filters (unlike
    `transformers.generate`, which silently applies top_k=50 when sampling)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = True

    @classmethod
    def greedy(cls, max_new_tokens: int) -> SamplingParams:
        return cls(max_new_tokens=max_new_tokens, temperature=1.0, do_sample=False)

    @property
    def logit_temperature(self) -> float:
        """The temperature log-probs are computed with (1.0 for greedy decoding)."""
        return self.temperature if self.do_sample and self.temperature > 0 else 1.0


@dataclass
class RolloutOutput:
    """Per response, unpadded: `response_ids[i]` ends with EOS when `finish_reasons[i] == "stop"`."""

    response_ids: list[list[int]] = field(default_factory=list)
    rollout_log_probs: list[list[float]] = field(default_factory=list)
    finish_reasons: list[FinishReason] = field(default_factory=list)
    trajectories: list | None = None
    """Multi-turn (engine/multi_turn.py): each response's Trajectory (its turns, response mask and
    tool rewards); None for single-turn responses."""

    def extend(self, other: RolloutOutput) -> None:
        self.response_ids += other.response_ids
        self.rollout_log_probs += other.rollout_log_probs
        self.finish_reasons += other.finish_reasons
        if other.trajectories is not None:
            self.trajectories = (self.trajectories or []) + other.trajectories


class RolloutEngine(Protocol):
    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        seeds: Sequence[int],
        on_batch: Callable[[int], None] | None = None,
        on_tokens: Callable[[int], None] | None = None,
    ) -> RolloutOutput:
        """Generate one response per prompt (repeat a prompt n times for n samples), response i
        sampled from its own random stream `seeds[i]` (so a response does not depend on the other
        prompts of its batch, or on which device generated it); `on_batch(k)` after k responses are
        finished, `on_tokens(k)` after k more tokens are generated."""
        ...


def filter_logits(logits: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus top-p set to −inf. logits: (B, V)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The random stream of one response: sample `sample_index` of the prompt at `prompt_index` in
    a step's batch, under the step's `seed`. Independent of how the batch is split over devices."""
    digest = hashlib.blake2b(f"{seed}/{prompt_index}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # torch.Generator takes a non-negative int64


class HFRolloutEngine:
    """Batched sampling with a `transformers` causal LM and its KV cache, `batch_size` prompts at a
    time (actor_rollout_ref.rollout.micro_batch_size on one device).

    Deterministic for given seeds and prompts: each response samples from its own `torch.Generator`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        batch_size: int = 256,
    ):
        self.model = model
        self.eos_token_ids = torch.tensor(sorted(set(eos_token_ids)))
        self.pad_token_id = pad_token_id
        self.batch_size = batch_size
        self._cache_kw = cache_keyword(model)
        # Only the last position's logits are sampled from: the prompt's (P, V) logits are not made.
        self._last_logits = {"logits_to_keep": 1} if keeps_logits(model) else {}
        self._shares_prefill = True  # until the model's cache turns out not to be a DynamicCache

    @torch.no_grad()
    def generate(self, prompt_ids, params, *, seeds, on_batch=None, on_tokens=None) -> RolloutOutput:
        if len(seeds) != len(prompt_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(seeds)} seeds: one seed per response")
        was_training = self.model.training
        self.model.eval()
        out = RolloutOutput()
        try:
            for start in range(0, len(prompt_ids), self.batch_size):
                chunk = prompt_ids[start : start + self.batch_size]
                streams = RowStreams(seeds[start : start + self.batch_size])
                out.extend(self._generate_batch(chunk, params, streams, on_tokens))
                if on_batch is not None:
                    on_batch(len(chunk))
        finally:
            self.model.train(was_training)
        return out

    def _generate_batch(
        self, prompts, params: SamplingParams, streams: RowStreams, on_tokens=None
    ) -> RolloutOutput:
        device = next(self.model.parameters()).device
        input_ids, attention_mask = left_pad(prompts, self.pad_token_id)
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        batch = input_ids.shape[0]
        eos = self.eos_token_ids.to(device)
        tokens, log_probs = [], []
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        lengths = torch.zeros(batch, dtype=torch.long, device=device)
        distinct = _distinct_prompts(prompts) if self._shares_prefill else None
        cache, step_ids = None, input_ids
        for step in range(params.max_new_tokens):
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
            shared = None
            if step == 0 and distinct is not None:
                shared = self._shared_prefill(input_ids, attention_mask, position_ids, *distinct)
            cache, logits = shared or self._forward(step_ids, attention_mask, position_ids, cache)
            logits = logits.float() / params.logit_temperature
            next_ids = self._pick(logits, params, streams, params.max_new_tokens - step)
            next_ids = torch.where(done, torch.full_like(next_ids, self.pad_token_id), next_ids)
            token_log_probs = torch.log_softmax(logits, dim=-1).gather(-1, next_ids[:, None])[:, 0]
            tokens.append(next_ids)
            log_probs.append(token_log_probs)
            alive = ~done
            lengths += alive.long()
            if on_tokens is not None:
                on_tokens(int(alive.sum()))
            done |= torch.isin(next_ids, eos)
            if bool(done.all()):
                break
            step_ids = next_ids[:, None]
            attention_mask = torch.cat([attention_mask, alive.long()[:, None]], dim=-1)
        return _collect(torch.stack(tokens, 1), torch.stack(log_probs, 1), lengths, done)

    def _forward(self, input_ids, attention_mask, position_ids, cache):
        """One forward pass with the KV cache: (the cache, the last position's logits)."""
        result = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **{self._cache_kw: cache},
            **self._last_logits,
        )
        return getattr(result, self._cache_kw), result.logits[:, -1, :]

    def _shared_prefill(self, input_ids, attention_mask, position_ids, firsts, rows):
        """The prompts' forward pass once per distinct prompt (`firsts`: the first row of each), its
        KV cache and last logits then given to every row (`rows`: each row's distinct prompt): the
        n responses of a prompt share its prefill, as vLLM's prefix cache does. Only a
        transformers DynamicCache is shared: other caches may keep state that `reorder_cache` does
        not index (MiniMax's linear-attention states); for those it returns None (the caller
        prefills every row) and later batches do not try."""
        from transformers import DynamicCache

        device = input_ids.device
        firsts, rows = torch.tensor(firsts, device=device), torch.tensor(rows, device=device)
        cache, logits = self._forward(input_ids[firsts], attention_mask[firsts], position_ids[firsts], None)
        if type(cache) is not DynamicCache:
            self._shares_prefill = False
            return None
        cache.reorder_cache(rows)  # index_select over the batch: each row gets its prompt's keys and values
        return cache, logits[rows]

    def _pick(self, logits: torch.Tensor, params: SamplingParams, streams: RowStreams, steps_left: int):
        if not params.do_sample or params.temperature <= 0:
            return logits.argmax(dim=-1)
        filtered = filter_logits(logits, top_k=params.top_k, top_p=params.top_p)
        probs = torch.softmax(filtered, dim=-1).cpu()
        return streams.sample(probs, steps_left).to(logits.device)


NOISE_PER_THREAD = 1 << 18
"""Noise values a thread of RowStreams' draw gets at least (smaller draws are not worth a thread)."""


class RowStreams:
    """One random stream per response (a CPU `torch.Generator` each), sampled as a batch.

    `sample` draws exactly what `torch.multinomial(probs[i], 1, generator=generators[i])` would for
    every row i, without a call per row and token: torch samples one category as argmax(p / q) with
    q ~ Exp(1) drawn from the generator (the exponential form of the Gumbel-max trick), and a CPU
    generator's exponential stream is the same however it is split into calls, so each row's noise
    for several decoding steps is drawn at once (at most `budget` floats for the whole batch) and
    each step is one division and argmax over the batch. The rows' noise is drawn by up to
    torch.get_num_threads() threads, each filling its own rows from their own generators (the
    same numbers as one thread): at a real vocabulary the draw is large, on the CPU whatever the
    device (docs/PERFORMANCE.md).
    tests/engine/test_rollout.py holds the equality to torch.multinomial on the installed torch.
    """

    def __init__(self, seeds: Sequence[int], *, budget: int = 1 << 20):
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]
        self.budget = budget
        self._noise = torch.empty(len(seeds), 0, 0)  # (rows, steps drawn, vocabulary)
        self._next = 0

    def sample(self, probs: torch.Tensor, steps_left: int = 1) -> torch.Tensor:
        """(B,) one category per row of the CPU probabilities (B, V); `steps_left`: how many more
        calls may come (how far ahead noise is worth drawing)."""
        rows, vocab = probs.shape
        if rows != len(self.generators):
            raise ValueError(f"{rows} rows of probabilities for {len(self.generators)} random streams")
        if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()):
            raise ValueError("sampling probabilities contain inf, nan or a negative value")
        if self._next == self._noise.shape[1]:
            steps = max(1, min(steps_left, self.budget // max(1, rows * vocab)))
            self._noise = torch.empty(rows, steps, vocab, dtype=probs.dtype)
            self._draw_noise()
            self._next = 0
        noise = self._noise[:, self._next]
        self._next += 1
        return (probs / noise).argmax(dim=-1)

    def _draw_noise(self) -> None:
        """Fill `_noise` row by row from each row's generator, rows split over threads when the draw
        is large (torch's kernels release the GIL; a generator is only used by the thread given its
        row)."""
        rows = list(zip(self._noise, self.generators, strict=True))

        def fill(share: list[tuple[torch.Tensor, torch.Generator]]) -> None:
            for noise, generator in share:
                noise.exponential_(1, generator=generator)

        workers = max(1, min(torch.get_num_threads(), len(rows), self._noise.numel() // NOISE_PER_THREAD))
        if workers == 1:
            fill(rows)
            return
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(fill, [rows[i::workers] for i in range(workers)]))


def _distinct_prompts(prompts: Sequence[Sequence[int]]) -> tuple[list[int], list[int]] | None:
    """(the first row of each distinct prompt, each row's index among them), or None when no two
    rows share a prompt."""
    index: dict[tuple[int, ...], int] = {}
    firsts, rows = [], []
    for row, prompt in enumerate(prompts):
        key = tuple(prompt)
        if key not in index:
            index[key] = len(firsts)
            firsts.append(row)
        rows.append(index[key])
    return (firsts, rows) if len(firsts) < len(rows) else None


def pad_flat(
    flat: torch.Tensor, lengths: torch.Tensor, width: int, pad_value, *, left: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows given as their concatenation and lengths → (B, width) values and a bool mask of the
    valid positions, the rows placed at the right (`left=True`: left padding) or at the left."""
    longest = int(lengths.max()) if len(lengths) else 0
    if longest > width:
        raise ValueError(f"a row of {longest} values does not fit in width {width}")
    positions = torch.arange(width)
    mask = positions >= width - lengths[:, None] if left else positions < lengths[:, None]
    values = torch.full((len(lengths), width), pad_value, dtype=flat.dtype)
    values[mask] = flat
    return values, mask


def _flatten(rows: Sequence[Sequence[float]], dtype) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    return torch.tensor(list(chain.from_iterable(rows)), dtype=dtype), lengths


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) ids and attention mask, padded on the left."""
    flat, lengths = _flatten(rows, torch.long)
    ids, mask = pad_flat(flat, lengths, int(lengths.max()), pad_id, left=True)
    return ids, mask.long()


def right_pad(rows: Sequence[Sequence[float]], pad_value, *, width: int | None = None, dtype=torch.long):
    """(B, T) values and mask, padded on the right to `width` (default: the longest row)."""
    flat, lengths = _flatten(rows, dtype)
    width = width if width is not None else (int(lengths.max()) if len(rows) else 0)
    values, mask = pad_flat(flat, lengths, width, pad_value)
    return values, mask.float()


def row_prefixes(values: torch.Tensor, lengths: Sequence[int]) -> list[list]:
    """The first `lengths[i]` values of each row i of (N, T) `values`, as Python lists: the valid
    values are gathered and converted at once (neither row by row nor with the padding)."""
    ends = torch.tensor(lengths, dtype=torch.long, device=values.device)
    flat = values[torch.arange(values.shape[1], device=values.device) < ends[:, None]].tolist()
    starts = [0, *accumulate(min(n, values.shape[1]) for n in lengths)]
    return [flat[a:b] for a, b in zip(starts, starts[1:], strict=False)]


def _collect(tokens, log_probs, lengths, done) -> RolloutOutput:
    cut = lengths.tolist()
    return RolloutOutput(
        response_ids=row_prefixes(tokens, cut),
        rollout_log_probs=row_prefixes(log_probs, cut),
        finish_reasons=["stop" if stopped else "length" for stopped in done.tolist()],
    )
