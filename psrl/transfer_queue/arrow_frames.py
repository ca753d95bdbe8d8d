"""Record batch <-> buffer frames, without copying token data.

Token columns (``list<int32|float32|int8|...>`` without nulls) travel as two frames each: the
int32 offsets and the values buffer itself (a zero-copy slice of the Arrow buffer, read back as
a zero-copy view of the received ZeroMQ frame). Everything else (keys, rewards, status strings,
maps) is small and goes in one Arrow IPC stream frame.
"""

from __future__ import annotations

import functools

import numpy as np
import pyarrow as pa

from .messages import BatchSpec, ColumnSpec

_NUMERIC = (pa.types.is_integer, pa.types.is_floating)


def _zero_copy_ok(arr: pa.Array) -> bool:
    t = arr.type
    return (
        pa.types.is_list(t)
        and any(f(t.value_type) for f in _NUMERIC)
        and arr.null_count == 0
        and arr.values.null_count == 0
    )


def encode_batch(batch: pa.RecordBatch) -> tuple[BatchSpec, list]:
    """Frames to send after the metadata frame, and the spec that rebuilds the batch."""
    frames: list = []
    zero_copy: list[ColumnSpec] = []
    rest_names: list[str] = []
    rest_cols: list[pa.Array] = []
    for name, arr in zip(batch.schema.names, batch.columns, strict=True):
        if not _zero_copy_ok(arr):
            rest_names.append(name)
            rest_cols.append(arr)
            continue
        offsets = arr.offsets.to_numpy()
        start, end = int(offsets[0]), int(offsets[-1])
        if start:
            offsets = offsets - np.int32(start)  # a slice of a bigger batch: rebase
        values = arr.values
        width = values.type.bit_width // 8
        data = values.buffers()[1]
        first = (values.offset + start) * width
        frames.append(np.ascontiguousarray(offsets, np.int32))
        frames.append(data.slice(first, (end - start) * width))
        zero_copy.append(ColumnSpec(name, values.type.to_pandas_dtype().__name__, len(frames) - 2, len(frames) - 1))
    ipc_frame = -1
    if rest_cols:
        sink = pa.BufferOutputStream()
        small = pa.RecordBatch.from_arrays(rest_cols, names=rest_names)
        with pa.ipc.new_stream(sink, small.schema) as writer:
            writer.write_batch(small)
        frames.append(sink.getvalue())
        ipc_frame = len(frames) - 1
    return BatchSpec(batch.num_rows, list(batch.schema.names), zero_copy, ipc_frame), frames


def decode_batch(spec: BatchSpec, frames: list, schema: pa.Schema | None = None) -> pa.RecordBatch:
    """Rebuild the batch; token columns are views of ``frames`` (kept alive by the arrays).

    ``schema``: field metadata to apply to the token columns where it names them (the item field
    name and nullability), so a round trip returns the schema that was sent.
    """
    last = max([spec.ipc_frame, *(max(c.offsets_frame, c.values_frame) for c in spec.zero_copy)])
    if last >= len(frames):
        raise ValueError(f"the batch's columns name buffer frame {last}, but the message carries {len(frames)} buffer frames")
    known = _fields_by_name(schema)
    cols: dict[str, pa.Array] = {}
    for c in spec.zero_copy:
        vtype, itemsize = _value_type(c.value_type)
        values_buf = pa.py_buffer(frames[c.values_frame])
        values = pa.Array.from_buffers(vtype, values_buf.size // itemsize, [None, values_buf])
        field = known.get(c.name)
        ltype = field.type if field is not None else pa.list_(vtype)
        cols[c.name] = pa.Array.from_buffers(
            ltype, spec.num_rows, [None, pa.py_buffer(frames[c.offsets_frame])], children=[values]
        )
    if spec.ipc_frame >= 0:
        small = pa.ipc.open_stream(pa.py_buffer(frames[spec.ipc_frame])).read_next_batch()
        for name, arr in zip(small.schema.names, small.columns, strict=True):
            cols[name] = arr
    missing = [n for n in spec.order if n not in cols]
    if missing:
        raise ValueError(f"batch frames lack columns {missing}")
    fields = []
    for n in spec.order:
        field = known.get(n)
        fields.append(field if field is not None and field.type == cols[n].type else pa.field(n, cols[n].type))
    return pa.RecordBatch.from_arrays([cols[n] for n in spec.order], schema=pa.schema(fields))


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
