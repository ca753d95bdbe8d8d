#!/usr/bin/env bash
# Greedy rollouts of MODEL (an HF directory or a psrl model name) on the ReTool validation rows,
# written to OUT (parquet), then accuracy and well-formed tool-call rate (python -m psrl.sft.stats).
#   bash recipes/retool/eval_rollout.sh smollm2-135m runs/retool_eval/base.parquet [overrides]
set -euo pipefail
DIR="$(cd "$(dirname "$0")" && pwd)"
MODEL="$1"; OUT="$2"; shift 2
psrl rollout "$DIR/config.yaml" -o "$OUT" "data.train_files=[$DIR/data/val.jsonl]" "*.model.path=$MODEL" \
  gen_actor_rollout_ref.rollout.sampling.temperature=0 gen_actor_rollout_ref.rollout.sampling.n=1 \
  "logging.output_dir=$(dirname "$OUT")" logging.progress_bar=false "$@"
python -m psrl.sft.stats "$OUT"
