"""The controller's bookkeeping: which samples it holds and where, what is ready, who took what.

``SampleLedger`` is the state half of ``Controller`` (``controller.py`` answers the requests and
makes them wait). It reserves slots under ``capacity_samples`` and gives a put's new samples one
storage unit, marks fields ready, picks a consumer's batch with its sampler, and forgets samples
(cleared, aborted, or in a group gone stale) and deletes their data on the units. A change that may
let a waiting request through calls ``_notify``, which wakes the requests ``Controller._waiting``
holds; nothing here waits for the state to change.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING

import anyio
import numpy as np

from psrl.config.transfer_queue import TransferQueueConfig

from .errors import ServiceUnavailable, describe_keys
from .messages import BatchMeta, Body, Commit, GetMeta, Ok, Put, Reserve, Reserved, SampleUpdate, UnitDelete
from .meta import KVBatchMeta, QueueStatistics, Refill, SampleInfo
from .rpc import Reply, RpcClient
from .samplers import Candidates
from .staleness import StalenessManager
from .table import SampleTable

if TYPE_CHECKING:
    from .controller import LocalUnit

log = logging.getLogger(__name__)


class SampleLedger:
    """The controller's state and what changes it; ``Controller`` adds the requests. ``units``:
    clients of the storage unit processes, or one ``LocalUnit``; ``task_group`` runs the unit
    deletions nobody awaits."""

    def __init__(self, cfg: TransferQueueConfig, units: Sequence[RpcClient | LocalUnit], task_group: anyio.abc.TaskGroup):
        self.cfg = cfg
        self.units = list(units)
        self.table = SampleTable()
        self.staleness = StalenessManager(cfg.max_staleness, cfg.admission_batch_size)
        self.unit_load = [0] * len(self.units)
        self.dropped_stale = 0
        self.refills: deque[Refill] = deque()
        self.stale_groups: set[int] = set()
        self._tg = task_group
        self._changed = anyio.Event()
        self.unit_lock = anyio.Lock()  # checkpoint dumps see no deletions half-way

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    # ---- reserve, commit, abort ----------------------------------------------------------------

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

    def _abort(self, keys: Sequence[str]) -> int:
        """Drop reservations that never got data (a put failed half-way)."""
        slots, _ = self.table.slots_for(keys)
        bare = slots[self.table.cols["ready"][slots] == 0]
        self._remove(bare)
        return len(bare)

    # ---- get_meta: a consumer's batch ----------------------------------------------------------

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

    async def unit_call(self, unit: int, body: Body, keys: list[str]) -> None:
        await self.units[unit].call(body, keys=keys, what=type(body).__name__)

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
        mv = c["min_ver"][slots]
        stale = (mv >= 0) & (mv < self.staleness.oldest_allowed())
        if self.stale_groups:  # later members of groups already evicted
            stale |= np.isin(t.groups_of(slots), list(self.stale_groups))
        if not stale.any():  # the usual case: a fresh put
            return
        groups = t.groups_of(slots)
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
