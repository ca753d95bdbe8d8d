"""GAE over trained tokens (psrl.trainer.gae), against values computed by hand."""

import numpy as np
import pytest

from psrl.trainer.gae import gae, token_rewards, whiten, whiten_stats


def test_single_turn_final_reward_with_gamma_and_lambda():
    mask = np.array([1, 1, 1])
    r = token_rewards(mask, 1.0)
    assert r.tolist() == [0, 0, 1.0]
    v = np.array([0.5, 0.2, 0.4])
    adv, ret = gae(r, v, mask, gamma=0.9, lam=0.8)
    # delta = [0 + .9*.2 - .5, 0 + .9*.4 - .2, 1 - .4] = [-0.32, 0.16, 0.6]
    # A3 = .6; A2 = .16 + .72*.6 = .592; A1 = -.32 + .72*.592 = 0.10624
    assert adv == pytest.approx([0.10624, 0.592, 0.6])
    assert ret == pytest.approx([0.60624, 0.792, 1.0])


def test_gamma_lambda_one_gives_reward_minus_value():
    mask = np.ones(4)
    v = np.array([0.1, -0.3, 0.7, 0.2])
    adv, ret = gae(token_rewards(mask, 2.0), v, mask, 1.0, 1.0)
    assert adv == pytest.approx(2.0 - v)
    assert ret == pytest.approx([2.0] * 4)


def test_observation_tokens_are_skipped_and_bootstrapped_over():
    # model, model, tool, tool, model: the tool tokens are no steps; V after token 2 is V at token 5.
    mask = np.array([1, 1, 0, 0, 1])
    v = np.array([0.5, 0.25, 9.0, 9.0, 0.5])  # values on tool tokens must not matter
    r = token_rewards(mask, 1.0)
    assert r.tolist() == [0, 0, 0, 0, 1.0]
    adv, ret = gae(r, v, mask, gamma=0.5, lam=1.0)
    # steps: V = [.5, .25, .5], r = [0, 0, 1]
    # delta = [.5*.25 - .5, .5*.5 - .25, 1 - .5] = [-.375, 0, .5]
    # A3 = .5; A2 = 0 + .5*.5 = .25; A1 = -.375 + .5*.25 = -.25
    assert adv.tolist() == pytest.approx([-0.25, 0.25, 0, 0, 0.5])
    assert ret.tolist() == pytest.approx([0.25, 0.5, 0, 0, 1.0])


def test_turn_rewards_sit_on_each_turns_last_trained_token():
    mask = np.array([1, 1, 0, 1, 1, 0])
    bounds = np.array([[0, 2], [3, 6]])  # the second turn ends on an observation token
    r = token_rewards(mask, 1.5, bounds, np.array([0.25, 1.0]), use_turns=True)
    # turn 1 -> token 1; turn 2 -> token 4 (its last trained one); 1.5 - 1.25 left -> last trained token
    assert r.tolist() == pytest.approx([0, 0.25, 0, 0, 1.25, 0])
    # Without the switch, or without turn rewards: the episode reward on the last trained token.
    assert token_rewards(mask, 1.5, bounds, np.array([0.25, 1.0])).tolist() == [0, 0, 0, 0, 1.5, 0]
    assert token_rewards(mask, 1.5, bounds, np.zeros(0), use_turns=True).tolist() == [0, 0, 0, 0, 1.5, 0]


def test_gae_with_turn_rewards_by_hand():
    mask = np.array([1, 0, 1])
    r = token_rewards(mask, 1.0, np.array([[0, 1], [2, 3]]), np.array([1.0, 0.0]), use_turns=True)
    assert r.tolist() == [1.0, 0, 0]
    adv, _ = gae(r, np.array([0.0, 5.0, 0.5]), mask, gamma=1.0, lam=0.5)
    # steps r=[1,0], V=[0,.5]: delta=[1+.5-0, 0-.5] = [1.5, -.5]; A2=-.5; A1 = 1.5 + .5*(-.5) = 1.25
    assert adv.tolist() == pytest.approx([1.25, 0, -0.5])


def test_whitening_uses_trained_tokens_of_every_shard():
    a1, m1 = np.array([1.0, 5.0, 3.0]), np.array([1, 0, 1])
    a2, m2 = np.array([2.0]), np.array([1])
    stats = whiten_stats([a1], [m1]) + whiten_stats([a2], [m2])  # as summed over two ranks
    vals = np.array([1.0, 3.0, 2.0])
    w = whiten(a1, m1, stats)
    assert w.tolist() == pytest.approx([(1 - 2) / vals.std(), 0, (3 - 2) / vals.std()], rel=1e-5)
    assert whiten(a2, m2, stats, scale=False).tolist() == pytest.approx([0.0])


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="gae: 2 rewards, 3 values"):
        gae(np.zeros(2), np.zeros(3), np.ones(3), 1.0, 1.0)


def test_clipped_value_loss_by_hand():
    import torch

    from psrl.trainer.losses import value_loss

    v = torch.tensor([1.0, 0.0, 0.5])
    old = torch.tensor([0.0, 0.0, 0.4])
    ret = torch.tensor([2.0, 1.0, 0.0])
    w = torch.tensor([0.5, 0.5, 0.0])  # the third token is not trained
    t = value_loss(v, old, ret, w, clip=0.5)
    # token 1: err (1-2)^2 = 1, clipped V = 0.5 -> (0.5-2)^2 = 2.25 -> 0.5 * 2.25, clipped
    # token 2: V = V_old: both 1 -> 0.5, not clipped
    assert float(t.loss) == pytest.approx(0.5 * (0.5 * 2.25) + 0.5 * 0.5)
    assert float(t.metrics["value_clip_frac"]) == pytest.approx(0.5)
    plain = value_loss(v, old, ret, w, clip=None)
    assert float(plain.loss) == pytest.approx(0.5 * 0.5 * 1 + 0.5 * 0.5 * 1)
