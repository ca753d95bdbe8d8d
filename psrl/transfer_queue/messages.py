"""Typed wire messages: one msgpack metadata frame, then any Arrow buffer frames.

Every message is a tagged struct; ``decode`` returns one of them and services ``match`` on the
type. A request frame is ``Envelope(id, body)``; the reply carries the same id.
"""

from __future__ import annotations

import msgspec

from .meta import KVBatchMeta, QueueStatistics, Refill, RestoreReport, SampleInfo
from .samplers import Sampler


class ColumnSpec(msgspec.Struct, frozen=True, array_like=True):
    """A list<primitive> column sent as two buffer frames: int32 offsets and raw values."""

    name: str
    value_type: str  # numpy dtype name, e.g. "int32"
    offsets_frame: int
    values_frame: int


class BatchSpec(msgspec.Struct, frozen=True, array_like=True):
    """How to rebuild a record batch from buffer frames. ``order`` is the column order; columns
    not in ``zero_copy`` travel together in one Arrow IPC stream frame (``ipc_frame``)."""

    num_rows: int
    order: list[str]
    zero_copy: list[ColumnSpec]
    ipc_frame: int = -1


class SampleUpdate(msgspec.Struct, frozen=True, kw_only=True):
    """Per-sample metadata derived from a put's columns; ``None`` where the put lacks the column."""

    group_ids: list[str] | None = None
    seq_lens: list[int] | None = None
    min_versions: list[int] | None = None
    statuses: list[str] | None = None
    tags: list[dict[str, str]] | None = None


class Cancel(msgspec.Struct, tag=True):
    """The caller gave up on waiting request ``id`` (same connection): stop waiting, no reply."""

    id: int


# ---- controller requests --------------------------------------------------------------------

class Hello(msgspec.Struct, tag=True):
    pass


class Reserve(msgspec.Struct, tag=True):
    partition: str
    keys: list[str]
    wait_s: float  # 0: answer at once (put_nowait)


class Commit(msgspec.Struct, tag=True):
    keys: list[str]
    fields: list[str]
    update: SampleUpdate


class Abort(msgspec.Struct, tag=True):
    keys: list[str]


class GetMeta(msgspec.Struct, tag=True):
    partition: str
    batch_size: int
    fields: list[str]
    consumer: str
    sampler: Sampler
    partial: bool
    wait_s: float


class Put(msgspec.Struct, tag=True):
    """Reserve, store and commit in one round trip, to a controller that holds the queue's only
    storage unit (``Welcome.holds_unit``); the columns follow as buffer frames. Waits like
    ``Reserve`` while the queue is full."""

    partition: str
    keys: list[str]
    fields: list[str]
    update: SampleUpdate
    batch: BatchSpec
    wait_s: float  # 0: answer at once (put_nowait)


class GetBatch(msgspec.Struct, tag=True):
    """``GetMeta`` answered with the batch's data too (``BatchData``), by a controller that holds
    the queue's only storage unit."""

    get: GetMeta


class Release(msgspec.Struct, tag=True):
    """Hand samples back to a consumer (a batch whose reply arrived after the caller gave up)."""

    consumer: str
    keys: list[str]


class ListKeys(msgspec.Struct, tag=True):
    partition: str | None


class Clear(msgspec.Struct, tag=True):
    partition: str | None
    keys: list[str] | None


class SetVersion(msgspec.Struct, tag=True):
    version: int


class AcquireRollouts(msgspec.Struct, tag=True):
    n: int
    wait_s: float


class FinishRollouts(msgspec.Struct, tag=True):
    accepted: int
    rejected: int


class TakeRefills(msgspec.Struct, tag=True):
    max_items: int


class Checkpoint(msgspec.Struct, tag=True):
    path: str
    with_data: bool


class Restore(msgspec.Struct, tag=True):
    path: str


class Stats(msgspec.Struct, tag=True):
    pass


# ---- storage unit requests ------------------------------------------------------------------

class UnitPut(msgspec.Struct, tag=True):
    keys: list[str]
    batch: BatchSpec


class UnitGet(msgspec.Struct, tag=True):
    keys: list[str]
    fields: list[str]


class UnitDelete(msgspec.Struct, tag=True):
    keys: list[str]


class UnitDump(msgspec.Struct, tag=True):
    path: str
    keys: list[str]


class UnitLoad(msgspec.Struct, tag=True):
    path: str


class UnitCount(msgspec.Struct, tag=True):
    pass


# ---- replies --------------------------------------------------------------------------------

class Ok(msgspec.Struct, tag=True):
    count: int = 0


class Failed(msgspec.Struct, tag=True):
    """The request was refused. ``kind``: the error class name there (ValueError, KeyError, ...)
    or ``WouldBlock``; ``keys``: samples concerned."""

    kind: str
    message: str
    keys: list[str] = []


class NotReady(msgspec.Struct, tag=True):
    """A wait slice ended without an answer; the client asks again (so a dead service is noticed
    within one slice plus the request timeout)."""


class Welcome(msgspec.Struct, tag=True):
    units: list[str]
    request_timeout_s: float
    holds_unit: bool = False  # the controller holds the only storage unit: Put and GetBatch work


class Reserved(msgspec.Struct, tag=True):
    units: list[int]
    new: list[bool]


class BatchMeta(msgspec.Struct, tag=True):
    meta: KVBatchMeta


class Data(msgspec.Struct, tag=True):
    batch: BatchSpec


class BatchData(msgspec.Struct, tag=True):
    meta: KVBatchMeta
    batch: BatchSpec


class Listing(msgspec.Struct, tag=True):
    samples: list[SampleInfo]


class Refills(msgspec.Struct, tag=True):
    items: list[Refill]


class Restored(msgspec.Struct, tag=True):
    report: RestoreReport


class StatsReply(msgspec.Struct, tag=True):
    stats: QueueStatistics


Body = (
    Cancel | Hello | Reserve | Commit | Abort | GetMeta | Put | GetBatch | Release | ListKeys | Clear | SetVersion | AcquireRollouts
    | FinishRollouts | TakeRefills | Checkpoint | Restore | Stats
    | UnitPut | UnitGet | UnitDelete | UnitDump | UnitLoad | UnitCount
    | Ok | Failed | NotReady | Welcome | Reserved | BatchMeta | Data | BatchData | Listing | Refills | Restored | StatsReply
)


class Envelope(msgspec.Struct, array_like=True):
    id: int
    body: Body


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Envelope)


def encode(req_id: int, body: Body) -> bytes:
    return _encoder.encode(Envelope(req_id, body))


def decode(frame: bytes | memoryview) -> Envelope:
    return _decoder.decode(frame)


def failed(exc: BaseException, keys: list[str] | None = None) -> Failed:
    if keys is None:
        named = getattr(exc, "keys", None)
        keys = named if isinstance(named, list) else []
    message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    return Failed(kind=type(exc).__name__, message=str(message), keys=list(keys))
