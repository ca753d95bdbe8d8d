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
from psrl.pipeline.ray.common import ray_cluster
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
    from psrl.pipeline.ray.trainer import RayPolicyTrainer

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


@pytest.mark.slow  # ~60-90 s: two Megatron ranks start in actors
@pytest.mark.timeout(300)
@pytest.mark.parametrize("advantage, mini", [("grpo", None), ("gae", 1)])
def test_data_parallel_ranks_fetch_their_own_shares_by_meta(advantage, mini):
    """dp=2: the driver takes a step's metadata and scalars; each rank fetches its share (whole
    groups) from the transfer queue on Ray and steps on it; the merged metrics cover the step.
    With GAE and one-group mini-batches: each rank holds 2 of the 4 groups and still takes the 4
    optimizer steps (two on a zero-weight micro-batch), the critic beside the policy."""
    import anyio

    from psrl.config import TransferQueueConfig
    from psrl.pipeline.metrics import METRIC_FIELDS
    from psrl.pipeline.ray.queue_actors import start_ray_transfer_queue
    from psrl.pipeline.ray.trainer import RayPolicyTrainer
    from psrl.pipeline.tq_queue import TransferQueueGroups

    trajs = [make_trajectory(f"g{i // 2}/{i % 2}", f"g{i // 2}", length=6 + i, reward=float(i % 2)) for i in range(8)]
    with ray_cluster(RAY):
        policy = RayPolicyTrainer.create(
            "tiny-qwen2", TrainerConfig(total_steps=2, parallel={"data": 2}, ppo_mini_batch_size=mini),
            AlgorithmConfig(advantage=advantage), RAY, temperature=1.0,
        )
        try:
            assert sorted(i["dp_rank"] for i in policy.info) == [0, 1]

            async def step() -> tuple[dict, int]:
                cfg = TransferQueueConfig(storage_units=1, request_timeout_s=20)
                async with start_ray_transfer_queue(cfg, RAY) as handle, handle.connect() as client:
                    policy.attach_queue(handle)
                    q = TransferQueueGroups(client, samples_per_step=8)
                    for g in range(4):
                        await q.put_group(trajs[2 * g: 2 * g + 2], partition="train")
                    fields = tuple(dict.fromkeys([*policy.fields, *METRIC_FIELDS]))
                    taken = await q.take(partition="train", n_groups=4, group_size=2, consumer="trainer", fields=fields)
                    assert not {"response_ids", "logprobs", "loss_mask"} & set(taken.batch.schema.names)
                    metrics = await anyio.to_thread.run_sync(policy.train_step_meta, taken.meta, taken.batch)
                    await taken.release()
                    return dict(metrics), len(await client.list("train"))

            metrics, left = anyio.run(step)
            assert left == 0
            assert metrics["samples"] == 8.0 and metrics["loss_tokens"] == float(sum(6 + i for i in range(8)))
            assert np.isfinite(metrics["loss"]) and metrics["version"] == 1.0
            assert metrics["optimizer_steps"] == (4.0 if mini else 1.0)
            if advantage == "gae":
                assert np.isfinite(metrics["critic/value_loss"]) and metrics["critic/update_ok"] == 1.0
            assert dict(policy.named_tensors())  # the weight source exported with the step
        finally:
            policy.close()
