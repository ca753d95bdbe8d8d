"""LoRA adapters on the Megatron policy (``trainer.lora``): only the adapters train, the base stays
as it was; the adapted policy is PEFT's (exported adapters load with ``peft`` and give the
trainer's log-probs); tensor and pipeline parallel give what one process gives; a checkpoint
resumes; a real vLLM engine serving the synced adapter samples with the trainer's log-probs."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from psrl.config import AlgorithmConfig, CriticConfig, LoraConfig, OptimConfig, TrainerConfig
from psrl.models import model_dir
from psrl.trainer.distributed import spawn_ranks
from packed_helpers import hf_logprobs, hf_model
from trainer_helpers import build_random_hf, make_trajectories, tp_worker

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
pytestmark = pytest.mark.timeout(300)
RANK = 8


def _cfg(tmp_path=None, **lora) -> TrainerConfig:
    extra = {"checkpoint_dir": str(tmp_path / "ckpt")} if tmp_path is not None else {}
    return TrainerConfig(device="cpu", optim=OptimConfig(lr=1e-2), lora=LoraConfig(rank=RANK, init="gaussian", **lora), **extra)


def _max_diff(a, b) -> float:
    return float(max(np.abs(x - y).max() for x, y in zip(a, b, strict=True)))


@pytest.fixture(scope="module")
def tiny():
    return str(model_dir("tiny-qwen2"))


def test_only_adapters_train_and_the_reference_is_the_base(tiny):
    """The adapted policy starts as the base (B = 0); after steps the base weights are bit-equal to
    the checkpoint's, the optimizer holds only the adapters, and the reference log-probs
    (the base, adapters skipped: no second model) are the untrained policy's."""
    from psrl.trainer.lora import projection_shape
    from psrl.trainer.trainer import MegatronTrainer

    trajs = make_trajectories(6)
    base_lp = hf_logprobs(hf_model(tiny), trajs)
    with MegatronTrainer(tiny, _cfg(), AlgorithmConfig(kl_coef=0.1)) as tr:
        assert tr.ref_model is None
        a = tr.arch
        per_layer = sum(RANK * sum(projection_shape(a, p)) for p in
                        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
        trainable = [p for p in tr.model.parameters() if p.requires_grad]
        assert sum(p.numel() for p in trainable) == tr.lora_params == a.num_layers * per_layer
        in_optimizer = {id(p) for g in tr.optimizer.param_groups for p in g["params"]}
        assert len(in_optimizer) == len(trainable)
        assert _max_diff(tr.compute_logprobs(trajs), base_lp) < 1e-5
        frozen = {n: p.detach().clone() for n, p in tr.model.named_parameters() if not p.requires_grad}
        for _ in range(3):
            m = tr.step(trajs)
            assert np.isfinite(m["loss"]) and m["update_ok"] == 1.0
        assert all(torch.equal(p, frozen[n]) for n, p in tr.model.named_parameters() if not p.requires_grad)
        assert _max_diff(tr.compute_logprobs(trajs), base_lp) > 0.05  # the adapters changed the policy
        assert _max_diff(tr.compute_logprobs(trajs, reference=True), base_lp) < 1e-5
        assert m["kl"] > 0


def test_exported_adapters_load_with_peft_and_merge_like_peft(tiny, tmp_path):
    """``psrl export`` of a LoRA checkpoint: a PEFT adapter directory that ``PeftModel`` loads
    over the base with the trainer's log-probs; ``--merge``: a full model with PEFT's merge; the
    trainer's merged weight export (``merge_for_rollout``) is the same."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from psrl.trainer.export import export_checkpoint
    from psrl.trainer.trainer import MegatronTrainer

    trajs = make_trajectories(6)
    with MegatronTrainer(tiny, _cfg(tmp_path, merge_for_rollout=True)) as tr:
        for _ in range(2):
            tr.step(trajs)
        ours = tr.compute_logprobs(trajs)
        synced = dict(tr.hf_weights(torch.float32))  # merge_for_rollout: full HF weights
        assert tr.adapter_config() is None and "model.layers.0.self_attn.q_proj.weight" in synced
        tr.save_checkpoint()
    adapter = export_checkpoint(tmp_path / "ckpt", tmp_path / "adapter", tiny, dtype="float32", merge=False)
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors", "psrl_export.json"]
    peft_model = PeftModel.from_pretrained(hf_model(tiny), str(adapter)).eval()
    assert _max_diff(hf_logprobs(peft_model, trajs), ours) < 1e-5
    merged = export_checkpoint(tmp_path / "ckpt", tmp_path / "merged", tiny, dtype="float32", merge=True)
    assert _max_diff(hf_logprobs(hf_model(str(merged)), trajs), ours) < 1e-5
    theirs = peft_model.merge_and_unload().state_dict()
    written = load_file(str(merged / "model.safetensors"))
    assert max((written[k] - theirs[k]).abs().max().item() for k in written) < 1e-6
    assert max((synced[k] - written[k]).abs().max().item() for k in synced) < 1e-6


def test_checkpoint_holds_the_adapters_and_resumes(tiny, tmp_path):
    """A LoRA checkpoint is the adapters (and their optimizer state), naming the base; a new
    trainer resumed from it steps exactly as the one that saved it; a trainer without adapters
    (or of another rank) is refused by name."""
    from psrl.trainer.trainer import MegatronTrainer

    trajs = make_trajectories(6)
    with MegatronTrainer(tiny, _cfg(tmp_path)) as tr:
        tr.step(trajs)
        step_dir = tr.save_checkpoint()
        after = tr.step(trajs)
        lp = tr.compute_logprobs(trajs)
    state = torch.load(step_dir / "tp0_pp0.pt", weights_only=False)
    assert state["model"] and all(".lora." in k for k in state["model"])
    assert state["lora"]["base"] == tiny and state["lora"]["adapter_config"]["r"] == RANK
    with MegatronTrainer(tiny, _cfg(tmp_path)) as tr:
        tr.load_checkpoint()
        again = tr.step(trajs)
        assert again["loss"] == pytest.approx(after["loss"], abs=1e-6)
        assert _max_diff(tr.compute_logprobs(trajs), lp) < 1e-6
    with MegatronTrainer(tiny, TrainerConfig(device="cpu", checkpoint_dir=str(tmp_path / "ckpt"))) as tr:
        with pytest.raises(ValueError, match="saved with trainer.lora adapters"):
            tr.load_checkpoint()
    cfg = TrainerConfig(device="cpu", checkpoint_dir=str(tmp_path / "ckpt"), lora=LoraConfig(rank=4))
    with MegatronTrainer(tiny, cfg) as tr:
        with pytest.raises(ValueError, match="adapters of rank 8"):
            tr.load_checkpoint()


def test_critic_gets_adapters_and_a_whole_value_head(tiny):
    """PPO with a critic and LoRA: the critic's backbone is frozen with adapters of its own, its
    value head trains whole; a step updates both."""
    from psrl.trainer.trainer import MegatronTrainer

    with MegatronTrainer(tiny, _cfg(), AlgorithmConfig(advantage="gae"), critic=CriticConfig()) as tr:
        model = tr.critic.model
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable and all(".lora." in n or "output_layer" in n for n in trainable)
        assert any("output_layer" in n for n in trainable)
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        m = tr.step(make_trajectories(6))
        assert np.isfinite(m["critic/value_loss"]) and m["critic/update_ok"] == 1.0
        assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)


def test_mixture_of_experts_adapts_the_attention_only():
    """Qwen3-MoE: ``all-linear`` adapts the attention (the experts take no adapters); naming an
    MLP projection is refused by name."""
    from psrl.trainer.lora import resolve_targets
    from psrl.trainer.model import HFArch

    arch = HFArch.from_pretrained(model_dir("tiny-qwen3-moe"))
    assert resolve_targets(LoraConfig(rank=8), arch) == ("q_proj", "k_proj", "v_proj", "o_proj")
    with pytest.raises(ValueError, match="experts"):
        resolve_targets(LoraConfig(rank=8, target_modules=["q_proj", "gate_proj"]), arch)
    dense = HFArch.from_pretrained(model_dir("tiny-qwen3"))
    assert resolve_targets(LoraConfig(rank=8, target_modules=["v_proj", "q_proj"]), dense) == ("q_proj", "v_proj")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_parallel_adapters_match_one_process(tmp_path, tp, pp):
    """Column/row-parallel adapters (tensor parallel 2) and adapters on two pipeline stages give
    the log-probs, losses and merged weights of one process (a critic with adapters included)."""
    model = build_random_hf(tmp_path / "llama", "llama", tied=False)
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    tp_worker(0, model, 1, 1, 1, str(one), 2, True, RANK)
    spawn_ranks(tp_worker, tp * pp, model, tp, pp, 1, str(two), 2, True, RANK)
    a, b = torch.load(one, weights_only=False), torch.load(two, weights_only=False)
    assert _max_diff(a["logprobs"], b["logprobs"]) < 1e-5
    for ma, mb in zip(a["metrics"], b["metrics"], strict=True):
        assert mb["loss"] == pytest.approx(ma["loss"], abs=1e-5)
        assert mb["grad_norm"] == pytest.approx(ma["grad_norm"], rel=1e-4)
    assert a["state"].keys() == b["state"].keys()
    assert max((a["state"][k] - b["state"][k]).abs().max().item() for k in a["state"]) < 1e-5
