"""Each model family end to end in the trainer against transformers: Qwen3 (q/k norm), Qwen3-MoE
(router, 4 experts, top-2), Llama 3 (llama3 rope scaling). Log-probs, a training step, the live
HF export (what weight sync sends) and the checkpoint export, all on the offline tiny models;
router metrics, the aux-loss coefficient, router replay and expert parallelism for the MoE."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

from psrl.config import AlgorithmConfig, MoEConfig, TrainerConfig
from psrl.models import model_dir
from psrl.trainer.distributed import spawn_ranks
from packed_helpers import hf_logprobs, hf_model
from trainer_helpers import make_trajectories

pytestmark = pytest.mark.timeout(180)
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
FAMILIES = ["tiny-qwen3", "tiny-qwen3-moe", "tiny-llama3"]


def _trainer(name, algo=None, **cfg):
    from psrl.trainer.trainer import MegatronTrainer

    cfg.setdefault("micro_batch_tokens", 64)
    return MegatronTrainer(str(model_dir(name)), TrainerConfig(device="cpu", **cfg), algo or AlgorithmConfig())


def _hf(path):
    return hf_model(path, "eager")


def _max_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def _disk_shapes(path):
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.mark.parametrize("name", FAMILIES)
def test_family_matches_transformers_and_round_trips(name, tmp_path):
    from transformers import AutoConfig

    from psrl.trainer.export import export_checkpoint

    path = model_dir(name)
    trajs = make_trajectories(6, vocab=800)
    with _trainer(name) as tr:
        assert tr.arch.family == {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "llama": "llama"}[AutoConfig.from_pretrained(path).model_type]
        assert _max_diff(tr.compute_logprobs(trajs), hf_logprobs(_hf(path), trajs)) <= 1e-5
        m = tr.step(trajs)
        assert m["update_ok"] == 1.0 and np.isfinite(m["loss"])
        # what weight sync sends: every tensor of the checkpoint, by its on-disk name and shape
        state = tr.hf_state_dict()
        assert {k: tuple(v.shape) for k, v in state.items()} == _disk_shapes(path)
        trained = tr.compute_logprobs(trajs)
        tr.save_checkpoint(tmp_path / "ckpt")
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf", path)
    assert _disk_shapes(out) == _disk_shapes(path)
    assert json.loads((out / "config.json").read_text())["model_type"] == json.loads((path / "config.json").read_text())["model_type"]
    assert _max_diff(hf_logprobs(_hf(out), trajs), trained) <= 1e-5


def test_moe_router_metrics_and_aux_loss_coefficient():
    trajs = make_trajectories(6, vocab=800)
    with _trainer("tiny-qwen3-moe") as tr:
        assert tr.tconfig.num_moe_experts == 4 and tr.tconfig.moe_router_topk == 2
        assert tr.tconfig.moe_aux_loss_coeff == pytest.approx(0.001)  # the checkpoint's router_aux_loss_coef
        assert tr.tconfig.moe_router_pre_softmax is False  # norm_topk_prob: top-k, then softmax over the k
        m = tr.step(trajs)
        assert m["router/load_max_over_mean"] >= 1.0 >= m["router/load_min_over_mean"] >= 0.0
        assert m["router/aux_loss"] > 0 and m["router/dropped_frac"] == pytest.approx(0.0, abs=1e-9)
        assert {"rollout_logprob_abs_diff", "rollout_logprob_abs_diff_max", "rollout_kl"} <= set(m)
        before = {n: p.detach().clone() for n, p in tr.model.named_parameters() if "router" in n}
    with _trainer("tiny-qwen3-moe", moe=MoEConfig(aux_loss_coef=0.0)) as tr:
        assert tr.tconfig.moe_aux_loss_coeff == 0.0 and tr.tconfig.moe_router_load_balancing_type == "none"
        tr.step(trajs)
        after = {n: p.detach() for n, p in tr.model.named_parameters() if "router" in n}
    # the same data and start: only the load-balancing loss differs, and it moves the routers
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_rollout_agreement_metrics_measure_the_behaviour_log_probs():
    """The step reports |trainer - behaviour| log-prob differences and k3 KL on trained tokens:
    zero when the trajectories carry the trainer's own log-probs, the offset when shifted."""
    trajs = make_trajectories(6, vocab=800)
    with _trainer("tiny-qwen3") as tr:
        own = tr.compute_logprobs(trajs)
        for t, lp in zip(trajs, own, strict=True):
            t.logprobs = lp.astype(np.float32)
        m = tr.step(trajs)
        assert m["rollout_logprob_abs_diff"] < 1e-5 and m["rollout_logprob_abs_diff_max"] < 1e-5 and m["rollout_kl"] < 1e-9
        own = tr.compute_logprobs(trajs)
        for t, lp in zip(trajs, own, strict=True):
            t.logprobs = np.where(t.loss_mask == 1, lp - 0.1, 0).astype(np.float32)
        m = tr.step(trajs)
        assert m["rollout_logprob_abs_diff"] == pytest.approx(0.1, abs=1e-4)
        assert m["rollout_logprob_abs_diff_max"] == pytest.approx(0.1, abs=1e-4)
        assert m["rollout_kl"] == pytest.approx(np.exp(0.1) - 1.1, rel=1e-3)


