#!/usr/bin/env bash
# GRPO on reasoning-gym's basic_arithmetic with SmolLM2 (see config.yaml). Makes the rows first
# (deterministic in the seed), then trains. Extra dotted overrides pass through, e.g.
#   bash recipes/reasoning_gym/run.sh trainer.total_steps=5
set -euo pipefail
DIR="$(cd "$(dirname "$0")" && pwd)"
DATA="runs/reasoning_gym/data"
GEN="basic_arithmetic"
CONFIG=(--config min_terms=2 max_terms=2 min_digits=1 max_digits=1)
[ -f "$DATA/train.parquet" ] || psrl data reasoning-gym "$GEN" --size 256 --seed 1 -o "$DATA/train.parquet" "${CONFIG[@]}"
[ -f "$DATA/val.parquet" ] || psrl data reasoning-gym "$GEN" --size 16 --seed 2 -o "$DATA/val.parquet" "${CONFIG[@]}"
exec psrl train "$DIR/config.yaml" "$@"
