"""TransferQueue: a disaggregated trajectory store over ZeroMQ with Arrow columns.

Services
    A **controller** holds every sample's metadata (key, partition, group, status and user tags,
    sequence length, oldest policy version), which fields are ready (a reward may arrive after
    the tokens), and what each consumer has taken. **Storage units** hold the Arrow columns.
    Token columns cross the wire as zero-copy buffer frames beside one msgpack metadata frame.
    With one storage unit (the default) the controller's process holds it, and a put and a
    ``get_batch`` are one round trip each; with more, each unit is a process of its own and the
    controller never touches token data.
    Transports: inproc (services in this process), ipc and tcp (services in their own
    processes by default); tcp may add ZeroMQ CURVE (``curve_auth``). Everything binds to
    loopback unless ``host`` says otherwise.

Use
    ::

        cfg = TransferQueueConfig(transport="ipc", storage_units=2, capacity_samples=10_000)
        async with start_transfer_queue(cfg) as handle:          # spawns 1 + 2 processes
            async with handle.connect() as q:                   # a TransferQueueClient
                await q.batch_put(trajectories, partition="train")
                await q.put_fields(["k1"], {"reward": [1.0]})     # field-level readiness
                meta = await q.get_meta("train", 64, ["response_ids", "reward"], consumer="trainer",
                                        sampler=GRPOGroupSampler(group_size=8))
                batch = await q.get_data(meta, ["response_ids", "logprobs"])   # pa.RecordBatch
                meta, batch = await q.get_batch("train", 64, ["response_ids"], consumer="critic")

    ``handle`` pickles (ipc/tcp), so rollout and trainer processes can ``handle.connect()`` to the
    same queue. ``run_controller`` / ``run_storage_unit`` start single services in a task group
    (``task_status.started(endpoint)``) for custom layouts.

Semantics
    - ``put``/``batch_put`` wait while the queue holds ``capacity_samples``; the ``_nowait``
      forms raise ``WouldBlock``. A put returns once its data is stored; its commit (a
      notification) reaches the controller before any later request of the same client, so a
      client reads its own writes (closing a client confirms its last commits first).
    - ``clear`` returns after the storage units deleted the data.
    - ``get_meta`` hands a sample to a consumer once; other consumers still see it. A call that
      is cancelled hands its batch back. ``get_batch`` is ``get_meta`` then ``get_data`` of
      the same fields. ``clear`` frees samples.
    - Staleness: ``set_version(v)`` evicts every group holding a sample whose oldest generated
      token is older than ``v - max_staleness`` (``on_stale='refill'`` also queues the group for
      regeneration: ``take_refills``). ``acquire_rollouts``/``finish_rollouts`` implement the
      ``StalenessManager`` admission capacity ``(eta + v + 1) * B - (accepted + running)``.
    - ``checkpoint(path, with_data=...)`` / ``restore(path)`` (or ``start_transfer_queue(cfg,
      restore_from=path)``) carry metadata, consumption state and optionally the data across a
      restart.
    - A service that does not answer within ``request_timeout_s`` raises
      ``ControllerUnavailable`` / ``StorageUnitUnavailable`` naming it and the keys affected.
"""

from .base import TransferQueue
from .client import TRAJECTORY_FIELDS, TransferQueueClient
from .controller import Controller, run_controller
from .errors import (
    ControllerUnavailable, QueueError, RemoteError, ServiceUnavailable, StorageUnitUnavailable, WouldBlock,
)
from .launcher import QueueHandle, start_transfer_queue
from .meta import KVBatchMeta, QueueStatistics, Refill, RestoreReport, SampleInfo
from .samplers import GRPOGroupSampler, Sampler, SeqLenBalancedSampler, SequentialSampler, make_sampler
from .staleness import StalenessManager, StalenessStatistics
from .storage import ColumnStore, run_storage_unit
from .zsocket import CurveKeys

__all__ = [
    "TRAJECTORY_FIELDS", "ColumnStore", "Controller", "ControllerUnavailable", "CurveKeys", "GRPOGroupSampler",
    "KVBatchMeta", "QueueError", "QueueHandle", "QueueStatistics", "Refill", "RemoteError", "RestoreReport",
    "SampleInfo", "Sampler", "SeqLenBalancedSampler", "SequentialSampler", "ServiceUnavailable",
    "StalenessManager", "StalenessStatistics", "StorageUnitUnavailable", "TransferQueue", "TransferQueueClient",
    "WouldBlock", "make_sampler", "run_controller", "run_storage_unit", "start_transfer_queue",
]
