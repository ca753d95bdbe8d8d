#!/usr/bin/env bash
# retool recipe (see config.yaml). Extra dotted overrides pass through,
# e.g.  bash recipes/retool/run.sh trainer.total_steps=10
set -euo pipefail
DIR="$(cd "$(dirname "$0")" && pwd)"
exec psrl train "$DIR/config.yaml" "data.train_files=[$DIR/data/train.jsonl]" "data.val_files=[$DIR/data/val.jsonl]" "$@"
