"""The vLLM rollout engine (actor_rollout_ref.rollout.name=vllm): generation at serving speed on a
GPU, behind the same `RolloutEngine` protocol as the transformers engine.

vLLM is an optional extra with no CPU build: it is imported when an engine is created, never at
module import, so this module loads everywhere (and its request-building is tested on CPU).

How it runs (vLLM 0.33):
- The engine lives in the trainer's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, one GPU per
  engine), so weights move from the trained actor to the engine by reference, on the device, with
  no disk round trip: `load_weights` hands the actor's named tensors to vLLM's in-place
  `reload_weights` (each copied into vLLM's own parameter, cast to rollout.dtype). In a worker group
  each rank's engine joins the group's process group through vLLM's external launcher, as
  independent data-parallel engines (verl's layout).
- Prompts go in as token ids and responses come back as token ids (`skip_tokenizer_init`): ppoflow
  tokenizes once, for every engine the same way, and the tokenizer never has to load inside vLLM.
- Each response is its own request with its own seed (`sample_seed`), as in the transformers
  engine: which random stream a response samples from does not depend on its batch. vLLM's kernels
  are not batch-invariant, though, so the numbers (and rarely a sampled token) can move with the
  batch vLLM schedules; the transformers engine is bit-reproducible, vLLM only up to that.
- `rollout_log_probs[t]` is vLLM's log-prob of the sampled token after temperature (and after top-k
  / top-p when those are set: vLLM's "processed" log-probs), what `training/rollout_probs_diff_*`
  compares with the trainer's recomputed `old_log_probs`.
- free_cache_engine: between generations the engine sleeps at level 2 (weights and KV cache
  released, their GPU memory free for the update); it wakes with the actor's newest weights.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .names import VLLM_DUMMY_LOAD_FORMATS
from .rollout import RolloutOutput, SamplingParams


@dataclass(frozen=True)
class VLLMOptions:
    """How the engine is built (actor_rollout_ref.rollout.*). Only `dtype` is part of a stage's cache
    key: the rest are memory and scheduling settings, which ask for nothing different (vLLM is not
    batch-invariant, so they can move its numerics; they stay out of the key so that, say, a lower
    gpu_memory_utilization after running out of memory keeps every finished stage)."""

    dtype: str
    """rollout.dtype: the engine's weight dtype (the actor's weights are cast to it at each sync)."""
    max_model_len: int = field(metadata={"cache_key": False})
    """rollout.prompt_length + rollout.response_length: the longest sequence the engine serves (the
    stages' keys hold both lengths already)."""
    load_format: str = field(default="dummy", metadata={"cache_key": False})
    gpu_memory_utilization: float = field(default=0.5, metadata={"cache_key": False})
    max_num_batched_tokens: int = field(default=8192, metadata={"cache_key": False})
    max_num_seqs: int = field(default=1024, metadata={"cache_key": False})
    enforce_eager: bool = field(default=True, metadata={"cache_key": False})
    free_cache_engine: bool = field(default=True, metadata={"cache_key": False})
    enable_chunked_prefill: bool = field(default=True, metadata={"cache_key": False})
    engine_seed: int = field(default=0, metadata={"cache_key": False})
    """rollout.seed: vLLM's global seed (every request also carries its own, which decides what it
    samples)."""


def engine_arguments(
    options: VLLMOptions, model_dir: str, *, in_process_group: bool = False
) -> dict[str, Any]:
    """The keyword arguments of `vllm.LLM` for `options`, serving the model at `model_dir` (its
    config; with a dummy load format its weights are not read). `in_process_group`: this process is a
    rank of a worker group's process group, which vLLM then joins as independent data-parallel
    engines (its external launcher, as verl's rollout workers do) instead of starting its own."""
    load_format = "dummy" if options.load_format in VLLM_DUMMY_LOAD_FORMATS else options.load_format
    launcher = {"distributed_executor_backend": "external_launcher"} if in_process_group else {}
    return {
        **launcher,
        "model": model_dir,
        "skip_tokenizer_init": True,
        "dtype": options.dtype,
        "load_format": load_format,
        "seed": options.engine_seed,
        "gpu_memory_utilization": options.gpu_memory_utilization,
        "tensor_parallel_size": 1,  # one engine per rank (the config refuses other sizes)
        "max_model_len": options.max_model_len,
        "max_num_batched_tokens": options.max_num_batched_tokens,
        "max_num_seqs": options.max_num_seqs,
        "enforce_eager": options.enforce_eager,
        "enable_chunked_prefill": options.enable_chunked_prefill,
        "enable_sleep_mode": options.free_cache_engine,
        "enable_prefix_caching": True,  # the n responses of a prompt share its prefill; reset at each sync
        "logprobs_mode": "processed_logprobs",
        "max_logprobs": 0,  # only the sampled token's log-prob is returned
        "disable_log_stats": True,
    }


def request_arguments(params: SamplingParams, seed: int, stop_token_ids: Sequence[int]) -> dict[str, Any]:
    """The keyword arguments of one `vllm.SamplingParams`: one response sampled from `seed`, its
    sampled token's log-prob returned, stopping at (and keeping) any of `stop_token_ids`.

    ppoflow's conventions become vLLM's: greedy is temperature 0; top_k ≤ 0 (all tokens) is vLLM's 0;
    the EOS ids are stop tokens since vLLM runs without a tokenizer."""
    greedy = not params.do_sample or params.temperature <= 0
    return {
        "n": 1,
        "temperature": 0.0 if greedy else params.temperature,
        "top_p": 1.0 if greedy else params.top_p,
        "top_k": 0 if greedy or params.top_k <= 0 else params.top_k,
        "seed": seed,
        "max_tokens": params.max_new_tokens,
        "logprobs": 0,
        "stop_token_ids": sorted(set(stop_token_ids)),
        "ignore_eos": False,
        "detokenize": False,
        "skip_special_tokens": False,
    }


def response_of(token_ids: Sequence[int], position_logprobs: Sequence[Any] | None, finish_reason: str | None):
    """(ids, log-probs, finish reason) of one vLLM completion: `position_logprobs[t]` maps the
    sampled token id at t to its Logprob (vLLM returns the sampled token's entry with logprobs=0)."""
    ids = list(token_ids)
    if position_logprobs is None or len(position_logprobs) != len(ids):
        got = "none" if position_logprobs is None else len(position_logprobs)
        raise RuntimeError(f"vLLM returned {len(ids)} tokens but {got} log-probs for a response")
    log_probs = [float(position_logprobs[t][token].logprob) for t, token in enumerate(ids)]
    if finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM ended a response with finish_reason={finish_reason!r} (aborted?)")
    return ids, log_probs, finish_reason


def _check_model_length(model_dir: Path, max_model_len: int) -> None:
    """vLLM refuses to serve sequences longer than the model's positions; say which keys decide it."""
    positions = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
    if positions is not None and max_model_len > positions:
        raise ValueError(
            f"rollout.prompt_length + rollout.response_length = {max_model_len} is longer than the model's "
            f"{positions} positions (max_position_embeddings in {model_dir / 'config.json'}): vLLM cannot "
            "serve it; lower data.max_prompt_length or data.max_response_length"
        )


class VLLMRolloutEngine:
    """A vLLM engine in this process, serving the actor whose weights `load_weights` last gave it.

    Created with the actor's model directory (for its config: architecture, vocabulary, shapes); it
    generates only after `load_weights`, since its own start-up weights are not the actor's."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        options: VLLMOptions,
        *,
        eos_token_ids: Sequence[int],
        in_process_group: bool = False,
    ):
        """`in_process_group`: this process is a rank of a worker group (its process group is the
        run's, and outlives the engine)."""
        _check_model_length(Path(model_dir), options.max_model_len)
        # the engine core runs in this process, so weights are synced by reference on the device
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        self.options = options
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.in_process_group = in_process_group
        self.llm = LLM(**engine_arguments(options, str(model_dir), in_process_group=in_process_group))
        self.weights_version: object = None
        """Which actor state the engine's weights are (None: not the actor's yet)."""
        self._asleep = False

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: object) -> None:
        """Copy the actor's weights (Hugging Face names, any dtype, on this process's GPU or CPU)
        into the running engine, in place; `version` names the actor state they are."""
        if self._asleep:
            self.llm.wake_up(tags=["weights"])
        dtype = getattr(torch, self.options.dtype)  # cast here: vLLM warns for every narrowed tensor
        weights = ((name, tensor.detach().to(dtype)) for name, tensor in named_tensors)  # one at a time
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.weights_version = version
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        self.llm.reset_prefix_cache()

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        seeds: Sequence[int],
        on_batch: Callable[[int], None] | None = None,
        on_tokens: Callable[[int], None] | None = None,
    ) -> RolloutOutput:
        from vllm import SamplingParams as VLLMSamplingParams

        if len(seeds) != len(prompt_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(seeds)} seeds: one seed per response")
        if self.weights_version is None or self._asleep:
            raise RuntimeError("the vLLM engine has no actor weights: call load_weights before generate")
        prompts = [{"prompt_token_ids": list(ids)} for ids in prompt_ids]
        requests = [VLLMSamplingParams(**request_arguments(params, s, self.eos_token_ids)) for s in seeds]
        finished = self.llm.generate(prompts, requests, use_tqdm=False)
        out = RolloutOutput()
        for request in finished:
            completion = request.outputs[0]
            ids, log_probs, reason = response_of(
                completion.token_ids, completion.logprobs, completion.finish_reason
            )
            out.response_ids.append(ids)
            out.rollout_log_probs.append(log_probs)
            out.finish_reasons.append(reason)
        if on_tokens is not None:
            on_tokens(sum(len(ids) for ids in out.response_ids))
        if on_batch is not None:
            on_batch(len(out.response_ids))
        self._release()
        return out

    def _release(self) -> None:
        """free_cache_engine: after generating, release the engine's weights and KV cache (a level-2
        sleep) until the next `load_weights`, leaving their GPU memory to the log-prob passes and the
        update (verl's free_cache_engine)."""
        if self.options.free_cache_engine:
            self.llm.sleep(level=2)
            self._asleep = True
            self.weights_version = None

    def close(self) -> None:
        """Shut the engine down and free its GPU memory. In a worker group the engine stays until the
        rank's process ends: vLLM's shutdown would destroy the group's process group with it."""
        llm, self.llm = self.llm, None
        if llm is not None and not self.in_process_group:
            llm.llm_engine.engine_core.shutdown()
            del llm
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
