"""The Megatron-Core trainer on CPU, one process: log-probs, weights, training, checkpoints."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from psrl.config import AlgorithmConfig, OptimConfig, TrainerConfig
from psrl.models import model_dir
from psrl.trainer.batch import TRAINER_FIELDS
from psrl.trajectory import Trajectory, to_arrow
from trainer_helpers import build_random_hf, make_trajectories, reads_per_step

pytestmark = pytest.mark.timeout(120)
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")


def _trainer(algo: AlgorithmConfig | None = None, path=None, **cfg):
    from psrl.trainer.trainer import MegatronTrainer

    cfg.setdefault("micro_batch_tokens", 40)
    cfg.setdefault("device", "cpu")
    return MegatronTrainer(str(path or model_dir("tiny-qwen2")), TrainerConfig(**cfg), algo or AlgorithmConfig())


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def _hf_logprobs(hf, trajs, temperature=1.0):
    out = []
    for t in trajs:
        ids = torch.from_numpy(np.concatenate([t.prompt_ids, t.response_ids]).astype(np.int64))[None]
        logp = torch.log_softmax(hf(ids).logits[0].float() / temperature, -1)
        p = len(t.prompt_ids)
        out.append(logp[p - 1 : -1].gather(-1, ids[0, p:, None])[:, 0].numpy() * t.loss_mask)
    return out


@pytest.mark.parametrize("batching", ["packed", "padded"])
def test_logprobs_match_transformers(batching):
    trajs = make_trajectories(6)
    hf = _hf(model_dir("tiny-qwen2"))
    with _trainer(batching=batching) as tr:
        for temp in (1.0, 0.7):
            tr.temperature = temp
            ours = tr.compute_logprobs(trajs)
            for a, b in zip(ours, _hf_logprobs(hf, trajs, temp)):
                np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_llama_with_separate_lm_head(tmp_path):
    """Llama family, untied embeddings: log-probs and the HF round trip, lm_head included."""
    path = build_random_hf(tmp_path / "llama", "llama", tied=False)
    trajs = make_trajectories(4)
    with _trainer(path=path) as tr:
        ours = tr.compute_logprobs(trajs)
        back = tr.hf_state_dict()
    for a, b in zip(ours, _hf_logprobs(_hf(path), trajs)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    src = _file_tensors(tmp_path / "llama")
    assert "lm_head.weight" in src and set(back) == set(src)
    assert all(torch.equal(back[k], v) for k, v in src.items())


def _file_tensors(path):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("name", ["tiny-qwen2", "smollm2-135m"])
def test_hf_megatron_hf_round_trip_is_exact(name):
    from psrl.trainer.trainer import MegatronTrainer

    path = model_dir(name)
    src = _file_tensors(path)
    with MegatronTrainer(str(path), TrainerConfig(device="cpu")) as tr:
        # SmolLM2 is stored in bf16 and trained in fp32: bf16 -> fp32 -> bf16 must be lossless.
        back = dict(tr.hf_weights(dtype=tr.sync_dtype()))
    assert set(back) == set(src)
    for k, v in src.items():
        assert back[k].dtype == v.dtype, k
        assert torch.equal(back[k], v), k


def test_steps_on_fixed_data_lower_the_loss():
    trajs = make_trajectories(6)
    with _trainer(optim=OptimConfig(lr=1e-3)) as tr:
        for t, lp in zip(trajs, tr.compute_logprobs(trajs)):
            t.logprobs = lp  # on-policy: the ratio starts at 1
        losses = [tr.step(trajs)["loss"] for _ in range(4)]
    # Once most ratios are clipped the loss levels off (and may wobble), but stays well below the start.
    assert all(later < losses[0] - 0.05 for later in losses[1:]), losses


def test_packed_padded_and_micro_batch_split_give_the_same_step():
    trajs = make_trajectories(6)
    results = []
    for batching, budget in [("packed", 4096), ("packed", 24), ("padded", 40)]:
        with _trainer(batching=batching, micro_batch_tokens=budget, optim=OptimConfig(lr=1e-3)) as tr:
            m = tr.step(trajs)
            results.append((m["micro_batches"], m["loss"], m["grad_norm"], m["entropy"]))
    assert results[0][0] == 1 and results[1][0] > 2
    for r in results[1:]:
        assert r[1:] == pytest.approx(results[0][1:], abs=2e-6)


def test_host_reads_of_a_step_do_not_grow_with_its_micro_batches():
    # Each read inside the micro-batch loop would be a GPU stall (test_cuda_paths runs the same on CUDA).
    reads = reads_per_step("cpu", "float32")
    assert max(reads.values()) <= 1, reads  # the grad-norm clip's


def test_fp32_gradients_land_in_the_buffers_without_a_hook_per_parameter():
    """On CPU each parameter's .grad is a view of its Megatron gradient buffer, so micro-batches
    accumulate there natively and no per-parameter Python hook runs; a .grad reset after the
    buffers were zeroed still reaches the buffer (moved in at finish_grad_sync)."""
    trajs = make_trajectories(6)
    results = []
    for budget, break_views in ((4096, False), (24, False), (24, True)):
        with _trainer(micro_batch_tokens=budget, optim=OptimConfig(lr=1e-3)) as tr:
            ddp = tr.model
            assert not ddp.grad_accs, "fp32 parameters keep no gradient hook"
            assert all(p.grad.data_ptr() == p.main_grad.data_ptr() for p in ddp.module.parameters())
            if break_views:
                zero = ddp.zero_grad_buffer

                def zero_then_drop(zero=zero, ddp=ddp):
                    zero()
                    for p in ddp.module.parameters():
                        p.grad = None

                ddp.zero_grad_buffer = zero_then_drop
            m = tr.step(trajs)
            results.append((m["micro_batches"], m["loss"], m["grad_norm"]))
    assert results[0][0] == 1 and results[1][0] > 2
    for r in results[1:]:
        assert r[1:] == pytest.approx(results[0][1:], abs=2e-6)


def test_arrow_record_batch_trains_like_trajectories():
    trajs = make_trajectories(6)
    with _trainer() as tr:
        a = tr.step(trajs)
    with _trainer() as tr:
        b = tr.step(to_arrow(trajs, TRAINER_FIELDS))
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]


def test_bad_batch_is_rejected_before_any_update():
    trajs = make_trajectories(4)
    trajs[3].reward = float("nan")
    with _trainer() as tr:
        before = tr.hf_state_dict()
        with pytest.raises(ValueError, match="'k3'"):
            tr.step(trajs)
        assert tr.version == 0
        after = tr.hf_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_reference_model_kl_and_decoupled_weights():
    trajs = make_trajectories(6)
    algo = AlgorithmConfig(loss="decoupled_ppo", kl_coef=0.5, kl_estimator="k3", tis_cap=None)
    with _trainer(algo, optim=OptimConfig(lr=1e-2)) as tr:
        initial = tr.compute_logprobs(trajs)
        for t, lp in zip(trajs, initial):
            t.logprobs = lp  # behaviour == proximal at the first step: weights are exactly 1
        m0 = tr.step(trajs)
        assert m0["kl"] == pytest.approx(0.0, abs=1e-10)
        assert m0["tis_weight"] == pytest.approx(1.0, abs=1e-6)
        m1 = tr.step(trajs)
        assert m1["kl"] > 1e-4
        assert m1["tis_weight"] != pytest.approx(1.0, abs=1e-4)  # the policy moved away from the rollouts
        for a, b in zip(tr.compute_logprobs(trajs, reference=True), initial):
            np.testing.assert_allclose(a, b, atol=1e-6)


def test_checkpoint_resume_gives_the_same_next_losses(tmp_path):
    batches = [make_trajectories(6, seed=s) for s in range(3)]
    opt = OptimConfig(lr=1e-3, warmup_steps=1, lr_schedule="cosine")
    with _trainer(optim=opt, total_steps=5) as tr:
        tr.step(batches[0])
        tr.save_checkpoint(str(tmp_path))
        straight = [tr.step(b) for b in batches[1:]]
        final = tr.hf_state_dict()
    with _trainer(optim=opt, total_steps=5) as tr:
        tr.load_checkpoint(str(tmp_path))
        assert tr.version == 1 and tr.step_count == 1
        resumed = [tr.step(b) for b in batches[1:]]
        final_resumed = tr.hf_state_dict()
    for a, b in zip(straight, resumed):
        for k in ("loss", "grad_norm", "lr", "entropy"):
            assert a[k] == b[k], k
    assert all(torch.equal(final[k], final_resumed[k]) for k in final)


def _adam_groups(tr):
    opt = tr.optimizer
    return [g for o in getattr(opt, "chained_optimizers", [opt]) for g in o.optimizer.param_groups]


def test_adam_runs_fused_and_stays_fused_after_a_resume(tmp_path):
    """torch's fused Adam kernel (on CPU ~7x faster than the default per-parameter loop), the same
    update as unfused AdamW, and still fused after loading a checkpoint, even one saved unfused."""
    trajs = make_trajectories(6)
    opt = OptimConfig(lr=1e-3, weight_decay=0.1)
    with _trainer(optim=opt) as tr:
        groups = _adam_groups(tr)
        assert groups and all(g["fused"] for g in groups)
        decay = {id(p): g["weight_decay"] for g in groups for p in g["params"]}  # none on norms and biases
        assert {0.0, 0.1} <= set(decay.values())
        named = list(tr.model.module.named_parameters())
        before = [torch.nn.Parameter(p.detach().clone()) for _, p in named]
        reference = torch.optim.AdamW([{"params": [q], "weight_decay": decay[id(p)]} for q, (_, p) in zip(before, named)],
                                      lr=1e-3, betas=opt.betas, eps=opt.eps, foreach=False)
        tr.step(trajs)
        for q, (_, p) in zip(before, named):
            q.grad = p.main_grad.clone()  # the gradient the update used (zeroed only before the next step)
        reference.step()
        for q, (n, p) in zip(before, named):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7, msg=n)
        for g in _adam_groups(tr):  # what a checkpoint of the unfused code holds
            g["fused"] = None
        tr.save_checkpoint(str(tmp_path))
    with _trainer(optim=opt) as tr:
        tr.load_checkpoint(str(tmp_path))
        assert all(g["fused"] for g in _adam_groups(tr))
        tr.step(trajs)


def _toy_rl(steps: int, group: int, groups: int, lr: float, seed: int = 0) -> list[float]:
    """Reward 1 when the single sampled token is the target; sampling uses an HF copy of the
    policy that receives the trainer's weights after every step."""
    hf = _hf(model_dir("tiny-qwen2"))
    prompt = np.array([5, 17, 99, 3])
    with torch.no_grad():
        p0 = torch.softmax(hf(torch.from_numpy(prompt)[None]).logits[0, -1], -1)
    target = int(torch.argsort(p0, descending=True)[1])  # a plausible token, still rare (~0.3%)
    gen = torch.Generator().manual_seed(seed)
    rewards = []
    with _trainer(micro_batch_tokens=4096, optim=OptimConfig(lr=lr)) as tr:
        for step in range(steps):
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.from_numpy(prompt)[None]).logits[0, -1], -1)
            toks = torch.multinomial(logp.exp(), group * groups, replacement=True, generator=gen).tolist()
            trajs = [
                Trajectory(
                    key=f"s{step}-{i}", group_id=f"g{i // group}", prompt_ids=prompt, response_ids=[t], loss_mask=[1],
                    logprobs=[float(logp[t])], versions=[tr.version], turn_bounds=[[0, 1]],
                    turn_rewards=[float(t == target)], reward=float(t == target),
                )
                for i, t in enumerate(toks)
            ]
            m = tr.step(trajs)
            rewards.append(m["reward_mean"])
            hf.load_state_dict(tr.hf_state_dict(), strict=False)
            if len(rewards) >= 2 and min(rewards[-2:]) > 0.9:
                break
    return rewards


