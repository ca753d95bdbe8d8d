"""The pipeline's ``GroupQueue`` over the ZeroMQ transfer queue.

Groups are put whole; the trainer asks for ``KVBatchMeta`` with the GRPO-group sampler, fetches
only the columns it needs, and the consumed samples are cleared. Admission is the controller's
``StalenessManager`` (``acquire_rollouts`` / ``finish_rollouts``), so rollout workers in other
processes share one bound. The queue is run with ``on_stale='refill'`` so that every eviction
is reported (``take_refills``); whether a row is generated again is the scheduler's choice.
"""

from __future__ import annotations

from collections.abc import Sequence

from psrl.config import TransferQueueConfig
from psrl.trajectory import TOKEN_FIELDS, Trajectory, to_arrow
from psrl.transfer_queue import TRAJECTORY_FIELDS, KVBatchMeta, TransferQueue
from psrl.transfer_queue.samplers import GRPOGroupSampler

from .protocols import TakenBatch


def queue_config(base: TransferQueueConfig, *, eta: int, samples_per_step: int) -> TransferQueueConfig:
    """The transfer-queue config a pipeline run needs: its mode's eta and batch size."""
    return base.model_copy(update={"max_staleness": eta, "admission_batch_size": samples_per_step, "on_stale": "refill"})


class TransferQueueGroups:
    def __init__(self, client: TransferQueue, *, samples_per_step: int) -> None:
        self.client = client
        self.samples_per_step = samples_per_step

    async def acquire(self, n: int) -> None:
        granted = await self.client.acquire_rollouts(n)
        if granted < n:
            await self.client.finish_rollouts(0, granted)
            raise RuntimeError(
                f"admission granted {granted} of a group's {n} rollouts: the samples per step "
                f"({self.samples_per_step}) must be a multiple of the group size"
            )

    async def finish(self, n: int, *, accepted: bool) -> None:
        await self.client.finish_rollouts(n if accepted else 0, 0 if accepted else n)

    async def put_group(self, trajectories: Sequence[Trajectory], *, partition: str) -> None:
        await self.client.batch_put(list(trajectories), partition=partition)

    async def take(
        self, *, partition: str, n_groups: int, group_size: int, consumer: str, fields: Sequence[str]
    ) -> TakenBatch:
        fields = [f for f in fields if f != "key"]
        if n_groups == 0:
            return TakenBatch(to_arrow([], ["key", *fields]), [], [])
        meta, batch = await self.client.get_batch(
            partition, n_groups * group_size, fields, consumer=consumer, sampler=GRPOGroupSampler(group_size=group_size)
        )
        gids = list(dict.fromkeys(meta.group_ids))
        if any(f in TOKEN_FIELDS for f in fields):
            await self.client.clear(partition, keys=meta.keys)
            return TakenBatch(batch, gids, list(meta.keys), meta)

        async def release() -> None:  # the token data is fetched by meta elsewhere (trainer ranks)
            await self.client.clear(partition, keys=meta.keys)

        return TakenBatch(batch, gids, list(meta.keys), meta, release)

    async def set_version(self, version: int) -> None:
        await self.client.set_version(version)

    async def take_evicted(self) -> list[str]:
        return [r.group_id for r in await self.client.take_refills() if r.partition == "train"]

    async def queued(self, partition: str) -> TakenBatch:
        # The listing, not get_meta: a snapshot must not count as a consumer having taken them.
        infos = [i for i in await self.client.list(partition) if i.ready_fields]
        meta = KVBatchMeta(
            partition=partition, consumer="checkpoint", fields=list(TRAJECTORY_FIELDS), keys=[i.key for i in infos],
            group_ids=[i.group_id for i in infos], seq_lens=[0] * len(infos), min_versions=[0] * len(infos),
            units=[i.unit for i in infos], tags=[{} for _ in infos],
        )
        batch = await self.client.get_data(meta, TRAJECTORY_FIELDS) if infos else to_arrow([])
        return TakenBatch(batch, list(dict.fromkeys(meta.group_ids)), list(meta.keys))

    async def resume_at(self, version: int) -> None:
        # A fresh controller counts nothing as accepted; admit and accept the samples of the
        # ``version`` steps already trained so that capacity is what it was at the checkpoint.
        await self.client.set_version(version)
        owed = version * self.samples_per_step
        while owed > 0:
            granted = await self.client.acquire_rollouts(owed)
            await self.client.finish_rollouts(granted, 0)
            owed -= granted
