"""Storage units: Arrow columns in memory, addressed by (key, field).

Each put keeps its columns as they arrived (views of the received ZeroMQ frames, no copy) and
indexes every (field, key) to (chunk, row). A get gathers rows per field: runs of consecutive
rows of one chunk are zero-copy slices; only a batch stitched from several puts is concatenated.
A chunk is freed when none of its rows is referenced any more.
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

from .arrow_frames import decode_batch, encode_batch
from .errors import describe_keys
from .messages import Body, Data, Ok, UnitCount, UnitDelete, UnitDump, UnitGet, UnitLoad, UnitPut
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
    def __init__(self) -> None:
        self._chunks: dict[int, pa.Array] = {}
        self._refs: dict[int, int] = {}
        self._loc: dict[str, dict[str, int]] = {}  # field -> key -> chunk << 32 | row
        self._next = 0

    def put(self, keys: Sequence[str], batch: pa.RecordBatch) -> None:
        if batch.num_rows != len(keys):
            raise ValueError(f"put of {len(keys)} keys carries {batch.num_rows} rows")
        unique = set(keys)
        if len(unique) != len(keys):
            raise ValueError("put repeats keys: " + describe_keys(sorted({k for k in keys if keys.count(k) > 1})))
        for name, arr in zip(batch.schema.names, batch.columns, strict=True):
            if name == "key":
                continue
            cid, self._next = self._next, self._next + 1
            self._chunks[cid] = arr
            self._refs[cid] = len(keys)
            loc = self._loc.setdefault(name, {})
            for k in loc.keys() & unique:  # overwriting a field: release the old row
                self._unref(loc[k] >> _ROW_BITS)
            base = cid << _ROW_BITS
            loc.update(zip(keys, range(base, base + len(keys))))

    def get(self, keys: Sequence[str], fields: Sequence[str]) -> pa.RecordBatch:
        cols = self.columns(keys, fields)
        return pa.RecordBatch.from_arrays([pa.array(list(keys), pa.string()), *cols.columns], names=["key", *fields])

    def columns(self, keys: Sequence[str], fields: Sequence[str]) -> pa.RecordBatch:
        """``fields`` of ``keys``, without the key column (the caller knows the keys it asked for)."""
        return pa.RecordBatch.from_arrays([self._gather(f, keys) for f in fields], names=list(fields))

    def _gather(self, field: str, keys: Sequence[str]) -> pa.Array:
        loc = self._loc.get(field, {})
        if not keys:
            return self._empty(field)
        codes = np.fromiter(map(loc.get, keys, itertools.repeat(-1)), np.int64, len(keys))
        if codes.min() < 0:
            missing = [k for k, c in zip(keys, codes.tolist(), strict=True) if c < 0]
            raise MissingData(f"field {field!r} is not stored for keys {describe_keys(missing)}", missing)
        if codes[-1] - codes[0] == len(keys) - 1 and (len(keys) < 3 or (np.diff(codes) == 1).all()):
            # One run of one chunk (a get of what one put stored): a zero-copy slice.
            return self._chunks[int(codes[0]) >> _ROW_BITS].slice(int(codes[0]) & _ROW_MASK, len(keys))
        cids, rows = codes >> _ROW_BITS, codes & _ROW_MASK
        brk = np.flatnonzero((cids[1:] != cids[:-1]) | (rows[1:] != rows[:-1] + 1)) + 1
        starts, ends = np.r_[0, brk], np.r_[brk, len(keys)]
        pieces = [self._chunks[int(cids[s])].slice(int(rows[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)]
        return pieces[0] if len(pieces) == 1 else pa.concat_arrays(pieces)

    def _empty(self, field: str) -> pa.Array:
        if field in TRAJECTORY_SCHEMA.names:
            return pa.array([], TRAJECTORY_SCHEMA.field(field).type)
        chunk = next((self._chunks[c >> _ROW_BITS] for c in self._loc.get(field, {}).values()), None)
        return pa.array([], chunk.type if chunk is not None else pa.null())

    def delete(self, keys: Sequence[str]) -> int:
        found = np.zeros(len(keys), np.bool_)
        for loc in self._loc.values():
            codes = np.fromiter(map(loc.pop, keys, itertools.repeat(-1)), np.int64, len(keys))
            held = codes >= 0
            found |= held
            # Chunk references dropped per chunk, not per row (a clear is every row of a put).
            cids, counts = np.unique(codes[held] >> _ROW_BITS, return_counts=True)
            for cid, n in zip(cids.tolist(), counts.tolist(), strict=True):
                self._unref(cid, n)
        return int(np.count_nonzero(found))  # a repeated key is found once: its first pop

    def clear(self) -> None:
        self._chunks.clear()
        self._refs.clear()
        self._loc.clear()

    def _unref(self, cid: int, n: int = 1) -> None:
        self._refs[cid] -= n
        if self._refs[cid] == 0:
            del self._refs[cid], self._chunks[cid]

    def num_samples(self) -> int:
        keys: set[str] = set()
        for loc in self._loc.values():
            keys.update(loc)
        return len(keys)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._chunks.values())

    # ---- checkpoint: one Arrow IPC file per field, columns (key, value) ----------------------

    def dump(self, path: str | os.PathLike, keys: Sequence[str]) -> int:
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        manifest = []
        wanted = set(keys)
        for i, (field, loc) in enumerate(sorted(self._loc.items())):
            ks = [k for k in loc if k in wanted]
            if not ks:
                continue
            table = pa.table({"key": pa.array(ks, pa.string()), "value": self._gather(field, ks)})
            with pa.OSFile(str(out / f"field-{i}.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
                w.write_table(table)
            manifest.append({"field": field, "file": f"field-{i}.arrow", "rows": len(ks)})
        (out / "manifest.json").write_text(json.dumps(manifest))
        return len({k for loc in self._loc.values() for k in loc if k in wanted})

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
                batch = decode_batch(spec, [f.buffer for f in frames], TRAJECTORY_SCHEMA)
                self.store.put(keys, batch)
                return Ok(len(keys)), ()
            case UnitGet(keys=keys, fields=fields):  # no key column: the client has the keys
                spec, out = encode_batch(self.store.columns(keys, fields))
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