def test_toy_rl_problem_learns():
    rewards = _toy_rl(steps=30, group=8, groups=32, lr=1e-2)
    assert rewards[0] < 0.05, rewards
    assert rewards[-1] > 0.9, rewards


def test_parallel_layout_must_match_the_world_and_the_model():
    from psrl.config import ParallelConfig

    with pytest.raises(ValueError, match="world size 1 != tensor 2"):
        _trainer(parallel=ParallelConfig(tensor=2))
    with pytest.raises(ValueError, match="on CPU"):
        _trainer(dtype="bfloat16")
    with _trainer() as tr:  # nothing leaked from the failed attempts
        assert tr.layout.tp == 1


def test_unsupported_architecture_is_named(tmp_path):
    from psrl.trainer.model import HFArch

    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        HFArch.from_pretrained(tmp_path)
    smol = HFArch.from_pretrained(model_dir("smollm2-135m"))
    assert (smol.family, smol.num_kv_heads, smol.tied_embeddings, smol.qkv_bias) == ("llama", 3, True, False)
    with pytest.raises(ValueError, match="3 key/value heads are not divisible by tensor parallel 2"):
        smol.check_parallel(2, 1)


def test_output_layer_scores_only_loss_tokens():
    """The output layer projects the trained positions only, and those logits are the full
    forward's; a micro-batch without a trained token (a response that is all tool output) still
    trains and scores zero."""
    from psrl.trainer.batch import build_micro_batch, to_samples
    from psrl.trainer.model import scoring_rows

    trajs = make_trajectories(6)
    with _trainer(micro_batch_tokens=4096) as tr:
        samples = to_samples(trajs)
        mb = build_micro_batch(samples, list(range(len(samples))), "packed")
        with torch.no_grad():
            full = tr.model(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params())
            with scoring_rows(tr.model, mb.scored):
                part = tr.model(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params())
        assert part.shape == (1, int(mb.loss_mask.sum()), full.shape[-1])
        torch.testing.assert_close(part[0], full.reshape(-1, full.shape[-1])[mb.scored], atol=1e-5, rtol=0)

    trajs[1].loss_mask[:] = 0
    trajs[1].logprobs[:] = 0
    trajs[1].versions[:] = -1
    with _trainer(micro_batch_tokens=24, optim=OptimConfig(lr=1e-3)) as tr:
        logp = tr.compute_logprobs(trajs)
        assert not logp[1].any() and all(lp.any() for i, lp in enumerate(logp) if i != 1)
        m = tr.step(trajs)
    assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"]) and m["micro_batches"] > 2
