"""``RayPolicyTrainer``: a Megatron-Core trainer rank as a Ray actor on a private local cluster,
driven as the scheduler drives a ``PolicyTrainer``: a step, the weights for the engines, a
checkpoint, and nothing left afterwards."""

from __future__ import annotations

import time

import numpy as np
import psutil
import pytest

from psrl.config import AlgorithmConfig, TrainerConfig
from psrl.config.schema import ActorResources, RayConfig
from psrl.pipeline.protocols import PolicyTrainer
from psrl.pipeline.ray_common import ray_cluster
from psrl.testing.conformance_queue import make_trajectory
from psrl.trajectory import to_arrow

RAY = RayConfig(address="local", num_cpus=2, trainer=ActorResources(num_cpus=1.0))


def _rank_processes() -> list[psutil.Process]:
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if " ".join(p.cmdline()).startswith("ray::TrainerRankActor"):
                found.append(p)
        except psutil.Error:
            pass
    return found


@pytest.mark.timeout(240)
def test_trainer_rank_actor_steps_exports_weights_and_checkpoints(tmp_path):
    from psrl.pipeline.ray_trainer import RayPolicyTrainer

    # Two groups of two with different rewards: non-zero GRPO advantages, so the step moves weights.
    trajs = [make_trajectory(f"k{i}", f"g{i // 2}", length=6, reward=float(i % 2)) for i in range(4)]
    with ray_cluster(RAY):
        policy = RayPolicyTrainer.create(
            "tiny-qwen2", TrainerConfig(total_steps=2, optim={"lr": 1e-2}), AlgorithmConfig(), RAY, temperature=1.0
        )
        try:
            assert isinstance(policy, PolicyTrainer)
            assert [i["rank"] for i in policy.info] == [0] and policy.info[0]["device"] == "cpu"
            assert len(_rank_processes()) == 1  # the rank lives in its actor's process
            before = dict(policy.named_tensors())  # nothing cached yet: exported now
            metrics = policy.train_step(to_arrow(trajs, list(policy.fields)))
            assert metrics["samples"] == 4.0 and metrics["version"] == 1.0 and np.isfinite(metrics["loss"])
            after = dict(policy.named_tensors())  # exported with the step, as CPU tensors
            assert after.keys() == before.keys() and all(t.device.type == "cpu" for t in after.values())
            assert any(not np.array_equal(before[k].numpy(), after[k].numpy()) for k in after)
            policy.save_checkpoint(str(tmp_path / "ckpt"))
            assert any((tmp_path / "ckpt").iterdir())
        finally:
            policy.close()
        deadline = time.monotonic() + 20
        while _rank_processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _rank_processes() == []
