"""Weight sync to engines: in process (colocated) and over ZeroMQ to another process."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import anyio
import pytest
import torch
import zmq

from psrl.config import OptimConfig, TrainerConfig
from psrl.models import model_dir
from psrl.testing import ScriptedEngine
from psrl.trainer.weight_sync import InProcessPublisher, WeightPublisher, ZmqWeightPublisher
from trainer_helpers import make_trajectories, tensor_digest

pytestmark = [pytest.mark.timeout(120), pytest.mark.anyio]
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def trained():
    """HF-named weights and version after one step of the tiny model."""
    from psrl.trainer.trainer import MegatronTrainer

    with MegatronTrainer(str(model_dir("tiny-qwen2")), TrainerConfig(device="cpu", optim=OptimConfig(lr=1e-3))) as tr:
        tr.step(make_trajectories())
        assert tr.is_weight_source
        return list(tr.hf_weights(dtype=tr.sync_dtype())), tr.version


async def test_in_process_publish_updates_every_engine(trained):
    named, version = trained
    engines = [ScriptedEngine([[1, 2]]), ScriptedEngine([[3]])]
    pub = InProcessPublisher(engines)
    assert isinstance(pub, WeightPublisher)
    report = await pub.publish(named, version)
    await pub.aclose()
    assert [e.statistics().version for e in engines] == [version, version]
    assert [e.statistics().weight_updates for e in engines] == [1, 1]
    assert report.version == version and report.targets == 2
    assert report.num_tensors == len(named) == 2 + 2 * 12  # embed + final norm; 12 per layer (q/k/v biases)
    assert report.bytes == sum(t.numel() * t.element_size() for _, t in named)
    assert report.seconds >= 0


async def test_publish_to_an_engine_in_another_process(trained, tmp_path, anyio_backend):
    named, version = trained
    record = tmp_path / "received.json"
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "weight_receiver_proc.py"), str(record), anyio_backend],
        stdout=subprocess.PIPE, text=True, cwd=HERE,
    )
    ctx = zmq.Context()
    try:
        endpoint = await anyio.to_thread.run_sync(proc.stdout.readline)
        assert endpoint.startswith("tcp://127.0.0.1:"), endpoint
        pub = ZmqWeightPublisher(ctx, [endpoint.strip()], timeout_s=60)
        try:
            report = await pub.publish(named, version)
            report2 = await pub.publish(named[:3], version + 1)  # a partial update is fine too
        finally:
            await pub.aclose()
    finally:
        proc.kill()
        proc.wait(timeout=10)
        ctx.term()
    got = json.loads(record.read_text())
    assert got["version"] == version + 1 and report2.num_tensors == 3
    assert report.num_tensors == len(named) and report.targets == 1
    assert report.bytes > sum(t.numel() * t.element_size() for _, t in named)  # payload + metadata frame
    assert report.seconds > 0
    assert got["digests"] == {n: tensor_digest(t) for n, t in named[:3]}


async def test_receiver_reports_engine_failure(tmp_path):
    from psrl.trainer.weight_sync import ZmqWeightReceiver

    class Broken(ScriptedEngine):
        async def update_weights(self, named_tensors, version):
            raise RuntimeError("disk full")

    ctx = zmq.Context()
    receiver = ZmqWeightReceiver(ctx, Broken([[1]]))
    pub = None
    try:
        async with anyio.create_task_group() as tg:
            endpoint = await tg.start(receiver.serve)
            pub = ZmqWeightPublisher(ctx, [endpoint], timeout_s=10)
            with pytest.raises(RuntimeError, match="disk full"):
                await pub.publish([("w", torch.ones(2))], 1)
            tg.cancel_scope.cancel()
    finally:
        if pub is not None:
            await pub.aclose()
        await receiver.aclose()
        ctx.term()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # pure data, one backend is enough
async def test_wire_format_round_trips_bit_exact(anyio_backend):
    from psrl.trainer.weight_sync import pack, unpack

    g = torch.Generator().manual_seed(0)
    named = [
        ("a", torch.randn(3, 4, generator=g).to(torch.bfloat16)),
        ("b", torch.randn(5, generator=g)),
        ("c", torch.arange(6, dtype=torch.int64).reshape(2, 3)),
        ("d", torch.randn(4, 4, generator=g).t()),  # not contiguous
        ("e", torch.zeros(0)),
    ]
    header, *buffers = pack(named, 7)
    meta = json.loads(header)
    assert meta["version"] == 7
    back = unpack(meta["tensors"], [bytes(memoryview(b).cast("B")) for b in buffers])
    assert [n for n, _ in back] == [n for n, _ in named]
    for (_, x), (_, y) in zip(named, back):
        assert tensor_digest(x) == tensor_digest(y)
    with pytest.raises(ValueError, match="'a' is given twice"):
        pack([named[0], named[0]], 1)
