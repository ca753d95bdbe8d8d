"""Gemma 3 (``gemma3_text``) in the Megatron trainer: (1 + w) norms, sandwich norms, scaled
embeddings, the query_pre_attn_scalar attention scale, sliding-window and full layers with their own
RoPE bases. Log-probs against transformers' eager forward, the HF round trip after a step, the
checkpoint export, tensor and pipeline parallel against one process, and the sliding-window
attention against a dense masked softmax."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from psrl.config import AlgorithmConfig, OptimConfig, ParallelConfig, TrainerConfig
from psrl.models import model_dir
from psrl.trainer.attention import packed_attention
from psrl.trainer.batch import to_samples
from psrl.trainer.distributed import spawn_ranks
from packed_helpers import hf_logprobs, hf_model, packed_trajectories

pytestmark = pytest.mark.timeout(120)
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
# Per-token log-prob tolerance against transformers in fp32 (the trainer's other families use it too).
ATOL = 1e-5
WINDOW = 16
VOCAB = 832
# Layer 2 is the only full-attention layer: with two pipeline stages each stage holds one type
# the other does not (a stage given the wrong layers' types or rope bases shows).
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def build_random_gemma3(out, seed: int = 0) -> str:
    """A random Gemma 3 text model that tensor parallel 2 can split (2 key/value heads), its norm
    weights random too (HF initializes them to 0, where a mixed-up norm would not show), and a
    query_pre_attn_scalar unlike head_dim."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
        layer_types=LAYER_TYPES, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh", bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    )
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(out, safe_serialization=True)
    return str(out)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return build_random_gemma3(tmp_path_factory.mktemp("gemma3") / "model")


def _trajectories():
    """Sequences of 18 to 81 tokens (most longer than the window), several to a micro-batch."""
    return packed_trajectories(vocab=VOCAB)


def _trainer(path, **cfg):
    from psrl.trainer.trainer import MegatronTrainer

    cfg.setdefault("micro_batch_tokens", 160)
    cfg.setdefault("device", "cpu")
    return MegatronTrainer(str(path), TrainerConfig(**cfg), AlgorithmConfig())


def _hf(path):
    return hf_model(path, "eager")


def _max_diff(a, b) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


# ---- attention -------------------------------------------------------------------------------


def _dense_reference(q, k, v, cu, scale, window):
    """(T, T) masked softmax: same document, causal, distance < window."""
    T, H, _ = q.shape
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.diff(cu))
    pos = torch.arange(T)
    allowed = (pos[:, None] >= pos[None, :]) & (seg[:, None] == seg[None, :])
    if window is not None:
        allowed &= pos[:, None] - pos[None, :] < window
    rep = H // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("thd,shd->hts", q, kk) * scale
    return torch.einsum("hts,shd->thd", torch.softmax(s.masked_fill(~allowed, float("-inf")), -1), vv)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("window", [1, 5, 16, None])
