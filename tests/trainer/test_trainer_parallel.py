"""Tensor, pipeline and data parallel on CPU (gloo, two processes) against one process.

The models are random Qwen2 (tied embeddings, q/k/v biases) and Llama (separate lm head) with 2
key/value heads, so that tensor parallel 2 can split them."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from psrl.trainer.distributed import spawn_ranks
from trainer_helpers import build_random_hf, tp_worker

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
STEPS = 2


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "qwen2": build_random_hf(root / "qwen2", "qwen2", tied=True),
        "llama": build_random_hf(root / "llama", "llama", tied=False),
    }


@pytest.fixture(scope="module")
def reference(models, tmp_path_factory):
    cache = {}

    def get(family, gae=False):
        if (family, gae) not in cache:
            out = tmp_path_factory.mktemp("ref") / f"{family}.pt"
            tp_worker(0, models[family], 1, 1, 1, str(out), STEPS, gae)
            cache[family, gae] = torch.load(out, weights_only=False)
        return cache[family, gae]

    return get


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "family,tp,pp,dp",
    [  # ids are built from the values each case runs, so a label cannot name another case
        pytest.param(family, tp, pp, dp, id=f"{family}-" + "-".join(f"{k}{v}" for k, v in (("tp", tp), ("pp", pp), ("dp", dp)) if v > 1))
        for family, tp, pp, dp in [
            ("qwen2", 2, 1, 1),
            ("llama", 2, 1, 1),
            ("qwen2", 1, 2, 1),  # tied embeddings across stages: the last stage's copy stays in sync
            ("llama", 1, 2, 1),  # a separate lm head on the last stage
            ("qwen2", 1, 1, 2),
        ]
    ],
)
def test_two_processes_match_one(models, reference, tmp_path, family, tp, pp, dp):
    out = tmp_path / "par.pt"
    spawn_ranks(tp_worker, tp * pp * dp, models[family], tp, pp, dp, str(out), STEPS)
    got, ref = torch.load(out, weights_only=False), reference(family)
    for a, b in zip(got["logprobs"], ref["logprobs"]):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    for ma, mb in zip(got["metrics"], ref["metrics"]):
        for k in ("loss", "pg_loss", "grad_norm", "entropy", "clip_frac", "tis_weight"):
            assert ma[k] == pytest.approx(mb[k], abs=1e-5), k
    _same_weights(got, ref)


def _same_weights(got, ref):
    # Exported HF weights after the steps: the same names, the same values up to Adam's
    # amplification of rounding in near-zero gradients (well below the 1e-3 learning rate).
    assert set(got["state"]) == set(ref["state"])
    for k, v in ref["state"].items():
        torch.testing.assert_close(got["state"][k], v, atol=1e-4, rtol=0)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("family,tp,pp,dp", [("qwen2", 2, 1, 1), ("llama", 1, 2, 1), ("qwen2", 1, 1, 2)],
                         ids=["qwen2-tp2", "llama-pp2", "qwen2-dp2"])
def test_critic_and_mini_batches_match_one_process(models, reference, tmp_path, family, tp, pp, dp):
    """GAE with its critic and two mini-batches a batch: every layout gives the one-process step."""
    out = tmp_path / "par.pt"
    spawn_ranks(tp_worker, tp * pp * dp, models[family], tp, pp, dp, str(out), STEPS, True)
    got, ref = torch.load(out, weights_only=False), reference(family, True)
    for ma, mb in zip(got["metrics"], ref["metrics"]):
        assert ma["optimizer_steps"] == mb["optimizer_steps"] == 2
        for k in ("loss", "grad_norm", "clip_frac", "actor/clip_frac_after_first", "critic/value_loss",
                  "critic/grad_norm", "critic/explained_var", "critic/return_mean", "adv_abs_mean"):
            assert ma[k] == pytest.approx(mb[k], abs=1e-5), k
    _same_weights(got, ref)
