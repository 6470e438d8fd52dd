"""Forward passes over (prompt, response) batches: per-token log-probs, entropy and values, and a
reward model's score of each sequence.

A batch is the left-padded prompt (N, P) followed by the right-padded response (N, T). The logits
at position P−1+t predict response token t, and the critic's output there is V(s_t), the value of
the state *before* token t (ALGORITHMS.md). Work is split into micro-batches so that at most one
(micro-batch, T, V) logits tensor exists at a time.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .batching import ForwardBatching, micro_batches
from .logits import entropy_from_logits, logprobs_from_logits, sum_pi_squared_from_logits
from .packing import PackedBatch, pack, packed_pass, use_packed_attention


@dataclass
class SequenceBatch:
    """Token tensors of N (prompt, response) pairs.

    prompt_ids (N, P) left-padded, prompt_mask (N, P); response_ids (N, T) right-padded,
    response_mask (N, T) float, 1 on the response tokens the policy sampled, up to and including
    EOS: the tokens log-probs, values and losses count. `response_attention` (N, T), when given, is 1
    on every token of the response, the policy's and those a tool turn inserted (0 in
    response_mask, engine/multi_turn.py): the tokens the model reads. None: the same as
    response_mask (a single-turn response has no inserted tokens).
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    response_attention: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def attended(self) -> torch.Tensor:
        """(N, T): 1 on every response token the model reads (response_attention, else response_mask)."""
        return self.response_mask if self.response_attention is None else self.response_attention

    def _tensors(self) -> tuple[torch.Tensor | None, ...]:
        return (
            self.prompt_ids,
            self.prompt_mask,
            self.response_ids,
            self.response_mask,
            self.response_attention,
        )

    def select(self, rows: torch.Tensor | slice) -> SequenceBatch:
        return SequenceBatch(*(None if t is None else t[rows] for t in self._tensors()))

    def without_padding(self) -> SequenceBatch:
        """The same rows without the columns that are padding in all of them: leading prompt
        columns and trailing response columns (a side with no valid token at all is kept whole).
        Every row keeps its tokens, positions and attention, so its outputs are the same up to float
        rounding (shorter shapes can change a kernel's blocking); a micro-batch of one prompt's
        responses then costs its own length, not that of the batch's longest prompt and response."""
        prompt_columns = (self.prompt_mask != 0).any(dim=0).nonzero()
        response_columns = (self.attended != 0).any(dim=0).nonzero()
        first = int(prompt_columns[0]) if len(prompt_columns) else 0
        width = int(response_columns[-1]) + 1 if len(response_columns) else self.response_ids.shape[1]
        if first == 0 and width == self.response_ids.shape[1]:
            return self
        prompt_ids, prompt_mask, *responses = self._tensors()
        return SequenceBatch(
            prompt_ids[:, first:],
            prompt_mask[:, first:],
            *(None if t is None else t[:, :width] for t in responses),
        )

    def to(self, device: torch.device | str) -> SequenceBatch:
        return SequenceBatch(*(None if t is None else t.to(device) for t in self._tensors()))

    def packed(self) -> PackedBatch:
        """The rows' valid tokens as one packed sequence (engine/packing.py)."""
        return pack(self.prompt_ids, self.prompt_mask, self.response_ids, self.attended)

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """input_ids, attention_mask and position_ids of the concatenated sequences."""
        input_ids = torch.cat([self.prompt_ids, self.response_ids], dim=1)
        attention_mask = torch.cat([self.prompt_mask.long(), self.attended.long()], dim=1)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def response_logits(model: torch.nn.Module, batch: SequenceBatch, temperature: float) -> torch.Tensor:
    """(N, T, V) float logits / temperature at the positions that predict each response token
    (on the model's device; `batch` may be anywhere).

    The output head runs only on the last T + 1 positions (transformers' `logits_to_keep`): the
    prompt's positions need no (P, V) logits, which for a long prompt and a large vocabulary are most
    of a forward pass's memory."""
    prompt_len, response_len = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    inputs = batch.to(model_device(model)).model_inputs()
    if keeps_logits(model):
        logits = model(**inputs, use_cache=False, logits_to_keep=response_len + 1).logits[:, :response_len]
    else:
        logits = model(**inputs, use_cache=False).logits[:, prompt_len - 1 : prompt_len - 1 + response_len]
    return _scaled(logits, temperature)


