"""The async client: what rollout workers and trainer ranks hold.

With one storage unit (the default) the controller's process holds it: a put is one round trip
(``Put``: the columns go with the request; the controller reserves, stores and commits, waiting
while the queue is full) and so is ``get_batch`` (``GetBatch``: the batch's metadata and columns
in one reply). Every message wakes two processes and their I/O threads, which under load is
what limits throughput (``psrl bench queue``).

With more units: ``put`` = reserve keys at the controller (waits while the queue is full) -> send
the columns to the storage unit it named -> commit the fields as a notification (no reply): the
controller handles it before any later request of this client, so the client reads its own
writes. A commit the controller refuses (its keys were cleared or evicted while the put was under
way) is logged there; closing the client first confirms every notification with one round trip,
since a close drops messages not yet sent.

``get_meta`` asks the controller for a batch (metadata only); ``get_data`` fetches just the
wanted columns from the units holding them, in parallel; ``get_batch`` does both. Waiting calls
wait in slices of ``wait_slice_s`` so a dead controller is noticed; bound them with
``anyio.fail_after``. A call given up part way (cancelled, timed out) undoes its effect at the
controller, so no sample is lost or handed out twice; a one-round-trip put the controller
finished before it heard of the cancellation stays done (nothing lost, nothing doubled).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
import contextlib
from contextlib import AsyncExitStack, asynccontextmanager

import anyio
import numpy as np
import pyarrow as pa
import zmq

from psrl.trajectory import FIELD_NAMES, TRAJECTORY_SCHEMA, Trajectory, from_arrow

from .arrow_frames import decode_batch, encode_batch
from .columns import Puttable, Tags, as_batch, sample_update
from .errors import ControllerUnavailable, StorageUnitUnavailable
from .messages import (
    Abort, AcquireRollouts, BatchData, BatchMeta, BatchSpec, Body, Checkpoint, Clear, Commit, Data, FinishRollouts, GetBatch,
    GetMeta, Hello, Listing, ListKeys, NotReady, Ok, Put, Refills, Release, Reserve, Reserved, Restore, Restored,
    SetVersion, Stats, StatsReply, TakeRefills, UnitGet, UnitPut, Welcome,
)
from .meta import KVBatchMeta, QueueStatistics, Refill, RestoreReport, SampleInfo
from .rpc import RpcClient, first_error, open_rpc_client
from .samplers import Sampler, make_sampler
from .zsocket import CurveKeys

TRAJECTORY_FIELDS = tuple(f for f in FIELD_NAMES if f != "key")


class TransferQueueClient:
    """Implements ``TransferQueue``. Make one with ``TransferQueueClient.connect`` or
    ``QueueHandle.connect``; it is safe to share between tasks of one event loop."""

    def __init__(self, controller: RpcClient, units: Sequence[RpcClient], *, wait_slice_s: float, holds_unit: bool = False):
        self._controller = controller
        self._units = list(units)
        self._slice = wait_slice_s
        self._holds_unit = holds_unit  # the controller holds the only unit (``units`` is itself): Put, GetBatch

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        ctx: zmq.Context,
        controller_endpoint: str,
        *,
        curve: CurveKeys | None = None,
        request_timeout_s: float = 30.0,
        wait_slice_s: float = 2.0,
    ) -> AsyncIterator[TransferQueueClient]:
        async with AsyncExitStack() as stack:
            ctl = await stack.enter_async_context(open_rpc_client(
                ctx, controller_endpoint, service="controller", timeout_s=request_timeout_s, curve=curve,
                unavailable=ControllerUnavailable,
            ))
            welcome, _ = await ctl.call(Hello(), what="connect")
            assert isinstance(welcome, Welcome)
            units = [ctl] if welcome.holds_unit else [
                await stack.enter_async_context(open_rpc_client(
                    ctx, ep, service=f"storage unit {i}", timeout_s=request_timeout_s, curve=curve,
                    unavailable=StorageUnitUnavailable,
                ))
                for i, ep in enumerate(welcome.units)
            ]
            try:
                yield cls(ctl, units, wait_slice_s=wait_slice_s, holds_unit=welcome.holds_unit)
            finally:
                if ctl.unconfirmed:  # commits not yet sent would be dropped by the close (linger 0)
                    with anyio.CancelScope(shield=True), anyio.move_on_after(request_timeout_s):
                        with contextlib.suppress(ControllerUnavailable):
                            await ctl.call(Hello(), what="confirm commits")

    @property
    def num_storage_units(self) -> int:
        return len(self._units)

    # ---- put ---------------------------------------------------------------------------------

    async def put(self, trajectory: Trajectory, *, partition: str = "train", tags: Tags = None) -> None:
        await self.batch_put([trajectory], partition=partition, tags=tags)

    async def put_nowait(self, trajectory: Trajectory, *, partition: str = "train", tags: Tags = None) -> None:
        """Like ``put`` but raises ``WouldBlock`` at once when the queue is full."""
        await self.batch_put_nowait([trajectory], partition=partition, tags=tags)

    async def batch_put(self, data: Puttable, *, partition: str = "train", tags: Tags = None) -> None:
        """Store samples or some of their fields (e.g. a reward that arrives later).

        ``data``: trajectories, a record batch/table with a ``key`` column, or a mapping of
        columns including ``key``. Waits while the queue is at capacity.
        """
        await self._put(as_batch(data), partition, tags, wait=True)

    async def batch_put_nowait(self, data: Puttable, *, partition: str = "train", tags: Tags = None) -> None:
        await self._put(as_batch(data), partition, tags, wait=False)

    async def put_fields(self, keys: Sequence[str], fields: dict, *, partition: str = "train") -> None:
        """Set ``fields`` (name -> one value per key) on samples, e.g. ``{"reward": [1.0, 0.0]}``."""
        await self.batch_put({"key": list(keys), **fields}, partition=partition)

    async def _put(self, batch: pa.RecordBatch, partition: str, tags: Tags, *, wait: bool) -> None:
        keys = batch.column("key").to_pylist()
        update = sample_update(batch, tags)
        fields = [n for n in batch.schema.names if n != "key"]
        if self._holds_unit:
            spec, frames = encode_batch(batch.drop_columns(["key"]))
            req = Put(partition, keys, fields, update, spec, 0.0)
            while True:  # the reply is a refusal (raised), Ok, or NotReady after a wait slice
                req.wait_s = self._slice if wait else 0.0
                reply, _ = await self._controller.call(req, frames, keys=keys, wait_s=req.wait_s, what="put")
                if isinstance(reply, Ok):
                    return
        reserved = await self._reserve(partition, keys, wait)
        new = [k for k, n in zip(keys, reserved.new, strict=True) if n]
        try:
            units = np.asarray(reserved.units)
            if (units == units[0]).all():  # the usual case: no task group to start (a put is ~5 messages)
                await self._unit_put(int(units[0]), keys, batch)
            else:
                with first_error():
                    async with anyio.create_task_group() as tg:
                        for u in np.unique(units).tolist():
                            rows = np.flatnonzero(units == u)
                            part = batch.take(pa.array(rows))
                            tg.start_soon(self._unit_put, u, [keys[i] for i in rows.tolist()], part)
        except BaseException:
            if new:  # release the reservations; data already sent is deleted with them
                self._controller.notify(Abort(new))
            raise
        self._controller.notify(Commit(keys, fields, update))

    async def _reserve(self, partition: str, keys: list[str], wait: bool) -> Reserved:
        def undo(reply: Body) -> Body | None:
            if isinstance(reply, Reserved):
                return Abort([k for k, n in zip(keys, reply.new, strict=True) if n])
            return None

        while True:
            slice_s = self._slice if wait else 0.0
            reply, _ = await self._controller.call(
                Reserve(partition, keys, slice_s), keys=keys, wait_s=slice_s, what="reserve a put", on_orphan=undo
            )
            if isinstance(reply, Reserved):
                return reply

    async def _unit_put(self, unit: int, keys: list[str], batch: pa.RecordBatch) -> None:
        spec, frames = encode_batch(batch.drop_columns(["key"]))
        await self._units[unit].call(UnitPut(keys, spec), frames, keys=keys, what="store samples")

    # ---- get ---------------------------------------------------------------------------------

    async def get_meta(
        self,
        partition: str,
        batch_size: int,
        fields: Sequence[str] | None = None,
        consumer: str = "trainer",
        sampler: Sampler | str = "sequential",
        *,
        partial: bool = False,
    ) -> KVBatchMeta:
        """Take a batch for ``consumer``: keys whose ``fields`` (default: all trajectory fields)
        are ready and that ``consumer`` has not taken before. Waits until the sampler can form a
        full batch; with ``partial=True`` returns at once with what is ready (maybe nothing)."""
        reply, _ = await self._take(GetMeta(partition, batch_size, list(fields or TRAJECTORY_FIELDS), consumer,
                                            _sampler(sampler, batch_size), partial, 0.0))
        return reply.meta

    async def get_batch(
        self,
        partition: str,
        batch_size: int,
        fields: Sequence[str] | None = None,
        consumer: str = "trainer",
        sampler: Sampler | str = "sequential",
        *,
        partial: bool = False,
    ) -> tuple[KVBatchMeta, pa.RecordBatch]:
        """``get_meta`` and then ``get_data`` of the same ``fields``; one round trip when the
        controller holds the queue's only storage unit."""
        req = GetMeta(partition, batch_size, list(fields or TRAJECTORY_FIELDS), consumer, _sampler(sampler, batch_size), partial, 0.0)
        if not self._holds_unit:
            reply, _ = await self._take(req)
            return reply.meta, await self.get_data(reply.meta)
        reply, frames = await self._take(GetBatch(req))
        if isinstance(reply, BatchMeta):  # nothing ready (partial)
            return reply.meta, await self.get_data(reply.meta)
        return reply.meta, _decode_rows(reply.meta.keys, reply.batch, frames)

    async def _take(self, body: GetMeta | GetBatch) -> tuple[BatchMeta | BatchData, list]:
        req = body.get if isinstance(body, GetBatch) else body

        def undo(reply: Body) -> Body | None:
            taken = isinstance(reply, BatchMeta | BatchData) and reply.meta.keys
            return Release(req.consumer, reply.meta.keys) if taken else None

        while True:
            req.wait_s = 0.0 if req.partial else self._slice
            reply, frames = await self._controller.call(body, wait_s=req.wait_s, what="get_meta", on_orphan=undo)
            if isinstance(reply, BatchMeta | BatchData):
                return reply, frames
            assert isinstance(reply, NotReady)

    async def get_data(self, meta: KVBatchMeta, fields: Sequence[str] | None = None) -> pa.RecordBatch:
        """Columns ``key`` + ``fields`` (default: ``meta.fields``) of the batch, in ``meta`` order."""
        fields = list(fields or meta.fields)
        if "key" in fields:
            fields.remove("key")
        units = np.asarray(meta.units, np.int64)
        if len(meta) == 0:
            return pa.RecordBatch.from_arrays([pa.array([], pa.string())], names=["key"])
        order = np.unique(units).tolist()
        results: dict[int, pa.RecordBatch] = {}

        async def fetch(u: int, rows: np.ndarray) -> None:
            keys = meta.keys if len(rows) == len(meta.keys) else [meta.keys[i] for i in rows.tolist()]
            reply, frames = await self._units[u].call(UnitGet(keys, fields), keys=keys, what="fetch samples")
            assert isinstance(reply, Data)
            results[u] = _decode_rows(keys, reply.batch, frames)

        if len(order) == 1:  # one unit: no task group to start
            await fetch(order[0], np.arange(len(units)))
            return results[order[0]]
        with first_error():
            async with anyio.create_task_group() as tg:
                for u in order:
                    tg.start_soon(fetch, u, np.flatnonzero(units == u))
        table = pa.concat_tables([pa.Table.from_batches([results[u]]) for u in order], promote_options="permissive")
        grouped = np.concatenate([np.flatnonzero(units == u) for u in order])
        inverse = np.empty_like(grouped)
        inverse[grouped] = np.arange(len(grouped))
        return table.take(pa.array(inverse)).combine_chunks().to_batches()[0]

    async def get_trajectories(self, meta: KVBatchMeta) -> list[Trajectory]:
        return from_arrow(await self.get_data(meta, TRAJECTORY_FIELDS))

    # ---- bookkeeping -------------------------------------------------------------------------

    async def list(self, partition: str | None = None) -> list[SampleInfo]:
        reply, _ = await self._controller.call(ListKeys(partition), what="list")
        assert isinstance(reply, Listing)
        return reply.samples

    async def clear(self, partition: str | None = None, keys: Sequence[str] | None = None) -> int:
        """Remove samples (metadata and data); returns how many were removed."""
        reply, _ = await self._controller.call(Clear(partition, None if keys is None else list(keys)), what="clear")
        assert isinstance(reply, Ok)
        return reply.count

    async def statistics(self) -> QueueStatistics:
        reply, _ = await self._controller.call(Stats(), what="statistics")
        assert isinstance(reply, StatsReply)
        return reply.stats

    # ---- staleness ---------------------------------------------------------------------------

    async def set_version(self, version: int) -> None:
        """The trainer published policy ``version``; samples older than ``version - eta`` go."""
        await self._controller.call(SetVersion(version), what="set_version")

    async def acquire_rollouts(self, n: int) -> int:
        """Admission: wait until at least one of ``n`` rollouts may start; returns how many may
        (they count as running until ``finish_rollouts``)."""
        if n < 1:
            raise ValueError(f"acquire_rollouts needs n >= 1, got {n}")

        def undo(reply: Body) -> Body | None:
            return FinishRollouts(0, reply.count) if isinstance(reply, Ok) and reply.count else None

        while True:
            reply, _ = await self._controller.call(
                AcquireRollouts(n, self._slice), wait_s=self._slice, what="acquire_rollouts", on_orphan=undo
            )
            if isinstance(reply, Ok):
                return reply.count

    async def finish_rollouts(self, accepted: int, rejected: int = 0) -> None:
        await self._controller.call(FinishRollouts(accepted, rejected), what="finish_rollouts")

    async def take_refills(self, max_items: int = 1024) -> list[Refill]:
        reply, _ = await self._controller.call(TakeRefills(max_items), what="take_refills")
        assert isinstance(reply, Refills)
        return reply.items

    # ---- checkpoint --------------------------------------------------------------------------

    async def checkpoint(self, path: str, *, with_data: bool = True) -> int:
        """Write metadata and consumption state (and the data, if asked) under ``path``."""
        reply, _ = await self._controller.call(
            Checkpoint(str(path), with_data), wait_s=self._controller.timeout_s, what="checkpoint"
        )
        assert isinstance(reply, Ok)
        return reply.count

    async def restore(self, path: str) -> RestoreReport:
        """Replace the queue's state with a checkpoint's."""
        reply, _ = await self._controller.call(Restore(str(path)), wait_s=self._controller.timeout_s, what="restore")
        assert isinstance(reply, Restored)
        return reply.report


def _decode_rows(keys: list[str], spec: BatchSpec, frames: list) -> pa.RecordBatch:
    """A unit's reply (no key column: we know which keys we asked for) with the keys in front."""
    return decode_batch(spec, [f.buffer for f in frames], TRAJECTORY_SCHEMA, keys=pa.array(keys, pa.string()))


def _sampler(sampler: Sampler | str, batch_size: int) -> Sampler:
    if isinstance(sampler, str):
        sampler = make_sampler(sampler) if sampler == "sequential" else _named_sampler_error(sampler)
    sampler.check(batch_size)
    return sampler


def _named_sampler_error(name: str) -> Sampler:
    raise ValueError(
        f"sampler {name!r} needs parameters: pass GRPOGroupSampler(group_size=...) or "
        f"SeqLenBalancedSampler(dp_size=...), or make_sampler({name!r}, ...); by name only 'sequential' works"
    )


__all__ = ["TRAJECTORY_FIELDS", "TransferQueueClient"]
