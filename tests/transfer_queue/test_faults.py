"""Dead, hung and unauthorised peers give clear errors within a timeout, never a hang."""

import os
import signal
import time

import anyio
import pytest
import zmq

from psrl.config import TransferQueueConfig
from psrl.testing.conformance_queue import make_trajectory
from psrl.transfer_queue import (
    ControllerUnavailable, CurveKeys, StorageUnitUnavailable, TransferQueueClient, start_transfer_queue,
)
from psrl.transfer_queue.errors import RemoteError

TIMEOUT_S = 2.0


def _cfg(**kw) -> TransferQueueConfig:
    return TransferQueueConfig(**{"storage_units": 2, "request_timeout_s": TIMEOUT_S, "wait_slice_s": 0.5, **kw})


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_killed_storage_unit_names_itself_and_the_keys(anyio_backend):
    async with start_transfer_queue(_cfg(transport="tcp")) as handle, handle.connect() as q:
        await q.batch_put([make_trajectory(f"a{i}", "a") for i in range(4)])  # -> unit 0
        await q.batch_put([make_trajectory(f"b{i}", "b") for i in range(4)])  # -> unit 1
        meta = await q.get_meta("train", 8)
        assert set(meta.units) == {0, 1}
        os.kill(handle.pids["storage unit 1"], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(StorageUnitUnavailable) as err:
            await q.get_data(meta, ["response_ids"])
        assert time.monotonic() - start < TIMEOUT_S + 1.5
        msg = str(err.value)
        assert "storage unit 1" in msg and "'b0'" in msg and "'a0'" not in msg, msg
        assert err.value.keys == [f"b{i}" for i in range(4)]
        # The live unit still serves its samples.
        data = await q.get_data(meta.select([i for i, u in enumerate(meta.units) if u == 0]), ["reward"])
        assert data.column("key").to_pylist() == [f"a{i}" for i in range(4)]
        # A put routed to the dead unit fails the same way and leaves no reservation behind.
        await q.clear(keys=[f"a{i}" for i in range(4)])  # unit 0 becomes the less loaded... so load unit 1
        with pytest.raises(StorageUnitUnavailable):
            for i in range(3):
                await q.batch_put([make_trajectory(f"c{i}-{j}", "c") for j in range(4)])
        with anyio.fail_after(5):
            while any(s.key.startswith("c") and not s.ready_fields for s in await q.list()):
                await anyio.sleep(0.05)


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.parametrize("units", [1, 2])  # 1: the controller's process holds the unit
async def test_killed_controller_is_reported_not_awaited_forever(units, anyio_backend):
    async with start_transfer_queue(_cfg(transport="ipc", storage_units=units)) as handle, handle.connect() as q:
        await q.put(make_trajectory("k0", "g"))
        os.kill(handle.pids["controller"], signal.SIGKILL)
        for wait in (lambda: q.get_meta("train", 4), lambda: q.get_batch("train", 4)):
            start = time.monotonic()
            with pytest.raises(ControllerUnavailable) as err:
                await wait()  # would wait for a batch; must notice the death
            assert time.monotonic() - start < 0.5 + TIMEOUT_S + 1.5
            assert "controller" in str(err.value)
        with pytest.raises(ControllerUnavailable) as err:
            await q.put(make_trajectory("k1", "g"))
        assert "'k1'" in str(err.value)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_put_whose_columns_cannot_be_read_is_refused_and_reserves_nothing(anyio_backend):
    """A one-round-trip put whose frames do not match its spec (a broken or hostile client) gets
    an error, and the keys it reserved are released: the queue holds what it held before."""
    from psrl.transfer_queue.messages import BatchSpec, ColumnSpec, Put, SampleUpdate

    async with start_transfer_queue(_cfg(transport="inproc", storage_units=1)) as handle, handle.connect() as q:
        await q.put(make_trajectory("k0", "g"))
        spec = BatchSpec(1, ["response_ids"], [ColumnSpec("response_ids", "int32", 0, 1)])
        with pytest.raises(RemoteError, match="controller: ValueError: .* name buffer frame 1, but the message carries 0"):
            await q._controller.call(Put("train", ["bad0"], ["response_ids"], SampleUpdate(), spec, 0.0), (), keys=["bad0"])
        assert [s.key for s in await q.list()] == ["k0"]
        assert (await q.statistics()).samples == 1


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_service_that_never_answers(anyio_backend):
    ctx = zmq.Context()
    mute = ctx.socket(zmq.ROUTER)
    mute.setsockopt(zmq.LINGER, 0)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(ControllerUnavailable, match="did not answer"):
            async with TransferQueueClient.connect(ctx, f"tcp://127.0.0.1:{port}", request_timeout_s=0.5):
                pass
    finally:
        mute.close(linger=0)
        ctx.term()


@pytest.mark.anyio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_curve_refuses_clients_without_the_key(anyio_backend):
    cfg = _cfg(transport="tcp", curve_auth=True, in_process=True, storage_units=1)
    async with start_transfer_queue(cfg) as handle:
        async with handle.connect() as q:  # the right keys
            await q.put(make_trajectory("s0", "g"))
        wrong = CurveKeys.generate()
        impostor = CurveKeys(handle.curve.server_public, b"", wrong.client_public, wrong.client_secret)
        for curve in (impostor, None):
            with pytest.raises(ControllerUnavailable):
                async with TransferQueueClient.connect(
                    handle.context, handle.controller_endpoint, curve=curve, request_timeout_s=0.5
                ):
                    pass


def test_inproc_and_curve_misconfigurations_are_refused():
    async def main(cfg):
        async with start_transfer_queue(cfg):
            pass

    with pytest.raises(ValueError, match="inproc"):
        anyio.run(main, TransferQueueConfig(transport="inproc", in_process=False))
    with pytest.raises(ValueError, match="curve_auth"):
        anyio.run(main, TransferQueueConfig(transport="ipc", curve_auth=True))