def test_sliding_window_attention_equals_dense_masked_softmax(window):
    # Below, at and above the window, exact multiples of it, and runs of one length (one batched call).
    lengths = [3, 16, 17, 31, 32, 32, 33, 50, 50, 1, 100]
    cu = torch.tensor([0, *np.cumsum(lengths)])
    T = int(cu[-1])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, h, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    ours = packed_attention(q, k, v, cu, max(lengths), 0.3, window)
    ref = _dense_reference(q, k, v, cu, 0.3, window)
    torch.testing.assert_close(ours, ref, atol=1e-12, rtol=0)
    w = torch.randn(ours.shape, generator=g, dtype=torch.float64)
    g_ours = torch.autograd.grad((ours * w).sum(), (q, k, v))
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(g_ours, g_ref):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_sliding_window_varlen_flash_equals_dense_masked_softmax():
    """bf16 on CUDA: the windowed varlen flash call (or, on a torch without windows, the blocked
    SDPA) against the fp32 dense reference on the same rounded inputs."""
    lengths, window = [5, 300, 64, 1, 130, 17], 64
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    T = int(cu[-1])
    torch.manual_seed(0)
    q, k, v = (torch.randn(T, h, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (8, 2, 2))
    g = torch.randn(T, 8, 64, device="cuda")
    out = packed_attention(q, k, v, cu, max(lengths), 64**-0.5, window)
    (out.float() * g).sum().backward()
    qf, kf, vf = (t.detach().cpu().float().requires_grad_() for t in (q, k, v))
    ref = _dense_reference(qf, kf, vf, cu.long(), 64**-0.5, window)
    (ref * g.cpu()).sum().backward()
    torch.testing.assert_close(out.float().cpu(), ref.detach(), atol=3e-2, rtol=3e-2)
    for got, want in ((q, qf), (k, kf), (v, vf)):
        torch.testing.assert_close(got.grad.float().cpu(), want.grad, atol=1e-1, rtol=5e-2)


@pytest.mark.timeout(30)
def test_gemma_rms_norm_equals_transformers():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm as HFNorm

    from psrl.trainer.gemma3 import Gemma3RMSNorm

    class _Config:
        sequence_parallel = False

    ours, ref = Gemma3RMSNorm(_Config(), 48, eps=1e-6), HFNorm(48, eps=1e-6)
    with torch.no_grad():  # weights a bf16 checkpoint can hold, for the bf16 check below
        ref.weight.normal_(generator=torch.Generator().manual_seed(1)).copy_(ref.weight.bfloat16())
        ours.weight.copy_(ref.weight)
    x = torch.randn(7, 3, 48, generator=torch.Generator().manual_seed(2), requires_grad=True)
    torch.testing.assert_close(ours(x), ref(x), atol=1e-6, rtol=0)
    gx_ours, gw_ours = torch.autograd.grad(ours(x).square().sum(), (x, ours.weight))
    gx_ref, gw_ref = torch.autograd.grad(ref(x).square().sum(), (x, ref.weight))
    torch.testing.assert_close(gx_ours, gx_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gw_ours, gw_ref, atol=1e-5, rtol=1e-5)
    xb = x.detach().bfloat16()  # bf16 in: float32 inside, the product cast back, as transformers does
    out = ours(xb)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref.bfloat16()(xb), atol=0, rtol=2**-8)  # at most one bf16 rounding apart


# ---- the trainer -----------------------------------------------------------------------------


@pytest.mark.parametrize("batching", ["packed", "padded"])
def test_logprobs_match_transformers(gemma_dir, batching):
    trajs = _trajectories()
    assert sum(len(t.prompt_ids) + len(t.response_ids) > WINDOW for t in trajs) >= 6
    with _trainer(gemma_dir, batching=batching) as tr:
        ours = tr.compute_logprobs(trajs)
        if batching == "packed":  # several documents per micro-batch
            samples = to_samples(trajs, VOCAB)
            assert any(len(mb.cu_seqlens) > 3 for mb in tr._micro_batches(samples, range(len(samples))))
    ref = hf_logprobs(_hf(gemma_dir), trajs)
    for a, b in zip(ours, ref, strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)


def test_shipped_tiny_gemma3_matches_transformers():
    path = model_dir("tiny-gemma3")
    trajs = packed_trajectories(vocab=800)
    with _trainer(path) as tr:
        ours = tr.compute_logprobs(trajs)
    for a, b in zip(ours, hf_logprobs(_hf(path), trajs), strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)


