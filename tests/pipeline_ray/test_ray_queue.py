"""``launcher=ray``'s transfer queue: the controller and storage units as Ray actors on a private
local cluster, ZeroMQ tcp on loopback with CURVE, reached by a plain client in the driver. Real
Ray, real sockets: the whole queue conformance suite runs against it."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

import anyio
import psutil
import pytest
import zmq

from psrl.config import TransferQueueConfig
from psrl.config.schema import ActorResources, RayConfig
from psrl.pipeline.ray.common import RayLaunchError, ray_cluster, resolve
from psrl.pipeline.ray.queue_actors import start_ray_transfer_queue
from psrl.testing.conformance_queue import check_transfer_queue, make_trajectory
from psrl.transfer_queue import ControllerUnavailable, CurveKeys, TransferQueueClient

RAY = RayConfig(address="local", num_cpus=2, queue=ActorResources(num_cpus=0.0))


@pytest.fixture(scope="module")
def ray_local():
    with ray_cluster(RAY):
        yield


def _queue_factory(units: int, **overrides):
    @asynccontextmanager
    async def factory(cfg: TransferQueueConfig):
        cfg = cfg.model_copy(update={"storage_units": units, "request_timeout_s": 10.0, "wait_slice_s": 0.5, **overrides})
        async with start_ray_transfer_queue(cfg, RAY) as handle, handle.connect() as client:
            yield client

    return factory


def actor_processes(class_name: str) -> list[psutil.Process]:
    """This cluster's actor processes of a class (Ray titles them ``ray::Class[.method]``); the
    private cluster's processes all descend from this test process."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            title = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if title.startswith(f"ray::{class_name}"):
            found.append(p)
    return found


def wait_gone(class_name: str, timeout_s: float = 20.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while (left := actor_processes(class_name)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.anyio
@pytest.mark.timeout(240)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_queue_actors_pass_the_conformance_suite_over_tcp_with_curve(ray_local, anyio_backend):
    await check_transfer_queue(_queue_factory(2, curve_auth=True), timeout_s=220)


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_queue_actors_bind_loopback_tcp_refuse_strangers_and_are_gone_after(ray_local, anyio_backend):
    cfg = TransferQueueConfig(storage_units=2, curve_auth=True, request_timeout_s=5.0, wait_slice_s=0.5)
    with anyio.fail_after(100):
        async with start_ray_transfer_queue(cfg, RAY) as handle:
            assert handle.controller_endpoint.startswith("tcp://127.0.0.1:")
            assert all(ep.startswith("tcp://127.0.0.1:") for ep in handle.unit_endpoints) and len(handle.unit_endpoints) == 2
            assert len(actor_processes("QueueServiceActor")) == 3  # services live in actor processes
            async with handle.connect() as q:
                await q.batch_put([make_trajectory(f"k{i}", "g0") for i in range(4)], partition="train")
                meta = await q.get_meta("train", 4, ["response_ids", "reward"], consumer="trainer")
                batch = await q.get_data(meta, ["response_ids"])
                assert sorted(meta.keys) == [f"k{i}" for i in range(4)]
                assert batch.column("response_ids").to_pylist()[0] == make_trajectory(meta.keys[0], "g0").response_ids.tolist()
            wrong = CurveKeys.generate()
            impostor = CurveKeys(handle.curve.server_public, b"", wrong.client_public, wrong.client_secret)
            ctx = zmq.Context()
            try:
                for curve in (impostor, None):
                    with pytest.raises(ControllerUnavailable):
                        async with TransferQueueClient.connect(ctx, handle.controller_endpoint, curve=curve, request_timeout_s=0.5):
                            pass
            finally:
                ctx.destroy(linger=0)
    # Every actor the queue started is dead once its block has ended.
    assert wait_gone("QueueServiceActor") == []


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_queue_that_cannot_be_placed_fails_naming_what_it_asked_for(ray_local, anyio_backend):
    greedy = RAY.model_copy(update={"queue": ActorResources(num_cpus=64.0), "actor_start_timeout_s": 2.0})
    with anyio.fail_after(50):
        with pytest.raises(RayLaunchError, match=r"storage unit 0, storage unit 1 did not start within 2 s .*ray.actor_start_timeout_s"):
            async with start_ray_transfer_queue(TransferQueueConfig(storage_units=2), greedy):
                pass
    assert wait_gone("QueueServiceActor") == []


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_resolve_awaits_ray_results_on_asyncio_and_trio(ray_local, anyio_backend):
    import ray

    from psrl.pipeline.ray.queue_actors import QueueServiceActor

    actor = ray.remote(QueueServiceActor).options(num_cpus=0).remote()
    try:
        with anyio.fail_after(50):
            assert await resolve(actor.failure.remote()) is None
            with pytest.raises(ray.exceptions.RayTaskError, match="failed to start"):
                await resolve(actor.start.remote("unit", TransferQueueConfig().model_dump_json(), "256.0.0.1", 0, None, [], 10.0))
    finally:
        ray.kill(actor)
