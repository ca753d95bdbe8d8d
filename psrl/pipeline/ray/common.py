"""What every part of ``launcher=ray`` shares: joining or starting the cluster, actor options from
config, and awaiting Ray results from anyio code.

The event loop never blocks on ``ray.get``: results are awaited through ``resolve``, which works
on asyncio and trio alike (Ray's own ``await ref`` serves asyncio only). A blocking ``ray.get`` is
used only in worker threads (the trainer's step) and in set-up/tear-down code outside the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import anyio
import sniffio

from psrl.config.schema import ActorResources, RayConfig
from psrl.log import get_logger

log = get_logger("psrl.ray")

# Ray rewrites 127.0.0.1 to the machine's outward address unless this is set; on machines where
# only loopback traffic is allowed a driver then hangs, so a loopback run sets it (unless the
# user did), and actors inherit it through ``forward_env``.
_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


class RayLaunchError(RuntimeError):
    """A component could not be placed or started on the cluster (the message says which)."""


def actor_env(cfg: RayConfig) -> dict[str, str]:
    """The environment every actor gets: forwarded driver variables, then ``cfg.env_vars``."""
    env = {name: os.environ[name] for name in cfg.forward_env if name in os.environ}
    env.update(cfg.env_vars)
    return env


def actor_options(res: ActorResources, *, max_concurrency: int | None = None) -> dict[str, Any]:
    """``ActorClass.options(**...)`` for one component from its resource request. Actors are
    anonymous (two runs on one cluster never collide) and not restarted: a restarted component
    would have lost its state, so a dead one is reported instead. Their environment is the job's
    (``ray_cluster``)."""
    opts: dict[str, Any] = {"num_cpus": res.num_cpus, "num_gpus": res.num_gpus, "max_restarts": 0}
    if res.resources:
        opts["resources"] = dict(res.resources)
    if res.memory_gb is not None:
        opts["memory"] = int(res.memory_gb * 2**30)
    if max_concurrency is not None:
        opts["max_concurrency"] = max_concurrency
    return opts


@contextlib.contextmanager
def ray_cluster(cfg: RayConfig) -> Iterator[None]:
    """Join ``cfg.address`` ("auto", "host:port") or start a private cluster ("local") for the
    block. A private cluster is shut down at the end; a joined one only loses this driver (the
    launcher kills its own actors before)."""
    import ray

    if ray.is_initialized():
        raise RayLaunchError("ray is already initialized in this process; launcher=ray starts its own driver")
    if _is_loopback(cfg.address):
        for key, value in _LOOPBACK_ENV.items():
            os.environ.setdefault(key, value)
    kwargs: dict[str, Any] = {
        "address": cfg.address,
        "namespace": cfg.namespace,
        "runtime_env": {"env_vars": actor_env(cfg)},
        "include_dashboard": False,
        "log_to_driver": True,
    }
    if cfg.address == "local":
        kwargs["num_cpus"], kwargs["num_gpus"] = cfg.num_cpus, cfg.num_gpus
    elif cfg.num_cpus is not None or cfg.num_gpus is not None:
        raise RayLaunchError(f"ray.num_cpus / ray.num_gpus size a private cluster only (ray.address={cfg.address!r} joins one)")
    try:
        ray.init(**kwargs)
    except ConnectionError as e:
        raise RayLaunchError(f"cannot join the Ray cluster at ray.address={cfg.address!r}: {e}") from None
    log.info("ray cluster", address=cfg.address, resources=ray.cluster_resources())
    try:
        yield
    finally:
        ray.shutdown()


def _is_loopback(address: str) -> bool:
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS", "auto")
    host = address.removeprefix("ray://").rsplit(":", 1)[0]
    return address == "local" or host in ("127.0.0.1", "localhost", "::1", "[::1]") or host.startswith("127.")


def wait_started(refs: Sequence[Any], what: Sequence[str], timeout_s: float) -> list[Any]:
    """``ray.get`` on actor start-up calls, with an error that names the component and what the
    cluster still has free when it could not be placed in time. Blocking: call it in a thread."""
    import ray

    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    if pending:
        names = [w for r, w in zip(refs, what) if r in pending]
        raise RayLaunchError(
            f"{', '.join(names)} did not start within {timeout_s:g} s (ray.actor_start_timeout_s): the cluster may lack "
            f"the resources asked for in ray.* (available now: {ray.available_resources()})"
        )
    out = []
    for ref, name in zip(refs, what):
        try:
            out.append(ray.get(ref))
        except ray.exceptions.RayError as e:
            raise RayLaunchError(f"{name} failed to start: {e}") from e
    return out


def kill_actors(actors: Sequence[Any]) -> None:
    """Kill actors now (their processes exit; nothing they held survives)."""
    import ray

    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception as e:  # already gone with its node: nothing left to release
            log.debug("kill of a gone actor", error=str(e))


def _call_soon_threadsafe() -> Callable[[Callable[[], None]], None]:
    """A non-blocking way to run a callback on the current event loop from another thread.

    Non-blocking matters: Ray runs completion callbacks on its own thread, and a callback that
    waited for a busy event loop would stall every other result."""
    if sniffio.current_async_library() == "trio":
        import trio

        token = trio.lowlevel.current_trio_token()

        def soon(fn: Callable[[], None]) -> None:
            try:
                token.run_sync_soon(fn)
            except trio.RunFinishedError:  # the waiter's loop is gone: nobody to wake
                pass

        return soon
    loop = asyncio.get_running_loop()

    def soon(fn: Callable[[], None]) -> None:
        try:
            loop.call_soon_threadsafe(fn)
        except RuntimeError:  # loop closed
            pass

    return soon


async def resolve(ref: Any) -> Any:
    """Await an ``ObjectRef`` on asyncio or trio. Cancelling the wait does not cancel the remote
    call (callers that need that send their own abort)."""
    fut = ref.future()
    done = anyio.Event()
    soon = _call_soon_threadsafe()
    fut.add_done_callback(lambda _f: soon(done.set))
    await done.wait()
    return fut.result()
