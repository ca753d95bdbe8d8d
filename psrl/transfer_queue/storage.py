"""Storage units: Arrow columns in memory, addressed by (key, field).

Each put keeps its columns as they arrived (the received ZeroMQ frames, no copy) and indexes
every (field, key) to (chunk, row). A get gathers rows per field: a get of exactly what one put
stored sends that put's own frame objects back (no Arrow array is ever built for them, and pyzmq
shares their messages: a view of them would be a new zero-copy frame, whose release wakes pyzmq's
garbage-collector thread: ~2 ms of the service's CPU per ``psrl bench queue`` round); other runs
of consecutive rows of one chunk are zero-copy slices; only a batch stitched from several puts
is concatenated. A chunk is freed when none of its rows is referenced any more.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Sequence
from pathlib import Path

import anyio
import numpy as np
import pyarrow as pa
import zmq

from psrl.trajectory import TRAJECTORY_SCHEMA

from .arrow_frames import FrameColumn, FrameWriter, decode_columns
from .errors import describe_keys
from .messages import BatchSpec, Body, Data, Ok, UnitCount, UnitDelete, UnitDump, UnitGet, UnitLoad, UnitPut
from .rpc import Reply, RpcServer
from .zsocket import CurveKeys

_ROW_BITS = 32
_ROW_MASK = (1 << _ROW_BITS) - 1


class MissingData(KeyError):
    def __init__(self, message: str, keys: list[str]):
        super().__init__(message)
        self.keys = keys

    def __str__(self) -> str:
        return str(self.args[0])


class ColumnStore:
    """Columns by (key, field). Each key has a row id (one dict look-up per request, however
    many fields it names); per field a numpy array maps row id -> chunk << 32 | row (-1: the
    field is not stored for that key). Row ids of deleted keys are reused."""

    def __init__(self) -> None:
        self._chunks: dict[int, pa.Array | FrameColumn] = {}
        self._refs: dict[int, int] = {}
        self._next = 0
        self._ids: dict[str, int] = {}  # key -> row id
        self._free: list[int] = []  # row ids of deleted keys
        self._n_ids = 0  # row ids handed out so far (in use or free)
        self._cap = 0  # length of every array in _loc
        self._loc: dict[str, np.ndarray] = {}  # field -> row id -> chunk << 32 | row, or -1

    def put(self, keys: Sequence[str], batch: pa.RecordBatch) -> None:
        self.put_columns(keys, batch.num_rows, dict(zip(batch.schema.names, batch.columns, strict=True)))

    def put_columns(self, keys: Sequence[str], rows: int, columns: dict[str, pa.Array | FrameColumn]) -> None:
        """Store ``columns`` (``rows`` long, as ``decode_columns`` gives them) for ``keys``."""
        n = len(keys)
        if rows != n:
            raise ValueError(f"put of {n} keys carries {rows} rows")
        if all(name == "key" for name in columns):
            raise ValueError("put of keys without any field")
        if len(set(keys)) != n:
            raise ValueError("put repeats keys: " + describe_keys(sorted({k for k in keys if keys.count(k) > 1})))
        ids = self._ids_of(keys)
        new = ids < 0
        if new.any():
            ids[new] = self._new_ids(int(new.sum()))
            fresh = keys if new.all() else [k for k, m in zip(keys, new.tolist(), strict=True) if m]
            self._ids.update(zip(fresh, ids[new].tolist(), strict=True))
        for name, arr in columns.items():
            if name == "key":
                continue
            cid, self._next = self._next, self._next + 1
            self._chunks[cid] = arr
            self._refs[cid] = n
            loc = self._loc.get(name)
            if loc is None:
                loc = self._loc[name] = np.full(self._cap, -1, np.int64)
            self._drop(loc[ids])  # overwriting a field: release the old rows
            loc[ids] = np.arange(cid << _ROW_BITS, (cid << _ROW_BITS) + n, dtype=np.int64)

    def get(self, keys: Sequence[str], fields: Sequence[str]) -> pa.RecordBatch:
        cols = self.columns(keys, fields)
        return pa.RecordBatch.from_arrays([pa.array(list(keys), pa.string()), *cols.columns], names=["key", *fields])

    def columns(self, keys: Sequence[str], fields: Sequence[str]) -> pa.RecordBatch:
        """``fields`` of ``keys``, without the key column (the caller knows the keys it asked for)."""
        ids, unknown = self._lookup(keys)
        return pa.RecordBatch.from_arrays(
            [self._gather(f, self._codes(f, keys, ids, unknown)) for f in fields], names=list(fields)
        )

    def encode(self, keys: Sequence[str], fields: Sequence[str]) -> tuple[BatchSpec, list]:
        """``columns(keys, fields)`` as buffer frames to send: a field whose rows are exactly
        what one put stored goes back as the frames that put brought."""
        ids, unknown = self._lookup(keys)
        out = FrameWriter()
        for f in fields:
            codes = self._codes(f, keys, ids, unknown)
            whole = self._whole_chunk(codes)
            out.add(f, whole if whole is not None else self._gather(f, codes))
        return out.finish(len(keys), list(fields))

    def _lookup(self, keys: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        ids = self._ids_of(keys)
        unknown = ids < 0
        ids[unknown] = 0  # looked up, then marked missing
        return ids, unknown

    def _codes(self, field: str, keys: Sequence[str], ids: np.ndarray, unknown: np.ndarray) -> np.ndarray:
        """chunk << 32 | row of each key's ``field``; raises ``MissingData`` naming the keys without it."""
        loc = self._loc.get(field)
        codes = loc[ids] if loc is not None else np.full(len(keys), -1, np.int64)
        codes[unknown] = -1
        if len(codes) and codes.min() < 0:
            missing = [k for k, c in zip(keys, codes.tolist(), strict=True) if c < 0]
            raise MissingData(f"field {field!r} is not stored for keys {describe_keys(missing)}", missing)
        return codes

    @staticmethod
    def _one_run(codes: np.ndarray) -> bool:
        n = len(codes)
        return n > 0 and codes[-1] - codes[0] == n - 1 and (n < 3 or bool((np.diff(codes) == 1).all()))

    def _whole_chunk(self, codes: np.ndarray) -> FrameColumn | None:
        """The received column that ``codes`` cover entirely, in order, if there is one."""
        if not len(codes) or int(codes[0]) & _ROW_MASK:
            return None
        chunk = self._chunks[int(codes[0]) >> _ROW_BITS]
        if isinstance(chunk, FrameColumn) and chunk.rows == len(codes) and self._one_run(codes):
            return chunk
        return None

    def _array(self, cid: int) -> pa.Array:
        chunk = self._chunks[cid]
        return chunk.array() if isinstance(chunk, FrameColumn) else chunk

    def _gather(self, field: str, codes: np.ndarray) -> pa.Array:
        if not len(codes):
            return self._empty(field)
        if self._one_run(codes):
            # One run of one chunk (a get of what one put stored): a zero-copy slice.
            return self._array(int(codes[0]) >> _ROW_BITS).slice(int(codes[0]) & _ROW_MASK, len(codes))
        cids, rows = codes >> _ROW_BITS, codes & _ROW_MASK
        brk = np.flatnonzero((cids[1:] != cids[:-1]) | (rows[1:] != rows[:-1] + 1)) + 1
        starts, ends = np.r_[0, brk], np.r_[brk, len(codes)]
        pieces = [self._array(int(cids[s])).slice(int(rows[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)]
        return pieces[0] if len(pieces) == 1 else pa.concat_arrays(pieces)

    def _empty(self, field: str) -> pa.Array:
        if field in TRAJECTORY_SCHEMA.names:
            return pa.array([], TRAJECTORY_SCHEMA.field(field).type)
        loc = self._loc.get(field)
        held = loc[loc >= 0] if loc is not None else loc
        return pa.array([], self._chunks[int(held[0]) >> _ROW_BITS].type if held is not None and len(held) else pa.null())

    def delete(self, keys: Sequence[str]) -> int:
        # Popped: a key repeated in ``keys`` is found once, its row id freed once.
        ids = np.fromiter(map(self._ids.pop, keys, itertools.repeat(-1)), np.int64, len(keys))
        ids = ids[ids >= 0]
        for loc in self._loc.values():
            self._drop(loc[ids])
            loc[ids] = -1
        self._free.extend(ids.tolist())
        return len(ids)

    def clear(self) -> None:
        self.__init__()

    def _ids_of(self, keys: Sequence[str]) -> np.ndarray:
        return np.fromiter(map(self._ids.get, keys, itertools.repeat(-1)), np.int64, len(keys))

    def _new_ids(self, n: int) -> np.ndarray:
        k = min(n, len(self._free))
        reuse = self._free[len(self._free) - k:]
        del self._free[len(self._free) - k:]
        fresh = n - k
        if self._n_ids + fresh > self._cap:
            self._grow(max(2 * self._cap, self._n_ids + fresh, 1024))
        out = np.concatenate([np.asarray(reuse, np.int64), np.arange(self._n_ids, self._n_ids + fresh, dtype=np.int64)])
        self._n_ids += fresh
        return out

    def _grow(self, cap: int) -> None:
        for name, loc in self._loc.items():
            self._loc[name] = np.concatenate([loc, np.full(cap - self._cap, -1, np.int64)])
        self._cap = cap

    def _drop(self, codes: np.ndarray) -> None:
        """Release the rows ``codes`` point at (-1: none), per chunk, not per row."""
        held = codes[codes >= 0]
        if len(held):
            cids, counts = np.unique(held >> _ROW_BITS, return_counts=True)
            for cid, n in zip(cids.tolist(), counts.tolist(), strict=True):
                self._refs[cid] -= n
                if self._refs[cid] == 0:
                    del self._refs[cid], self._chunks[cid]

    def num_samples(self) -> int:
        return len(self._ids)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._chunks.values())  # FrameColumn.nbytes: its frames

    # ---- checkpoint: one Arrow IPC file per field, columns (key, value) ----------------------

    def dump(self, path: str | os.PathLike, keys: Sequence[str]) -> int:
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        manifest = []
        held = [k for k in dict.fromkeys(keys) if k in self._ids]
        ids = np.array([self._ids[k] for k in held], np.int64)
        for i, (field, loc) in enumerate(sorted(self._loc.items())):
            has = loc[ids] >= 0
            ks = [k for k, h in zip(held, has.tolist(), strict=True) if h]
            if not ks:
                continue
            value = self._gather(field, self._codes(field, ks, ids[has], np.zeros(len(ks), np.bool_)))
            table = pa.table({"key": pa.array(ks, pa.string()), "value": value})
            with pa.OSFile(str(out / f"field-{i}.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
                w.write_table(table)
            manifest.append({"field": field, "file": f"field-{i}.arrow", "rows": len(ks)})
        (out / "manifest.json").write_text(json.dumps(manifest))
        return len(held)

    def load(self, path: str | os.PathLike) -> int:
        """Replace the contents with a dump (memory-mapped, not read into RAM up front)."""
        src = Path(path)
        manifest = json.loads((src / "manifest.json").read_text())
        self.clear()
        for entry in manifest:
            table = pa.ipc.open_file(pa.memory_map(str(src / entry["file"]))).read_all().combine_chunks()
            keys = table.column("key").to_pylist()
            value = table.column("value").combine_chunks()
            self.put(keys, pa.RecordBatch.from_arrays([value], names=[entry["field"]]))
        return self.num_samples()


class StorageUnit:
    """The request handler of one storage unit."""

    def __init__(self, index: int):
        self.index = index
        self.name = f"storage unit {index}"
        self.store = ColumnStore()

    def handle(self, body: Body, frames: list) -> Reply:
        match body:
            case UnitPut(keys=keys, batch=spec):
                self.store.put_columns(keys, spec.num_rows, decode_columns(spec, frames, TRAJECTORY_SCHEMA))
                return Ok(len(keys)), ()
            case UnitGet(keys=keys, fields=fields):  # no key column: the client has the keys
                spec, out = self.store.encode(keys, fields)
                return Data(spec), out
            case UnitDelete(keys=keys):
                return Ok(self.store.delete(keys)), ()
            case UnitDump(path=path, keys=keys):
                return Ok(self.store.dump(path, keys)), ()
            case UnitLoad(path=path):
                return Ok(self.store.load(path)), ()
            case UnitCount():
                return Ok(self.store.num_samples()), ()
            case _:
                raise ValueError(f"{self.name}: unexpected request {type(body).__name__}")


async def run_storage_unit(
    ctx: zmq.Context,
    endpoint: str,
    index: int,
    *,
    curve: CurveKeys | None = None,
    task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve one storage unit until cancelled; ``task_status.started(bound_endpoint)``."""
    unit = StorageUnit(index)
    server = RpcServer(ctx, endpoint, name=unit.name, curve=curve)
    await server.serve(unit.handle, task_status=task_status)
