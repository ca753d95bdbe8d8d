"""Turning what a producer puts into one checked record batch, and per-sample metadata from it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from psrl.trajectory import NO_VERSION, TRAJECTORY_SCHEMA, Trajectory, to_arrow

from .messages import SampleUpdate

Puttable = Sequence[Trajectory] | pa.RecordBatch | pa.Table | Mapping[str, Any]
Tags = Mapping[str, str] | Sequence[Mapping[str, str]] | None


def as_batch(data: Puttable) -> pa.RecordBatch:
    """Trajectories, an Arrow batch/table, or ``{"key": [...], field: column, ...}``.

    A column in the trajectory schema must have the schema's type; other fields are free.
    """
    if isinstance(data, pa.Table):
        data = data.combine_chunks()
        batch = data.to_batches()[0] if data.num_rows else pa.RecordBatch.from_pylist([], schema=data.schema)
    elif isinstance(data, pa.RecordBatch):
        batch = data
    elif isinstance(data, Mapping):
        cols = {name: _column(name, col) for name, col in data.items()}
        batch = pa.RecordBatch.from_arrays(list(cols.values()), names=list(cols))
    else:
        trajs = list(data)
        for t in trajs:
            if not isinstance(t, Trajectory):
                raise TypeError(f"batch_put takes Trajectory objects, a record batch or a column mapping; got {type(t).__name__}")
            t.validate()
        batch = to_arrow(trajs)
    _check(batch)
    return batch


def _column(name: str, col: Any) -> pa.Array:
    if isinstance(col, pa.ChunkedArray):
        return col.combine_chunks()
    if isinstance(col, pa.Array):
        return col
    if name in TRAJECTORY_SCHEMA.names:
        return pa.array(col, TRAJECTORY_SCHEMA.field(name).type)
    return pa.array(col)


def _check(batch: pa.RecordBatch) -> None:
    names = batch.schema.names
    if "key" not in names:
        raise ValueError(f"a put needs a 'key' column; got columns {names}")
    if len(set(names)) != len(names):
        raise ValueError(f"a put repeats columns: {names}")
    if len(names) < 2:
        raise ValueError("a put needs at least one field besides 'key'")
    if batch.num_rows == 0:
        raise ValueError("a put needs at least one row")
    key = batch.column("key")
    if not pa.types.is_string(key.type) or key.null_count:
        raise ValueError(f"'key' must be a string column without nulls (got {key.type}, {key.null_count} nulls)")
    for name, typ in zip(names, batch.schema.types, strict=True):
        want = _SCHEMA_TYPES.get(name)
        if want is not None and typ != want:
            raise ValueError(f"column {name!r} has type {typ}; the trajectory schema says {want}")


_SCHEMA_TYPES = {f.name: f.type for f in TRAJECTORY_SCHEMA}  # looked up per put: built once


def sample_update(batch: pa.RecordBatch, tags: Tags) -> SampleUpdate:
    names = batch.schema.names
    col = batch.column
    seq_lens = None
    if "prompt_ids" in names and "response_ids" in names:
        seq_lens = (_lengths(col("prompt_ids")) + _lengths(col("response_ids"))).tolist()
    return SampleUpdate(
        group_ids=col("group_id").to_pylist() if "group_id" in names else None,
        seq_lens=seq_lens,
        min_versions=_min_versions(batch),
        statuses=col("status").to_pylist() if "status" in names else None,
        tags=_tags(tags, batch.num_rows),
    )


def _min_versions(batch: pa.RecordBatch) -> list[int] | None:
    """The producer's ``min_version`` column (``to_arrow`` derives it as it builds the batch), else
    one pass over the ``versions`` tokens (a batch built by hand)."""
    names = batch.schema.names
    if "min_version" in names and not batch.column("min_version").null_count:
        return batch.column("min_version").to_numpy().tolist()
    return min_versions(batch.column("versions")).tolist() if "versions" in names else None


def _lengths(arr: pa.ListArray) -> np.ndarray:
    off = arr.offsets.to_numpy()
    return np.diff(off).astype(np.int64)


def min_versions(arr: pa.ListArray) -> np.ndarray:
    """Oldest generated-token version per row (``NO_VERSION`` where a row generated nothing)."""
    off = arr.offsets.to_numpy()
    # A sliced column shares its parent's values: look only at this slice's run of them.
    vals = arr.values.to_numpy(zero_copy_only=False)[off[0] : off[-1]]
    starts = (off[:-1] - off[0]).astype(np.intp)
    out = np.full(len(arr), NO_VERSION, np.int64)
    nonempty = off[1:] > off[:-1]
    if nonempty.any():
        # Seen as uint32, NO_VERSION (-1) is the largest value: one pass, no masked copy.
        mins = np.minimum.reduceat(vals.astype(np.int32, copy=False).view(np.uint32), starts[nonempty]).astype(np.int64)
        mins[mins == np.iinfo(np.uint32).max] = NO_VERSION
        out[nonempty] = mins
    return out


def _tags(tags: Tags, n: int) -> list[dict[str, str]] | None:
    if tags is None:
        return None
    if isinstance(tags, Mapping):
        rows = [dict(tags)] * n
    else:
        rows = [dict(t) for t in tags]
        if len(rows) != n:
            raise ValueError(f"got {len(rows)} tag dicts for {n} samples")
    for r in rows:
        for k, v in r.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ValueError(f"tags must map str to str; got {k!r}: {v!r}")
    return rows
