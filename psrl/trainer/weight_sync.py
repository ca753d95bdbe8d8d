"""Weight sync: after a step the trainer publishes HF-named tensors and a policy version.

- ``DirectPublisher``: the production path. A ``WeightSender`` in the trainer's process streams
  the exported tensors bucket by bucket straight into the engines' workers
  (``psrl.engines.weight_transfer``: shared memory on one machine, ZeroMQ tcp across machines,
  a broadcast group or CUDA IPC on GPUs); whoever drives it passes only metadata.
- ``sync_direct``: the orchestration both it and the Ray trainer use: start the sender(s), have
  every engine receive, retry a failed sync as a whole version (``weight_sync.retries``).
- ``InProcessPublisher``: engines with no worker to stream into (scripted, simulated engines):
  ``engine.update_weights`` with the tensors.

All report bytes and seconds in a :class:`SyncReport`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import anyio
import torch
import zmq

from psrl.config.weight_sync import WeightSyncConfig
from psrl.engines.base import InferenceEngine
from psrl.engines.weight_transfer import WeightTransferError
from psrl.engines.weight_transfer.sender import SendReport, WeightSender
from psrl.log import get_logger

log = get_logger("psrl.weight_sync")


@dataclass(frozen=True)
class SyncReport:
    version: int
    num_tensors: int
    bytes: int
    seconds: float
    targets: int  # engines (or engine workers) updated
    buckets: int = 0
    attempts: int = 1


@runtime_checkable
class WeightPublisher(Protocol):
    async def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncReport: ...

    async def aclose(self) -> None: ...


def _nbytes(named: Sequence[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def can_receive(engine: Any) -> bool:
    """Whether ``engine`` loads weights streamed from a sender (vLLM engines, their Router)."""
    if not (callable(getattr(engine, "receive_weights", None)) and callable(getattr(engine, "weight_receivers", None))):
        return False
    return bool(getattr(engine, "receives_weights", lambda: True)())


class InProcessPublisher:
    """Colocated engines: the same tensors are handed to every engine, concurrently."""

    def __init__(self, engines: Sequence[InferenceEngine]) -> None:
        self.engines = list(engines)

    async def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncReport:
        named = [(n, t.detach()) for n, t in named_tensors]
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for engine in self.engines:
                tg.start_soon(engine.update_weights, named, version)
        return SyncReport(version, len(named), _nbytes(named), time.perf_counter() - start, len(self.engines))

    async def aclose(self) -> None:
        pass


SendFn = Callable[[str, int], Awaitable[Sequence[SendReport]]]  # (sync id, receivers) -> one report per sender


async def sync_direct(engine: Any, sources: list[dict[str, Any]], send: SendFn, cancel: Callable[[], Awaitable[None]],
                      version: int, cfg: WeightSyncConfig, *, adapter: dict[str, Any] | None = None) -> SyncReport:
    """One version from the sender(s) behind ``sources`` into every worker of ``engine``.
    ``adapter``: the tensors are a LoRA adapter with this ``adapter_config.json``, which the
    engine serves over its base from then on (its requests name it), instead of weights.

    ``send(sync, receivers)`` runs the senders (in this process or in trainer actors) and
    ``cancel()`` stops them early. A failed attempt is retried as a whole version; the engines
    stay paused (or restored) in between, so none serves a mixture. The last failure is raised,
    naming the bucket."""
    start = time.perf_counter()
    receivers = int(engine.weight_receivers())
    if receivers < 1:
        raise RuntimeError(f"no engine worker to sync version {version} into")
    last: BaseException | None = None
    for attempt in range(cfg.retries + 1):
        sync = uuid.uuid4().hex
        spec = {"sync": sync, "version": int(version), "sources": sources, "plane": cfg.transport,
                "timeout_s": cfg.timeout_s, "keep_previous": cfg.keep_previous}
        if adapter is not None:
            spec["adapter"] = adapter
        reports: list[Sequence[SendReport]] = []
        send_error: list[BaseException] = []

        async def run_send() -> None:
            try:
                reports.append(await send(sync, receivers))
            except Exception as exc:  # the receiving side reports the failure with its bucket
                send_error.append(exc)

        failure: BaseException | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_send)
            try:
                await engine.receive_weights(spec, version, final=attempt == cfg.retries)
            except BaseException as exc:  # raised below, after the sender has stopped
                failure = exc
                with anyio.CancelScope(shield=True):
                    await cancel()
        if isinstance(failure, (WeightTransferError, RuntimeError)) and not isinstance(failure, anyio.get_cancelled_exc_class()):
            last = failure
            log.warning("weight sync failed", version=version, attempt=attempt + 1, error=str(failure))
            continue
        if failure is not None:
            raise failure
        rs = reports[0] if reports else ()
        return SyncReport(version, sum(r.num_tensors for r in rs), sum(r.bytes for r in rs), time.perf_counter() - start,
                          receivers, sum(r.buckets for r in rs), attempt + 1)
    assert last is not None
    raise last


class DirectPublisher:
    """The trainer process's own sender; ``publish`` streams a version into ``engine``'s workers
    (an engine without workers to stream into gets ``update_weights`` instead)."""

    def __init__(self, engine: Any, cfg: WeightSyncConfig | None = None, *, host: str = "127.0.0.1") -> None:
        self.engine = engine
        self.cfg = cfg or WeightSyncConfig()
        self.host = host
        self._ctx = zmq.Context()
        self.sender = WeightSender(self._ctx, host=host, bucket_bytes=self.cfg.bucket_bytes, window=self.cfg.window,
                                   timeout_s=self.cfg.timeout_s)

    def export_buffers(self) -> dict[str, torch.Tensor] | None:
        """The sender's shared-memory export buffers (``WeightSender.export_buffers``) when the
        engine streams from it; None for an engine handed the tensors themselves (it may keep
        them, and the buffers are rewritten by every export)."""
        return self.sender.export_buffers() if can_receive(self.engine) else None

    async def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *,
                      adapter: dict[str, Any] | None = None) -> SyncReport:
        """``adapter``: the tensors are a LoRA adapter of that config (``sync_direct``)."""
        named = [(n, t.detach()) for n, t in named_tensors]
        if not can_receive(self.engine):
            if adapter is not None:
                raise ValueError(f"{type(self.engine).__name__} cannot serve LoRA adapters; set trainer.lora.merge_for_rollout=true")
            return await InProcessPublisher([self.engine]).publish(named, version)
        if self.cfg.transport == "collective" and "collective" not in self.sender.planes:
            await self._join_group(named[0][1].device if named else torch.device("cpu"))
        if self.cfg.transport == "cuda_ipc" and "cuda_ipc" not in self.sender.planes:
            from psrl.engines.weight_transfer.cuda_ipc import CudaIpcPlane

            self.sender.add_plane(CudaIpcPlane(named[0][1].device))

        async def send(sync: str, receivers: int) -> list[SendReport]:
            return [await anyio.to_thread.run_sync(lambda: self.sender.send(named, version, receivers=receivers, sync=sync))]

        async def cancel() -> None:
            self.sender.cancel()

        return await sync_direct(self.engine, [self.sender.source()], send, cancel, version, self.cfg, adapter=adapter)

    async def _join_group(self, device: torch.device) -> None:
        """Form the broadcast group: this process as rank 0, then every engine worker. Formed
        once; the engines' workers must stay the same ones (a replica lost later fails the
        broadcasts: use tcp or shm where replicas come and go)."""
        from psrl.engines.weight_transfer.collective import CollectivePlane
        from psrl.trainer.distributed import free_port

        rendezvous = {"host": self.host, "port": free_port(), "world": 1 + int(self.engine.weight_receivers()),
                      "first_rank": 1, "timeout_s": self.cfg.timeout_s}
        planes: list[CollectivePlane] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: anyio.to_thread.run_sync(lambda: planes.append(CollectivePlane.join(rendezvous, device))))
            await self.engine.init_weight_group(rendezvous)
        self.sender.add_plane(planes[0])

    async def aclose(self) -> None:
        self.sender.close()
        self._ctx.term()
