"""Checkpoint/restore across a restart of every service process: nothing repeated or skipped."""

import anyio
import pytest

from psrl.config import TransferQueueConfig
from psrl.testing.conformance_queue import make_trajectory
from psrl.transfer_queue import start_transfer_queue


@pytest.mark.anyio
@pytest.mark.timeout(90)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_restart_resumes_consumption_exactly(tmp_path, anyio_backend):
    cfg = TransferQueueConfig(transport="ipc", storage_units=2, request_timeout_s=10, wait_slice_s=0.5)
    trajs = [make_trajectory(f"k{i}", f"g{i // 4}", length=5 + i, version=2, reward=i) for i in range(16)]
    async with start_transfer_queue(cfg) as handle, handle.connect() as q:
        await q.batch_put(trajs[:8])
        await q.batch_put(trajs[8:])
        await q.set_version(3)
        first = await q.get_meta("train", 8, consumer="trainer")
        await q.checkpoint(str(tmp_path / "step-1"), with_data=True)
        # Taken after the checkpoint: a trainer that crashes now must see these again.
        lost = await q.get_meta("train", 4, consumer="trainer")
        old_pids = set(handle.pids.values())
    async with start_transfer_queue(cfg, restore_from=str(tmp_path / "step-1")) as handle, handle.connect() as q:
        assert not old_pids & set(handle.pids.values())
        stats = await q.statistics()
        assert stats.version == 3 and stats.samples == 16
        rest = await q.get_meta("train", 8, consumer="trainer")
        assert sorted(rest.keys) == sorted({t.key for t in trajs} - set(first.keys))
        assert set(lost.keys) <= set(rest.keys)
        with anyio.move_on_after(0.5):
            extra = await q.get_meta("train", 1, consumer="trainer")
            raise AssertionError(f"a sample was handed out twice: {extra.keys}")
        back = {t.key: t for t in await q.get_trajectories(rest)}
        for t in trajs:
            if t.key in back:
                assert back[t.key].reward == t.reward and (back[t.key].response_ids == t.response_ids).all()


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_metadata_only_restore_into_empty_units_names_missing_keys(tmp_path, anyio_backend):
    cfg = TransferQueueConfig(transport="inproc", storage_units=1, request_timeout_s=5, wait_slice_s=0.5)
    async with start_transfer_queue(cfg) as handle, handle.connect() as q:
        await q.batch_put([make_trajectory(f"m{i}", "g") for i in range(3)])
        await q.checkpoint(str(tmp_path / "meta"), with_data=False)
    async with start_transfer_queue(cfg, restore_from=str(tmp_path / "meta")) as handle, handle.connect() as q:
        meta = await q.get_meta("train", 3)
        with pytest.raises(KeyError, match="'m0'"):
            await q.get_data(meta, ["response_ids"])
