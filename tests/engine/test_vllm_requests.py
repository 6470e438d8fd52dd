"""The vLLM engine's requests, built from ppoflow's settings (no vLLM needed: these are the
arguments handed to vllm.LLM and vllm.SamplingParams, and the reading of its completions)."""

from types import SimpleNamespace

import pytest

from ppoflow.engine.rollout import SamplingParams
from ppoflow.engine.vllm_rollout import VLLMOptions, engine_arguments, request_arguments, response_of


def test_sampling_maps_to_vllm_conventions_one_seeded_response_per_request():
    sampled = request_arguments(SamplingParams(64, temperature=0.7, top_p=0.9, top_k=-1), 123, [7, 2, 7])
    assert sampled == {
        "n": 1,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 0,  # vLLM's "all tokens"; ppoflow and verl spell it -1
        "seed": 123,
        "max_tokens": 64,
        "logprobs": 0,  # the sampled token's log-prob only
        "stop_token_ids": [2, 7],
        "ignore_eos": False,
        "detokenize": False,
        "skip_special_tokens": False,
    }
    assert request_arguments(SamplingParams(8, top_k=5), 1, [2])["top_k"] == 5


@pytest.mark.parametrize(
    "params",
    [SamplingParams.greedy(16), SamplingParams(16, temperature=0.0, top_k=3, top_p=0.5)],
    ids=["do_sample=false", "temperature=0"],
)
def test_greedy_is_temperature_zero_without_filters(params):
    greedy = request_arguments(params, 5, [2])
    assert (greedy["temperature"], greedy["top_k"], greedy["top_p"]) == (0.0, 0, 1.0)


def test_engine_arguments_follow_the_rollout_keys():
    options = VLLMOptions(
        dtype="bfloat16",
        max_model_len=576,
        load_format="dummy_dtensor",
        gpu_memory_utilization=0.4,
        max_num_batched_tokens=4096,
        max_num_seqs=256,
        enforce_eager=False,
        free_cache_engine=True,
        enable_chunked_prefill=False,
        engine_seed=9,
    )
    args = engine_arguments(options, "/models/actor")
    assert args["model"] == "/models/actor" and args["load_format"] == "dummy"  # verl's dtensor → dummy
    assert (args["gpu_memory_utilization"], args["max_num_batched_tokens"], args["max_num_seqs"]) == (
        0.4,
        4096,
        256,
    )
    assert (args["enforce_eager"], args["enable_chunked_prefill"], args["enable_sleep_mode"]) == (
        False,
        False,
        True,
    )
    assert (args["max_model_len"], args["seed"], args["dtype"], args["tensor_parallel_size"]) == (
        576,
        9,
        "bfloat16",
        1,
    )
    assert args["skip_tokenizer_init"] and args["logprobs_mode"] == "processed_logprobs"
    assert args["enable_prefix_caching"] and "distributed_executor_backend" not in args
    grouped = engine_arguments(options, "/models/actor", in_process_group=True)
    assert grouped["distributed_executor_backend"] == "external_launcher"  # a worker group's rank
    assert (
        engine_arguments(VLLMOptions("float32", 64, load_format="safetensors"), "m")["load_format"]
        == "safetensors"
    )


def _logprob(value):
    return SimpleNamespace(logprob=value)


def test_a_completion_becomes_ids_log_probs_and_finish_reason():
    ids, log_probs, reason = response_of(
        (4, 9, 2), [{4: _logprob(-0.5)}, {9: _logprob(-1.25)}, {2: _logprob(0.0)}], "stop"
    )
    assert (ids, log_probs, reason) == ([4, 9, 2], [-0.5, -1.25, 0.0], "stop")


@pytest.mark.parametrize(
    ("logprobs", "reason", "message"),
    [
        (None, "length", "2 tokens but none log-probs"),
        ([{4: _logprob(-0.5)}], "length", "2 tokens but 1 log-probs"),
        ([{4: _logprob(-0.5)}, {9: _logprob(-1.0)}], "abort", "finish_reason='abort'"),
    ],
)
def test_an_incomplete_completion_is_an_error_not_a_short_row(logprobs, reason, message):
    with pytest.raises(RuntimeError, match=message):
        response_of([4, 9], logprobs, reason)


def test_only_the_dtype_is_part_of_a_stage_cache_key():
    """Memory and scheduling settings ask for nothing different: changing them (say, after running
    out of GPU memory) keeps every finished stage cached; the dtype changes the numbers."""
    from ppoflow.tasks.pipeline.cache_keys import identity

    assert (
        identity(VLLMOptions("bfloat16", 576, gpu_memory_utilization=0.3, max_num_seqs=8))
        == identity(VLLMOptions("bfloat16", 1024))
        == {"dtype": "bfloat16"}
    )
    assert identity(VLLMOptions("float32", 576)) != identity(VLLMOptions("bfloat16", 576))


def test_a_sequence_longer_than_the_model_positions_is_refused_before_vllm_starts(tiny_model_dir):
    """The tiny model has 64 positions; vLLM would refuse in a long traceback."""
    from ppoflow.engine.vllm_rollout import VLLMRolloutEngine

    with pytest.raises(
        ValueError, match=r"= 80 is longer than the model's 64 positions .*lower data.max_prompt_length"
    ):
        VLLMRolloutEngine(tiny_model_dir, VLLMOptions("float32", 80), eos_token_ids=[1])
