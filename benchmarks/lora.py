"""Benchmark: LoRA against full weights on SmolLM2-135M-Instruct, one actor update of a GRPO-shaped batch.

    python benchmarks/lora.py                      # 3 alternating rounds, rank 8 (alpha 16)
    python benchmarks/lora.py --rounds 5 --rank 32 --alpha 64

Each measurement runs in a fresh process, one torch thread. The batch is what one GRPO step of
conf/gsm8k_cpu.yaml's shape trains on: 4 GSM8K questions in SmolLM2's chat template (about 150
tokens) × 4 responses of 64 random tokens; their old log-probs are computed first, then the peak
resident memory is reset (/proc/self/clear_refs) and the actor update runs: one optimizer step
(AdamW) over the 16 responses in micro-batches of 2 (`engine.update.update_actor`, as the
`actor_update` stage runs it). Then the checkpoint of that iteration is written as a run writes it
(`tasks.pipeline.model_files.save_checkpoint`: the weights, or the adapters, and the optimizer
state). Reported, medians over the rounds:
- trainable: parameters that receive gradients (the adapters, or every weight),
- checkpoint MB: bytes of checkpoints/iter=1/actor/ and actor.optim/ (one iteration's checkpoint),
- update peak MB: resident memory the update adds at its peak (activations, gradients, AdamW state),
- update s / save s: seconds of the update and of writing the checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("lora", "full")
QUESTIONS, RESPONSES_PER_QUESTION, RESPONSE_TOKENS, MICRO_BATCH = 4, 4, 64, 2


def _peak_rss_mb() -> float:
    return _status_mb("VmHWM:")


def _rss_mb() -> float:
    return _status_mb("VmRSS:")


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(variant: str, rank: int, alpha: int) -> dict:
    """One measurement in this process (run by the parent in a fresh interpreter)."""
    import torch

    from ppoflow.conf import load_config
    from ppoflow.engine.forward import compute_log_probs
    from ppoflow.engine.lora import LoraSpec, add_adapters, trainable_parameters
    from ppoflow.engine.models import load_actor, load_tokenizer
    from ppoflow.engine.optim import build_optimizer
    from ppoflow.engine.ppo import build_sequence_batch
    from ppoflow.engine.update import update_actor
    from ppoflow.tasks.pipeline.model_files import save_checkpoint
    from ppoflow.tasks.pipeline.plan import run_settings
    from ppoflow.tasks.pipeline.run import RunFiles
    from ppoflow.tasks.pipeline.states import ModelState
    from ppoflow.tasks.stages.prepare_model import converted_gguf, smollm2_gguf
    from ppoflow.tasks.storage.checkpoints import Trainable, directory_digest

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model_dir = converted_gguf(smollm2_gguf())
    settings = run_settings(load_config(ROOT / "conf/gsm8k_cpu.yaml", check_paths=False), total_steps=1)
    update = dataclasses.replace(
        settings.actor.update,
        mini_batch_size=QUESTIONS * RESPONSES_PER_QUESTION,
        micro_batch_size=MICRO_BATCH,
    )
    lora = LoraSpec(rank, alpha, "all-linear", None, seed=0) if variant == "lora" else None
    model, tokenizer = load_actor(model_dir), load_tokenizer(model_dir)
    if lora is not None:
        model = add_adapters(model, lora)
    optimizer, scheduler = build_optimizer(model, settings.actor.optim)
    questions = [
        json.loads(line)["question"]
        for line in (ROOT / "data/gsm8k/train.jsonl").read_text().splitlines()[:QUESTIONS]
    ]
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )
        for q in questions
        for _ in range(RESPONSES_PER_QUESTION)
    ]
    answers = torch.randint(0, model.config.vocab_size, (len(prompts), RESPONSE_TOKENS)).tolist()
    batch = build_sequence_batch(prompts, answers, pad_token_id=tokenizer.pad_token_id)
    old = compute_log_probs(model, batch, temperature=1.0, batching=4)
    advantages = torch.randn(len(prompts), 1).expand_as(old) * batch.response_mask  # GRPO: per response
    Path("/proc/self/clear_refs").write_text("5")  # peak resident memory := current
    before = _rss_mb()
    started = time.perf_counter()
    update_actor(
        model,
        optimizer,
        batch,
        old_log_probs=old,
        advantages=advantages,
        ref_log_probs=None,
        settings=update,
        seed=1,
    )
    scheduler.step()
    seconds = time.perf_counter() - started
    peak = _peak_rss_mb() - before
    with tempfile.TemporaryDirectory(prefix="ppoflow-lora-bench-") as run_dir:
        run = RunFiles(run_dir)
        base = ModelState("actor", directory_digest(model_dir), 0, str(model_dir))
        started = time.perf_counter()
        save_checkpoint(
            run,
            "actor",
            1,
            Trainable(model, optimizer, scheduler),
            tokenizer,
            base=base if lora else None,
            lora=lora,
        )
        save_seconds = time.perf_counter() - started
        saved = Path(run_dir) / "checkpoints/iter=000001"
        checkpoint = _folder_bytes(saved / "actor") + _folder_bytes(saved / "actor.optim")
    return {
        "trainable": trainable_parameters(model),
        "checkpoint_mb": checkpoint / 1e6,
        "peak_mb": peak,
        "seconds": seconds,
        "save_seconds": save_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=int, default=16)
    parser.add_argument("--measure", metavar="VARIANT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.rank, args.alpha)))
        return
    results: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:  # alternating
            command = [
                sys.executable,
                __file__,
                "--measure",
                variant,
                "--rank",
                str(args.rank),
                "--alpha",
                str(args.alpha),
            ]
            out = subprocess.run(command, capture_output=True, text=True, check=True)
            results[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(
        f"SmolLM2-135M, one actor update: {QUESTIONS} GSM8K prompts × {RESPONSES_PER_QUESTION} responses of "
        f"{RESPONSE_TOKENS} tokens, micro-batches of {MICRO_BATCH}, 1 thread; LoRA rank {args.rank}, alpha "
        f"{args.alpha}, all-linear; medians of {args.rounds} alternating rounds"
    )
    header = ("trainable", 13), ("checkpoint MB", 15), ("update peak MB", 16), ("update s", 10), ("save s", 8)
    print(f"{'variant':<9}" + "".join(f"{name:>{width}}" for name, width in header))
    medians = {}
    for variant in VARIANTS:
        runs = results[variant]
        medians[variant] = m = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"{variant:<9}{m['trainable']:>13,.0f}{m['checkpoint_mb']:>15.1f}{m['peak_mb']:>16.0f}"
            f"{m['seconds']:>10.2f}{m['save_seconds']:>8.2f}"
        )
    lora, full = medians["lora"], medians["full"]
    print(
        f"{'lora/full':<9}{lora['trainable'] / full['trainable']:>13.4f}"
        f"{lora['checkpoint_mb'] / full['checkpoint_mb']:>15.4f}{lora['peak_mb'] / full['peak_mb']:>16.2f}"
        f"{lora['seconds'] / full['seconds']:>10.2f}{lora['save_seconds'] / full['save_seconds']:>8.2f}"
    )


if __name__ == "__main__":
    main()
