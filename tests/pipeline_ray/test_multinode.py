"""A real multi-node run: ``ray.cluster_utils.Cluster`` with two raylets on loopback (two node
ids), a custom resource ``env`` on each so that the two rollout workers land one per node; the
engine replica, the trainer rank and the queue are actors too. One GRPO step of the quickstart
task trains on trajectories produced on both nodes (their ``produced_by`` column)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import anyio
import pytest

from psrl.testing.sim_tasks import write_digit_task

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~2-3 min on a loaded 2-core machine: vLLM and Megatron start in actors
@pytest.mark.timeout(600)
def test_one_step_holds_trajectories_from_workers_on_two_nodes(tmp_path):
    from ray.cluster_utils import Cluster

    from psrl.config import load_config
    from psrl.pipeline.ray.common import ray_cluster
    from psrl.pipeline.ray.launcher import train_on_ray
    from psrl.models import model_dir

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"env": 1}, "node_ip_address": "127.0.0.1", "include_dashboard": False,
    })
    try:
        cluster.add_node(num_cpus=0, resources={"env": 1}, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        train, val = write_digit_task(tmp_path / "data", train=16, val=2)
        tiny = str(model_dir("tiny-qwen2"))
        cfg = load_config(REPO / "recipes" / "quickstart" / "config.yaml", [
            f"data.train_files=[{train}]", f"data.val_files=[{val}]", f"*.model.path={tiny}",
            f"logging.output_dir={tmp_path / 'run'}", f"trainer.checkpoint_dir={tmp_path / 'ckpt'}",
            "logging.progress_bar=false", "data.batch_size=4", "gen_actor_rollout_ref.rollout.sampling.n=2",
            "trainer.mode=sync", "trainer.total_steps=1", "trainer.eval_every=0", "trainer.save_every=0",
            "gen_actor_rollout_ref.rollout.engine.cpu_kv_cache_gb=0.5", "launcher=ray", f"ray.address={cluster.address}",
            "ray.engine.num_cpus=1", "ray.trainer.num_cpus=1", "ray.rollout_workers=2", "ray.rollout_worker.num_cpus=0",
            "ray.rollout_worker.resources={env: 1}", "gen_actor_rollout_ref.rollout.agent.max_concurrency=4",
        ])
        with ray_cluster(cfg.ray):
            import ray

            nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            assert len(nodes) == 2
            code = anyio.run(train_on_ray, cfg, backend="asyncio")
        assert code == 0
        (step,) = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
        assert step["samples"] == 8.0 and step["train/samples"] == 8.0
        assert step["rollout/workers"] == 2.0 and step["rollout/nodes"] == 2.0
        assert step["rollout/worker_restarts"] == 0.0
    finally:
        cluster.shutdown()
