"""The conformance suite over every transport, on asyncio and trio."""

import pytest

from psrl.testing.conformance_queue import check_transfer_queue

from .conftest import queue_factory


@pytest.mark.anyio
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["inproc", "ipc", "tcp"])
@pytest.mark.parametrize("units", [1, 2])  # 1: the controller holds the unit (one-round-trip put and get_batch)
async def test_conformance_services_in_process(transport, units, anyio_backend):
    await check_transfer_queue(queue_factory(transport, units=units))


@pytest.mark.anyio
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("units", "anyio_backend"), [(1, "asyncio"), (2, "trio")])
async def test_conformance_services_in_their_own_processes(units, anyio_backend):
    await check_transfer_queue(queue_factory("ipc", in_process=False, units=units), timeout_s=170)


@pytest.mark.anyio
@pytest.mark.timeout(120)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_conformance_tcp_with_curve(anyio_backend):
    await check_transfer_queue(queue_factory("tcp", curve_auth=True, units=1))
