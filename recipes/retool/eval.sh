#!/usr/bin/env bash
# psrl eval of MODEL (an HF directory or a psrl model name) on the ReTool validation rows (greedy,
# the recipe's validation settings) into OUT/{eval.json,samples.parquet}, then accuracy and the
# well-formed tool-call rate of its episodes (python -m psrl.sft.stats).
#   bash recipes/retool/eval.sh smollm2-135m runs/retool_eval/base [overrides]
set -euo pipefail
DIR="$(cd "$(dirname "$0")" && pwd)"
MODEL="$1"; OUT="$2"; shift 2
# A long episode limit: on a loaded CPU machine the recipe's 300 s measures the load, not the model.
psrl eval "$DIR/config.yaml" --model "$MODEL" -o "$OUT" --data "$DIR/data/val.jsonl" "logging.output_dir=$OUT" \
  '*.rollout.multi_turn.episode_timeout_s=3600' "$@"
python -m psrl.sft.stats "$OUT/samples.parquet"
