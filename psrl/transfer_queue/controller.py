"""The controller: sample metadata, readiness per field, consumption per consumer, staleness.

It never touches token data. Producers ``Reserve`` keys (this is where capacity backpressure
happens and where each new sample is given a storage unit), send the columns to that unit, then
``Commit`` the fields they sent. Consumers ask ``GetMeta`` for a batch; the sampler picks among
samples whose requested fields are all ready and that this consumer has not taken yet.

With one storage unit (``storage_units=1``, the default) the controller's process holds it: a
``Put`` reserves, stores and commits in one round trip, a ``GetBatch`` answers ``GetMeta`` with
the data, and the unit's own requests come to the controller's socket. That halves the messages
per sample and the processes each byte wakes (``psrl bench queue``). With more units each is a
process of its own and the controller never touches token data.

Requests that may wait (capacity, a batch, admission) wait at most one ``wait_slice_s`` here and
answer ``NotReady``; the client asks again. So a client notices a dead controller within one
slice plus its request timeout, and a server never holds a request for a client that is gone.

The bookkeeping (slots, readiness, consumption, removal, staleness) is ``SampleLedger`` in
``ledger.py``; this file answers the requests, makes them wait, and serves the controller.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from functools import partial
from typing import TypeVar

import anyio
import numpy as np
import zmq

from psrl.config.transfer_queue import TransferQueueConfig

from .checkpoint import load_checkpoint, save_checkpoint
from .errors import StorageUnitUnavailable, WouldBlock
from .ledger import SampleLedger
from .messages import (
    Abort, AcquireRollouts, BatchData, BatchMeta, Body, Checkpoint, Clear, Commit, FinishRollouts, GetBatch,
    GetMeta, Hello, ListKeys, Listing, NotReady, Ok, Put, Refills, Release, Reserve, Restore, Restored,
    SetVersion, Stats, StatsReply, TakeRefills, UnitCount, UnitDelete, UnitDump, UnitGet, UnitLoad, UnitPut,
    Welcome,
)
from .rpc import Reply, RpcClient, RpcServer, open_rpc_client
from .storage import StorageUnit
from .zsocket import CurveKeys

R = TypeVar("R")


class LocalUnit:
    """The storage unit held in the controller's process, called like a remote one."""

    def __init__(self) -> None:
        self.unit = StorageUnit(0)
        self.endpoint = ""  # the controller's, once bound

    async def call(self, body: Body, frames: Sequence = (), **_: object) -> tuple[Body, list]:
        reply, out = self.unit.handle(body, list(frames))
        return reply, list(out)


