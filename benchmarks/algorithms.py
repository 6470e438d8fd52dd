"""Does every algorithm of verl's registries learn? Trains the embedded task (single-digit addition,
the tiny model) with GRPO-style sampling (8 answers to each of 32 prompts a step) once per policy
loss (actor.policy_loss.loss_mode, with the GRPO estimator) and once per advantage estimator (with
the vanilla loss), for several seeds, and prints a table of greedy correctness at steps 20 and 40
and the seconds per step.

    .venv/bin/python benchmarks/algorithms.py                       # every row, seeds 1 2 3
    .venv/bin/python benchmarks/algorithms.py --only loss:gspo estimator:rloo --seeds 1
    .venv/bin/python benchmarks/algorithms.py --parallel 2          # two runs at a time, 1 thread each

Each run is the real `ppoflow train` in a process of its own (its own temporary Prefect server);
seconds per step are the median of its steps' timing_s/step. With --keep, a kept run that reached
step 40 is read instead of trained again (a benchmark stopped half-way goes on where it was). Exits 1
when a row's mean correctness at step 40 is below --target and the row has no stated reason (`WHY`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

GRPO_STYLE = [
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=8",
    "data.train_batch_size=32",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "trainer.total_training_steps=40",
    "trainer.test_freq=20",
    "trainer.save_freq=-1",
]
LOSSES = {
    "vanilla": [],
    "dppo_tv": [],
    "dppo_kl": [],
    "gspo": ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"],
    "sapo": [],
    "gpg": [],
    "clip_cov": [],
    "kl_cov": [],
    "geo_mean": [],
    "dro": ["actor_rollout_ref.actor.policy_loss.dro_beta=0.1"],
    "cispo": [],
    "bypass_mode": [
        "algorithm.rollout_correction.bypass_mode=true",
        "algorithm.rollout_correction.loss_type=reinforce",
        "algorithm.rollout_correction.rollout_is=token",
    ],
}
"""loss_mode → what a user sets beside it (verl's recipes' keys)."""
ESTIMATORS = {
    "gae": ["critic.ppo_mini_batch_size=16"],
    "grpo": [],
    "grpo_vectorized": [],
    "gdpo": ["algorithm.gdpo_reward_keys=[correctness,format]"],
    "grpo_passk": [],
    "rloo": [],
    "rloo_vectorized": [],
    "opo": [],
    "gpg": [],
    "reinforce_plus_plus": [],
    "reinforce_plus_plus_baseline": [],
    "remax": [],
    "optimal_token_baseline": [],
    "tir_optimal_token_baseline": [],
}
"""adv_estimator → what a user sets beside it."""
WHY: dict[str, str] = {
    "loss:gpg": (
        "learns more slowly and is still rising at step 40 (mean 0.56 at step 20, 0.82 at 40): GPG's loss "
        "is plain REINFORCE, -log π · A with no ratio and no clip, so its gradient is vanilla's on a "
        "step's first mini-batch only and the second is an unclipped off-policy step at the learning "
        "rate tuned for PPO's clip"
    ),
    "loss:cispo": (
        "learns more slowly and is still rising at step 40 (mean 0.59 at step 20, 0.89 at 40): CISPO "
        "clips the importance weight, not the gradient, so every token keeps its gradient on the second "
        "mini-batch of a step too (no trust region) at the learning rate tuned for PPO's clip"
    ),
    "estimator:grpo_passk": (
        "plateaus near 0.88 (0.79 at step 20): it trains pass@k, not pass@1. Only a group's best "
        "answer gets an advantage (its score less the second best's), so with the task's near-binary "
        "scores only groups with exactly one right answer teach anything, and a prompt the model gets "
        "right twice in 8 gives no gradient"
    ),
}
"""Rows measured below the target, and why (benchmarks/algorithms.py, 3 seeds)."""
CURVE = (
    'SELECT step, "val-aux/ppoflow/addition/correctness/mean@1" AS correct, "timing_s/step" AS seconds '
    "FROM metrics ORDER BY step"
)


def rows() -> dict[str, list[str]]:
    """Row name → its overrides on top of GRPO_STYLE."""
    table = {
        f"loss:{mode}": [f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}", *more]
        for mode, more in LOSSES.items()
    }
    table |= {
        f"estimator:{name}": [f"algorithm.adv_estimator={name}", *more] for name, more in ESTIMATORS.items()
    }
    return table


def run(name: str, overrides: list[str], seed: int, scratch: Path, threads: int) -> dict:
    """One run's step-20 and step-40 correctness and its median seconds per step. A run kept under
    --keep that reached step 40 is read, not trained again."""
    run_dir = scratch / f"{name.replace(':', '-')}-seed-{seed}"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PPOFLOW_PROGRESS": "0"}
    if run_dir.is_dir() and (kept := result(name, seed, run_dir, env)).get("at_40") is not None:
        return kept | {"kept": True}
    command = [sys.executable, "-m", "ppoflow", "train", *GRPO_STYLE, *overrides, f"trainer.seed={seed}"]
    command += [f"trainer.default_local_dir={run_dir}", f"trainer.num_threads={threads}"]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return {"name": name, "seed": seed, "error": done.stderr.strip().splitlines()[-1:]}
    return result(name, seed, run_dir, env)


def result(name: str, seed: int, run_dir: Path, env: dict) -> dict:
    """What a run's metrics say: correctness at steps 20 and 40 (None where it has no such row)."""
    query = [sys.executable, "-m", "ppoflow", "query", str(run_dir), CURVE, "--format", "json"]
    answer = subprocess.run(query, env=env, capture_output=True, text=True)
    curve = json.loads(answer.stdout) if answer.returncode == 0 else []
    correct = {row["step"]: row["correct"] for row in curve if row["correct"] is not None}
    seconds = [row["seconds"] for row in curve if row["seconds"] is not None]
    return {
        "name": name,
        "seed": seed,
        "at_20": correct.get(20),
        "at_40": correct.get(40),
        "seconds": statistics.median(seconds) if seconds else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--only", nargs="+", help="row names (loss:gspo, estimator:rloo, …)")
    parser.add_argument(
        "--parallel", type=int, default=1, help="runs at a time (each gets 1 thread when > 1)"
    )
    parser.add_argument(
        "--target", type=float, default=0.9, help="mean correctness every row needs at step 40"
    )
    parser.add_argument(
        "--keep", type=Path, help="keep the runs under this folder (a run there that reached step 40 is read)"
    )
    args = parser.parse_args()
    table = {name: o for name, o in rows().items() if not args.only or name in args.only}
    unknown = set(args.only or ()) - set(rows())
    if unknown:
        raise SystemExit(f"unknown rows {sorted(unknown)}; rows: {', '.join(rows())}")
    threads = 1 if args.parallel > 1 else 2
    with tempfile.TemporaryDirectory(prefix="ppoflow-algorithms-") as temporary:
        scratch = args.keep or Path(temporary)
        jobs = [(name, overrides, seed) for name, overrides in table.items() for seed in args.seeds]
        results = []
        with ThreadPoolExecutor(args.parallel) as pool:
            futures = [pool.submit(run, *job, scratch, threads) for job in jobs]
            for done in as_completed(futures):
                results.append(done.result())
                print(f"[{len(results)}/{len(jobs)}] {_line(results[-1])}", file=sys.stderr, flush=True)
    return report(table, results, args.target)


def _line(result: dict) -> str:
    """One finished run, as the progress line says it."""
    head = f"{result['name']} seed {result['seed']}"
    if "error" in result:
        return f"{head}: failed: {result['error']}"
    kept = " (a kept run, read)" if result.get("kept") else ""
    return (
        f"{head}: {result['at_20']} at step 20, {result['at_40']} at step 40, "
        f"{result['seconds'] or float('nan'):.2f} s/step{kept}"
    )


def report(table: dict, results: list[dict], target: float) -> int:
    print("| row | step 20 (seeds) | step 40 (seeds) | mean at 40 | s/step |")
    print("|---|---|---|---|---|")
    short = []
    for name in table:
        mine = [r for r in results if r["name"] == name]
        failed = [r for r in mine if "error" in r]
        if failed:
            print(f"| {name} | failed: {failed[0]['error']} | | | |")
            short.append(name)
            continue
        at_20 = " ".join(f"{r['at_20']:.2f}" for r in mine)
        at_40 = " ".join(f"{r['at_40']:.2f}" for r in mine)
        mean = statistics.mean(r["at_40"] for r in mine)
        seconds = statistics.median(r["seconds"] for r in mine)
        print(f"| {name} | {at_20} | {at_40} | {mean:.2f} | {seconds:.2f} |")
        if mean < target and name not in WHY:
            short.append(name)
    for name, why in WHY.items():
        if name in table:
            print(f"\n{name}: {why}")
    print(f"\nrows below {target} at step 40 without a stated reason: {', '.join(short) or 'none'}")
    return 1 if short else 0


if __name__ == "__main__":
    sys.exit(main())
