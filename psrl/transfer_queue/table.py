"""The controller's sample metadata, held as numpy columns indexed by slot.

Slots are handed out in arrival order and never reused, so "oldest first" is slot order and a
batch is chosen with a few vectorised masks. Removed slots are compacted away once they are the
majority. Per sample this costs ~30 bytes of columns plus the key string and its dict entry,
which keeps a million samples' metadata in a few hundred MB.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np
import pyarrow as pa

from psrl.trajectory import NO_VERSION

from .messages import SampleUpdate

MAX_FIELDS = 64  # readiness is a uint64 bit mask per sample
NO_GROUP = -1

_COLUMNS = {
    "alive": np.bool_, "part": np.int16, "group": np.int32, "unit": np.int16,
    "seq_len": np.int32, "min_ver": np.int32, "status": np.int8, "ready": np.uint64,
}
_FILL = {"group": NO_GROUP, "min_ver": NO_VERSION}


class SampleTable:
    def __init__(self, initial: int = 1024):
        self.n = 0  # slots used
        self.live = 0
        self.cols = {name: np.full(initial, _FILL.get(name, 0), dt) for name, dt in _COLUMNS.items()}
        self.keys: list[str | None] = []
        self.slot_of: dict[str, int] = {}
        self.partitions: list[str] = []
        self._part_idx: dict[str, int] = {}
        self.group_names: list[str] = []
        self._group_idx: dict[str, int] = {}
        self.status_names: list[str] = ["ok"]
        self._status_idx: dict[str, int] = {"ok": 0}
        self.field_names: list[str] = []
        self._field_bit: dict[str, int] = {}
        self.tags: dict[int, dict[str, str]] = {}  # sparse: only samples with user tags
        self.consumed: dict[str, np.ndarray] = {}

    # ---- names -> small ints ---------------------------------------------------------------

    def partition_index(self, name: str, create: bool = True) -> int:
        idx = self._part_idx.get(name)
        if idx is None:
            if not create:
                return -1
            idx = self._part_idx[name] = len(self.partitions)
            self.partitions.append(name)
        return idx

    def group_index(self, name: str) -> int:
        idx = self._group_idx.get(name)
        if idx is None:
            idx = self._group_idx[name] = len(self.group_names)
            self.group_names.append(name)
        return idx

    def status_index(self, name: str) -> int:
        return _codes([name], self._status_idx, self.status_names)[0]

    def field_mask(self, fields: Iterable[str], create: bool = True) -> int:
        mask = 0
        for f in fields:
            bit = self._field_bit.get(f)
            if bit is None:
                if len(self.field_names) >= MAX_FIELDS:
                    raise ValueError(f"too many distinct fields (at most {MAX_FIELDS}); cannot add {f!r}")
                if not create:
                    continue
                bit = self._field_bit[f] = len(self.field_names)
                self.field_names.append(f)
            mask |= 1 << bit
        return mask

    def fields_of(self, mask: int) -> list[str]:
        return [f for i, f in enumerate(self.field_names) if mask >> i & 1]

    # ---- rows ------------------------------------------------------------------------------

    def add(self, keys: Sequence[str], partition: int, unit: int) -> np.ndarray:
        self._grow(self.n + len(keys))
        slots = np.arange(self.n, self.n + len(keys))
        self.cols["alive"][slots] = True
        self.cols["part"][slots] = partition
        self.cols["unit"][slots] = unit
        self.slot_of.update(zip(keys, range(self.n, self.n + len(keys))))
        self.keys.extend(keys)
        self.n += len(keys)
        self.live += len(keys)
        return slots

    def update(self, slots: np.ndarray, mask: int, upd: SampleUpdate) -> None:
        self.cols["ready"][slots] |= np.uint64(mask)
        if upd.group_ids is not None:
            self.cols["group"][slots] = _codes(upd.group_ids, self._group_idx, self.group_names)
        if upd.seq_lens is not None:
            self.cols["seq_len"][slots] = upd.seq_lens
        if upd.min_versions is not None:
            self.cols["min_ver"][slots] = upd.min_versions
        if upd.statuses is not None:
            self.cols["status"][slots] = _codes(upd.statuses, self._status_idx, self.status_names)
        if upd.tags is not None:
            for s, t in zip(slots.tolist(), upd.tags, strict=True):
                if t:
                    self.tags.setdefault(s, {}).update(t)

    def remove(self, slots: np.ndarray) -> list[str]:
        slots = slots[self.cols["alive"][slots]]
        keys = [self.keys[s] for s in slots.tolist()]
        for k, s in zip(keys, slots.tolist(), strict=True):
            del self.slot_of[k]
            self.keys[s] = None
            self.tags.pop(s, None)
        self.cols["alive"][slots] = False
        self.cols["ready"][slots] = 0
        self.live -= len(slots)
        if self.n > 4096 and self.live < self.n // 2:
            self.compact()
        return keys

    def slots_for(self, keys: Sequence[str]) -> tuple[np.ndarray, list[str]]:
        """Slots of the known keys, and the unknown keys."""
        slots = np.fromiter(map(self.slot_of.get, keys, itertools.repeat(-1)), np.int64, len(keys))
        known = slots >= 0
        if known.all():
            return slots, []
        return slots[known], [k for k, ok in zip(keys, known.tolist(), strict=True) if not ok]

    def consumed_by(self, consumer: str) -> np.ndarray:
        arr = self.consumed.get(consumer)
        if arr is None:
            arr = self.consumed[consumer] = np.zeros(len(self.cols["alive"]), np.bool_)
        return arr

    def candidates(self, partition: int, need: int, consumer: str) -> np.ndarray:
        """Live slots of ``partition`` with every ``need`` field ready, not yet taken by ``consumer``."""
        n = self.n
        ready = self.cols["ready"][:n]
        m = self.cols["alive"][:n] & (self.cols["part"][:n] == partition)
        m &= (ready & np.uint64(need)) == np.uint64(need)
        m &= ~self.consumed_by(consumer)[:n]
        return np.flatnonzero(m)

    def groups_of(self, slots: np.ndarray) -> np.ndarray:
        """Group ids with unknown groups made unique (a sample without a group is its own)."""
        g = self.cols["group"][slots].astype(np.int64)
        lone = g == NO_GROUP
        g[lone] = -(slots[lone].astype(np.int64) + 2)
        return g

    def live_slots(self) -> np.ndarray:
        return np.flatnonzero(self.cols["alive"][: self.n])

    # ---- memory ----------------------------------------------------------------------------

    def _grow(self, need: int) -> None:
        size = len(self.cols["alive"])
        if need <= size:
            return
        new = max(need, size * 2)
        for name, arr in self.cols.items():
            grown = np.full(new, _FILL.get(name, 0), arr.dtype)
            grown[:size] = arr
            self.cols[name] = grown
        for c, arr in self.consumed.items():
            grown = np.zeros(new, np.bool_)
            grown[:size] = arr
            self.consumed[c] = grown

    def compact(self) -> None:
        keep = self.live_slots()
        size = max(1024, 2 * len(keep))
        remap = np.full(self.n, -1, np.int64)
        remap[keep] = np.arange(len(keep))
        for name, arr in self.cols.items():
            out = np.full(size, _FILL.get(name, 0), arr.dtype)
            out[: len(keep)] = arr[keep]
            self.cols[name] = out
        for c, arr in self.consumed.items():
            out = np.zeros(size, np.bool_)
            out[: len(keep)] = arr[keep]
            self.consumed[c] = out
        self.keys = [self.keys[s] for s in keep.tolist()]
        self.slot_of = {k: i for i, k in enumerate(self.keys)}
        self.tags = {int(remap[s]): t for s, t in self.tags.items()}
        self.n = self.live = len(keep)

    # ---- checkpoint ------------------------------------------------------------------------

    def to_arrow(self) -> tuple[pa.Table, dict]:
        """Samples holding at least one field (bare reservations belong to puts in flight)."""
        c = self.cols
        slots = np.flatnonzero(c["alive"][: self.n] & (c["ready"][: self.n] != 0))
        group = c["group"][slots]
        cols = {
            "key": pa.array([self.keys[s] for s in slots.tolist()], pa.string()),
            "partition": pa.array([self.partitions[p] for p in c["part"][slots].tolist()], pa.string()),
            "group_id": pa.array([self.group_names[g] if g >= 0 else None for g in group.tolist()], pa.string()),
            "status": pa.array([self.status_names[s] for s in c["status"][slots].tolist()], pa.string()),
            "tags": pa.array([list(self.tags.get(s, {}).items()) for s in slots.tolist()], pa.map_(pa.string(), pa.string())),
        }
        for name in ("unit", "seq_len", "min_ver"):
            cols[name] = pa.array(c[name][slots])
        cols["ready"] = pa.array([self.fields_of(int(r)) for r in c["ready"][slots].tolist()], pa.list_(pa.string()))
        consumers = sorted(self.consumed)
        for i, name in enumerate(consumers):
            cols[f"consumed_{i}"] = pa.array(self.consumed[name][slots])
        return pa.table(cols), {"consumers": consumers}

    @classmethod
    def from_arrow(cls, t: pa.Table, info: dict) -> SampleTable:
        table = cls(max(1024, t.num_rows))
        if t.num_rows == 0:
            for name in info["consumers"]:
                table.consumed_by(name)
            return table
        col = lambda n: t.column(n).to_pylist()  # noqa: E731
        keys, parts = col("key"), col("partition")
        slots = table.add(keys, 0, 0)
        c = table.cols
        c["part"][slots] = [table.partition_index(p) for p in parts]
        for name in ("unit", "seq_len", "min_ver"):
            c[name][slots] = t.column(name).to_numpy()
        c["group"][slots] = [NO_GROUP if g is None else table.group_index(g) for g in col("group_id")]
        c["status"][slots] = [table.status_index(s) for s in col("status")]
        c["ready"][slots] = [table.field_mask(fs) for fs in col("ready")]
        for i, tags in enumerate(col("tags")):
            if tags:
                table.tags[i] = dict(tags)
        for i, name in enumerate(info["consumers"]):
            table.consumed_by(name)[slots] = t.column(f"consumed_{i}").to_numpy(zero_copy_only=False)
        return table


def _codes(names: Sequence[str], index: dict[str, int], table: list[str]) -> list[int]:
    """Small-int codes of ``names``, adding the new ones: a dict pass per distinct name, one C-level
    map over the rows."""
    for name in dict.fromkeys(names):
        if name not in index:
            index[name] = len(table)
            table.append(name)
    return list(map(index.__getitem__, names))
