"""Real processes: 64 producers in one process, 4 consumers in another, the services in their own
(with one storage unit, the controller's process holds it: one service process)."""

import multiprocessing

import anyio
import pytest

from psrl.config import TransferQueueConfig
from psrl.transfer_queue import start_transfer_queue

from .workers import produce

PRODUCERS, PER_PRODUCER, CONSUMERS, BATCH = 64, 8, 4, 8


@pytest.mark.anyio
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("transport", "units", "anyio_backend"), [("ipc", 2, "asyncio"), ("tcp", 2, "trio"), ("ipc", 1, "trio")])
async def test_64_producers_4_consumers_count_every_key(transport, units, anyio_backend):
    cfg = TransferQueueConfig(
        transport=transport, storage_units=units, capacity_samples=128, request_timeout_s=10, wait_slice_s=0.5
    )
    total = PRODUCERS * PER_PRODUCER
    seen: list[str] = []
    critic_seen: list[str] = []
    cleared: list[None] = []
    async with start_transfer_queue(cfg) as handle:
        services = {"controller", "storage unit 0", "storage unit 1"} if units == 2 else {"controller"}
        assert set(handle.pids) == services
        proc = multiprocessing.get_context("spawn").Process(
            target=produce, args=(handle, PRODUCERS, PER_PRODUCER, "trio"), daemon=True
        )
        proc.start()
        try:
            async with handle.connect() as q:

                async def consume() -> None:
                    while True:
                        meta, data = await q.get_batch("train", BATCH, ["response_ids", "reward"], consumer="trainer")
                        for key, reward, ids in zip(
                            data.column("key").to_pylist(), data.column("reward").to_pylist(),
                            data.column("response_ids").to_pylist(), strict=True,
                        ):
                            p, i = map(int, key[1:].split("-"))
                            assert reward == p * 1000 + i, f"{key}: reward {reward}"
                            assert len(ids) == 8 + (p + i) % 13, f"{key}: {len(ids)} tokens"
                        seen.extend(meta.keys)
                        # The capacity (128) is far below the 512 samples: consumed ones must go.
                        critic = await q.get_meta("train", len(meta), ["response_ids"], consumer="critic", partial=True)
                        critic_seen.extend(critic.keys)
                        cleared.extend(await q.clear(keys=meta.keys) * [None])
                        if len(cleared) >= total:
                            tg.cancel_scope.cancel()

                with anyio.fail_after(100):
                    async with anyio.create_task_group() as tg:
                        for _ in range(CONSUMERS):
                            tg.start_soon(consume)
                stats = await q.statistics()
        finally:
            await anyio.to_thread.run_sync(proc.join, 30)
            if proc.is_alive():
                proc.kill()
        assert proc.exitcode == 0, f"producer process exited with {proc.exitcode}"
    expected = {f"p{p}-{i}" for p in range(PRODUCERS) for i in range(PER_PRODUCER)}
    assert len(seen) == len(set(seen)), f"{len(seen) - len(set(seen))} keys handed out twice"
    assert set(seen) == expected, f"lost {sorted(expected - set(seen))[:10]}"
    assert len(critic_seen) == len(set(critic_seen)) and set(critic_seen) <= expected
    assert stats.samples == 0
