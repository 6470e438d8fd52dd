"""Benchmark: one PPO step with a critic at real shapes, without downloading weights.

    python benchmarks/gpu_throughput.py --model qwen2.5-0.5b-instruct            # on CUDA, bf16
    python benchmarks/gpu_throughput.py --model smollm2-135m-instruct --dtype float32
    python benchmarks/gpu_throughput.py --model smollm2-135m-instruct --device cpu --prompts 4 \
        --response-length 8 --dtype float32                                            # a smoke run

The model is the architecture of benchmarks/architectures/<model>/config.json (copied from the
model's published config.json) with random weights; the critic is the same backbone with a value
head, the reference a frozen copy. The batch is verl's quickstart (docs/start/quickstart): 256
prompts (lengths uniform in 68–142 tokens, mean 105 like the quickstart log's prompt_length/mean),
256-token answers (random weights rarely stop early), and the settings `ppoflow train --config
conf/gsm8k.yaml` builds (verl's quickstart: ppo_mini_batch_size 64, micro-batches of 4 for actor,
critic and reference and 8 for old log-probs, one PPO epoch, its learning rates). Each phase runs
ppoflow's engine code: HFRolloutEngine generation, compute_log_probs, compute_values, update_critic,
update_actor.

Prints, per phase: seconds, tokens/s on this one device (generation: answer tokens; the others:
prompt + answer tokens, as verl's perf/throughput counts them) and the device's peak memory during
the phase; then verl's published quickstart step (Qwen2.5-0.5B-Instruct, GSM8K, one GPU of an
unstated kind) in the same columns. Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ppoflow.conf import ConfigError, load_config
from ppoflow.engine.forward import compute_log_probs, compute_values
from ppoflow.engine.models import load_actor, load_critic, load_reference
from ppoflow.engine.optim import build_optimizer
from ppoflow.engine.ppo import build_sequence_batch
from ppoflow.engine.rollout import HFRolloutEngine, RowStreams, sample_seed
from ppoflow.engine.update import update_actor, update_critic
from ppoflow.tasks.pipeline.plan import run_settings
from ppoflow.tasks.pipeline.settings import RunSettings

ARCHITECTURES = Path(__file__).parent / "architectures"
QUICKSTART = Path(__file__).resolve().parents[1] / "conf" / "gsm8k.yaml"
"""verl's quickstart settings (batch sizes, learning rates), which ppoflow's GSM8K config carries."""
GIB = 2**30

VERL_QUICKSTART = {  # verl docs/start/quickstart: step 0 of PPO on GSM8K, Qwen2.5-0.5B-Instruct, 1 GPU
    "prompts": 256,
    "prompt_length_mean": 104.883,
    "response_length_mean": 239.133,
    "seconds": {
        "gen": 21.470,
        "ref": 4.360,
        "values": 5.800,
        "update_critic": 15.664,
        "update_actor": 20.314,
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(p.name for p in ARCHITECTURES.iterdir()), required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--prompts", type=positive, default=256)
    parser.add_argument("--response-length", type=positive, default=256)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    on_cuda = torch.device(args.device).type == "cuda"
    if on_cuda and not torch.cuda.is_available():
        sys.exit("gpu_throughput: torch sees no CUDA device (use --device cpu for a smoke run)")
    if on_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True  # float32 runs: TF32 tensor cores, as verl's defaults
    torch.manual_seed(args.seed)
    try:
        figures = run(args)
    except ConfigError as error:  # e.g. fewer prompts than a micro-batch
        sys.exit(f"gpu_throughput: {error}")
    print_table(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive count")
    return value


def quickstart_settings(prompts: int, response_length: int) -> RunSettings:
    """Every stage's settings as `ppoflow train --config conf/gsm8k.yaml` builds them, for `prompts`
    per step (mini-batches of 64, or all of them when fewer) and answers of `response_length`."""
    overrides = [
        f"data.train_batch_size={prompts}",
        f"data.max_response_length={response_length}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={min(64, prompts)}",
    ]
    return run_settings(load_config(QUICKSTART, overrides, check_paths=False), total_steps=1)


def run(args) -> dict:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    settings = quickstart_settings(args.prompts, args.response_length)
    config = AutoConfig.from_pretrained(ARCHITECTURES / args.model)
    with tempfile.TemporaryDirectory(prefix="ppoflow-throughput-") as folder:
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)  # random weights, float32
        actor = load_actor(folder, dtype=dtype).to(device)
        reference = load_reference(folder, dtype=dtype).to(device)
        critic = load_critic(folder, dtype=dtype).to(device)
    torch.nn.init.normal_(critic.score.weight, std=config.initializer_range)  # verl's head starts random
    generator = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(68, 143, (args.prompts,), generator=generator).tolist()
    vocab = config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]
    eos = config.eos_token_id if isinstance(config.eos_token_id, int) else config.eos_token_id[0]
    pad = config.pad_token_id if config.pad_token_id is not None else eos
    figures = {
        "model": args.model,
        "dtype": args.dtype,
        "device": describe(device),
        "torch": torch.__version__,
        "parameters_m": round(sum(p.numel() for p in actor.parameters()) / 1e6, 1),
        "prompts": args.prompts,
        "phases": {},
    }
    phases = figures["phases"]

    engine = HFRolloutEngine(actor, eos_token_ids=[eos], pad_token_id=pad, batch_size=args.prompts)
    rollout = settings.rollout
    seeds = [sample_seed(args.seed, i, 0) for i in range(args.prompts)]
    out = timed(phases, "gen", device, lambda: engine.generate(prompts, rollout.sampling, seeds=seeds))
    batch = build_sequence_batch(prompts, out.response_ids, pad_token_id=pad)
    answer_tokens = sum(len(r) for r in out.response_ids)
    all_tokens = sum(lengths) + answer_tokens
    figures["prompt_length_mean"] = sum(lengths) / len(lengths)
    figures["response_length_mean"] = answer_tokens / len(lengths)

    temperature = rollout.sampling.logit_temperature
    old = timed(
        phases,
        "old_log_prob",
        device,
        lambda: compute_log_probs(actor, batch, temperature=temperature, batching=rollout.log_prob_batching),
    )
    timed(
        phases,
        "ref",
        device,
        lambda: compute_log_probs(
            reference, batch, temperature=temperature, batching=rollout.ref_log_prob_batching
        ),
    )
    values_micro = settings.advantages.values_batching
    values = timed(phases, "values", device, lambda: compute_values(critic, batch, batching=values_micro))
    returns = torch.randn_like(values) * batch.response_mask
    advantages = torch.randn_like(values) * batch.response_mask
    critic_optim, _ = build_optimizer(critic, settings.critic.optim)
    timed(
        phases,
        "update_critic",
        device,
        lambda: update_critic(
            critic,
            critic_optim,
            batch,
            values=values,
            returns=returns,
            settings=settings.critic.update,
            seed=args.seed,
        ),
    )
    actor_optim, _ = build_optimizer(actor, settings.actor.optim)
    timed(
        phases,
        "update_actor",
        device,
        lambda: update_actor(
            actor,
            actor_optim,
            batch,
            old_log_probs=old,
            advantages=advantages,
            ref_log_probs=None,
            settings=settings.actor.update,
            seed=args.seed,
        ),
    )
    figures["noise_draw_s"] = noise_draw_seconds(args.prompts, vocab)
    for name, phase in phases.items():
        tokens = answer_tokens if name == "gen" else all_tokens
        phase["tokens_per_s"] = tokens / phase["seconds"]
    peaks = [p["peak_memory_gib"] for p in phases.values() if p["peak_memory_gib"] is not None]
    figures["peak_memory_gib"] = max(peaks, default=None)
    return figures


def noise_draw_seconds(rows: int, vocab: int) -> dict[int, float]:
    """Seconds to draw one decoding step's sampling noise (rows × vocab exponentials from each row's
    CPU generator, engine.rollout.RowStreams) with one thread and with torch's thread count."""
    probs = torch.full((rows, vocab), 1.0 / vocab)
    threads, seconds = torch.get_num_threads(), {}
    for count in sorted({1, threads}):
        torch.set_num_threads(count)
        streams = RowStreams(list(range(rows)), budget=rows * vocab)  # one step per draw
        started = time.perf_counter()
        for _ in range(3):
            streams.sample(probs)
        seconds[count] = (time.perf_counter() - started) / 3
    torch.set_num_threads(threads)
    return seconds


