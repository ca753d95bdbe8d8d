"""Mask-free document attention: micro-batches carry bounds, not masks; packed log-probs equal a
plain transformers forward of every sequence alone, in one process and with TP=2 / PP=2."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch

from psrl.trainer.attention import packed_attention
from psrl.trainer.batch import build_micro_batch, plan_micro_batches, to_samples
from psrl.trainer.distributed import spawn_ranks
from packed_helpers import hf_logprobs_alone, packed_trajectories, packed_worker
from trainer_helpers import build_random_hf

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
# Per-token log-prob tolerance against transformers in fp32 (the same bound the existing
# log-prob tests use; the differences seen are ~1e-6, from summation order).
ATOL = 1e-5


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    """A random Qwen2 with 4 query heads over 2 key/value heads (GQA; TP=2 splits both)."""
    return build_random_hf(tmp_path_factory.mktemp("gqa") / "qwen2", "qwen2", tied=True)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["packed", "padded"])
def test_micro_batches_hold_no_token_by_token_tensor(mode):
    samples = to_samples(packed_trajectories())
    for idx in plan_micro_batches(samples, range(len(samples)), 160, mode):
        mb = build_micro_batch(samples, idx, mode)
        T = mb.tokens.shape[1]
        assert T > mb.tokens.shape[0]  # so that a (B, T) tensor is never mistaken for (T, T)
        tensors = {f.name: getattr(mb, f.name) for f in dataclasses.fields(mb)}
        tensors.update({f"extras.{k}": v for k, v in mb.extras.items()})
        for name, t in tensors.items():
            if isinstance(t, torch.Tensor):
                assert sum(d == T for d in t.shape) <= 1, f"{mode} micro-batch field {name} has shape {tuple(t.shape)}"
        assert int(mb.cu_seqlens[-1]) == sum(samples[i].seq_len for i in idx)


def _dense_reference(q, k, v, cu, scale):
    """The (T, T) block-diagonal causal softmax the trainer used to build, for comparison only."""
    T, H, _ = q.shape
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.diff(cu))
    allowed = torch.ones(T, T, dtype=torch.bool).tril() & (seg[:, None] == seg[None, :])
    rep = H // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("thd,shd->hts", q, kk) * scale
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
    return torch.einsum("hts,shd->thd", p, vv)


@pytest.mark.timeout(30)
def test_packed_attention_equals_block_diagonal_softmax():
    torch.manual_seed(0)
    lengths = [5, 9, 9, 9, 1, 16, 3]  # a run of equal lengths, a one-token document
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    T = int(cu[-1])
    q = torch.randn(T, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(T, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(T, 2, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(T, 4, 8, dtype=torch.float64)
    got = packed_attention(q, k, v, cu, max(lengths), 0.3)
    grads = torch.autograd.grad((got * w).sum(), (q, k, v))
    ref = _dense_reference(q, k, v, cu, 0.3)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("batching", ["packed", "padded"])
def test_packed_logprobs_equal_each_sequence_alone(gqa_model, batching):
    from psrl.config import TrainerConfig
    from psrl.trainer.trainer import MegatronTrainer

    trajs = packed_trajectories()
    with MegatronTrainer(gqa_model, TrainerConfig(device="cpu", micro_batch_tokens=160, batching=batching)) as tr:
        samples = to_samples(trajs)
        plan = plan_micro_batches(samples, range(len(samples)), 160, batching)
        assert any(len(mb) >= 3 for mb in plan)  # several documents share a micro-batch
        ours = tr.compute_logprobs(trajs)
    for a, b in zip(ours, hf_logprobs_alone(gqa_model, trajs)):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_packed_logprobs_with_model_parallel_equal_each_sequence_alone(gqa_model, tmp_path, tp, pp):
    out = tmp_path / "logprobs.pt"
    spawn_ranks(packed_worker, tp * pp, gqa_model, tp, pp, 160, str(out))
    got = torch.load(out, weights_only=False)
    for a, b in zip(got, hf_logprobs_alone(gqa_model, packed_trajectories())):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("llama3_factor", [None, 8.0])
def test_rotary_table_equals_megatrons_rope_per_document(llama3_factor):
    """The table applied once per micro-batch rotates every document from position 0, as
    Megatron's per-layer thd RoPE does (llama3 frequency scaling included), and in the padded
    layout every row from position 0."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd, _apply_rotary_pos_emb_bshd
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from psrl.trainer.attention import RotaryTable, apply_rotary

    torch.manual_seed(0)
    D = 16
    ref = RotaryEmbedding(kv_channels=D, rotary_percent=1.0, rotary_base=10000, rope_scaling=llama3_factor is not None,
                          rope_scaling_factor=llama3_factor or 8.0, use_cpu_initialization=True)
    # Megatron's freqs: (max_s, 1, 1, D) angles of positions 0..max_s-1
    angles = torch.arange(64, dtype=torch.float32)[:, None] * ref.inv_freq[None, :]
    freqs = torch.cat((angles, angles), -1)[:, None, None, :]
    table = RotaryTable(ref.inv_freq)
    cu = torch.tensor([0, 5, 5 + 17, 5 + 17 + 9], dtype=torch.int32)
    x = torch.randn(int(cu[-1]), 3, D)

    class _Group:  # context parallel size 1
        def size(self):
            return 1

        def rank(self):
            return 0

    key = object()
    at = dict(seq_len=x.shape[0], cu_seqlens=cu, max_seqlen=17)  # 17: the longest document
    cos, sin = table.rows(key, x.device, x.dtype, **at)
    torch.testing.assert_close(apply_rotary(x, cos, sin), _apply_rotary_pos_emb_thd(x, cu, freqs, cp_group=_Group()),
                               atol=1e-6, rtol=0)
    assert table.rows(key, x.device, x.dtype, **at)[0] is cos  # the next layer reuses the rows
    s = torch.randn(12, 2, 3, D)  # sbhd
    cos, sin = table.rows(("sbhd", 12), s.device, s.dtype, seq_len=12)
    torch.testing.assert_close(apply_rotary(s, cos[:, None], sin[:, None]), _apply_rotary_pos_emb_bshd(s, freqs[:12]),
                               atol=1e-6, rtol=0)
