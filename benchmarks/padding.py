"""Benchmark: token-budget micro-batches (use_dynamic_bsz) and padding-free passes
(use_remove_padding) with SmolLM2-135M-Instruct on GSM8K-shaped batches of uneven length.

    python benchmarks/padding.py                    # 3 alternating rounds, every variant
    python benchmarks/padding.py --rounds 5 --responses 32 --threads 1

Prompts are real GSM8K questions in SmolLM2's chat template (about 150 tokens), four responses per
question (rollout.n=4); responses are random token ids of 16–256 tokens (uniform, seeded), as
GSM8K answers vary. Two passes, each measured in a fresh process after a one-response warm-up, its
peak resident memory reset (/proc/self/clear_refs) just before the measured work:
- old_log_prob: `compute_log_probs` over every response (log_prob_micro_batch_size_per_gpu=4, or a
  budget of 4 × the longest sequence the batch could hold);
- actor_update: one `update_actor` epoch of one mini-batch of every response, an AdamW step included
  (ppo_micro_batch_size_per_gpu=2, or a budget of 2 × that longest sequence).
Variants: "padded" (fixed micro-batches, each without its all-padding columns: ppoflow's default),
"budget" (use_dynamic_bsz), "packed" (use_remove_padding), "packed+budget" (both). Tokens/s counts
the valid prompt and response tokens. Prints medians and each variant's ratio to "padded".
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("padded", "budget", "packed", "packed+budget")
STAGES = ("old_log_prob", "actor_update")
SHORTEST, LONGEST = 16, 256
MICRO = {"old_log_prob": 4, "actor_update": 2}


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(stage: str, variant: str, responses: int, threads: int, model_dir: str) -> dict:
    """One measurement in this process (run by the parent in a fresh interpreter)."""
    import dataclasses
    import time

    import torch

    from ppoflow.conf import load_config
    from ppoflow.engine.batching import ForwardBatching
    from ppoflow.engine.forward import compute_log_probs
    from ppoflow.engine.models import load_actor, load_tokenizer
    from ppoflow.engine.ppo import build_sequence_batch
    from ppoflow.engine.update import update_actor
    from ppoflow.tasks.pipeline.plan import run_settings

    torch.set_num_threads(threads)
    model, tokenizer = load_actor(model_dir), load_tokenizer(model_dir)
    questions = [
        json.loads(line)["question"]
        for line in (ROOT / "data/gsm8k/train.jsonl").read_text().splitlines()[: -(-responses // 4)]
    ]
    template = {"add_generation_prompt": True, "return_dict": True}
    prompts = [
        list(tokenizer.apply_chat_template([{"role": "user", "content": q}], **template)["input_ids"])
        for q in questions
        for _ in range(4)
    ][:responses]
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(SHORTEST, LONGEST + 1, (responses,), generator=generator).tolist()
    answers = [torch.randint(0, model.config.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    batch = build_sequence_batch(prompts, answers, pad_token_id=tokenizer.pad_token_id)
    tokens = int(batch.prompt_mask.sum() + batch.response_mask.sum())
    longest = int(batch.prompt_mask.sum(dim=1).max()) + LONGEST
    micro = MICRO[stage]
    budget = micro * longest if "budget" in variant else None
    packed = variant.startswith("packed")
    batching = ForwardBatching(micro, max_token_len=budget, remove_padding=packed)
    compute_log_probs(model, batch.select(slice(0, 1)), temperature=1.0, batching=batching)  # warm-up
    Path("/proc/self/clear_refs").write_text("5")  # peak resident memory := current
    before = _status_mb("VmRSS")
    started = time.perf_counter()
    if stage == "old_log_prob":
        compute_log_probs(model, batch, temperature=1.0, batching=batching)
    else:
        cfg = load_config(None, [f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}"])
        settings = dataclasses.replace(
            run_settings(cfg, 1).actor.update,
            ppo_epochs=1,
            mini_batch_size=len(batch),
            micro_batch_size=micro,
            max_token_len=budget,
            remove_padding=packed,
        )
        update_actor(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-6),
            batch,
            old_log_probs=torch.randn(batch.response_mask.shape, generator=generator) - 3,
            advantages=torch.randn(batch.response_mask.shape, generator=generator),
            ref_log_probs=None,
            settings=settings,
            seed=0,
        )
    seconds = time.perf_counter() - started
    return {"peak_mb": _status_mb("VmHWM") - before, "seconds": seconds, "tokens_per_s": tokens / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--responses", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--measure", nargs=3, metavar=("STAGE", "VARIANT", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure[:2], args.responses, args.threads, args.measure[2])))
        return
    from ppoflow.tasks.stages.prepare_model import converted_gguf, smollm2_gguf

    model_dir = str(converted_gguf(smollm2_gguf()))  # the built-in SmolLM2, converted once
    results: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for stage in STAGES:
            for variant in VARIANTS:  # alternating
                command = [sys.executable, __file__, "--measure", stage, variant, model_dir]
                command += ["--responses", str(args.responses), "--threads", str(args.threads)]
                out = subprocess.run(command, capture_output=True, text=True, check=True)
                results.setdefault((stage, variant), []).append(
                    json.loads(out.stdout.strip().splitlines()[-1])
                )
    print(
        f"SmolLM2-135M, {args.responses} responses of {SHORTEST}-{LONGEST} tokens after GSM8K prompts, "
        f"{args.threads} threads, medians of {args.rounds} alternating rounds"
    )
    print(
        f"{'stage':<14}{'variant':<16}{'peak MB':>9}{'seconds':>9}{'tokens/s':>10}"
        f"{'× time':>8}{'× memory':>10}"
    )
    for stage in STAGES:
        medians = {}
        for variant in VARIANTS:
            runs = results[(stage, variant)]
            medians[variant] = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        base = medians["padded"]
        for variant in VARIANTS:
            m = medians[variant]
            print(
                f"{stage:<14}{variant:<16}{m['peak_mb']:>9.0f}{m['seconds']:>9.2f}{m['tokens_per_s']:>10.0f}"
                f"{m['seconds'] / base['seconds']:>8.2f}{m['peak_mb'] / base['peak_mb']:>10.2f}"
            )


if __name__ == "__main__":
    main()
