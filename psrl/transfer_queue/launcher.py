"""Start a queue: controller + storage units, in this process's task group or as processes.
With one storage unit the controller's process holds it (see ``controller``).

``start_transfer_queue(cfg)`` yields a ``QueueHandle``; ``handle.connect()`` yields a client.
The handle pickles (but for inproc queues), so other processes can connect to the same queue.
Service processes are spawned (not forked: no inherited sockets or threads), exit when the
parent's pipe closes, and are terminated, then killed, when the context exits.
"""

from __future__ import annotations

import gc
import ipaddress
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import anyio
import zmq

from psrl.allocator import keep_freed_memory
from psrl.config.transfer_queue import TransferQueueConfig

from .client import TransferQueueClient
from .controller import run_controller
from .rpc import first_error, start_authenticator
from .storage import run_storage_unit
from .zsocket import CurveKeys

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 60.0
_STOP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class QueueHandle:
    """How to reach a running queue. ``pids``: service name -> process id (empty in-process)."""

    controller_endpoint: str
    unit_endpoints: tuple[str, ...]
    curve: CurveKeys | None = None
    request_timeout_s: float = 30.0
    wait_slice_s: float = 2.0
    pids: dict[str, int] = field(default_factory=dict)
    context: zmq.Context | None = field(default=None, compare=False, repr=False)  # inproc needs it

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["context"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    @asynccontextmanager
    async def connect(self, ctx: zmq.Context | None = None) -> AsyncIterator[TransferQueueClient]:
        own = None
        if ctx is None:
            if self.controller_endpoint.startswith("inproc://") and self.context is None:
                raise ValueError("an inproc queue is reachable only from the process that started it (use ipc or tcp)")
            ctx = self.context or (own := zmq.Context())
        try:
            async with TransferQueueClient.connect(
                ctx, self.controller_endpoint, curve=self.curve, request_timeout_s=self.request_timeout_s,
                wait_slice_s=self.wait_slice_s,
            ) as client:
                yield client
        finally:
            if own is not None:
                own.term()


def _endpoints(cfg: TransferQueueConfig, ipc_dir: str | None) -> tuple[str, list[str]]:
    """The controller's endpoint and the storage unit processes' (none for one unit: the
    controller's process holds it)."""
    names = ["controller", *(f"unit-{i}" for i in range(cfg.unit_services))]
    if cfg.transport == "inproc":
        tag = uuid.uuid4().hex[:12]
        eps = [f"inproc://psrl-tq-{tag}-{n}" for n in names]
    elif cfg.transport == "ipc":
        eps = [f"ipc://{ipc_dir}/{n}" for n in names]
    else:
        eps = [f"tcp://{cfg.host}:*" for _ in names]
    return eps[0], eps[1:]


@asynccontextmanager
async def start_transfer_queue(
    cfg: TransferQueueConfig,
    *,
    context: zmq.Context | None = None,
    restore_from: str | None = None,
) -> AsyncIterator[QueueHandle]:
    """Run a queue for the duration of the block.

    ``cfg.in_process`` (default: only for inproc) runs the services as tasks of this event loop,
    sharing ``context``; otherwise each runs in its own spawned process. ``restore_from``: a
    checkpoint directory to load before the handle is handed out.
    """
    in_process = cfg.in_process if cfg.in_process is not None else cfg.transport == "inproc"
    if cfg.transport == "inproc" and not in_process:
        raise ValueError("transport 'inproc' works only with the services in this process (in_process=True)")
    if cfg.curve_auth and cfg.transport != "tcp":
        raise ValueError(f"curve_auth needs transport 'tcp' (got {cfg.transport!r})")
    if cfg.transport == "tcp" and not cfg.curve_auth and not _is_loopback(cfg.host):
        log.warning("transfer queue binds %s without curve_auth: anyone who can reach it can read and write samples", cfg.host)
    curve = CurveKeys.generate() if cfg.curve_auth else None
    ipc_dir = tempfile.mkdtemp(prefix="psrl-tq-") if cfg.transport == "ipc" else None
    try:
        ctl_ep, unit_eps = _endpoints(cfg, ipc_dir)
        runner = _run_in_process(cfg, ctl_ep, unit_eps, curve, context) if in_process else _run_processes(cfg, ctl_ep, unit_eps, curve)
        async with runner as handle:
            if restore_from is not None:
                async with handle.connect() as client:
                    await client.restore(restore_from)
            yield handle
    finally:
        if ipc_dir is not None:
            shutil.rmtree(ipc_dir, ignore_errors=True)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@asynccontextmanager
async def _run_in_process(
    cfg: TransferQueueConfig, ctl_ep: str, unit_eps: list[str], curve: CurveKeys | None, context: zmq.Context | None
) -> AsyncIterator[QueueHandle]:
    ctx = context or zmq.Context()
    auth = start_authenticator(ctx, curve) if curve else None
    try:
        with first_error():
            async with anyio.create_task_group() as tg:
                bound = [await tg.start(partial(run_storage_unit, curve=curve), ctx, ep, i) for i, ep in enumerate(unit_eps)]
                ctl = await tg.start(partial(run_controller, curve=curve), ctx, ctl_ep, cfg, bound)
                try:
                    yield QueueHandle(ctl, tuple(bound), curve, cfg.request_timeout_s, cfg.wait_slice_s, context=ctx)
                finally:
                    tg.cancel_scope.cancel()
    finally:
        if auth is not None:
            auth.stop()
        if context is None:
            ctx.term()


@asynccontextmanager
async def _run_processes(
    cfg: TransferQueueConfig, ctl_ep: str, unit_eps: list[str], curve: CurveKeys | None
) -> AsyncIterator[QueueHandle]:
    mp = multiprocessing.get_context("spawn")
    procs: dict[str, tuple[multiprocessing.Process, multiprocessing.connection.Connection]] = {}
    cfg_json = cfg.model_dump_json()
    try:
        # Spawn all at once (start-up dominates); the controller learns the units' endpoints later.
        for name, kind, ep, idx in [("controller", "controller", ctl_ep, 0)] + [
            (f"storage unit {i}", "unit", e, i) for i, e in enumerate(unit_eps)
        ]:
            parent, child = mp.Pipe()
            p = mp.Process(target=_service_main, args=(kind, cfg_json, ep, idx, curve, child), name=f"psrl-tq {name}", daemon=True)
            p.start()
            child.close()
            procs[name] = (p, parent)
        bound_units = [await _ready(f"storage unit {i}", *procs[f"storage unit {i}"]) for i in range(len(unit_eps))]
        procs["controller"][1].send(bound_units)
        bound_ctl = await _ready("controller", *procs["controller"])
        pids = {name: p.pid for name, (p, _) in procs.items()}
        yield QueueHandle(bound_ctl, tuple(bound_units), curve, cfg.request_timeout_s, cfg.wait_slice_s, pids)
    finally:
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for name, (p, conn) in procs.items():
                    tg.start_soon(_stop, name, p, conn)


async def _ready(name: str, p: multiprocessing.Process, conn: multiprocessing.connection.Connection) -> str:
    ok = await anyio.to_thread.run_sync(conn.poll, _START_TIMEOUT_S, abandon_on_cancel=True)
    if not ok:
        raise TimeoutError(f"{name} (pid {p.pid}) did not start within {_START_TIMEOUT_S:g} s")
    try:
        status, detail = conn.recv()
    except EOFError:
        raise RuntimeError(f"{name} (pid {p.pid}) exited during start-up with code {p.exitcode}") from None
    if status != "ready":
        raise RuntimeError(f"{name} failed to start: {detail}")
    return detail


async def _stop(name: str, p: multiprocessing.Process, conn: multiprocessing.connection.Connection) -> None:
    try:
        conn.close()  # the service sees EOF and shuts down cleanly
    except OSError:
        pass
    await anyio.to_thread.run_sync(p.join, _STOP_TIMEOUT_S)
    if p.is_alive():
        log.warning("%s (pid %s) did not stop within %g s; terminating", name, p.pid, _STOP_TIMEOUT_S)
        p.terminate()
        await anyio.to_thread.run_sync(p.join, _STOP_TIMEOUT_S)
    if p.is_alive():
        p.kill()
        await anyio.to_thread.run_sync(p.join)


def _service_main(kind: str, cfg_json: str, endpoint: str, index: int, curve: CurveKeys | None, conn) -> None:
    """Entry point of a service process."""
    logging.basicConfig(level=os.environ.get("PSRL_LOG_LEVEL", "WARNING"))
    cfg = TransferQueueConfig.model_validate_json(cfg_json)
    # Requests allocate many short-lived, acyclic objects (keys, metadata); the cyclic collector
    # then keeps rescanning the imported modules' objects for nothing (``psrl bench queue``
    # profile: ~8% of the services' samples in gc). Freeze what start-up made, collect rarely.
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)
    keep_freed_memory()  # puts arrive in fresh buffers, clears free them: reuse, no page faults
    ctx = zmq.Context()
    auth = start_authenticator(ctx, curve) if curve else None

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            try:
                if kind == "unit":
                    bound = await tg.start(partial(run_storage_unit, curve=curve), ctx, endpoint, index)
                else:
                    units = await anyio.to_thread.run_sync(conn.recv)
                    bound = await tg.start(partial(run_controller, curve=curve), ctx, endpoint, cfg, units)
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
                raise
            conn.send(("ready", bound))
            await anyio.to_thread.run_sync(_until_parent_leaves, conn, abandon_on_cancel=True)
            tg.cancel_scope.cancel()

    try:
        anyio.run(main)
    finally:
        if auth is not None:
            auth.stop()
        ctx.term()


def _until_parent_leaves(conn) -> None:
    try:
        while True:
            conn.recv()
    except (EOFError, OSError):
        return
