#!/usr/bin/env bash
# GRPO on reasoning-gym's basic_arithmetic with SmolLM2 (see config.yaml). Makes the rows first
# (deterministic in the seed), then trains. Extra dotted overrides pass through, e.g.
#   bash recipes/reasoning_gym/run.sh trainer.total_steps=5
set -euo pipefail
DIR="$(cd "$(dirname "$0")" && pwd)"
DATA="runs/reasoning_gym/data"
GEN="basic_arithmetic"
# One-digit additions, no system prompt (SmolLM2-135M: ~1 in 4 right, see README.md).
CONFIG=(--system-prompt none --config min_terms=2 max_terms=2 min_digits=1 max_digits=1 'operators=["+"]'
        allow_parentheses=false allow_negation=false)
[ -f "$DATA/add1_train.parquet" ] || psrl data reasoning-gym "$GEN" --size 256 --seed 1 -o "$DATA/add1_train.parquet" "${CONFIG[@]}"
[ -f "$DATA/add1_val.parquet" ] || psrl data reasoning-gym "$GEN" --size 64 --seed 2 -o "$DATA/add1_val.parquet" "${CONFIG[@]}"
exec psrl train "$DIR/config.yaml" "$@"