def test_step_then_hf_weights_and_exported_checkpoint_give_the_trainers_logprobs(gemma_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from psrl.trainer.export import export_checkpoint

    trajs = _trajectories()
    src = load_file(f"{gemma_dir}/model.safetensors")
    with _trainer(gemma_dir, optim=OptimConfig(lr=1e-3)) as tr:
        before = tr.compute_logprobs(trajs)
        m = tr.step(trajs)
        assert np.isfinite(m["loss"]) and m["grad_norm"] > 0, m
        after = tr.compute_logprobs(trajs)
        state = tr.hf_state_dict()
        tr.save_checkpoint(str(tmp_path / "ckpt"))
    assert _max_diff(before, after) > 1e-3  # the step changed the policy
    assert set(state) == set(src)  # the checkpoint's names, lm_head omitted (tied)
    changed = {k for k in src if not torch.equal(state[k], src[k])}
    assert any("feedforward_layernorm" in k for k in changed) and "model.norm.weight" in changed

    # (b) the live export loaded into transformers
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(gemma_dir), dtype=torch.float32,
                                          attn_implementation="eager").eval()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    hf.tie_weights()
    for a, b in zip(after, hf_logprobs(hf, trajs), strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)

    # (c) the saved checkpoint exported to an HF directory
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf", gemma_dir)
    exported = load_file(f"{out}/model.safetensors")
    assert set(exported) == set(src) and all(torch.equal(exported[k], state[k]) for k in src)
    for a, b in zip(after, hf_logprobs(_hf(out), trajs), strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)


# ---- tensor and pipeline parallel ------------------------------------------------------------


def parallel_worker(rank: int, path: str, tp: int, pp: int, out_path: str) -> None:
    """One rank (module level: spawned ranks import it): log-probs, one step, log-probs and the
    HF weights after it."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    with _trainer(path, parallel=ParallelConfig(tensor=tp, pipeline=pp), optim=OptimConfig(lr=1e-3)) as tr:
        trajs = _trajectories()
        before = tr.compute_logprobs(trajs)
        metrics = tr.step(trajs)
        after = tr.compute_logprobs(trajs)
        state = tr.hf_state_dict()
        if rank == 0:
            torch.save({"before": before, "after": after, "metrics": metrics, "state": state}, out_path)


@pytest.fixture(scope="module")
def one_process(gemma_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "tp1.pt"
    parallel_worker(0, gemma_dir, 1, 1, str(out))
    return torch.load(out, weights_only=False)


def test_pipeline_stages_get_their_layers_types(gemma_dir):
    from psrl.trainer.gemma3 import decoder_block_spec
    from psrl.trainer.model import HFArch, transformer_config

    arch = HFArch.from_pretrained(gemma_dir)
    assert arch.layer_types == tuple(LAYER_TYPES) and arch.sliding_window == WINDOW
    config = transformer_config(arch, tp=1, pp=2, dtype="float32", device="cpu")
    specs = {t: object() for t in set(LAYER_TYPES)}
    for stage in (0, 1):
        got = decoder_block_spec(arch, config, specs, pp_rank=stage).layer_specs
        assert got == [specs[t] for t in LAYER_TYPES[2 * stage : 2 * stage + 2]]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])  # ~7-9 s each on a quiet machine
def test_two_processes_match_one(gemma_dir, one_process, tmp_path, tp, pp):
    out = tmp_path / "par.pt"
    spawn_ranks(parallel_worker, tp * pp, gemma_dir, tp, pp, str(out))
    got, ref = torch.load(out, weights_only=False), one_process
    for a, b in zip(got["before"], ref["before"], strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)
    for k in ("loss", "grad_norm", "entropy"):
        assert got["metrics"][k] == pytest.approx(ref["metrics"][k], abs=1e-5), k
    # After the step: the same weights and log-probs up to Adam's amplification of rounding in
    # near-zero gradients (its first step moves every weight by ~lr = 1e-3 whatever the gradient's
    # size). Gradients of the q/k norms left unsummed over tensor-parallel ranks show as ~1e-3.
    assert set(got["state"]) == set(ref["state"])
    for k, v in ref["state"].items():
        torch.testing.assert_close(got["state"][k], v, atol=1e-4, rtol=0, msg=k)
    for a, b in zip(got["after"], ref["after"], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
