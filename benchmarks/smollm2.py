"""Benchmark: SmolLM2-135M-Instruct's forward passes on GSM8K-shaped batches, memory and tokens/s.

    python benchmarks/smollm2.py                    # 3 alternating rounds, both variants
    python benchmarks/smollm2.py --rounds 5 --responses 16 --response-tokens 64

Each measurement runs in a fresh process, with the model loaded, one response's forward pass as a
warm-up (weights paged in), and its peak resident memory reset (/proc/self/clear_refs) just before
the measured work, so "peak MB" is what the work itself adds:
- old_log_prob: `compute_log_probs` over the responses (rollout.log_prob_micro_batch_size_per_gpu=4),
- actor_update: `policy_forward` with entropy and a backward pass, micro-batches of 2 (conf/gsm8k_cpu.yaml).
Prompts are real GSM8K questions in SmolLM2's chat template (about 150 tokens); responses are random
token ids of a fixed length, four responses per question (as rollout.n=4), so that the batch is
padded to its longest prompt. Three variants, alternating: ppoflow (each micro-batch without the
columns that are padding in all of its rows, and the output head on the response positions only);
"padded" (micro-batches at the batch's width, what ppoflow did before); "every-position" (padded,
and the head on every position of the sequence, what it did before that). The benchmark swaps
the baselines back in. Prints medians and the ratio of ppoflow to each baseline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("ppoflow", "padded", "every-position")


def _peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure(stage: str, variant: str, responses: int, response_tokens: int) -> dict:
    """One measurement in this process (run by the parent in a fresh interpreter)."""
    import time

    import torch

    from ppoflow.engine import forward
    from ppoflow.engine.models import load_actor, load_tokenizer
    from ppoflow.engine.ppo import build_sequence_batch
    from ppoflow.tasks.stages.prepare_model import converted_gguf, smollm2_gguf

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if variant != "ppoflow":  # the baselines: micro-batches at the whole batch's width
        forward.SequenceBatch.without_padding = lambda batch: batch
    if variant == "every-position":  # and the head on every position
        forward.keeps_logits = lambda model: False
    model_dir = converted_gguf(smollm2_gguf())
    model, tokenizer = load_actor(model_dir), load_tokenizer(model_dir)
    questions = [
        json.loads(line)["question"]
        for line in (ROOT / "data/gsm8k/train.jsonl").read_text().splitlines()[: max(1, responses // 4)]
    ]
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )
        for q in questions
        for _ in range(4)
    ][:responses]
    vocab = model.config.vocab_size
    answers = torch.randint(0, vocab, (len(prompts), response_tokens)).tolist()
    batch = build_sequence_batch(prompts, answers, pad_token_id=tokenizer.pad_token_id)
    tokens = int(batch.prompt_mask.sum() + batch.response_mask.sum())
    forward.compute_log_probs(model, batch.select(slice(0, 1)), temperature=1.0, batching=1)  # warm-up
    Path("/proc/self/clear_refs").write_text("5")  # peak resident memory := current
    before = _rss_mb()
    started = time.perf_counter()
    if stage == "old_log_prob":
        forward.compute_log_probs(model, batch, temperature=1.0, batching=4)
    else:
        for i in range(0, len(batch), 2):
            log_probs, entropy = forward.policy_forward(
                model, batch.select(slice(i, i + 2)).without_padding(), temperature=1.0, with_entropy=True
            )
            (log_probs.sum() - 0.01 * entropy.sum()).backward()
    seconds = time.perf_counter() - started
    return {"peak_mb": _peak_rss_mb() - before, "seconds": seconds, "tokens_per_s": tokens / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--responses", type=int, default=16)
    parser.add_argument("--response-tokens", type=int, default=64)
    parser.add_argument("--measure", nargs=2, metavar=("STAGE", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure, args.responses, args.response_tokens)))
        return
    results: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for stage in ("old_log_prob", "actor_update"):
            for variant in VARIANTS:  # alternating
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--measure",
                        stage,
                        variant,
                        "--responses",
                        str(args.responses),
                        "--response-tokens",
                        str(args.response_tokens),
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                results.setdefault((stage, variant), []).append(
                    json.loads(out.stdout.strip().splitlines()[-1])
                )
    print(
        f"SmolLM2-135M, {args.responses} responses of {args.response_tokens} tokens after GSM8K prompts, "
        f"1 thread, medians of {args.rounds} alternating rounds"
    )
    print(f"{'stage':<14}{'variant':<24}{'peak MB':>10}{'seconds':>10}{'tokens/s':>10}")
    for stage in ("old_log_prob", "actor_update"):
        medians = {}
        for variant in VARIANTS:
            runs = results[(stage, variant)]
            medians[variant] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            m = medians[variant]
            print(
                f"{stage:<14}{variant:<24}{m['peak_mb']:>10.0f}{m['seconds']:>10.2f}{m['tokens_per_s']:>10.0f}"
            )
        new = medians[VARIANTS[0]]
        for baseline in VARIANTS[1:]:
            old = medians[baseline]
            print(
                f"{stage:<14}{'ppoflow/' + baseline:<24}{new['peak_mb'] / old['peak_mb']:>10.2f}"
                f"{new['seconds'] / old['seconds']:>10.2f}"
            )


if __name__ == "__main__":
    main()