def timed(phases: dict, name: str, device: torch.device, work: Callable):
    with measured(device) as result:
        value = work()
    phases[name] = result
    print(f"  {name}: {result['seconds']:.2f} s", flush=True)
    return value


@contextmanager
def measured(device: torch.device):
    """Wall seconds of the block (the device synchronized at both ends) and its peak memory."""
    result: dict[str, float] = {}
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    yield result
    if device.type == "cuda":
        torch.cuda.synchronize()
    result["seconds"] = time.perf_counter() - started
    result["peak_memory_gib"] = peak_memory(device)


def peak_memory(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / GIB if device.type == "cuda" else None


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads"


def print_table(figures: dict) -> None:
    print(
        f"\n{figures['model']} ({figures['parameters_m']}M parameters, random weights, {figures['dtype']}) "
        f"on {figures['device']}, torch {figures['torch']}: {figures['prompts']} prompts of "
        f"{figures['prompt_length_mean']:.1f} tokens on average, "
        f"answers of {figures['response_length_mean']:.1f}"
    )
    verl = VERL_QUICKSTART
    verl_answers = verl["prompts"] * verl["response_length_mean"]
    verl_tokens = verl["prompts"] * (verl["prompt_length_mean"] + verl["response_length_mean"])
    print(f"{'phase':<14}{'ppoflow s':>10}{'tokens/s':>11}{'peak GiB':>10}   {'verl s':>8}{'tokens/s':>10}")
    for name, phase in figures["phases"].items():
        memory = f"{phase['peak_memory_gib']:.2f}" if phase["peak_memory_gib"] is not None else "-"
        verl_s = verl["seconds"].get(name)
        verl_cols = "       -         -"
        if verl_s is not None:
            verl_rate = (verl_answers if name == "gen" else verl_tokens) / verl_s
            verl_cols = f"{verl_s:>8.2f}{verl_rate:>10.0f}"
        print(f"{name:<14}{phase['seconds']:>10.2f}{phase['tokens_per_s']:>11.0f}{memory:>10}   {verl_cols}")
    total = sum(p["seconds"] for p in figures["phases"].values())
    verl_total = sum(verl["seconds"].values())
    print(
        f"{'step':<14}{total:>10.2f}{'':>21}   {verl_total:>8.2f}   (verl's step has no old_log_prob phase)"
    )
    draws = ", ".join(f"{count} thread(s) {s:.3f} s" for count, s in figures["noise_draw_s"].items())
    print(f"one decoding step's sampling noise on the CPU ({figures['prompts']} rows): {draws}")
    if figures["peak_memory_gib"] is not None:
        print(f"peak memory allocated by torch over the step: {figures['peak_memory_gib']:.2f} GiB")


if __name__ == "__main__":
    main()
