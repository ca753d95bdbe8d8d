"""Weight transfer that goes wrong (psrl.engines.weight_transfer, real ZeroMQ sockets and
/dev/shm between threads): a bad tensor, a stalled sender, a sender dead inside a streamed
bucket, a dead receiver each name their bucket and the previous version is restored; a failed
sync drops the receiver's kept connection."""

from __future__ import annotations

import json
import time

import pytest
import torch
import zmq

from psrl.engines.weight_transfer import WeightTransferError, plan_buckets
from psrl.engines.weight_transfer.loaders import ModuleLoader
from psrl.engines.weight_transfer.sender import WeightSender

from .weight_transfer_helpers import Layers, new_weights, run_receiver, spec_for

pytestmark = pytest.mark.timeout(60)


def test_a_bad_tensor_names_its_bucket_and_the_previous_version_is_restored(ctx):
    module = Layers()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    named = new_weights(module, 3)
    named[7] = (named[7][0], torch.zeros(3))  # layer 2 = bucket 1 at 70 kB
    sender = WeightSender(ctx, bucket_bytes=70_000)
    try:
        spec = spec_for(sender, 5, "tcp")
        out: dict = {}
        t = run_receiver(ctx, spec, ModuleLoader(module, keep_previous=True), out)
        with pytest.raises(WeightTransferError, match=r"failed at bucket 1 \(6 tensors: model.layers.2.a.weight") as info:
            sender.send(named, 5, receivers=1, sync=spec["sync"])
        t.join(10)
    finally:
        sender.close()
    assert info.value.bucket == 1
    err = out["r"]
    assert isinstance(err, WeightTransferError) and err.bucket == 1 and err.restored
    assert "'model.layers.2.b.weight' has shape (3,), the model's is (64, 64)" in str(err)
    assert "previous version is restored" in str(err)
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())  # bucket 0 was undone


@pytest.mark.parametrize("plane", ["tcp", "shm"])
def test_a_receiver_keeps_one_connection_per_sender_across_syncs_and_drops_it_after_a_failure(ctx, plane):
    """With ``connections`` (what a vLLM worker passes) later syncs reuse the connection of the
    first (a new tcp connection starts with small kernel windows); a failed sync closes it, and
    the next one connects anew and loads exactly."""
    module = Layers()
    loader = ModuleLoader(module, keep_previous=True)
    senders = [WeightSender(ctx, bucket_bytes=70_000) for _ in range(2)]
    connections: dict = {}

    def sync(sender: WeightSender, version: int, named: list):
        spec = spec_for(sender, version, plane)
        out: dict = {}
        t = run_receiver(ctx, spec, loader, out, connections=connections)
        try:
            sender.send(named, version, receivers=1, sync=spec["sync"])
        finally:
            t.join(10)
        if isinstance(out["r"], Exception):
            raise out["r"]
        return out["r"]

    try:
        for version in (1, 2, 3):
            assert sync(senders[0], version, new_weights(module, version))["tensors"] == 18
            if version == 1:
                kept = connections[senders[0].endpoint]
            assert list(connections.values()) == [kept]  # the same socket every time
        sync(senders[1], 4, new_weights(module, 4))  # a second sender: a connection of its own
        assert set(connections) == {senders[0].endpoint, senders[1].endpoint}
        bad = new_weights(module, 5)
        bad[7] = (bad[7][0], torch.zeros(3))
        with pytest.raises(WeightTransferError, match="failed at bucket 1"):
            sync(senders[0], 5, bad)
        assert senders[0].endpoint not in connections and kept.closed
        good = new_weights(module, 6)
        assert sync(senders[0], 6, good)["tensors"] == 18
        assert connections[senders[0].endpoint] is not kept
        got = dict(module.named_parameters())
        assert all(torch.equal(got[n], t) for n, t in good)
    finally:
        for s in senders:
            s.close()
        for sock in connections.values():
            sock.close(linger=0)


def test_a_sender_that_stalls_mid_sync_fails_the_receiver_at_that_bucket(ctx):
    module = Layers()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    sender = WeightSender(ctx, bucket_bytes=70_000, timeout_s=5.0)
    tcp = sender.planes["tcp"]
    stage = tcp.stage

    def stalling_stage(slot, slot_bytes, plan, tensors):
        if plan.index == 1:  # a trainer rank that hangs after bucket 0
            time.sleep(2.0)
        return stage(slot, slot_bytes, plan, tensors)

    tcp.stage = stalling_stage
    spec = spec_for(sender, 2, "tcp", timeout_s=0.5)
    out: dict = {}
    t = run_receiver(ctx, spec, ModuleLoader(module, keep_previous=True), out)
    try:
        with pytest.raises(WeightTransferError, match="bucket 1"):
            sender.send(new_weights(module, 4), 2, receivers=1, sync=spec["sync"])
        t.join(10)
    finally:
        sender.close()
    err = out["r"]
    assert isinstance(err, WeightTransferError) and err.bucket == 1 and err.restored, err
    assert "timed out after 0.5s waiting for bucket 1" in str(err)
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())


def test_a_receiver_that_dies_mid_sync_fails_the_sender_at_that_bucket(ctx):
    module = Layers()
    sender = WeightSender(ctx, bucket_bytes=70_000, timeout_s=1.0)

    class Dies(ModuleLoader):
        def load(self, stream):
            for i, _ in enumerate(stream):
                if i == 7:  # in bucket 1: the process hangs (nothing more is acked)
                    time.sleep(3)
                    raise SystemExit
            return i

    spec = spec_for(sender, 4, "tcp")
    out: dict = {}
    t = run_receiver(ctx, spec, Dies(module), out)
    try:
        with pytest.raises(WeightTransferError, match=r"timed out after 1s waiting for acks at bucket 1 \(6 tensors") as info:
            sender.send(new_weights(module, 5), 4, receivers=1, sync=spec["sync"])
    finally:
        t.join(10)
        sender.close()
    assert info.value.bucket == 1


def test_a_sender_that_dies_inside_a_streamed_bucket_fails_the_receiver_naming_the_frame(ctx):
    """Over tcp a bucket's tensors follow its header as messages of their own: a trainer that
    dies after the header and the first tensor leaves the receiver waiting for the second, which
    times out naming it and the bucket, and the previous version is restored."""
    module = Layers(n=1)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    named = new_weights(module, 7)
    (plan,) = plan_buckets(named, 1 << 20)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    spec = {"sync": "s1", "version": 1, "plane": "tcp", "timeout_s": 0.5,
            "sources": [{"endpoint": endpoint, "ipc_endpoint": "", "machine": "elsewhere", "planes": ["tcp"]}]}
    out: dict = {}
    t = run_receiver(ctx, spec, ModuleLoader(module, keep_previous=True), out)
    try:
        assert router.poll(5000)
        ident, hello = router.recv_multipart()
        assert json.loads(hello)["type"] == "hello"
        header = {"type": "bucket", "sync": "s1", "version": 1, "bucket": plan.to_wire(), "of": 1, "frames": len(named)}
        router.send_multipart([ident, json.dumps(header).encode()])
        router.send_multipart([ident, b"", named[0][1].numpy().tobytes()])  # then nothing more
        t.join(10)
        assert router.poll(2000)
        error = json.loads(router.recv_multipart()[1])
        assert error["type"] == "error" and error["bucket"] == 0
    finally:
        router.close(linger=0)
    err = out["r"]
    assert isinstance(err, WeightTransferError) and err.bucket == 0 and err.restored, err
    assert f"waiting for data frame 2/{len(named)} of bucket 0" in str(err)
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())