def keeps_logits(model: torch.nn.Module) -> bool:
    """Whether the model's forward takes `logits_to_keep` (transformers' causal LMs; the wrappers of
    `inner_model` pass keywords on to the model they wrap)."""
    return _forward_takes_logits_to_keep(type(inner_model(model)))


def inner_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under its wrappers: a DeepSpeed engine or a LoRA model's adapters-off
    view (`.module`), a peft model (`get_base_model()`, the base with the adapters in its layers)."""
    model = getattr(model, "module", model)
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def cache_keyword(model: torch.nn.Module) -> str:
    """The KV-cache argument name of `model.forward` (of the model a peft model wraps, which passes
    it on): transformers 5 renamed `past_key_values` to `cache`; accept either so a pinned older
    release keeps working."""
    params = inspect.signature(inner_model(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@functools.cache
def _forward_takes_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def policy_forward(
    model: torch.nn.Module,
    batch: SequenceBatch,
    *,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool = True,
    share_prompts: bool = False,
    remove_padding: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_probs (N, T) of the response tokens and, if asked, entropy (N, T). Keeps the graph of
    the log-probs, and of the entropy unless `entropy_grad` is False (a metric only: with
    entropy_coeff = 0 its backward through the (N, T, V) softmax would add zeros).

    `share_prompts` (actor.use_prefix_grouper): rows with the same prompt share one forward pass of
    it (`shared_prompt_logits`); otherwise, or where that does not apply, each row runs whole:
    packed with `remove_padding` (`packed_response_logits`; 0 at padding), else padded."""
    logits, labels, unpack = _token_logits(model, batch, temperature, share_prompts, remove_padding)
    log_probs = unpack(logprobs_from_logits(logits, labels))
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = unpack(entropy_from_logits(logits))
    return log_probs, entropy


def _token_logits(
    model: torch.nn.Module,
    batch: SequenceBatch,
    temperature: float,
    share_prompts: bool,
    remove_padding: bool,
) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """(logits (…, V) / temperature at the positions that predict the response tokens, their labels
    (…), and how per-token values (…) become (N, T)): the shared-prompt, packed or padded pass of
    `policy_forward`."""
    logits = shared_prompt_logits(model, batch, temperature) if share_prompts else None
    if logits is None and remove_padding:
        packed, logits = packed_response_logits(model, batch, temperature)
        labels = batch.response_ids[packed.rows, packed.columns].to(logits.device)
        # (K, 1, V): the log-prob and entropy temporaries then go in chunks of rows (engine/logits.py)
        return logits[:, None], labels[:, None], lambda values: packed.unpack(values[:, 0])
    if logits is None:
        logits = response_logits(model, batch, temperature)
    return logits, batch.response_ids.to(logits.device), lambda values: values


def packed_response_logits(
    model: torch.nn.Module, batch: SequenceBatch, temperature: float
) -> tuple[PackedBatch, torch.Tensor]:
    """(the packed batch, (K, V) logits / temperature at the positions that predict its K response
    tokens): `batch`'s rows packed into one sequence without padding (verl's use_remove_padding;
    engine/packing.py). The output head runs on those K positions only."""
    head_at_targets = keeps_logits(model)
    packed, targets, out = _packed_call(model, batch, head_at_targets=head_at_targets)
    logits = out.logits[0] if head_at_targets else out.logits[0, targets]
    return packed, _scaled(logits, temperature)


