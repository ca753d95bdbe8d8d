"""The trainer's CUDA-only paths against float references. Marked ``gpu``: skipped on machines
without CUDA (CI's); run on a lent GPU by ``scripts/gpu_check.sh``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


@pytest.mark.parametrize("dtype,grad_atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_logprobs_on_cuda_equal_float64(dtype, grad_atol):
    """Qwen2.5's vocabulary: chunked log-probs, entropy and their gradient on the GPU."""
    from psrl.trainer.logprobs import vocab_parallel_logprobs

    torch.manual_seed(0)
    n, vocab = 300, 151_936
    x = (3 * torch.randn(n, vocab)).to(dtype)
    targets = torch.randint(0, vocab, (n,))
    w = torch.randn(n)
    xc = x.cuda().requires_grad_()
    logp, ent = vocab_parallel_logprobs(xc, targets.cuda(), with_entropy=True)
    ((logp * w.cuda()).sum() + ent.sum()).backward()

    xr = x.double().requires_grad_()  # the same (rounded) logits, in float64
    ref = torch.log_softmax(xr, -1)
    ref_lp, ref_ent = ref.gather(-1, targets[:, None])[:, 0], -(ref.exp() * ref).sum(-1)
    ((ref_lp * w.double()).sum() + ref_ent.sum()).backward()
    torch.testing.assert_close(logp.cpu().double(), ref_lp.detach(), atol=2e-5, rtol=0)
    torch.testing.assert_close(ent.cpu().double(), ref_ent.detach(), atol=2e-4, rtol=0)
    torch.testing.assert_close(xc.grad.cpu().double(), xr.grad, atol=grad_atol, rtol=0)


def test_packed_varlen_attention_equals_per_document_sdpa():
    """bf16 packed documents (one varlen flash call) against fp32 SDPA per document, GQA 14/2."""
    from psrl.trainer.attention import packed_attention

    torch.manual_seed(0)
    lens = [5, 300, 64, 1, 130]
    total, scale = sum(lens), 64**-0.5
    cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
    q = torch.randn(total, 14, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(total, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(total, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(total, 14, 64, device="cuda")
    out = packed_attention(q, k, v, cu, max(lens), scale)
    (out.float() * g).sum().backward()

    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    refs = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        d = [t[s:e].transpose(0, 1)[None] for t in (qf, kf, vf)]
        refs.append(F.scaled_dot_product_attention(*d, is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1))
    ref = torch.cat(refs)
    (ref * g).sum().backward()
    torch.testing.assert_close(out.float(), ref.detach(), atol=3e-2, rtol=3e-2)
    for got, want in ((q, qf), (k, kf), (v, vf)):
        torch.testing.assert_close(got.grad.float(), want.grad, atol=1e-1, rtol=5e-2)


def test_decoupled_step_with_a_reference_reads_back_a_fixed_number_of_times():
    """bf16 on CUDA: the proximal and reference log-probs (forward-only passes whose per-micro-batch
    outputs are read back after the loop) and a step whose host reads, device-to-host copies
    included, do not grow with its micro-batches."""
    from trainer_helpers import reads_per_step

    reads_per_step("cuda", "bfloat16")  # asserts: finite, one value per token, equal counts