class Controller(SampleLedger):
    """Request handler; ``run_controller`` puts it behind a socket. ``units``: clients of the
    storage unit processes, or one ``LocalUnit``."""

    def __init__(self, cfg: TransferQueueConfig, units: Sequence[RpcClient | LocalUnit], task_group: anyio.abc.TaskGroup):
        super().__init__(cfg, units, task_group)
        self.local = units[0] if len(units) == 1 and isinstance(units[0], LocalUnit) else None

    # ---- dispatch --------------------------------------------------------------------------

    def handle(self, body: Body, frames: list) -> Reply | Awaitable[Reply]:
        match body:
            case Hello():
                return Welcome([u.endpoint for u in self.units], self.cfg.request_timeout_s, self.local is not None), ()
            case Reserve():
                return self._waiting(lambda: self._reserve(body), body.wait_s, nowait_msg=partial(self._full_msg, body))
            case Put() if self.local is not None:
                store = partial(self._store, body, frames)
                return self._waiting(
                    lambda: self._reserve_slots(body), body.wait_s, nowait_msg=partial(self._full_msg, body), wrap=store
                )
            case GetBatch(get=req) if self.local is not None:
                self._check_get_meta(req)
                return self._waiting(lambda: self._get_meta(req), req.wait_s, wrap=self._with_data)
            case UnitPut() | UnitGet() | UnitDelete() | UnitDump() | UnitLoad() | UnitCount() if self.local is not None:
                return self.local.unit.handle(body, frames)
            case Commit():
                return Ok(self._commit(body)), ()
            case Abort(keys=keys):
                return Ok(self._abort(keys)), ()
            case GetMeta():
                self._check_get_meta(body)
                return self._waiting(lambda: self._get_meta(body), body.wait_s)
            case Release(consumer=consumer, keys=keys):
                slots, _ = self.table.slots_for(keys)
                self.table.consumed_by(consumer)[slots] = False
                self._notify()
                return Ok(len(slots)), ()
            case ListKeys(partition=partition):
                return Listing(self._list(partition)), ()
            case Clear(partition=partition, keys=keys):
                return self._clear(partition, keys)
            case SetVersion(version=version):
                self.staleness.set_version(version)
                self._evict_stale(self.table.live_slots())
                self._notify()
                return Ok(version), ()
            case AcquireRollouts(n=n, wait_s=wait_s):
                return self._waiting(lambda: self.staleness.submit(n) or None, wait_s, wrap=lambda n: (Ok(n), ()))
            case FinishRollouts(accepted=accepted, rejected=rejected):
                self.staleness.finish(accepted, rejected)
                self._notify()
                return Ok(), ()
            case TakeRefills(max_items=max_items):
                items = [self.refills.popleft() for _ in range(min(max_items, len(self.refills)))]
                return Refills(items), ()
            case Checkpoint(path=path, with_data=with_data):
                return self._checkpoint(path, with_data)
            case Restore(path=path):
                return self._restore(path)
            case Stats():
                return StatsReply(self.statistics()), ()
            case _:
                raise ValueError(f"controller: unexpected request {type(body).__name__}")

    def _waiting(
        self,
        attempt: Callable[[], R | None],
        wait_s: float,
        *,
        nowait_msg: Callable[[], str] | None = None,
        wrap: Callable[[R], Reply] | None = None,
    ) -> Reply | Awaitable[Reply]:
        """Answer now if ``attempt`` succeeds; else wait up to ``wait_s`` for a state change.
        ``wrap`` turns what ``attempt`` found into the reply (default: it is the reply body)."""
        done = attempt()
        if done is not None:
            return wrap(done) if wrap else (done, ())
        if wait_s <= 0 and nowait_msg is not None:
            raise WouldBlock(nowait_msg())

        async def wait() -> Reply:
            with anyio.move_on_after(wait_s):
                while True:
                    await self._changed.wait()
                    done = attempt()
                    if done is not None:
                        return wrap(done) if wrap else (done, ())
            return NotReady(), ()

        return wait()

    def _check_get_meta(self, req: GetMeta) -> None:
        req.sampler.check(req.batch_size)
        if not req.fields:
            raise ValueError("get_meta needs at least one field that must be ready")
        if not req.consumer:
            raise ValueError("get_meta needs a consumer name")

    # ---- the local unit's one-round-trip paths: put, get_batch --------------------------------

    def _store(self, req: Put, frames: list, found: tuple[np.ndarray, np.ndarray]) -> Reply:
        """The rest of a ``Put`` once its keys have slots (all on the one, local unit)."""
        slots, new = found
        try:
            self.local.unit.handle(UnitPut(req.keys, req.batch), frames)
        except BaseException:
            self._remove(slots[new])  # the reservations it made (and whatever of its data got stored)
            raise
        return Ok(self._ready(slots, req.fields, req.update)), ()

    def _with_data(self, found: BatchMeta) -> Reply:
        """A ``GetBatch`` reply: the batch ``_get_meta`` chose and its columns from the local unit
        (handed back to the consumer if they cannot be read)."""
        meta = found.meta
        if not meta.keys:  # partial, nothing ready: the client needs no data
            return found, ()
        try:
            spec, frames = self.local.unit.store.encode(meta.keys, meta.fields)
        except BaseException:
            slots, _ = self.table.slots_for(meta.keys)
            self.table.consumed_by(meta.consumer)[slots] = False
            self._notify()
            raise
        return BatchData(meta, spec), frames

    # ---- checkpoints ---------------------------------------------------------------------------

    async def _checkpoint(self, path: str, with_data: bool) -> Reply:
        return Ok(await save_checkpoint(self, path, with_data)), ()

    async def _restore(self, path: str) -> Reply:
        report = await load_checkpoint(self, path)
        self._notify()
        return Restored(report), ()


async def run_controller(
    ctx: zmq.Context,
    endpoint: str,
    cfg: TransferQueueConfig,
    unit_endpoints: Sequence[str],
    *,
    curve: CurveKeys | None = None,
    task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the controller until cancelled; ``task_status.started(bound_endpoint)``.
    ``unit_endpoints``: the storage unit processes; none: this process holds the one unit."""
    async with AsyncExitStack() as stack:
        units: list[RpcClient | LocalUnit] = [
            await stack.enter_async_context(open_rpc_client(
                ctx, ep, service=f"storage unit {i}", timeout_s=cfg.request_timeout_s, curve=curve,
                unavailable=StorageUnitUnavailable,
            ))
            for i, ep in enumerate(unit_endpoints)
        ] or [LocalUnit()]
        async with anyio.create_task_group() as tg:
            controller = Controller(cfg, units, tg)
            server = RpcServer(ctx, endpoint, name="controller", curve=curve)
            if controller.local is not None:
                controller.local.endpoint = server.endpoint
            await server.serve(controller.handle, task_status=task_status)
