#!/usr/bin/env bash
# The GPU proof for a CUDA machine without network whose Python already has torch and transformers
# (the proven image: Python 3.12, torch 2.11.0 CUDA 13, transformers 5.17.0; no prefect, duckdb).
#   bash scripts/gpu-bundle                   # here, with network: the wheels that image lacks → .gpu-bundle/
#   bash benchmarks/gpu_proof.sh              # there, in the repository (the bundle travels with it)
#   bash benchmarks/gpu_proof.sh --dry-run    # anywhere: every step at the size a CPU manages
# Steps, each under its own time limit (≤ 9 minutes in all): install the bundle into a scratch
# folder; the tests marked gpu (the transformers engine on CUDA against the CPU; the vLLM tests skip
# with their reason); the embedded default on CUDA and on the CPU with the same seed
# (benchmarks/device_agreement.py: both curves, the final actors' distance, stated tolerances); one
# PPO step at verl's quickstart shapes with random weights for SmolLM2-135M and Qwen2.5-0.5B
# (benchmarks/gpu_throughput.py: tokens/s and peak memory per phase beside verl's published step).
# Results go to $OUT when set, else runs/gpu-proof-<time>/. Ends with one line: what passed, what did
# not. The repository's own ppoflow/ folder must not shadow the installed package (it lacks engine/,
# tasks/, flows/, conf/, which installing maps in): Python runs with PYTHONSAFEPATH=1 (no current
# folder on sys.path) and pytest with --import-mode=importlib. The dry run installs the bundle's
# ppoflow wheel the same way (its other wheels are for Python 3.12; this Python's packages stand in).
set -uo pipefail
cd "$(dirname "$0")/.."
dry_run=false
case "$*" in
  --dry-run) dry_run=true ;;
  "") ;;
  *) echo "gpu_proof: unknown arguments '$*' (use --dry-run or nothing)" >&2; exit 2 ;;
esac
out="${OUT:-runs/gpu-proof-$(date +%Y%m%d-%H%M%S)-$$}"
mkdir -p "$out"
site="$(mktemp -d "${TMPDIR:-/tmp}/ppoflow-site-XXXXXXXX")"
trap 'rm -rf "$site"' EXIT
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PPOFLOW_PROGRESS=0
deadline=$((SECONDS + 540))
passed=() failed=() notes=()

step() {  # name, seconds allowed, command...: runs it within the time left, records the outcome
  local name="$1" limit="$2"
  shift 2
  local left=$((deadline - SECONDS))
  ((limit > left)) && limit=$left
  if ((limit < 10)); then
    echo "== $name: not run, the proof's 9 minutes are spent"
    failed+=("$name (no time left)")
    return 1
  fi
  echo "== $name (≤ ${limit} s)"
  local started=$SECONDS
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  local took=$((SECONDS - started))
  if ((rc == 0)); then
    passed+=("$name")
    echo "== $name: passed in ${took} s"
  else
    ((rc == 124)) && failed+=("$name (over ${limit} s)") || failed+=("$name (exit $rc)")
    echo "== $name: FAILED (exit $rc) after ${took} s"
  fi
  return $rc
}

proof() {
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
  if $dry_run; then
    py="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
    device=cpu
    if [ -d .gpu-bundle ]; then
      step "bundle complete for the image (static check)" 60 "$py" scripts/gpu_bundle_check.py static .gpu-bundle
      step "install ppoflow's wheel from the bundle" 60 "$py" -m pip install -q --no-index --no-deps \
        --no-compile --target "$site" .gpu-bundle/ppoflow-*.whl
    else
      echo "== bundle: none here (bash scripts/gpu-bundle writes .gpu-bundle/): not checked, not installed"
      notes+=("no bundle here: neither checked nor installed")
    fi
  else
    py="${PYTHON:-python3}"
    device=cuda
    if ! "$py" -c "import torch" 2>/dev/null; then
      echo "gpu_proof: $py has no torch: run on the GPU machine (PYTHON=… names another Python), or use --dry-run"
      exit 2
    fi
    "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
      echo "gpu_proof: torch sees no CUDA device here: run on the GPU machine, or use --dry-run"
      exit 2
    }
    [ -d .gpu-bundle ] || { echo "gpu_proof: no .gpu-bundle/ here: run bash scripts/gpu-bundle first"; exit 2; }
    step "install the bundle" 120 "$py" scripts/gpu_bundle_check.py install "$site" .gpu-bundle
    case $? in  # 1: installed, with requirements unmet (listed above): the steps below show what breaks
      0 | 1) ;;
      *) echo "gpu_proof: FAILED: the bundle did not install (see above)"; exit 1 ;;
    esac
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  fi
  export PYTHONSAFEPATH=1
  "$py" -c "import sys, torch, transformers, prefect, duckdb, ppoflow.engine; print(f'python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, prefect {prefect.__version__}, duckdb {duckdb.__version__}; ppoflow from {ppoflow.engine.__path__[0]}')"

  step "tests marked gpu" 150 "$py" -m pytest -q -n 0 -m gpu -p no:cacheprovider --import-mode=importlib tests/gpu
  $dry_run && notes+=("the gpu tests were collected and skip without CUDA")
  if $dry_run; then
    step "embedded default, the same seed twice (2 steps)" 200 \
      "$py" benchmarks/device_agreement.py --devices cpu cpu -- trainer.total_training_steps=2
    for model in smollm2-135m-instruct qwen2.5-0.5b-instruct; do
      step "one PPO step, $model (4 tokens)" 150 "$py" benchmarks/gpu_throughput.py --model "$model" \
        --device cpu --dtype float32 --prompts 4 --response-length 4 --json "$out/throughput-$model.json"
    done
  else
    step "embedded default on CUDA and on the CPU, seed 1" 220 "$py" benchmarks/device_agreement.py --seed 1
    for model in smollm2-135m-instruct qwen2.5-0.5b-instruct; do
      step "one PPO step at verl's quickstart shapes, $model" 200 "$py" benchmarks/gpu_throughput.py \
        --model "$model" --device "$device" --json "$out/throughput-$model.json"
    done
  fi
  echo "== SmolLM2 GRPO on GSM8K: not run: its weights (a 98 MB GGUF) do not travel with the bundle"

  summary="${#passed[@]} of $((${#passed[@]} + ${#failed[@]})) steps passed"
  if ((${#failed[@]})); then
    echo "gpu_proof$($dry_run && echo " --dry-run"): FAILED: $summary; failed: $(IFS=';'; echo "${failed[*]}")"
    exit 1
  fi
  if $dry_run; then
    echo "gpu_proof --dry-run: $summary on the CPU ($(IFS=';'; echo "${notes[*]}")); on the GPU machine: bash benchmarks/gpu_proof.sh"
  else
    echo "gpu_proof: $summary on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); results in $out"
  fi
}

proof 2>&1 | tee "$out/proof.log"
exit "${PIPESTATUS[0]}"