def _packed_call(model: torch.nn.Module, batch: SequenceBatch, *, head_at_targets: bool = False):
    """(the packed batch, its targets on the model's device, the model's output) of one packed
    forward pass over `batch`; `head_at_targets`: the output head runs on the targets only
    (`logits_to_keep`)."""
    packed = batch.packed()
    device = model_device(model)
    use_packed_attention(model, inner_model(model))
    targets = packed.targets.to(device)
    keep = {"logits_to_keep": targets} if head_at_targets else {}
    with packed_pass():
        out = model(**packed.model_inputs(device), use_cache=False, **keep)
    return packed, targets, out


def shared_prompt_logits(
    model: torch.nn.Module, batch: SequenceBatch, temperature: float
) -> torch.Tensor | None:
    """`response_logits` with each distinct prompt of `batch` run once: GRPO's n responses of a
    prompt then cost one prompt and n responses, not n whole sequences (verl's use_prefix_grouper;
    here through the model's own KV cache, so for any transformers model whose cache holds only
    attention keys and values). None where it does not apply: no two rows share a prompt, a prompt
    has fewer than two tokens, the model trains under gradient checkpointing (transformers then
    keeps no cache), the model's forward takes no `logits_to_keep`, its rotary frequencies depend
    on the sequence length (`_length_dependent_rope`), or its cache holds more than attention keys
    and values (`_attention_only`; the class is then remembered in `_UNSHARED`).

    Causal attention makes a prompt's keys and values the same in every row that holds it. The
    pass over all prompt tokens but the last runs on one row per prompt; its cache is indexed out
    to every row (`Cache.reorder_cache`: an index_select, which autograd sums back over the rows);
    then each row runs its last prompt token and its response on that cache, which gives the T
    positions that predict the response. The result equals `response_logits` up to float rounding
    (other shapes), and so do the gradients."""
    inner = inner_model(model)
    if (
        type(inner) in _UNSHARED
        or (inner.training and _checkpoints_activations(inner))
        or not keeps_logits(model)
        or _length_dependent_rope(inner.config)
    ):
        return None
    groups = _prompt_groups(batch)
    if groups is None:
        return None
    device = model_device(model)
    firsts, rows = (index.to(device) for index in groups)
    inputs = batch.to(device).model_inputs()
    head = batch.prompt_ids.shape[1] - 1  # the columns of the shared pass
    end = head + batch.response_ids.shape[1]  # the last response token predicts nothing
    cache_kw = cache_keyword(model)
    shared = model(
        **{name: value[firsts, :head] for name, value in inputs.items()}, use_cache=True, logits_to_keep=1
    )
    cache = getattr(shared, cache_kw)
    if not _attention_only(cache):
        _UNSHARED.add(type(inner))
        return None
    cache.reorder_cache(rows)  # every row gets its prompt's keys and values
    own = model(
        input_ids=inputs["input_ids"][:, head:end],
        attention_mask=inputs["attention_mask"][:, :end],
        position_ids=inputs["position_ids"][:, head:end],
        use_cache=True,
        **{cache_kw: cache},
    )
    return _scaled(own.logits, temperature)


