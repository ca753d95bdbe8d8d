"""Advantages, losses and log-probs against small hand-computed examples (no Megatron model)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from psrl.config import AlgorithmConfig
from psrl.trainer.advantages import compute_advantages
from psrl.trainer.logprobs import vocab_parallel_logprobs
from psrl.trainer.losses import aggregate, behaviour_weights, kl_penalty, policy_loss

pytestmark = pytest.mark.timeout(60)


def test_grpo_advantages_group_normalized():
    rewards = np.array([1.0, 2.0, 3.0, 5.0, 5.0, 7.0])
    groups = ["a", "a", "a", "b", "b", "single"]
    adv = compute_advantages(rewards, groups, "grpo", norm_by_std=True)
    # group a: mean 2, unbiased std 1; group b: identical rewards -> 0; a group of one -> 0
    np.testing.assert_allclose(adv, [-1, 0, 1, 0, 0, 0], atol=1e-5)
    adv = compute_advantages(np.array([0.0, 4.0]), ["g", "g"], "grpo", norm_by_std=False)
    np.testing.assert_allclose(adv, [-2, 2])


def test_rloo_leave_one_out_baseline():
    adv = compute_advantages(np.array([1.0, 2.0, 3.0]), ["g"] * 3, "rloo")
    np.testing.assert_allclose(adv, [1 - 2.5, 2 - 2.0, 3 - 1.5])


def test_reinforce_pp_whitens_over_the_batch():
    adv = compute_advantages(np.array([1.0, 2.0, 3.0, 4.0]), ["a", "a", "b", "b"], "reinforce_pp")
    np.testing.assert_allclose(adv, (np.array([1, 2, 3, 4]) - 2.5) / math.sqrt(1.25), atol=1e-5)


def test_unknown_estimator_is_named():
    with pytest.raises(ValueError, match="gae"):
        compute_advantages(np.zeros(2), ["a", "a"], "gae")


# ratio, advantage per token; sequences [0, 1, 2] and [3, 4]
RATIO = torch.tensor([1.5, 0.9, 0.5, 1.1, 5.0])
ADV = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0])
# by hand, with clip (0.2, 0.28) and dual clip 3:
#   t0 max(-1.5, -1.28) = -1.28 (clipped)   t1 -0.9   t2 max(0.5, 0.8) = 0.8 (clipped)
#   t3 1.1   t4 max(5, 1.28) = 5 -> dual clip min(5, 3) = 3
PER_TOKEN = torch.tensor([-1.28, -0.9, 0.8, 1.1, 3.0])


def _loss(cfg, weights, **kw):
    old = torch.zeros(5)
    return policy_loss(RATIO.log(), old, ADV, weights, cfg, **kw)


def test_ppo_clip_and_dual_clip_token_mean():
    cfg = AlgorithmConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, dual_clip_c=3.0)
    t = _loss(cfg, torch.full((5,), 1 / 5))
    assert t.loss.item() == pytest.approx(PER_TOKEN.mean().item(), abs=1e-6)  # 0.544
    assert t.metrics["clip_frac"].item() == pytest.approx(2 / 5)
    assert t.metrics["dual_clip_frac"].item() == pytest.approx(1 / 5)
    assert t.metrics["ratio"].item() == pytest.approx(RATIO.mean().item(), abs=1e-6)


def test_without_dual_clip_the_large_ratio_is_unbounded():
    cfg = AlgorithmConfig(dual_clip_c=None)
    t = _loss(cfg, torch.full((5,), 1 / 5))
    assert t.loss.item() == pytest.approx((-1.28 - 0.9 + 0.8 + 1.1 + 5.0) / 5, abs=1e-6)
    assert t.metrics["dual_clip_frac"].item() == 0


def test_loss_aggregation_token_vs_sequence_mean():
    # two sequences as rows of a padded (B, T) layout
    values = torch.tensor([[-1.28, -0.9, 0.8], [1.1, 3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert aggregate(values, mask, "token_mean").item() == pytest.approx(2.72 / 5)
    assert aggregate(values, mask, "seq_mean").item() == pytest.approx(((-1.38 / 3) + 4.1 / 2) / 2)


def test_gradient_of_clipped_tokens_is_zero():
    logp = RATIO.log().clone().requires_grad_(True)
    cfg = AlgorithmConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, dual_clip_c=3.0)
    policy_loss(logp, torch.zeros(5), ADV, torch.ones(5), cfg).loss.backward()
    # d(-A r)/d logp = -A r where unclipped; 0 where clipped (t0, t2) or dual-clipped (t4)
    np.testing.assert_allclose(logp.grad.numpy(), [0, -0.9, 0, 1.1, 0], atol=1e-6)


def _elementwise_policy_loss(logp, old, adv, w, cfg, behav, ref, ent):
    """The loss written out op by op, differentiated by autograd: what the fused node must equal."""
    log_ratio = (logp - old).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    pg1, pg2 = -adv * ratio, -adv * ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    pg, dual = torch.maximum(pg1, pg2), torch.zeros_like(pg1)
    if cfg.dual_clip_c is not None:
        pg3 = -adv * cfg.dual_clip_c
        dual = ((adv < 0) & (pg > pg3)).float()
        pg = torch.where(adv < 0, torch.minimum(pg, pg3), pg)
    pg = pg * behav if behav is not None else pg
    total = pg + cfg.kl_coef * kl_penalty(logp, ref, cfg.kl_estimator) - cfg.entropy_coef * ent
    d = lambda t: float((t.detach() * w).sum())  # noqa: E731
    metrics = {"pg_loss": d(pg), "clip_frac": d((pg2 > pg1).float()), "dual_clip_frac": d(dual), "ratio": d(ratio),
               "approx_kl": d(0.5 * log_ratio.square()), "entropy": d(ent)}
    return (total * w).sum(), metrics


@pytest.mark.parametrize("dual_clip", [3.0, None])
@pytest.mark.parametrize("extras", [False, True])
def test_fused_policy_loss_equals_the_elementwise_form(dual_clip, extras):
    g = torch.Generator().manual_seed(1)
    n = 300
    logp0 = torch.randn(1, n, generator=g) - 2
    old = logp0 + torch.randn(1, n, generator=g) * 0.5
    old[0, :3] = logp0[0, :3] - 25  # past the log-ratio clamp: no gradient there
    adv = torch.randn(1, n, generator=g)
    w = torch.rand(1, n, generator=g) / n
    behav = torch.rand(1, n, generator=g) * 2 if extras else None
    ref = logp0 + 0.1 * torch.randn(1, n, generator=g)
    cfg = AlgorithmConfig(dual_clip_c=dual_clip, kl_coef=0.05 * extras, entropy_coef=0.01 * extras, clip_ratio_high=0.28)
    grads, results = [], []
    for fused in (True, False):
        logp = logp0.clone().requires_grad_(True)
        ent = (-logp).clone()  # an entropy that depends on the log-probs, so its gradient shows
        if fused:
            t = policy_loss(logp, old, adv, w, cfg, behav_weight=behav, ref_logp=ref, entropy=ent)
            loss, metrics = t.loss, {k: float(v) for k, v in t.metrics.items() if k not in ("loss", "kl", "tis_weight")}
        else:
            loss, metrics = _elementwise_policy_loss(logp, old, adv, w, cfg, behav, ref, ent)
        loss.backward()
        grads.append(logp.grad)
        results.append((float(loss), metrics))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6, abs=1e-8)
    assert results[0][1] == pytest.approx(results[1][1], rel=1e-5, abs=1e-8)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-9)
    if not extras:  # only the policy term: none past the clamp
        assert (grads[0][0, :3] == 0).all() and (grads[0][0, 3:] != 0).any()


def test_kl_estimators():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    lr = math.log(2)
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(lr)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * lr * lr)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 + lr - 1)


def test_kl_and_entropy_terms_enter_the_loss():
    cfg = AlgorithmConfig(kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01)
    w = torch.full((5,), 1 / 5)
    base = _loss(AlgorithmConfig(), w).loss.item()
    ref = torch.full((5,), -1.0)  # k1 = logp - ref = log r + 1
    ent = torch.full((5,), 2.0)
    t = _loss(cfg, w, ref_logp=ref, entropy=ent)
    kl = (RATIO.log() + 1).mean().item()
    assert t.metrics["kl"].item() == pytest.approx(kl, abs=1e-6)
    assert t.metrics["entropy"].item() == pytest.approx(2.0)
    assert t.loss.item() == pytest.approx(base + 0.1 * kl - 0.01 * 2.0, abs=1e-6)


def test_truncated_importance_weights():
    prox = torch.tensor([math.log(0.6), math.log(0.3)])
    behav = torch.tensor([math.log(0.2), math.log(0.2)])
    np.testing.assert_allclose(behaviour_weights(prox, behav, 2.0, "truncate").numpy(), [2.0, 1.5], rtol=1e-6)
    np.testing.assert_allclose(behaviour_weights(prox, behav, 2.0, "mask").numpy(), [0.0, 1.5], rtol=1e-6)
    np.testing.assert_allclose(behaviour_weights(prox, behav, None, "truncate").numpy(), [3.0, 1.5], rtol=1e-6)


def test_decoupled_loss_weights_each_token():
    w = torch.tensor([2.0, 1.0, 0.0, 1.0, 0.5])
    t = _loss(AlgorithmConfig(), torch.full((5,), 1 / 5), behav_weight=w)
    assert t.loss.item() == pytest.approx((PER_TOKEN * w).mean().item(), abs=1e-6)
    assert t.metrics["tis_weight"].item() == pytest.approx(w.mean().item())


def test_vocab_logprobs_and_entropy_match_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 50, generator=g) * 3
    targets = torch.randint(0, 50, (3, 7), generator=g)
    for temp in (1.0, 0.7):
        logp, ent = vocab_parallel_logprobs(logits, targets, temperature=temp, with_entropy=True)
        ref = torch.log_softmax(logits / temp, -1)
        torch.testing.assert_close(logp, ref.gather(-1, targets[..., None])[..., 0], atol=1e-5, rtol=0)
        torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1), atol=1e-5, rtol=0)
    empty = torch.zeros(0, 50, requires_grad=True)  # a micro-batch slice with no scored token
    logp, ent = vocab_parallel_logprobs(empty, torch.zeros(0, dtype=torch.long), with_entropy=True)
    (logp.sum() + ent.sum()).backward()
    assert logp.shape == ent.shape == (0,) and empty.grad.shape == (0, 50)


def test_entropy_gradient_only_when_asked():
    logits = torch.randn(4, 10, requires_grad=True)
    targets = torch.zeros(4, dtype=torch.long)
    _, ent = vocab_parallel_logprobs(logits, targets, with_entropy=True, entropy_grad=False)
    assert not ent.requires_grad
    _, ent = vocab_parallel_logprobs(logits, targets, with_entropy=True, entropy_grad=True)
    ent.sum().backward()
    p = torch.softmax(logits.detach(), -1)
    logp = p.log()
    h = -(p * logp).sum(-1, keepdim=True)
    torch.testing.assert_close(logits.grad, -p * (logp + h), atol=1e-5, rtol=0)  # dH/dz


def test_log_probs_reusing_the_logits_equal_the_plain_path():
    """``reuse_logits=True`` (the training loss) overwrites the logits and keeps the softmax for
    the backward: log-probs, entropy and gradients equal the plain path's bit for bit; a second
    backward through the graph fails loudly instead of reading the spent softmax."""
    g = torch.Generator().manual_seed(3)
    for n, v in ((96, 50), (0, 50)):
        z0 = torch.randn(n, v, generator=g) * 4
        targets = torch.randint(0, v, (n,), generator=g)
        w = torch.randn(n, generator=g)
        out = []
        for reuse in (False, True):
            z = z0.clone().requires_grad_(True)
            logp, ent = vocab_parallel_logprobs(z * 1.0, targets, with_entropy=True, entropy_grad=False, reuse_logits=reuse)
            loss = (logp * w).sum()
            loss.backward(retain_graph=True)
            out.append((logp.detach(), ent, z.grad.clone()))
            if reuse and n:
                with pytest.raises(RuntimeError, match="inplace"):
                    loss.backward()
        for a, b in zip(*out):
            assert torch.equal(a, b)
