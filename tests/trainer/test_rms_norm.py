"""RMSNorm as one autograd node on CPU (``psrl.trainer.norm``): torch's values and gradients."""

from __future__ import annotations

import warnings

import pytest
import torch

from psrl.config import TrainerConfig
from psrl.models import model_dir
from psrl.trainer.norm import _RMSNorm, rms_norm
from trainer_helpers import make_trajectories

pytestmark = pytest.mark.timeout(120)
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")


def test_backward_is_the_derivative_of_the_forward():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: _RMSNorm.apply(a, b, 1e-6), (x, w))


@pytest.mark.parametrize("weight_grad", [True, False])
def test_values_equal_torch_and_gradients_agree(weight_grad):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 1, 64, generator=g, requires_grad=True)
    w = (1.0 + 0.1 * torch.randn(64, generator=g)).requires_grad_(weight_grad)
    up = torch.randn(40, 1, 64, generator=g)
    ours = rms_norm(x, w, 1e-6)
    theirs = torch.rms_norm(x, (64,), w, 1e-6)
    # mean(x^2) as a squared vector norm: a few ulp from torch's square-then-mean
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    inputs = (x, w) if weight_grad else (x,)
    for a, b in zip(torch.autograd.grad(ours, inputs, up), torch.autograd.grad(theirs, inputs, up), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_every_norm_of_the_trainers_model_is_routed_and_gives_torchs_gradients():
    """A whole model's parameter gradients with the routed norms equal those with torch's own."""
    from psrl.trainer.batch import build_micro_batch, to_samples
    from psrl.trainer.trainer import MegatronTrainer

    with MegatronTrainer(str(model_dir("tiny-qwen2")), TrainerConfig(device="cpu", micro_batch_tokens=4096)) as tr:
        gpt = tr.model
        while hasattr(gpt, "module"):
            gpt = gpt.module
        norms = [m for m in gpt.modules() if isinstance(m, torch.nn.RMSNorm)]
        assert len(norms) == 2 * tr.arch.num_layers + 1  # two per layer and the final one
        assert all("forward" in vars(m) for m in norms)
        samples = to_samples(make_trajectories(6))
        mb = build_micro_batch(samples, list(range(len(samples))), "packed")
        params = [p for p in gpt.parameters() if p.requires_grad]

        def grads():
            out = gpt(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params())
            up = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
            return out.detach(), torch.autograd.grad((out * up).sum(), params)

        out, routed = grads()
        for m in norms:
            del m.forward  # back to torch.nn.RMSNorm.forward
        ref_out, ref = grads()
        torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=0)
        for a, b in zip(routed, ref, strict=True):
            # fp32 sums in another order: entries reach ~170 here, so an absolute 1e-4 is
            # ~1e-6 of the largest
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
