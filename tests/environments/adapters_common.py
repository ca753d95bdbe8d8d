"""Helpers shared by the adapter tests: the tiny model's tokenizer, a config for `psrl rollout`."""

from __future__ import annotations

from pathlib import Path

from psrl.config import load_config


def tiny_tokenizer():
    from transformers import AutoTokenizer

    from psrl.models import model_dir

    return AutoTokenizer.from_pretrained(model_dir("tiny-qwen2"))


def rollout_config(tmp_path: Path, data: Path, *, n: int = 2, max_turns: int = 4, loop: str = "multi_turn_agent", **extra):
    return load_config(None, [
        f"data.train_files=[{data}]", "data.batch_size=4",
        f"gen_actor_rollout_ref.rollout.sampling.n={n}",
        "gen_actor_rollout_ref.rollout.multi_turn.enable=true",
        f"gen_actor_rollout_ref.rollout.multi_turn.max_turns={max_turns}",
        f"gen_actor_rollout_ref.rollout.agent.default_agent_loop={loop}",
        "gen_actor_rollout_ref.rollout.agent.on_failure=keep_group",
        f"sandbox.spec.state_dir={tmp_path / 'sb'}", "sandbox.pool.warm=0", "logging.progress_bar=false",
        *[f"{k}={v}" for k, v in extra.items()],
    ])  # fmt: skip


def reply(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
