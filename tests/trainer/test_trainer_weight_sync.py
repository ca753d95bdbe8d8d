"""Weight sync from the trainer: in process (scripted engines), and bucket by bucket into the
parameters of a model in another process, over shared memory and ZeroMQ tcp."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

import anyio
import pytest

from psrl.config import OptimConfig, TrainerConfig
from psrl.models import model_dir
from psrl.testing import ScriptedEngine
from psrl.trainer.weight_sync import InProcessPublisher, WeightPublisher
from trainer_helpers import make_trajectories, tensor_digest

pytestmark = [pytest.mark.timeout(120), pytest.mark.anyio]
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def trained():
    """HF-named weights (float32, as the receiving model holds them) and version after one step."""
    import torch

    from psrl.trainer.trainer import MegatronTrainer

    with MegatronTrainer(str(model_dir("tiny-qwen2")), TrainerConfig(device="cpu", optim=OptimConfig(lr=1e-3))) as tr:
        tr.step(make_trajectories())
        assert tr.is_weight_source
        return list(tr.hf_weights(dtype=torch.float32)), tr.version


def test_export_into_buffers_casts_into_them_and_yields_them():
    """``hf_weights(dtype, into=...)``: every tensor with a buffer is cast into it and the buffer
    is yielded (a weight sender's export buffers); the values equal the plain export's; a buffer
    of the wrong shape is refused by name."""
    import torch

    from psrl.trainer.trainer import MegatronTrainer

    with MegatronTrainer(str(model_dir("tiny-qwen2")), TrainerConfig(device="cpu")) as tr:
        own = dict(tr.hf_weights())  # fp32, as trained: the MLP halves are still tensors of their own
        gate, up = own["model.layers.0.mlp.gate_proj.weight"], own["model.layers.0.mlp.up_proj.weight"]
        assert gate.untyped_storage().data_ptr() != up.untyped_storage().data_ptr()
        plain = dict(tr.hf_weights(dtype=torch.bfloat16))
        into = {n: torch.empty_like(t) for n, t in plain.items() if n != "model.norm.weight"}
        got = dict(tr.hf_weights(dtype=torch.bfloat16, into=into))
        assert got.keys() == plain.keys()
        assert all(got[n] is into[n] for n in into) and got["model.norm.weight"].dtype == torch.bfloat16
        assert all(torch.equal(got[n], plain[n]) for n in plain)
        into["model.layers.1.self_attn.k_proj.weight"] = torch.empty(3, 3, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.k_proj.weight' of shape \(\d+, \d+\) into a buffer of shape \(3, 3\)"):
            dict(tr.hf_weights(dtype=torch.bfloat16, into=into))


class SlowLoadingEngine(ScriptedEngine):
    LOAD_S = 0.2

    async def update_weights(self, named_tensors, version):
        await anyio.sleep(self.LOAD_S)
        await super().update_weights(named_tensors, version)


async def test_in_process_publish_updates_every_engine_concurrently(trained):
    named, version = trained
    engines = [SlowLoadingEngine([[1, 2]]), SlowLoadingEngine([[3]])]
    pub = InProcessPublisher(engines)
    assert isinstance(pub, WeightPublisher)
    report = await pub.publish(named, version)
    await pub.aclose()
    assert [e.statistics().version for e in engines] == [version, version]
    assert [e.statistics().weight_updates for e in engines] == [1, 1]
    assert report.version == version and report.targets == 2
    assert report.num_tensors == len(named) == 2 + 2 * 12  # embed + final norm; 12 per layer (q/k/v biases)
    assert report.bytes == sum(t.numel() * t.element_size() for _, t in named)
    # Both engines load at once: the publish takes one load's time, not two.
    assert SlowLoadingEngine.LOAD_S <= report.seconds < 2 * SlowLoadingEngine.LOAD_S


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_sync_into_a_model_in_another_process(trained):
    """Both transports, several buckets, into the parameters of a transformers model in another
    process; then a sync that fails half way names its bucket and leaves the process serving."""
    import zmq

    from psrl.engines.weight_transfer.sender import WeightSender

    named, version = trained
    proc = subprocess.Popen([sys.executable, str(HERE / "weight_receiver_proc.py"), str(model_dir("tiny-qwen2"))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=HERE)
    ctx = zmq.Context()
    sender = WeightSender(ctx, bucket_bytes=100_000, timeout_s=30)
    try:
        assert json.loads(await anyio.to_thread.run_sync(proc.stdout.readline)) == {"ready": True}

        async def sync(plane: str, tensors, v: int) -> tuple[dict, object]:
            sync_id = uuid.uuid4().hex
            spec = {"sync": sync_id, "version": v, "sources": [sender.source()], "plane": plane, "timeout_s": 30}
            proc.stdin.write(json.dumps(spec) + "\n")
            proc.stdin.flush()
            try:
                report = await anyio.to_thread.run_sync(lambda: sender.send(tensors, v, receivers=1, sync=sync_id))
            except Exception as exc:  # the failure case below
                report = exc
            return json.loads(await anyio.to_thread.run_sync(proc.stdout.readline)), report

        for i, plane in enumerate(["shm", "tcp"]):
            got, report = await sync(plane, named, version + i)
            assert got["version"] == version + i and got["tensors"] == len(named), got
            assert report.buckets == got["buckets"] > 2  # 100 kB buckets: the tiny model spans several
            sent = {n: tensor_digest(t) for n, t in named}
            assert {n: got["digests"][n] for n in sent if n in got["digests"]} == {n: d for n, d in sent.items() if n in got["digests"]}
            assert len(set(sent) & set(got["digests"])) == len(got["digests"])  # every parameter came
        bad = [(n, t[:1] if n == "model.layers.1.mlp.up_proj.weight" else t) for n, t in named]
        got, err = await sync("shm", bad, version + 5)
        assert "model.layers.1.mlp.up_proj.weight" in got["error"] and "has shape (1, 64), the model's is (128, 64)" in got["error"], got
        assert f"bucket {got['bucket']}" in str(err) and got["bucket"] > 0  # the sender names it too
        got, report = await sync("tcp", named, version + 6)  # the next sync goes through
        assert got["version"] == version + 6 and "error" not in got
    finally:
        proc.kill()
        proc.wait(timeout=10)
        sender.close()
        ctx.term()
