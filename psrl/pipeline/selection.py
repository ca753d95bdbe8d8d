"""Which samples train: a finished group as it goes to the queue, and the rows of a batch the
trainer may step on (not FAILED, with a response)."""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc

from psrl.trajectory import Status, Trajectory


def _trainable(t: Trajectory) -> bool:
    return t.status != Status.FAILED and len(t.response_ids) > 0


def trainable_mask(batch: pa.RecordBatch) -> pa.Array:
    # A response's length is a scalar column when the batch holds no token data (sharded steps).
    length = batch.column("response_length") if "response_length" in batch.schema.names else pc.list_value_length(batch.column("loss_mask"))
    return pc.and_(pc.not_equal(batch.column("status"), str(Status.FAILED)), pc.greater(length, 0))


def trainable(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The rows of a batch the trainer may step on: not FAILED, with a response."""
    ok = trainable_mask(batch)
    return batch if pc.all(ok).as_py() else batch.filter(ok)


def keep_group(trajs: Sequence[Trajectory], group_size: int, on_failure: str) -> list[Trajectory]:
    """The group as it goes to the queue, or [] when it is dropped. Under ``keep_group`` its
    failed episodes go along (whole groups keep the GRPO sampler simple); the trainer never
    sees them (``trainable``) but the step metrics count them."""
    ok = [t for t in trajs if _trainable(t)]
    if not ok or len(trajs) < group_size or (len(ok) < len(trajs) and on_failure == "drop_group"):
        return []
    return list(trajs)
