"""Bucketed weight transfer (psrl.engines.weight_transfer) between threads over real ZeroMQ
sockets and /dev/shm: bucket plans, exact weights on every plane, export buffers, pipelining
within the window, the collective plane on gloo. Failures: test_weight_transfer_failures.py."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from psrl.engines.weight_transfer import WeightTransferError, plan_buckets
from psrl.engines.weight_transfer.buckets import copy_into
from psrl.engines.weight_transfer.loaders import ModuleLoader
from psrl.engines.weight_transfer.planes import ShmReader
from psrl.engines.weight_transfer.receiver import receive
from psrl.engines.weight_transfer.sender import WeightSender

from .weight_transfer_helpers import Layers, new_weights, run_receiver, spec_for

pytestmark = pytest.mark.timeout(60)


def test_bucket_plans_keep_layers_whole_and_bounded():
    named = new_weights(Layers(n=6, width=64), 0)  # per layer 2*64*64*4 + 64*4 = 33,024 bytes
    plans = plan_buckets(named, 70_000)
    assert [len(p.tensors) for p in plans] == [6, 6, 6]  # two whole layers per bucket
    assert all(p.nbytes <= 70_000 for p in plans)
    layers_per_bucket = [{s.name.split(".")[2] for s in p.tensors} for p in plans]
    assert layers_per_bucket == [{"0", "1"}, {"2", "3"}, {"4", "5"}]
    assert all(s.offset % 64 == 0 for p in plans for s in p.tensors)
    # A layer larger than the bucket gets one of its own rather than being split.
    assert [len(p.tensors) for p in plan_buckets(named, 1000)] == [3] * 6
    with pytest.raises(ValueError, match="'x' is given twice"):
        plan_buckets([("x", torch.ones(1)), ("x", torch.ones(1))], 100)
    with pytest.raises(TypeError, match="dtype torch.complex64 cannot be sent"):
        plan_buckets([("x", torch.ones(1, dtype=torch.complex64))], 100)


def test_copy_into_is_exact_for_every_kind_of_pair():
    """The memmove path (CPU, one dtype, contiguous; a parameter that requires grad included)
    and the cases that must fall back to ``copy_`` (a cast, a strided source)."""
    src = torch.randn(64, 48).to(torch.bfloat16)
    dst = torch.zeros(64, 48, dtype=torch.bfloat16)
    assert copy_into(dst, src) is dst and torch.equal(dst, src)
    wide = torch.zeros(64, 48)
    copy_into(wide, src)
    assert torch.equal(wide, src.float())
    strided = torch.randn(48, 64).t()
    out = torch.zeros(64, 48)
    copy_into(out, strided)
    assert torch.equal(out, strided)
    param = torch.nn.Parameter(torch.zeros(64, 48, dtype=torch.bfloat16))
    with torch.no_grad():
        copy_into(param, src)
    assert torch.equal(param.detach(), src)
    empty = torch.zeros(0, 3)
    assert copy_into(empty, torch.zeros(0, 3)) is empty


@pytest.mark.parametrize("planes", [("shm",), ("tcp",), ("ipc",), ("shm", "tcp")])
def test_every_receiver_gets_the_exact_weights(ctx, planes):
    modules = [Layers() for _ in planes]
    named = new_weights(modules[0], 1)
    named[0] = (named[0][0], torch.randn(64, 64).t())  # not contiguous: each plane lays it out
    sender = WeightSender(ctx, bucket_bytes=50_000)
    try:
        sync = uuid.uuid4().hex
        out: dict = {}
        threads = [run_receiver(ctx, {**spec_for(sender, 3, p), "sync": sync}, ModuleLoader(m), out, f"r{i}")
                   for i, (p, m) in enumerate(zip(planes, modules))]
        report = sender.send(named, 3, receivers=len(planes), sync=sync)
        for t in threads:
            t.join(10)
    finally:
        sender.close()
    assert report.buckets == 6 and report.receivers == len(planes)
    for i, m in enumerate(modules):
        assert out[f"r{i}"]["tensors"] == len(named)
        got = dict(m.named_parameters())
        assert all(torch.equal(got[n], t) for n, t in named)


def test_a_version_exported_into_the_senders_buffers_is_sent_without_a_copy(ctx, monkeypatch):
    """Once a version was sent, ``export_buffers`` gives shared-memory tensors in its layout; a
    version written into them goes out as it lies (shm: no copy into the slots, at any bucket
    size), a tensor from elsewhere is copied with its bucket only, and tcp receivers read them
    like any tensors."""
    from psrl.engines.weight_transfer import planes

    packed: list[int] = []
    pack_into = planes.pack_into
    monkeypatch.setattr(planes, "pack_into", lambda buf, plan, tensors: (packed.append(plan.index), pack_into(buf, plan, tensors)))
    module, other = Layers(), Layers()
    sender = WeightSender(ctx, bucket_bytes=50_000)

    def sync(named, version: int, planes_: tuple[str, ...] = ("shm",)) -> None:
        sync_id, out = uuid.uuid4().hex, {}
        threads = [run_receiver(ctx, {**spec_for(sender, version, p), "sync": sync_id}, ModuleLoader(m), out, f"r{i}")
                   for i, (p, m) in enumerate(zip(planes_, (module, other)))]
        sender.send(named, version, receivers=len(planes_), sync=sync_id)
        for t in threads:
            t.join(10)
        for i, m in enumerate((module, other)[: len(planes_)]):
            assert out[f"r{i}"]["tensors"] == len(named), out
            got = dict(m.named_parameters())
            assert all(torch.equal(got[n], t) for n, t in named)

    try:
        assert sender.export_buffers() is None  # nothing sent yet: no layout to give
        sync(new_weights(module, 1), 1)
        assert packed == [0, 1, 2, 3, 4, 5]  # the first version is copied into the slots
        buffers = sender.export_buffers()
        assert set(buffers) == {n for n, _ in module.named_parameters()}
        assert all(buffers[n].shape == p.shape and buffers[n].dtype == p.dtype for n, p in module.named_parameters())
        packed.clear()
        sync([(n, buffers[n].copy_(t)) for n, t in new_weights(module, 2)], 2, ("shm", "tcp"))
        assert packed == []
        sender.bucket_bytes = 120_000  # other bucket bounds: each bucket is still one range of the file
        sync([(n, buffers[n].copy_(t)) for n, t in new_weights(module, 3)], 3)
        assert packed == []
        assert all(sender.export_buffers()[n] is t for n, t in buffers.items())  # same layout, same tensors
        sender.bucket_bytes = 50_000
        named = [(n, buffers[n].copy_(t)) for n, t in new_weights(module, 4)]
        named[7] = (named[7][0], named[7][1].clone())  # layer 2, not in the buffers: its bucket is copied
        sync(named, 4)
        assert packed == [2]
        sync(new_weights(module, 5), 5, ("tcp",))
        assert sender.export_buffers() is None  # no receiver read shared memory: nothing to gain
    finally:
        sender.close()


def test_a_full_dev_shm_fails_the_bucket_by_name_and_exports_go_to_memory_of_their_own(ctx, monkeypatch):
    """Writing past a full tmpfs would kill the trainer with SIGBUS: a slot file that does not
    fit fails its bucket with a clear error instead, and export buffers that do not fit are not
    made (the export then allocates, as before the first version)."""
    from psrl.engines.weight_transfer import planes

    module = Layers()
    sender = WeightSender(ctx, bucket_bytes=50_000)
    try:
        out: dict = {}
        spec = spec_for(sender, 1, "shm")
        t = run_receiver(ctx, spec, ModuleLoader(module), out)
        sender.send(new_weights(module, 1), 1, receivers=1, sync=spec["sync"])  # fits
        t.join(10)
        monkeypatch.setattr(planes, "free_bytes", lambda path: 1000)
        assert sender.export_buffers() is None
        sender.planes["shm"].close()  # the slots must be made again: no room now
        spec = spec_for(sender, 2, "shm")
        t = run_receiver(ctx, spec, ModuleLoader(module), out)
        with pytest.raises(WeightTransferError, match=r"bucket 0 \(3 tensors: model.layers.0.a.weight .. model.layers.0.b.bias\): .* has 0.0 MiB free; the weight transfer needs 0.1 MiB"):
            sender.send(new_weights(module, 2), 2, receivers=1, sync=spec["sync"])
        t.join(10)
        assert isinstance(out["r"], WeightTransferError) and "aborted" in str(out["r"])
    finally:
        sender.close()


class SettlingShmReader(ShmReader):
    """The shm plane with a ``settle`` (as the CUDA IPC reader has): notes, at each call, how
    many tensors the loader had taken and how many buckets had been read."""

    def __init__(self, loaded: list) -> None:
        super().__init__()
        self.loaded, self.reads, self.settled = loaded, 0, []

    def read(self, header, plan, frames):
        self.reads += 1
        for name, t in super().read(header, plan, frames):
            yield name, t
            self.loaded.append(name)

    def settle(self) -> None:
        self.settled.append((self.reads, len(self.loaded)))


def test_a_reader_settles_each_bucket_after_the_loader_took_it_and_before_the_next(ctx):
    module = Layers(n=6)
    named = new_weights(module, 4)
    reader = SettlingShmReader([])
    sender = WeightSender(ctx, bucket_bytes=50_000)
    try:
        spec = spec_for(sender, 1, "shm")
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(r=receive(ctx, spec, ModuleLoader(module), {"shm": reader}, name="r")))
        t.start()
        report = sender.send(named, 1, receivers=1, sync=spec["sync"])
        t.join(10)
    finally:
        sender.close()
    assert report.buckets == 6 and out["r"]["tensors"] == len(named)
    # One settle per bucket (one layer each here: a.weight, b.weight, b.bias), once the loader
    # took all of that bucket's tensors and before the next bucket is read.
    assert reader.settled == [(i + 1, 3 * (i + 1)) for i in range(6)]


class RecordingLoader(ModuleLoader):
    """Slow loads; notes, while each bucket loads, how many buckets the sender has staged."""

    def __init__(self, module, sender: WeightSender, **kw) -> None:
        super().__init__(module, **kw)
        self.staged_at_load: list[int] = []
        self.sender = sender

    def load(self, stream):
        def slow():
            last = None
            for name, t in stream:
                layer = name.split(".")[2]
                if layer != last and int(layer) % 2 == 0:  # two layers per bucket: a new bucket
                    time.sleep(0.1)  # loading: the sender has time to stage what the window allows
                    self.staged_at_load.append(self.sender.planes["shm"].staged)
                last = layer
                yield name, t

        return super().load(slow())


def test_next_bucket_is_staged_while_the_last_loads_and_never_more_than_the_window(ctx):
    module = Layers(n=8)
    sender = WeightSender(ctx, bucket_bytes=70_000, window=2)
    shm = sender.planes["shm"]
    shm.staged = 0
    stage = shm.stage

    def counting_stage(*args):
        shm.staged += 1
        return stage(*args)

    shm.stage = counting_stage
    loader = RecordingLoader(module, sender)
    try:
        spec = spec_for(sender, 1, "shm")
        out: dict = {}
        t = run_receiver(ctx, spec, loader, out)
        report = sender.send(new_weights(module, 2), 1, receivers=1, sync=spec["sync"])
        t.join(10)
    finally:
        sender.close()
    assert report.buckets == 4 and out["r"]["buckets"] == 4
    # While bucket i loads, bucket i+1 is already staged (pipelined) but not i+2 (window 2).
    assert loader.staged_at_load == [2, 3, 4, 4]


def join_group(n_receivers: int):
    """A gloo broadcast group: the sender's plane (rank 0) and one reader per receiver."""
    from psrl.engines.weight_transfer.collective import CollectivePlane, CollectiveReader
    from psrl.trainer.distributed import free_port

    rendezvous = {"host": "127.0.0.1", "port": free_port(), "world": 1 + n_receivers, "backend": "gloo", "timeout_s": 20}
    readers: dict = {}
    threads = [threading.Thread(target=lambda r=r: readers.update({r: CollectiveReader.join(rendezvous, r, torch.device("cpu"))}))
               for r in range(1, n_receivers + 1)]
    for t in threads:
        t.start()
    plane = CollectivePlane.join(rendezvous)
    for t in threads:
        t.join(20)
    return plane, [readers[r] for r in range(1, n_receivers + 1)]


