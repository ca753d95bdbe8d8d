#!/usr/bin/env bash
# The device checks of issues 13 and 14 on a lent GPU machine, in one run (see
# shared/gpu/README.md: wheels fetched into .whl/ by fetch-wheels.sh, carried as ".whl").
# Every step has its own time limit and writes its log under $OUT, so a failure in one step
# still returns the others. Usage there: bash scripts/gpu_check.sh [SECONDS_FOR_TRAINER_STEPS]
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
T=${1:-150}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 VLLM_HOST_IP=127.0.0.1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, megatron.core, transformers; print(torch.__version__, megatron.core.__version__, transformers.__version__)" | tee -a "$OUT/gpu.txt"
step() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $((SECONDS - t0))s"; grep -v "Loading weights\|Warning\|warn(" "$OUT/$name.log" | tail -n 8
}
step gputests 150 python3 -m pytest -q -p no:cacheprovider tests/trainer/test_cuda_paths.py
step shape05 "$T" python3 -m benchmarks.trainer --device cuda --shape qwen2.5-0.5b --json
step shape15 "$T" python3 -m benchmarks.trainer --device cuda --shape qwen2.5-1.5b --json
step fit16k 100 python3 -m benchmarks.trainer --device cuda --shape qwen2.5-1.5b --shape-batch 16 \
  --shape-micro-batch-tokens 16384 --steps 1 --json
step wsync 100 python3 -m benchmarks.weight_sync --device cuda --shape qwen2.5-0.5b --rounds 3 --json
