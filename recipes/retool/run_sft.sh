#!/usr/bin/env bash
# ReTool cold start, then RL from it:
#   1. demonstrations: a scripted policy through the real rollout path + bubblewrap (rewarded ones kept)
#   2. psrl sft on them (SmolLM2-135M, Megatron), 3. psrl export of the final checkpoint,
#   4. the ReTool RL recipe started from the exported model (skip with RL=0), with the settings of
#      README's SFT -> RL run (reward 0.24 -> 0.88 on held-out rows in 10 steps): fp32 engine,
#      rollout temperature 0.6, 4 tasks x 8 episodes, 160 tokens a turn, lr 5e-5.
# Extra dotted overrides go to the RL run, e.g.  bash recipes/retool/run_sft.sh trainer.total_steps=20
# Sizes: ROWS demonstrations (default 40: a 5-step SFT, which leaves RL something to raise; 48
# give a model that already solves the validation rows greedily), SFT settings in sft.yaml; OUT
# (default runs/retool_sft).
set -euo pipefail
DIR="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-runs/retool_sft}"
ROWS="${ROWS:-40}"
mkdir -p "$OUT"
psrl data retool-demos --config "$DIR/config.yaml" -o "$OUT/demos.parquet" --rows "$ROWS"
python -m psrl.sft.stats "$OUT/demos.parquet"
psrl sft "$DIR/sft.yaml" "sft.data=[$OUT/demos.parquet]" "sft.save_dir=$OUT" "logging.output_dir=$OUT" sft.export_hf=false
psrl export "$OUT" -o "$OUT/hf"
[ "${RL:-1}" = "0" ] && exit 0
exec psrl train "$DIR/config.yaml" "data.train_files=[$DIR/data/train.jsonl]" "data.val_files=[$DIR/data/val.jsonl]" \
  "*.model.path=$OUT/hf" "trainer.model_path=$OUT/hf" \
  "trainer.checkpoint_dir=$OUT/rl/checkpoints" "logging.output_dir=$OUT/rl" \
  '*.model.dtype=float32' trainer.optim.lr=5e-5 trainer.eval_every=0 trainer.save_every=5 data.batch_size=4 \
  gen_actor_rollout_ref.rollout.sampling.temperature=0.6 gen_actor_rollout_ref.rollout.sampling.n=8 \
  gen_actor_rollout_ref.rollout.sampling.max_tokens=160 "$@"