def _prompt_groups(batch: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(a row of each distinct prompt, each row's index among them) of a left-padded batch, or None
    when no two rows share a prompt or a prompt has fewer than two tokens. Rows of the same prompt
    are the same padded row (as the rollout engine's `_distinct_prompts`, without a Python loop
    over rows)."""
    valid = batch.prompt_mask.cpu() != 0
    if len(batch) < 2 or int(valid.sum(dim=1).min()) < 2:
        return None
    keys = torch.cat([batch.prompt_ids.cpu(), valid.long()], dim=1)
    _, rows = torch.unique(keys, dim=0, return_inverse=True)
    distinct = int(rows.max()) + 1
    if distinct == len(batch):
        return None
    positions = torch.arange(len(batch))
    firsts = torch.full((distinct,), len(batch)).scatter_reduce_(0, rows, positions, "amin")
    return firsts, rows


def _attention_only(cache) -> bool:
    """Whether `cache` holds only attention keys and values, which `reorder_cache` indexes and a
    continuation of several tokens extends: a transformers DynamicCache of full or sliding-window
    attention layers. Not a hybrid's linear-attention or state-space layers (Jamba's, Qwen3-Next's,
    Mamba's), whose multi-token continuation drops or overwrites their recurrent state in place,
    nor another cache class (MiniMax's)."""
    from transformers import DynamicCache

    if type(cache) is not DynamicCache:
        return False
    layers = getattr(cache, "layers", None)
    if layers is None:  # a transformers release without per-layer cache classes: attention only
        return True
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    return all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in layers)


def _length_dependent_rope(config) -> bool:
    """Whether the rotary frequencies depend on the length of each forward call (longrope, as
    Phi-3.5 and Phi-4-mini; dynamic NTK scaling): a prompt-only pass could then rotate its keys
    differently from a pass over the whole row."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(config, name, None)
        if isinstance(params, dict):
            sets = [params, *(value for value in params.values() if isinstance(value, dict))]
            if any(p.get("rope_type", p.get("type")) in ("longrope", "dynamic") for p in sets):
                return True
    return False


def _checkpoints_activations(model: torch.nn.Module) -> bool:
    """Whether gradient checkpointing is on (transformers 5 `is_activation_checkpointing`, earlier
    releases `is_gradient_checkpointing`)."""
    flag = "is_activation_checkpointing"
    return bool(getattr(model, flag if hasattr(type(model), flag) else "is_gradient_checkpointing", False))


_UNSHARED: set[type] = set()
"""Model classes whose cache turned out to hold more than attention keys and values
(`shared_prompt_logits`, `_attention_only`)."""


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


def value_forward(
    critic: torch.nn.Module, batch: SequenceBatch, *, remove_padding: bool = False
) -> torch.Tensor:
    """values (N, T): V(s_t) for every response position. Keeps the graph. `remove_padding`: the
    rows run packed into one sequence (engine/packing.py), 0 at padding."""
    if remove_padding:
        packed, targets, out = _packed_call(critic, batch)
        return packed.unpack(out.logits[0, targets, 0].float())
    prompt_len, response_len = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    out = critic(**batch.to(model_device(critic)).model_inputs(), use_cache=False).logits[..., 0]
    return out[:, prompt_len - 1 : prompt_len - 1 + response_len].float()


@torch.no_grad()
def compute_log_probs(
    model: torch.nn.Module,
    batch: SequenceBatch,
    *,
    temperature: float,
    batching: ForwardBatching | int,
    share_prompts: bool = False,
) -> torch.Tensor:
    """log_probs (N, T) without gradient, in the micro-batches of `batching` (an int: that many
    rows each), on the CPU; 0 at masked positions. `share_prompts`: as `policy_forward`'s."""
    batching = ForwardBatching.of(batching)
    parts = _in_eval_micro_batches(
        model,
        batch,
        batching,
        lambda part: policy_forward(
            model,
            part,
            temperature=temperature,
            with_entropy=False,
            share_prompts=share_prompts,
            remove_padding=batching.remove_padding,
        )[0],
    )
    return torch.cat(parts).cpu() * batch.response_mask


@torch.no_grad()
def compute_log_probs_and_sum_pi_squared(
    model: torch.nn.Module,
    batch: SequenceBatch,
    *,
    temperature: float,
    batching: ForwardBatching | int,
    share_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`compute_log_probs` and, from the same pass, Σ_v π(v | s_t)² (N, T) of every response
    position (verl's sum_pi_squared, for the optimal token baselines); both 0 at masked positions."""
    batching = ForwardBatching.of(batching)
    width = batch.response_ids.shape[1]
    squares: list[torch.Tensor] = []

    def forward(part: SequenceBatch) -> torch.Tensor:
        logits, labels, unpack = _token_logits(
            model, part, temperature, share_prompts, batching.remove_padding
        )
        square = unpack(sum_pi_squared_from_logits(logits))
        squares.append(F.pad(square, (0, width - square.shape[1])))
        return unpack(logprobs_from_logits(logits, labels))

    parts = _in_eval_micro_batches(model, batch, batching, forward)
    return torch.cat(parts).cpu() * batch.response_mask, torch.cat(squares).cpu() * batch.response_mask


def _in_eval_micro_batches(
    model: torch.nn.Module,
    batch: SequenceBatch,
    batching: ForwardBatching,
    forward: Callable[[SequenceBatch], torch.Tensor],
    agree: Callable[[int], int] | None = None,
) -> list[torch.Tensor]:
    """`forward` of each micro-batch of `batch` (`batching.micro_batches`: consecutive rows), without
    its padding columns (`without_padding`), with `model` in eval mode (its mode restored after).
    Per-token outputs narrower than the batch's responses are padded back to its width with zeros.
    `agree`: as `batching.micro_batches`' (the ranks of a sharded model)."""
    was_training = model.training
    model.eval()
    width = batch.response_ids.shape[1]
    try:
        micros = micro_batches(
            torch.arange(len(batch)),
            batch.prompt_mask,
            batch.attended,
            size=batching.micro_batch_size,
            max_tokens=batching.max_token_len,
            packed=batching.remove_padding,
            agree=agree,
        )
        spans = [slice(int(m[0]), int(m[-1]) + 1) for m in micros if len(m)]
        outputs = [forward(batch.select(span).without_padding()) for span in spans]
    finally:
        model.train(was_training)
    return [out if out.dim() < 2 else F.pad(out, (0, width - out.shape[1])) for out in outputs]


@torch.no_grad()
def compute_values(
    critic: torch.nn.Module,
    batch: SequenceBatch,
    *,
    batching: ForwardBatching | int,
    agree: Callable[[int], int] | None = None,
) -> torch.Tensor:
    """values (N, T) without gradient, in the micro-batches of `batching` (an int: that many rows
    each), on the CPU; 0 at masked positions. `agree`: see `_in_eval_micro_batches` (a sharded
    critic's ranks)."""
    batching = ForwardBatching.of(batching)
    parts = _in_eval_micro_batches(
        critic,
        batch,
        batching,
        lambda part: value_forward(critic, part, remove_padding=batching.remove_padding),
        agree,
    )
    return torch.cat(parts).cpu() * batch.response_mask


def score_forward(model: torch.nn.Module, batch: SequenceBatch) -> torch.Tensor:
    """scores (N,) float32: a sequence classifier's scalar (its `score` head, one label) on the
    hidden state of each row's last valid token. Keeps the graph.

    verl's RewardModelWorker._forward_micro_batch takes the per-position score at the last valid
    token, argmax(position_ids · attention_mask); this is the same position (the rightmost one the
    attention mask keeps, also for a one-token row). transformers' own pooling would look for the
    last token that is not the pad id, which is wrong when the tokenizer pads with EOS."""
    inputs = batch.to(model_device(model)).model_inputs()
    mask = inputs["attention_mask"]
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.argmax(positions * mask, dim=-1)
    hidden = getattr(model, model.base_model_prefix)(**inputs, use_cache=False).last_hidden_state
    rows = torch.arange(len(batch), device=hidden.device)
    return model.score(hidden[rows, last]).squeeze(-1).float()


@torch.no_grad()
def compute_scores(model: torch.nn.Module, batch: SequenceBatch, *, micro_batch_size: int) -> torch.Tensor:
    """scores (N,) without gradient, in micro-batches (reward_model.micro_batch_size_per_gpu), on
    the CPU."""
    batching = ForwardBatching(micro_batch_size)
    parts = _in_eval_micro_batches(model, batch, batching, lambda part: score_forward(model, part))
    return torch.cat(parts).cpu() if parts else torch.zeros(0)
