"""Benchmark: ppoflow against TRL's GRPOTrainer, side by side, on the tiny model and the addition task.

    pip install -c constraints.txt 'trl==1.16.0'        # benchmark only: never a ppoflow dependency
    python benchmarks/vs_trl.py                         # 3 alternating rounds of 12 iterations each
    python benchmarks/vs_trl.py --rounds 5 --iterations 12 --threads 2

Both systems train the same warm-started tiny model (ppoflow's builtin:tiny-addition) with the same
batch: 64 prompts × 8 samples, at most 4 new tokens, one optimizer step per iteration in 8
micro-batches of 64 responses, β = 0 (no reference policy), no validation, no checkpoints for TRL.
ppoflow runs twice per round: `trainer.save_freq=1` (a checkpoint every iteration, its default in
the embedded run) and `save_freq=-1` (none). Each run is a fresh process; the seconds of iteration k
are the wall time between the ends of iterations k−1 and k (everything included: generation,
log-probs, the update, ppoflow's Prefect orchestration and parquet, TRL's trainer loop); the first
iteration is left out (start-up). Prints the median per system and the ratios to TRL.
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

PROMPTS, SAMPLES, NEW_TOKENS, MICRO_BATCH, LR = 64, 8, 4, 64, 3e-4


def _trl(iterations: int, threads: int) -> list[float]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from ppoflow.engine.models import load_actor, load_tokenizer
    from ppoflow.engine.rewards import addition_components
    from ppoflow.engine.tiny import sample_addition_problems
    from ppoflow.tasks.stages.prepare_model import build_tiny_base

    torch.set_num_threads(threads)
    model_dir = build_tiny_base(seed=1)
    problems = sample_addition_problems(PROMPTS * (iterations + 1), seed=0)
    data = Dataset.from_dict({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]})

    def reward(completions, answer, **_):
        return [addition_components(c, a)["correctness"] for c, a in zip(completions, answer, strict=True)]

    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-"),
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=PROMPTS * SAMPLES // MICRO_BATCH,
        num_generations=SAMPLES,
        max_completion_length=NEW_TOKENS,
        beta=0.0,
        learning_rate=LR,
        max_steps=iterations,
        logging_steps=iterations,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
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
    return [b - a for a, b in zip(ends, ends[1:], strict=False)]


def _ppoflow(iterations: int, threads: int, save_freq: int) -> list[float]:
    from ppoflow.flows.train import ppo_train

    summary = ppo_train(
        None,
        [
            "algorithm.adv_estimator=grpo",
            f"actor_rollout_ref.rollout.n={SAMPLES}",
            f"data.train_batch_size={PROMPTS}",
            f"data.max_response_length={NEW_TOKENS}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={MICRO_BATCH}",
            "actor_rollout_ref.actor.ppo_epochs=1",
            f"actor_rollout_ref.actor.optim.lr={LR}",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            f"trainer.save_freq={save_freq}",
            f"trainer.num_threads={threads}",
            f"trainer.total_training_steps={iterations}",
            f"trainer.default_local_dir={tempfile.mkdtemp(prefix='ppoflow-')}",
        ],
    )
    ends = summary["wall_times"]
    return [b - a for a, b in zip(ends, ends[1:], strict=False)]


SYSTEMS = {
    "trl": "TRL 1.16 GRPOTrainer",
    "ppoflow-save1": "ppoflow save_freq=1",
    "ppoflow-save-1": "ppoflow save_freq=-1",
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--run", choices=sorted(SYSTEMS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        if args.run == "trl":
            seconds = _trl(args.iterations, args.threads)
        else:
            seconds = _ppoflow(args.iterations, args.threads, 1 if args.run == "ppoflow-save1" else -1)
        print(json.dumps(seconds))
        return
    env = {
        **os.environ,
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "TRANSFORMERS_VERBOSITY": "error",
        "PPOFLOW_PROGRESS": "0",
    }
    per_system: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    for round_ in range(args.rounds):
        for name in SYSTEMS:  # alternating
            done = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--run",
                    name,
                    "--iterations",
                    str(args.iterations),
                    "--threads",
                    str(args.threads),
                ],
                capture_output=True,
                text=True,
                env=env,
            )
            if done.returncode != 0:
                sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
            seconds = json.loads(done.stdout.strip().splitlines()[-1])[1:]  # the first is start-up
            per_system[name] += seconds
            print(
                f"round {round_ + 1} {SYSTEMS[name]:<22} median {statistics.median(seconds):.3f} s/iteration"
            )
    print(
        f"\n{PROMPTS} prompts x {SAMPLES} samples, <= {NEW_TOKENS} new tokens, 1 optimizer step of "
        f"{PROMPTS * SAMPLES // MICRO_BATCH} micro-batches, {args.threads} torch threads; medians over "
        f"{args.rounds} rounds x {args.iterations - 1} iterations"
    )
    trl = statistics.median(per_system["trl"])
    for name, label in SYSTEMS.items():
        median = statistics.median(per_system[name])
        print(f"{label:<24} {median:.3f} s/iteration   {median / trl:.2f}x TRL")


if __name__ == "__main__":
    main()