def test_collective_plane_broadcasts_each_bucket_to_every_worker(ctx):
    """The GPU path's logic on gloo (NCCL itself needs a GPU per member: not run here)."""
    plane, readers = join_group(2)
    modules = [Layers(), Layers()]
    sender = WeightSender(ctx, bucket_bytes=70_000)
    sender.add_plane(plane)
    named = new_weights(modules[0], 6)
    try:
        sync = uuid.uuid4().hex
        out: dict = {}
        threads = []
        for i, (m, reader) in enumerate(zip(modules, readers)):
            spec = {**spec_for(sender, 7, "collective"), "sync": sync}

            def target(spec=spec, m=m, reader=reader, name=f"r{i}"):
                out[name] = receive(ctx, spec, ModuleLoader(m), {"collective": reader}, name=name)

            threads.append(threading.Thread(target=target))
            threads[-1].start()
        report = sender.send(named, 7, receivers=2, sync=sync)
        for t in threads:
            t.join(20)
        assert report.buckets == 3 and [out[f"r{i}"]["buckets"] for i in range(2)] == [3, 3]
        for m in modules:
            got = dict(m.named_parameters())
            assert all(torch.equal(got[n], t) for n, t in named)

        # One worker refuses bucket 1; the other keeps taking part in the broadcasts until the
        # sender aborts, so nobody hangs, and both report the bucket.
        sync = uuid.uuid4().hex
        out = {}

        class FailsInBucket1(ModuleLoader):
            def load(self, stream):
                def check():
                    for name, t in stream:
                        if name == "model.layers.3.a.weight":
                            raise OSError("worker out of memory")
                        yield name, t

                return super().load(check())

        def target2(m, reader, name):
            loader = FailsInBucket1(m) if name == "r0" else ModuleLoader(m)
            try:
                receive(ctx, {**spec_for(sender, 8, "collective"), "sync": sync}, loader, {"collective": reader}, name=name)
            except WeightTransferError as exc:
                out[name] = exc

        threads = [threading.Thread(target=target2, args=(m, r, f"r{i}")) for i, (m, r) in enumerate(zip(modules, readers))]
        for t in threads:
            t.start()
        with pytest.raises(WeightTransferError, match="bucket 1"):
            sender.send(new_weights(modules[0], 7), 8, receivers=2, sync=sync)
        for t in threads:
            t.join(20)
        assert not any(t.is_alive() for t in threads)
        assert out["r0"].bucket == 1 and "OSError: worker out of memory" in str(out["r0"])
        assert "the sender aborted" in str(out["r1"]) and "bucket 1" in str(out["r1"]), out["r1"]
    finally:
        sender.close()


