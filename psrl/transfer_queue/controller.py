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
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from functools import partial
from typing import TypeVar

import anyio
import numpy as np
import zmq

from psrl.config.transfer_queue import TransferQueueConfig

from .checkpoint import load_checkpoint, save_checkpoint
from .errors import ServiceUnavailable, StorageUnitUnavailable, WouldBlock, describe_keys
from .messages import (
    Abort, AcquireRollouts, BatchData, BatchMeta, Body, Checkpoint, Clear, Commit, FinishRollouts, GetBatch,
    GetMeta, Hello, ListKeys, Listing, NotReady, Ok, Put, Refills, Release, Reserve, Reserved, Restore,
    Restored, SampleUpdate, SetVersion, Stats, StatsReply, TakeRefills, UnitCount, UnitDelete, UnitDump,
    UnitGet, UnitLoad, UnitPut, Welcome,
)
from .meta import KVBatchMeta, QueueStatistics, Refill, SampleInfo
from .rpc import Reply, RpcClient, RpcServer, open_rpc_client
from .samplers import Candidates
from .staleness import StalenessManager
from .storage import StorageUnit
from .table import SampleTable
from .zsocket import CurveKeys

log = logging.getLogger(__name__)
R = TypeVar("R")


class LocalUnit:
    """The storage unit held in the controller's process, called like a remote one."""

    def __init__(self) -> None:
        self.unit = StorageUnit(0)
        self.endpoint = ""  # the controller's, once bound

    async def call(self, body: Body, frames: Sequence = (), **_: object) -> tuple[Body, list]:
        reply, out = self.unit.handle(body, list(frames))
        return reply, list(out)


