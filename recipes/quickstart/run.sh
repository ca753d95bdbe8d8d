#!/usr/bin/env bash
# Quickstart: GRPO on the tiny offline model (see config.yaml). Extra dotted overrides pass through,
# e.g.  bash recipes/quickstart/run.sh trainer.total_steps=10 trainer.mode=sync
set -euo pipefail
DIR="$(cd "$(dirname "$0")" && pwd)"
exec psrl train "$DIR/config.yaml" "data.train_files=[$DIR/data/train.jsonl]" "data.val_files=[$DIR/data/val.jsonl]" "$@"