class ManySmall(torch.nn.Module):
    """``n`` layers of three tiny tensors each: a bucket of thousands of tensors."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4, bias=False), "b": torch.nn.Linear(4, 4)}) for _ in range(n)
        )


@pytest.mark.parametrize("plane", ["tcp", "ipc"])
def test_streamed_frames_arrive_whole_when_a_bucket_holds_more_tensors_than_zeromqs_default_queue(ctx, plane):
    """tcp and ipc send each tensor as a message of its own; a bucket of 4,500 tensors queued
    behind a slow loader (more than ZeroMQ's default limit of 1,000 messages, past which a
    ROUTER drops) still arrives exactly."""
    module = ManySmall(1500)
    named = new_weights(module, 5)
    assert len(named) == 4500

    class SlowStart(ModuleLoader):
        def load(self, stream):
            def slow():
                for i, item in enumerate(stream):
                    if i == 0:
                        time.sleep(0.5)  # the sender has queued the whole bucket meanwhile
                    yield item

            return super().load(slow())

    sender = WeightSender(ctx, bucket_bytes=1 << 30)
    try:
        spec = spec_for(sender, 1, plane)
        out: dict = {}
        t = run_receiver(ctx, spec, SlowStart(module), out)
        report = sender.send(named, 1, receivers=1, sync=spec["sync"])
        t.join(20)
    finally:
        sender.close()
    assert report.buckets == 1 and out["r"]["tensors"] == 4500
    got = dict(module.named_parameters())
    assert all(torch.equal(got[n], w) for n, w in named)


def test_the_tcp_reader_hands_out_each_tensor_as_its_frame_comes():
    """The loader gets a bucket's first tensor before the second frame is taken: with frames
    that stream in, loading starts before the whole bucket arrived."""
    from psrl.engines.weight_transfer.planes import TcpReader

    named = [(f"t{i}", torch.full((3,), float(i))) for i in range(3)]
    plan = plan_buckets(named, 1 << 20)[0]
    taken = []

    def frames():
        for i, (_, t) in enumerate(named):
            taken.append(i)
            yield t.numpy().tobytes()

    tensors = TcpReader().read({"frames": 3}, plan, frames())
    name, first = next(tensors)
    assert (name, first.tolist(), taken) == ("t0", [0.0, 0.0, 0.0], [0])
    assert [n for n, _ in tensors] == ["t1", "t2"] and taken == [0, 1, 2]
    with pytest.raises(ValueError, match="2 data frames for 3 tensors"):
        list(TcpReader().read({"frames": 2}, plan, frames()))
    with pytest.raises(ValueError, match="ended before 't2'"):
        list(TcpReader().read({"frames": 3}, plan, iter([t.numpy().tobytes() for _, t in named[:2]])))
