"""Batch validation and micro-batch planning (no Megatron model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from psrl.trainer.batch import (
    TRAINER_FIELDS, build_micro_batch, per_position, per_response, plan_micro_batches, shard_for_rank, to_samples,
)
from psrl.trajectory import to_arrow
from trainer_helpers import make_trajectories

pytestmark = pytest.mark.timeout(60)


def _bad(kind: str):
    trajs = make_trajectories(4)
    t = trajs[2]
    if kind == "lengths":
        t.logprobs = t.logprobs[:-1]
        match = "'k2'.*logprobs has"
    elif kind == "nan_reward":
        t.reward = float("nan")
        match = "'k2'.*reward is nan"
    elif kind == "empty_response":
        for f in ("response_ids", "loss_mask", "logprobs", "versions"):
            setattr(t, f, getattr(t, f)[:0])
        match = "'k2'.*empty response"
    elif kind == "out_of_vocab":
        t.response_ids = t.response_ids.copy()
        t.response_ids[0] = 5000
        match = "'k2'.*outside"
    elif kind == "mask_value":
        t.loss_mask = t.loss_mask.copy()
        t.loss_mask[0] = 2
        match = "'k2'.*other than 0 and 1"
    elif kind == "nan_logprob":
        t.loss_mask = t.loss_mask.copy()
        t.logprobs = t.logprobs.copy()
        t.loss_mask[0], t.logprobs[0] = 1, float("nan")
        match = "'k2'.*non-finite"
    else:
        raise AssertionError(kind)
    return trajs, match


@pytest.mark.parametrize("kind", ["lengths", "nan_reward", "empty_response", "out_of_vocab", "mask_value", "nan_logprob"])
@pytest.mark.parametrize("form", ["trajectories", "arrow"])
def test_bad_sample_is_named(kind, form):
    trajs, match = _bad(kind)
    batch = to_arrow(trajs, TRAINER_FIELDS) if form == "arrow" else trajs
    with pytest.raises(ValueError, match=match):
        to_samples(batch, vocab_size=832)


def test_duplicate_key_and_missing_column():
    trajs = make_trajectories(3)
    trajs[1].key = "k0"
    with pytest.raises(ValueError, match="'k0' appears twice"):
        to_samples(trajs)
    with pytest.raises(KeyError, match="reward"):
        to_samples(to_arrow(make_trajectories(2), ["key", "group_id", "prompt_ids"]))


def test_arrow_and_trajectories_give_the_same_samples():
    trajs = make_trajectories(5)
    a, b = to_samples(trajs), to_samples(to_arrow(trajs, TRAINER_FIELDS))
    for x, y in zip(a, b):
        assert x.key == y.key and x.group_id == y.group_id and x.reward == y.reward
        for f in ("prompt_ids", "response_ids", "loss_mask", "logprobs", "versions"):
            np.testing.assert_array_equal(getattr(x, f), getattr(y, f))


@pytest.mark.parametrize("mode", ["packed", "padded"])
def test_plans_respect_the_token_budget_and_cover_every_sample(mode):
    samples = to_samples(make_trajectories(12, seed=3))
    budget = 40
    plan = plan_micro_batches(samples, range(len(samples)), budget, mode)
    assert sorted(i for mb in plan for i in mb) == list(range(len(samples)))
    for mb in plan:
        cost = sum(samples[i].seq_len for i in mb) if mode == "packed" else len(mb) * max(samples[i].seq_len for i in mb)
        assert cost <= budget or len(mb) == 1


def test_data_parallel_shards_are_disjoint_and_balanced():
    samples = to_samples(make_trajectories(11, seed=1))
    shards = [shard_for_rank(samples, 3, r) for r in range(3)]
    assert sorted(i for s in shards for i in s) == list(range(11))
    loads = [sum(samples[i].seq_len for i in s) for s in shards]
    assert max(loads) - min(loads) <= max(s.seq_len for s in samples)


@pytest.mark.parametrize("mode", ["packed", "padded"])
def test_micro_batch_layout(mode):
    samples = to_samples(make_trajectories(3))
    mb = build_micro_batch(samples, [0, 1, 2], mode)
    # every trained position predicts the next response token
    for i, s in enumerate(samples):
        rows, cols = (mb.sample_index == i).nonzero(as_tuple=True)
        p = len(s.prompt_ids)
        tgt = mb.targets[rows, cols][p - 1 : p - 1 + len(s.response_ids)]
        np.testing.assert_array_equal(tgt.numpy(), s.response_ids)
        np.testing.assert_array_equal(mb.loss_mask[rows, cols][p - 1 : p - 1 + len(s.response_ids)].numpy(), s.loss_mask)
        assert mb.position_ids[rows, cols].tolist() == list(range(s.seq_len))
    assert int(mb.loss_mask.sum()) == sum(s.num_loss_tokens for s in samples)
    # document bounds: every sample's tokens, in order, and nothing else
    lengths = (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).tolist()
    assert lengths == [samples[i].seq_len for i in mb.samples] and mb.max_seqlen == max(lengths)
    # the scored positions (what the output layer projects) are exactly the trained ones
    assert torch.equal(mb.scored, mb.loss_mask.reshape(-1).nonzero()[:, 0])
    assert torch.equal(mb.spread(mb.at_scored(mb.targets)), mb.targets * mb.loss_mask)
    # per_position / per_response round trip on trained tokens
    vals = [np.arange(len(s.response_ids), dtype=np.float32) + 1 for s in samples]
    back = per_response(mb, samples, per_position(mb, samples, vals))
    for i, s in enumerate(samples):
        np.testing.assert_array_equal(back[i], vals[i] * s.loss_mask)
    # ... and each value sits where its response token is predicted (also with the micro-batch's
    # samples in another order than the batch's): scattering the tokens gives the targets
    for order in ([0, 1, 2], [2, 0, 1]):
        mb = build_micro_batch(samples, order, mode)
        got = per_position(mb, samples, [s.response_ids.astype(np.float32) for s in samples])
        assert torch.equal(got, mb.targets.float() * mb.loss_mask)
        assert sorted(per_response(mb, samples, got)) == [0, 1, 2]
