"""Record batch <-> buffer frames, without copying token data.

Token columns (``list<int32|float32|int8|...>`` without nulls) travel as two frames each: the
int32 offsets (one frame for all columns with equal offsets) and the values buffer itself (a
zero-copy slice of the Arrow buffer, read back as a zero-copy view of the received ZeroMQ
frame). Everything else (keys, rewards, status strings, maps) is small and goes in one Arrow IPC
stream frame.
"""

from __future__ import annotations

import functools

import numpy as np
import pyarrow as pa

from .messages import BatchSpec, ColumnSpec

_NUMERIC = (pa.types.is_integer, pa.types.is_floating)


@functools.lru_cache(maxsize=64)
def _list_info(t: pa.DataType) -> tuple[int, str] | None:
    """(value width in bytes, numpy dtype name) of a list<integer|floating> type; None otherwise."""
    if not pa.types.is_list(t) or not any(f(t.value_type) for f in _NUMERIC):
        return None
    return t.value_type.bit_width // 8, t.value_type.to_pandas_dtype().__name__


class FrameColumn:
    """A token column as it arrived: its offsets and values frames. The Arrow array is built on
    first use, so a storage unit that only hands whole columns back sends the frames it got."""

    __slots__ = ("type", "rows", "dtype", "offsets", "values", "_array")

    def __init__(self, name: str, type_: pa.ListType, rows: int, dtype: str, offsets, values):
        off, itemsize = np.frombuffer(offsets, np.int32), _value_type(dtype)[1]
        size = memoryview(values).nbytes
        if len(off) != rows + 1 or off[0] != 0 or int(off[-1]) * itemsize != size:
            raise ValueError(
                f"column {name!r}: {len(off)} offsets (first {off[:1].tolist()}, last {off[-1:].tolist()}) "
                f"do not describe {rows} rows of {size} bytes of {dtype}"
            )
        self.type, self.rows, self.dtype, self.offsets, self.values = type_, rows, dtype, offsets, values
        self._array: pa.ListArray | None = None

    def array(self) -> pa.ListArray:
        if self._array is None:
            vtype, itemsize = _value_type(self.dtype)
            buf = pa.py_buffer(self.values)
            values = pa.Array.from_buffers(vtype, buf.size // itemsize, [None, buf])
            self._array = pa.Array.from_buffers(self.type, self.rows, [None, pa.py_buffer(self.offsets)], children=[values])
        return self._array

    @property
    def nbytes(self) -> int:
        return memoryview(self.offsets).nbytes + memoryview(self.values).nbytes


class FrameWriter:
    """Columns in, buffer frames and the ``BatchSpec`` that rebuilds them out.

    Token columns of one trajectory batch have equal offsets (one length per sample): they share
    one offsets frame, so four token columns are five frames, not eight."""

    def __init__(self) -> None:
        self.frames: list = []
        self._zero_copy: list[ColumnSpec] = []
        self._rest: dict[str, pa.Array] = {}
        self._offsets: dict[object, int] = {}  # offsets bytes, or id of a received frame -> frame index

    def add(self, name: str, col: pa.Array | FrameColumn) -> None:
        if isinstance(col, FrameColumn):  # sent back as it came
            at = self._offsets.get(id(col.offsets), -1)
            if at < 0:
                at = self._offsets[id(col.offsets)] = len(self.frames)
                self.frames.append(col.offsets)
            self.frames.append(col.values)
            self._zero_copy.append(ColumnSpec(name, col.dtype, at, len(self.frames) - 1))
            return
        info = _list_info(col.type)
        values = col.values if info is not None else None
        if values is None or col.null_count or values.null_count:
            self._rest[name] = col
            return
        width, dtype = info
        offsets = col.offsets.to_numpy()
        start, end = int(offsets[0]), int(offsets[-1])
        if start:
            offsets = offsets - np.int32(start)  # a slice of a bigger batch: rebase
        key = offsets.tobytes()
        at = self._offsets.get(key, -1)
        if at < 0:
            at = self._offsets[key] = len(self.frames)
            self.frames.append(key)
        self.frames.append(values.buffers()[1].slice((values.offset + start) * width, (end - start) * width))
        self._zero_copy.append(ColumnSpec(name, dtype, at, len(self.frames) - 1))

    def finish(self, num_rows: int, order: list[str]) -> tuple[BatchSpec, list]:
        ipc_frame = -1
        if self._rest:
            sink = pa.BufferOutputStream()
            small = pa.RecordBatch.from_arrays(list(self._rest.values()), names=list(self._rest))
            with pa.ipc.new_stream(sink, small.schema) as writer:
                writer.write_batch(small)
            self.frames.append(sink.getvalue())
            ipc_frame = len(self.frames) - 1
        return BatchSpec(num_rows, order, self._zero_copy, ipc_frame), self.frames


def encode_batch(batch: pa.RecordBatch) -> tuple[BatchSpec, list]:
    """Frames to send after the metadata frame, and the spec that rebuilds the batch."""
    out = FrameWriter()
    names = batch.schema.names
    for name, arr in zip(names, batch.columns, strict=True):
        out.add(name, arr)
    return out.finish(batch.num_rows, names)


def decode_columns(spec: BatchSpec, frames: list, schema: pa.Schema | None = None) -> dict[str, pa.Array | FrameColumn]:
    """The batch's columns by name, in ``spec.order``: token columns as ``FrameColumn`` views of
    ``frames`` (their offsets checked against their values), the rest as Arrow arrays.

    ``schema``: field metadata to apply to the token columns where it names them (the item field
    name and nullability), so a round trip returns the schema that was sent.
    """
    last = max([spec.ipc_frame, *(max(c.offsets_frame, c.values_frame) for c in spec.zero_copy)])
    if last >= len(frames):
        raise ValueError(f"the batch's columns name buffer frame {last}, but the message carries {len(frames)} buffer frames")
    known = _fields_by_name(schema)
    cols: dict[str, pa.Array | FrameColumn] = {}
    for c in spec.zero_copy:
        field = known.get(c.name)
        ltype = field.type if field is not None else pa.list_(_value_type(c.value_type)[0])
        cols[c.name] = FrameColumn(c.name, ltype, spec.num_rows, c.value_type, frames[c.offsets_frame], frames[c.values_frame])
    if spec.ipc_frame >= 0:
        small = pa.ipc.open_stream(pa.py_buffer(frames[spec.ipc_frame])).read_next_batch()
        for name, arr in zip(small.schema.names, small.columns, strict=True):
            cols[name] = arr
    missing = [n for n in spec.order if n not in cols]
    if missing:
        raise ValueError(f"batch frames lack columns {missing}")
    return {n: cols[n] for n in spec.order}


def decode_batch(
    spec: BatchSpec, frames: list, schema: pa.Schema | None = None, *, keys: pa.Array | None = None
) -> pa.RecordBatch:
    """Rebuild the batch; token columns are views of ``frames`` (kept alive by the arrays).
    ``keys``: a ``key`` column to put in front (a reply that left it out: the asker knows it)."""
    known = _fields_by_name(schema)
    arrays = [] if keys is None else [keys]
    fields = [] if keys is None else [known.get("key") or pa.field("key", keys.type)]
    for n, col in decode_columns(spec, frames, schema).items():
        arr = col.array() if isinstance(col, FrameColumn) else col
        field = known.get(n)
        arrays.append(arr)
        fields.append(field if field is not None and field.type == arr.type else pa.field(n, arr.type))
    return pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields))


# Every put and get decodes a batch: look-ups by name in a pyarrow schema (``schema.names``
# builds a list each call) were most of ``decode_batch``'s time (``psrl bench queue`` profile).
_BY_NAME: dict[int, tuple[pa.Schema, dict[str, pa.Field]]] = {}  # id -> (schema kept alive, fields)


def _fields_by_name(schema: pa.Schema | None) -> dict[str, pa.Field]:
    if schema is None:
        return {}
    hit = _BY_NAME.get(id(schema))
    if hit is None or hit[0] is not schema:
        if len(_BY_NAME) > 16:
            _BY_NAME.clear()
        hit = _BY_NAME[id(schema)] = (schema, {f.name: f for f in schema})
    return hit[1]


@functools.lru_cache(maxsize=32)
def _value_type(name: str) -> tuple[pa.DataType, int]:
    dtype = np.dtype(name)
    return pa.from_numpy_dtype(dtype), dtype.itemsize


def frame_bytes(frames: list) -> int:
    return sum(memoryview(f).nbytes for f in frames)
