"""The transfer queue on Ray: the controller and each storage unit (with one unit, the
controller holds it) are Ray actors serving over ZeroMQ tcp; clients (the driver's scheduler,
trainer ranks) connect with a plain ``QueueHandle``.

Ray only places the services and carries the endpoints and CURVE keys at start-up; trajectory
data never goes through Ray. Each service binds on its node (``bind_host``: an address, or "node"
for the node's address as Ray reports it) on a port ZeroMQ picks.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio

from psrl.config.schema import RayConfig
from psrl.config.transfer_queue import TransferQueueConfig
from psrl.log import get_logger
from psrl.transfer_queue import CurveKeys, QueueHandle, run_controller, run_storage_unit

from .common import actor_options, kill_actors, wait_started

log = get_logger("psrl.ray")

_STOP_TIMEOUT_S = 10.0


class QueueServiceActor:
    """One queue service (controller or storage unit) on a thread of its own with an anyio loop.

    ``start`` returns once the service is bound (or raises its start-up error); ``stop`` ends it
    and closes its sockets."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._status: queue.Queue[tuple[str, str]] = queue.Queue()
        self._failure: str | None = None

    def start(
        self, kind: str, cfg_json: str, bind_host: str, index: int, curve: CurveKeys | None, units: list[str], timeout_s: float
    ) -> str:
        if self._thread is not None:
            raise RuntimeError("this queue service is already started")
        if bind_host == "node":
            import ray

            bind_host = ray.util.get_node_ip_address()
        cfg = TransferQueueConfig.model_validate_json(cfg_json)
        args = (kind, cfg, f"tcp://{bind_host}:*", index, curve, units)
        self._thread = threading.Thread(target=self._main, args=args, name=f"psrl-tq-{kind}-{index}", daemon=True)
        self._thread.start()
        try:
            status, detail = self._status.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"queue {kind} {index} did not bind within {timeout_s:g} s") from None
        if status != "ready":
            raise RuntimeError(f"queue {kind} {index} failed to start: {detail}")
        return detail

    def failure(self) -> str | None:
        """Why the service stopped on its own, if it did."""
        return self._failure

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(_STOP_TIMEOUT_S)

    def _main(self, kind: str, cfg: TransferQueueConfig, endpoint: str, index: int, curve: CurveKeys | None, units: list[str]) -> None:
        import zmq

        from psrl.allocator import keep_freed_memory
        from psrl.transfer_queue.rpc import start_authenticator

        keep_freed_memory()  # the actor's process serves the queue only
        ctx = zmq.Context()
        auth = start_authenticator(ctx, curve) if curve else None
        try:
            anyio.run(self._serve, kind, cfg, ctx, endpoint, index, curve, units)
        except BaseException as exc:
            self._failure = f"{type(exc).__name__}: {exc}"
            self._status.put(("error", self._failure))
            log.error("queue service stopped", kind=kind, index=index, error=self._failure)
        finally:
            if auth is not None:
                auth.stop()
            ctx.destroy(linger=0)

    async def _serve(self, kind: str, cfg: TransferQueueConfig, ctx: Any, endpoint: str, index: int,
                     curve: CurveKeys | None, units: list[str]) -> None:
        async with anyio.create_task_group() as tg:
            if kind == "unit":
                bound = await tg.start(partial(run_storage_unit, curve=curve), ctx, endpoint, index)
            else:
                bound = await tg.start(partial(run_controller, curve=curve), ctx, endpoint, cfg, units)
            self._status.put(("ready", bound))
            await anyio.to_thread.run_sync(self._stop.wait, abandon_on_cancel=True)
            tg.cancel_scope.cancel()


def bind_host(tq: TransferQueueConfig, ray_cfg: RayConfig) -> str:
    host = ray_cfg.queue_host or tq.host
    if host not in ("127.0.0.1", "localhost", "::1") and not tq.curve_auth:
        log.warning("the transfer queue listens beyond loopback without authentication; set transfer_queue.curve_auth=true",
                    host=host)
    return host


@asynccontextmanager
async def start_ray_transfer_queue(tq: TransferQueueConfig, ray_cfg: RayConfig) -> AsyncIterator[QueueHandle]:
    """Run the controller and ``tq.storage_units`` units as actors for the block; yields the
    handle clients connect with. The transport is always tcp (the services may sit on any node)."""
    import ray

    if tq.transport != "tcp":
        log.info("launcher=ray runs the transfer queue over tcp", configured=tq.transport)
    cfg = tq.model_copy(update={"transport": "tcp", "in_process": False})
    curve = CurveKeys.generate() if cfg.curve_auth else None
    host = bind_host(cfg, ray_cfg)
    cls = ray.remote(QueueServiceActor).options(**actor_options(ray_cfg.queue))
    units = [cls.remote() for _ in range(cfg.unit_services)]
    controller = cls.remote()
    actors = [*units, controller]
    started = False
    timeout = ray_cfg.actor_start_timeout_s
    try:
        cfg_json = cfg.model_dump_json()
        unit_refs = [u.start.remote("unit", cfg_json, host, i, curve, [], timeout) for i, u in enumerate(units)]
        unit_eps = await anyio.to_thread.run_sync(
            wait_started, unit_refs, [f"storage unit {i}" for i in range(len(units))], timeout, abandon_on_cancel=True
        )
        ctl_ref = controller.start.remote("controller", cfg_json, host, 0, curve, unit_eps, timeout)
        (ctl_ep,) = await anyio.to_thread.run_sync(wait_started, [ctl_ref], ["queue controller"], timeout, abandon_on_cancel=True)
        started = True
        log.info("transfer queue on ray", controller=ctl_ep, units=unit_eps, curve=curve is not None)
        yield QueueHandle(ctl_ep, tuple(unit_eps), curve, cfg.request_timeout_s, cfg.wait_slice_s)
    finally:
        with anyio.CancelScope(shield=True):
            if started:
                await anyio.to_thread.run_sync(_stop_all, actors)
            kill_actors(actors)


def _stop_all(actors: list[Any]) -> None:
    import ray

    refs = [a.stop.remote() for a in actors]
    try:
        ray.wait(refs, num_returns=len(refs), timeout=_STOP_TIMEOUT_S + 5)
    except ray.exceptions.RayError:  # a service already gone: it is killed next anyway
        pass
