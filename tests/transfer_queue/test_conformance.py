"""The conformance suite over every transport, on asyncio and trio."""

import pytest

from psrl.testing.conformance_queue import check_transfer_queue

from .conftest import queue_factory


@pytest.mark.anyio
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["inproc", "ipc", "tcp"])
async def test_conformance_services_in_process(transport, anyio_backend):
    await check_transfer_queue(queue_factory(transport))


@pytest.mark.anyio
@pytest.mark.timeout(180)
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_conformance_services_in_their_own_processes(anyio_backend):
    await check_transfer_queue(queue_factory("ipc", in_process=False), timeout_s=170)


@pytest.mark.anyio
@pytest.mark.timeout(120)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_conformance_tcp_with_curve(anyio_backend):
    await check_transfer_queue(queue_factory("tcp", curve_auth=True, units=1))