def _forced_hf_routes(hf, forced):
    """Patch each HF router to send token i of layer l to ``forced[l][i]`` where that row is
    >= 0 (the router's own top-k elsewhere), with the router's renormalized probabilities."""
    for layer, block in enumerate(hf.model.layers):
        gate = block.mlp.gate

        def forward(hidden, gate=gate, want=torch.from_numpy(forced[:, layer])):
            hidden = hidden.reshape(-1, gate.hidden_dim)
            logits = torch.nn.functional.linear(hidden, gate.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            _, idx = torch.topk(probs, gate.top_k, dim=-1)
            idx = torch.where((want >= 0).all(-1, keepdim=True), want, idx)
            top = probs.gather(1, idx)
            return logits, (top / top.sum(-1, keepdim=True)).to(logits.dtype), idx

        gate.forward = forward


@pytest.mark.parametrize("batching", ["packed", "padded"])
def test_router_replay_routes_tokens_to_the_recorded_experts(batching):
    """Recorded experts (random, and for one sample only half the tokens recorded) decide the
    trainer's routing: its log-probs equal transformers' with its routers forced the same way,
    and differ from unforced routing."""
    path = model_dir("tiny-qwen3-moe")
    trajs = make_trajectories(4, vocab=800)
    rng = np.random.default_rng(0)
    forced = []
    for i, t in enumerate(trajs):
        r = np.stack([np.stack([rng.choice(4, 2, replace=False) for _ in range(2)]) for _ in range(t.seq_len)])
        if i == 1:
            r[t.seq_len // 2 :] = -1
        forced.append(r)
        t.routed_experts = r.reshape(-1)
    hf = _hf(path)
    free = hf_logprobs(hf, trajs)
    want = []
    for t, r in zip(trajs, forced, strict=True):
        _forced_hf_routes(hf, r)
        want += hf_logprobs(hf, [t])
    with _trainer("tiny-qwen3-moe", AlgorithmConfig(router_replay=True), batching=batching) as tr:
        got = tr.compute_logprobs(trajs)
        assert _max_diff(got, want) <= 1e-5
        assert _max_diff(got, free) > 1e-3
        assert tr.step(trajs)["update_ok"] == 1.0


def test_router_replay_refuses_a_dense_model_and_bad_routes():
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        _trainer("tiny-qwen3", AlgorithmConfig(router_replay=True))
    trajs = make_trajectories(2, vocab=800)
    trajs[0].routed_experts = np.zeros(7, np.int16)  # not seq_len x 2 layers x top-2
    with _trainer("tiny-qwen3-moe", AlgorithmConfig(router_replay=True)) as tr, pytest.raises(ValueError, match="router replay"):
        tr.compute_logprobs(trajs)


def test_expert_parallel_two_ranks_match_one(tmp_path):
    """EP=2 over two data-parallel gloo ranks: the same log-probs, loss, gradient norm and
    weight updates (about lr x gradient: Adam with eps 1) as EP=1 on the same two ranks, where
    every rank holds every expert. (Against one process the load-balancing loss differs: it is
    taken per rank's tokens, and is not linear in them.)"""
    from moe_helpers import ep_worker

    path = str(model_dir("tiny-qwen3-moe"))
    spawn_ranks(ep_worker, 2, path, 2, 1, str(tmp_path / "ref.pt"))
    spawn_ranks(ep_worker, 2, path, 2, 2, str(tmp_path / "ep.pt"))
    ref, got = (torch.load(tmp_path / f, weights_only=False) for f in ("ref.pt", "ep.pt"))
    assert _max_diff(got["logprobs"], ref["logprobs"]) <= 1e-5
    for k in ("loss", "pg_loss", "grad_norm", "router/load_max_over_mean", "rollout_logprob_abs_diff"):
        assert got["metrics"][k] == pytest.approx(ref["metrics"][k], rel=2e-5, abs=1e-5), k  # summation order
    assert set(got["delta"]) == set(ref["delta"])
    assert any("experts.3" in k for k in got["delta"])
    for k, v in ref["delta"].items():
        torch.testing.assert_close(got["delta"][k], v, atol=1e-6, rtol=1e-3, msg=lambda m, k=k: f"{k}: {m}")
