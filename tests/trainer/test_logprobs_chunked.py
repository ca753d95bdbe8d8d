"""Chunked log-probs and entropy: values and gradients equal a full-vocabulary log_softmax, with
chunks smaller than the micro-batch, and the logits are left untouched."""

from __future__ import annotations

import pytest
import torch

import psrl.trainer.logprobs as lp_mod
from psrl.trainer.logprobs import vocab_parallel_logprobs

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("chunk_elements", [1 << 24, 1000])  # one chunk; many chunks of 3 tokens
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [True, False])
def test_chunked_logprobs_equal_log_softmax(monkeypatch, chunk_elements, temperature, entropy_grad):
    monkeypatch.setattr(lp_mod, "_CHUNK_ELEMENTS", {"cpu": chunk_elements, "cuda": chunk_elements})
    torch.manual_seed(0)
    x = (3 * torch.randn(2, 37, 301)).requires_grad_()
    targets = torch.randint(0, 301, (2, 37))
    w_lp, w_ent = torch.randn(2, 37), torch.randn(2, 37)
    before = x.detach().clone()

    logp, ent = vocab_parallel_logprobs(x, targets, temperature=temperature, with_entropy=True, entropy_grad=entropy_grad)
    assert ent.requires_grad == entropy_grad
    ((logp * w_lp).sum() + ((ent * w_ent).sum() if entropy_grad else 0)).backward()
    grad, x.grad = x.grad.clone(), None
    assert torch.equal(x.detach(), before)

    ref = torch.log_softmax(x / temperature, -1)
    ref_lp = ref.gather(-1, targets[..., None])[..., 0]
    ref_ent = -(ref.exp() * ref).sum(-1)
    ((ref_lp * w_lp).sum() + ((ref_ent * w_ent).sum() if entropy_grad else 0)).backward()
    torch.testing.assert_close(logp, ref_lp, atol=2e-6, rtol=0)
    torch.testing.assert_close(ent, ref_ent.detach(), atol=2e-6, rtol=2e-6)  # a 301-term fp32 sum, other order
    torch.testing.assert_close(grad, x.grad, atol=5e-6, rtol=0)  # fp32 rounding


def test_no_entropy_requested():
    x = torch.randn(5, 11, requires_grad=True)
    logp, ent = vocab_parallel_logprobs(x, torch.arange(5), with_entropy=False)
    assert ent is None
    logp.sum().backward()
    torch.testing.assert_close(x.grad, (torch.nn.functional.one_hot(torch.arange(5), 11) - x.softmax(-1)).detach())