class Controller:
    """Request handler; ``run_controller`` puts it behind a socket. ``units``: clients of the
    storage unit processes, or one ``LocalUnit``."""

    def __init__(self, cfg: TransferQueueConfig, units: Sequence[RpcClient | LocalUnit], task_group: anyio.abc.TaskGroup):
        self.cfg = cfg
        self.units = list(units)
        self.local = units[0] if len(units) == 1 and isinstance(units[0], LocalUnit) else None
        self.table = SampleTable()
        self.staleness = StalenessManager(cfg.max_staleness, cfg.admission_batch_size)
        self.unit_load = [0] * len(self.units)
        self.dropped_stale = 0
        self.refills: deque[Refill] = deque()
        self.stale_groups: set[int] = set()
        self._tg = task_group
        self._changed = anyio.Event()
        self.unit_lock = anyio.Lock()  # checkpoint dumps see no deletions half-way

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

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

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

    # ---- put: reserve, commit, abort ---------------------------------------------------------

    def _full_msg(self, req: Reserve | Put) -> str:
        return (
            f"queue is full: {self.table.live} of {self.cfg.capacity_samples} samples held, "
            f"put of {len(req.keys)} keys ({describe_keys(req.keys)}) would exceed it"
        )

    def _reserve(self, req: Reserve | Put) -> Reserved | None:
        found = self._reserve_slots(req)
        if found is None:
            return None
        slots, new = found
        return Reserved(self.table.cols["unit"][slots].tolist(), new.tolist())

    def _reserve_slots(self, req: Reserve | Put) -> tuple[np.ndarray, np.ndarray] | None:
        """The slots of ``req.keys`` (new ones added) and which are new; None while full."""
        t = self.table
        if len(set(req.keys)) != len(req.keys):
            dup = sorted({k for k in req.keys if req.keys.count(k) > 1})
            raise ValueError(f"put repeats keys {describe_keys(dup)}")
        part = t.partition_index(req.partition)
        # One dict pass over the keys; the rest is numpy (a put of new keys is the common case).
        slots = np.fromiter(map(t.slot_of.get, req.keys, itertools.repeat(-1)), np.int64, len(req.keys))
        new = slots < 0
        old = slots[~new]
        if len(old) and (t.cols["part"][old] != part).any():
            wrong = [k for k, s in zip(req.keys, slots.tolist(), strict=True) if s >= 0 and t.cols["part"][s] != part]
            raise ValueError(f"keys {describe_keys(wrong)} already live in another partition than {req.partition!r}")
        n_new = int(new.sum())
        if n_new > self.cfg.capacity_samples:
            raise ValueError(
                f"a put of {n_new} new samples can never fit a queue of capacity {self.cfg.capacity_samples}"
            )
        if n_new and t.live + n_new > self.cfg.capacity_samples:
            return None
        if n_new:
            unit = int(np.argmin(self.unit_load))  # a put's new samples stay together on one unit
            keys = req.keys if n_new == len(slots) else [k for k, n in zip(req.keys, new.tolist(), strict=True) if n]
            slots[new] = t.add(keys, part, unit)
            self.unit_load[unit] += n_new
        return slots, new

    def _commit(self, req: Commit) -> int:
        slots, missing = self.table.slots_for(req.keys)
        if missing:
            raise KeyError(f"commit of keys that are not reserved (cleared or evicted meanwhile): {describe_keys(missing)}")
        return self._ready(slots, req.fields, req.update)

    def _ready(self, slots: np.ndarray, fields: list[str], update: SampleUpdate) -> int:
        t = self.table
        t.update(slots, t.field_mask(fields), update)
        self._evict_stale(slots)
        self._notify()
        return len(slots)

    def _store(self, req: Put, frames: list, found: tuple[np.ndarray, np.ndarray]) -> Reply:
        """The rest of a ``Put`` once its keys have slots (all on the one, local unit)."""
        slots, new = found
        try:
            self.local.unit.handle(UnitPut(req.keys, req.batch), frames)
        except BaseException:
            self._remove(slots[new])  # the reservations it made (and whatever of its data got stored)
            raise
        return Ok(self._ready(slots, req.fields, req.update)), ()

    def _abort(self, keys: Sequence[str]) -> int:
        """Drop reservations that never got data (a put failed half-way)."""
        slots, _ = self.table.slots_for(keys)
        bare = slots[self.table.cols["ready"][slots] == 0]
        self._remove(bare)
        return len(bare)

    # ---- get_meta ----------------------------------------------------------------------------

    def _check_get_meta(self, req: GetMeta) -> None:
        req.sampler.check(req.batch_size)
        if not req.fields:
            raise ValueError("get_meta needs at least one field that must be ready")
        if not req.consumer:
            raise ValueError("get_meta needs a consumer name")

    def _get_meta(self, req: GetMeta) -> BatchMeta | None:
        t = self.table
        part = t.partition_index(req.partition)
        slots = t.candidates(part, t.field_mask(req.fields), req.consumer)
        cand = Candidates(groups=t.groups_of(slots), seq_lens=t.cols["seq_len"][slots])
        pos = req.sampler.select(cand, req.batch_size, req.partial)
        if pos is None:
            return None
        chosen = slots[pos]
        t.consumed_by(req.consumer)[chosen] = True
        return BatchMeta(self._meta(req, chosen))

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

    def _meta(self, req: GetMeta, slots: np.ndarray) -> KVBatchMeta:
        t, c = self.table, self.table.cols
        sl = slots.tolist()
        status = [t.status_names[s] for s in c["status"][slots].tolist()]
        tags = [{"status": st, **t.tags[s]} if s in t.tags else {"status": st} for s, st in zip(sl, status, strict=True)]
        groups = c["group"][slots].tolist()
        return KVBatchMeta(
            partition=req.partition, consumer=req.consumer, fields=list(req.fields),
            keys=[t.keys[s] for s in sl],
            group_ids=[t.group_names[g] if g >= 0 else "" for g in groups],
            seq_lens=c["seq_len"][slots].tolist(), min_versions=c["min_ver"][slots].tolist(),
            units=c["unit"][slots].tolist(), tags=tags,
            dp_size=getattr(req.sampler, "dp_size", 1),
        )

    # ---- removal: clear, staleness ----------------------------------------------------------

    def _remove(self, slots: np.ndarray, deletes: list[tuple[int, list[str]]] | None = None) -> list[str]:
        """Forget samples and delete their data on the units: in the background, or, given
        ``deletes``, by whoever awaits the (unit, keys) pairs put there."""
        t = self.table
        slots = slots[t.cols["alive"][slots]]
        by_unit: dict[int, list[str]] = {}
        units = t.cols["unit"][slots].tolist()
        keys = t.remove(slots)
        for k, u in zip(keys, units, strict=True):
            by_unit.setdefault(u, []).append(k)
            self.unit_load[u] -= 1
        for u, ks in by_unit.items():
            if deletes is None:
                self._tg.start_soon(self._delete_on_unit, u, ks)
            else:
                deletes.append((u, ks))
        if keys:
            self._notify()
        return keys

    async def _delete_on_unit(self, unit: int, keys: list[str]) -> None:
        async with self.unit_lock:
            try:
                await self.units[unit].call(UnitDelete(keys), keys=keys, what="delete samples")
            except ServiceUnavailable as exc:
                log.error("controller: %s", exc)

    def _clear(self, partition: str | None, keys: Sequence[str] | None) -> Reply | Awaitable[Reply]:
        """Answered once the units deleted the data: a key put again after ``clear`` returned
        must not meet a deletion still on its way to the unit."""
        t = self.table
        if keys is not None:
            slots, _ = t.slots_for(keys)
        else:
            slots = t.live_slots()
        if partition is not None:
            slots = slots[t.cols["part"][slots] == t.partition_index(partition, create=False)]
        deletes: list[tuple[int, list[str]]] = []
        n = len(self._remove(slots, deletes))
        if not deletes:
            return Ok(n), ()

        async def deleted() -> Reply:
            async with anyio.create_task_group() as tg:
                for u, ks in deletes:
                    tg.start_soon(self._delete_on_unit, u, ks)
            return Ok(n), ()

        return deleted()

    def _evict_stale(self, slots: np.ndarray) -> None:
        """Evict every ready sample of a group that holds a sample older than the bound; later
        members of such a group are evicted as they arrive."""
        t, c = self.table, self.table.cols
        if len(slots) == 0:
            return
        oldest = self.staleness.oldest_allowed()
        mv = c["min_ver"][slots]
        groups = t.groups_of(slots)
        stale = ((mv >= 0) & (mv < oldest)) | np.isin(groups, list(self.stale_groups))
        if not stale.any():
            return
        bad_groups = set(np.unique(groups[stale]).tolist())
        self.stale_groups |= {g for g in bad_groups if g >= 0}
        live = t.live_slots()
        live_groups = t.groups_of(live)
        victims = live[np.isin(live_groups, list(bad_groups)) & (c["ready"][live] != 0)]
        parts = c["part"][victims].tolist()
        vgroups = t.groups_of(victims).tolist()
        keys = self._remove(victims)
        self.dropped_stale += len(keys)
        self.staleness.evicted(len(keys))
        if self.cfg.on_stale == "refill":
            by_group: dict[tuple[int, int], list[str]] = {}
            for k, p, g in zip(keys, parts, vgroups, strict=True):
                by_group.setdefault((p, g), []).append(k)
            for (p, g), ks in by_group.items():
                name = t.group_names[g] if g >= 0 else ""
                self.refills.append(Refill(t.partitions[p], name, ks))

    # ---- listing, statistics ------------------------------------------------------------------

    def _list(self, partition: str | None) -> list[SampleInfo]:
        t, c = self.table, self.table.cols
        slots = t.live_slots()
        if partition is not None:
            slots = slots[c["part"][slots] == t.partition_index(partition, create=False)]
        out = []
        for s in slots.tolist():
            g = int(c["group"][s])
            out.append(SampleInfo(
                key=t.keys[s], partition=t.partitions[c["part"][s]], group_id=t.group_names[g] if g >= 0 else "",
                unit=int(c["unit"][s]), ready_fields=t.fields_of(int(c["ready"][s])),
                consumed_by=sorted(name for name, arr in t.consumed.items() if arr[s]),
            ))
        return out

    async def _checkpoint(self, path: str, with_data: bool) -> Reply:
        return Ok(await save_checkpoint(self, path, with_data)), ()

    async def _restore(self, path: str) -> Reply:
        report = await load_checkpoint(self, path)
        self._notify()
        return Restored(report), ()

    async def unit_call(self, unit: int, body: Body, keys: list[str]) -> None:
        await self.units[unit].call(body, keys=keys, what=type(body).__name__)

    def statistics(self) -> QueueStatistics:
        t, c = self.table, self.table.cols
        live = t.live_slots()
        ready = live[c["ready"][live] != 0]
        counts = np.bincount(c["part"][ready], minlength=len(t.partitions))
        st = self.staleness.statistics()
        return QueueStatistics(
            samples=t.live, ready_by_partition={p: int(n) for p, n in zip(t.partitions, counts, strict=False)},
            capacity_samples=self.cfg.capacity_samples, version=st.version, max_staleness=st.max_staleness,
            dropped_stale=self.dropped_stale, pending_refills=len(self.refills), accepted=st.accepted,
            running=st.running, admission_capacity=st.capacity, unit_samples=list(self.unit_load),
            consumers=sorted(t.consumed),
        )


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
