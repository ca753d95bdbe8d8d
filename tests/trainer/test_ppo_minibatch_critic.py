"""PPO mini-batches and epochs, and the GAE critic, on real Megatron steps (CPU, tiny-qwen2)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from psrl.config import AlgorithmConfig, CriticConfig, OptimConfig, TrainerConfig
from psrl.models import model_dir
from trainer_helpers import make_trajectories

pytestmark = pytest.mark.timeout(180)
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")


def _trainer(algo=None, critic=None, path=None, **cfg):
    from psrl.trainer.trainer import MegatronTrainer

    cfg.setdefault("micro_batch_tokens", 64)
    cfg.setdefault("device", "cpu")
    return MegatronTrainer(str(path or model_dir("tiny-qwen2")), TrainerConfig(**cfg), algo or AlgorithmConfig(),
                           critic=critic)


def _on_policy(tr, trajs):
    for t, lp in zip(trajs, tr.compute_logprobs(trajs)):
        t.logprobs = lp  # behaviour == the current policy: every ratio starts at exactly 1
    return trajs


def test_mini_batches_step_several_times_and_the_clip_acts_from_the_second():
    algo = AlgorithmConfig(loss="decoupled_ppo")
    with _trainer(algo, ppo_mini_batch_size=1, ppo_epochs=2, optim=OptimConfig(lr=5e-2)) as tr:
        trajs = _on_policy(tr, make_trajectories(12, group_size=3))  # 4 groups
        m = tr.step(trajs)
        assert m["optimizer_steps"] == 8 and tr.optimizer_steps == 8
        assert tr.version == 1 and m["version"] == 1  # versions count batches (weight syncs rely on it)
        after = m["actor/clip_frac_after_first"]
        assert after > 0.05, m
        # clip_frac is the mean over the 8 steps: the first step's share is what the others leave.
        first = m["clip_frac"] * 8 - after * 7
        assert first == pytest.approx(0.0, abs=1e-9)
        assert m["update_ok"] == 1.0


def test_one_mini_batch_per_batch_never_clips_on_policy_data():
    with _trainer(AlgorithmConfig(loss="decoupled_ppo"), optim=OptimConfig(lr=5e-2)) as tr:
        m = tr.step(_on_policy(tr, make_trajectories(12, group_size=3)))
    assert m["optimizer_steps"] == 1 and m["clip_frac"] == 0.0 and m["actor/clip_frac_after_first"] == 0.0


def test_lr_schedule_length_stays_in_batches():
    opt = OptimConfig(lr=1e-3, lr_schedule="cosine", warmup_steps=1)
    trajs = make_trajectories(12, group_size=3)
    lrs = []
    for mini in (None, 1):
        with _trainer(ppo_mini_batch_size=mini, optim=opt, total_steps=4) as tr:
            lrs.append([tr.step(trajs)["lr"] for _ in range(3)])
    assert lrs[0] == pytest.approx(lrs[1], rel=1e-9)


def test_mini_batch_larger_than_the_batch_is_a_clear_error():
    with _trainer(ppo_mini_batch_size=5) as tr:
        with pytest.raises(ValueError, match=r"ppo_mini_batch_size=5 is larger than the batch \(4 groups\)"):
            tr.step(make_trajectories(12, group_size=3))
        assert tr.version == 0


def test_gae_critic_learns_values_and_checkpoints_with_the_policy(tmp_path):
    algo = AlgorithmConfig(advantage="gae", gamma=0.99, lam=0.95, turn_rewards=True)
    critic = CriticConfig(optim=OptimConfig(lr=1e-2))
    trajs = make_trajectories(6)
    with _trainer(algo, critic, ppo_mini_batch_size=1, optim=OptimConfig(lr=1e-4)) as tr:
        assert tr.critic is not None
        ms = [tr.step(trajs) for _ in range(6)]
        for k in ("critic/value_loss", "critic/explained_var", "critic/value_clip_frac", "critic/value_mean", "critic/return_mean"):
            assert np.isfinite(ms[-1][k]), k
        assert ms[0]["critic/value_mean"] == 0.0  # the head is zero-initialized
        assert ms[-1]["critic/value_loss"] < 0.5 * ms[0]["critic/value_loss"], [m["critic/value_loss"] for m in ms]
        assert ms[-1]["critic/explained_var"] > ms[0]["critic/explained_var"]
        assert ms[0]["optimizer_steps"] == 2
        tr.save_checkpoint(str(tmp_path))
        values = tr.critic.values(tr_samples(trajs), range(len(trajs)))
        nxt = tr.step(trajs)
    with _trainer(algo, critic, ppo_mini_batch_size=1, optim=OptimConfig(lr=1e-4)) as tr:
        tr.load_checkpoint(str(tmp_path))
        again = tr.critic.values(tr_samples(trajs), range(len(trajs)))
        for i in values:
            np.testing.assert_array_equal(values[i], again[i])
        resumed = tr.step(trajs)
    assert resumed["critic/value_loss"] == nxt["critic/value_loss"] and resumed["loss"] == nxt["loss"]


def tr_samples(trajs):
    from psrl.trainer.batch import to_samples

    return to_samples(trajs)


def _hf(out, *, vocab: int, hidden: int) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=True,
    )).save_pretrained(out, safe_serialization=True)
    return str(out)


def test_critic_of_another_size_trains_and_another_vocabulary_is_refused(tmp_path):
    algo = AlgorithmConfig(advantage="gae")
    small = _hf(tmp_path / "small", vocab=832, hidden=32)
    with _trainer(algo, CriticConfig(model={"path": small})) as tr:
        assert tr.critic.arch.hidden_size == 32
        m = tr.step(make_trajectories(6))
        assert np.isfinite(m["critic/value_loss"]) and m["critic/update_ok"] == 1.0
    other = _hf(tmp_path / "other", vocab=900, hidden=64)
    with pytest.raises(ValueError, match=r"critic.model.path=.*vocabulary of 900 tokens, the policy's has 832"):
        _trainer(algo, CriticConfig(model={"path": other}))
