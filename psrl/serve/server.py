"""The body of ``psrl serve``.

The engines are the training rollout subtree's (``gen_actor_rollout_ref``: model, engine,
sampling defaults, ``agent.tool_parser``); the gateway reads the ``gateway`` section. Admin API
(``Authorization: Bearer <admin token>``):

    POST   /sessions        {"session_id"?, "max_calls"?, "lock_sampling"?, "sampling"?: {...}}
                            -> 201 {"session_id", "base_url", "token", "model"}
    DELETE /sessions/{id}   -> 200 {"session_id", "calls", "failed_calls", "tool_call_errors", "closed_reason"}

A session closes on DELETE, after ``gateway.session_idle_timeout_s`` without calls, at its
``max_calls``, or when the server stops; then its trajectories (one per sample, merged by token
prefix) are written to ``<logging.output_dir>/sessions/<session id>.parquet`` in the trajectory
schema, with reward 0 (the server runs no verifier: score the rows offline). Stop the server with
Ctrl-C or SIGTERM; open sessions are then closed and written too.
"""

from __future__ import annotations

import contextlib
import secrets
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from psrl.config import ConfigError, PSRLConfig, SamplingConfig
from psrl.engines.base import SamplingParams
from psrl.gateway import ChatTokenizer, Gateway, SessionCapture
from psrl.log import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class ServeInfo:
    url: str
    admin_token: str
    sessions_dir: Path


def write_capture(capture: SessionCapture, sessions_dir: Path) -> Path | None:
    """The session's trajectories as ``<sessions_dir>/<id>.parquet`` (none when it made no call)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from psrl.trajectory import TRAJECTORY_SCHEMA, to_arrow

    trajs = capture.trajectories(capture.session_id, group_id=capture.session_id)
    if not trajs:
        return None
    sessions_dir.mkdir(parents=True, exist_ok=True)
    path = sessions_dir / f"{capture.session_id}.parquet"
    tmp = path.with_suffix(".parquet.tmp")
    pq.write_table(pa.Table.from_batches([to_arrow(trajs)], schema=TRAJECTORY_SCHEMA), tmp)
    tmp.replace(path)  # a reader never sees half a file
    return path


async def serve(
    cfg: PSRLConfig,
    *,
    port: int | None = None,
    engine: Any = None,
    tokenizer: Any = None,
    on_ready: Callable[[ServeInfo], None] | None = None,
) -> None:
    """Serve until cancelled (or SIGINT/SIGTERM when run by the CLI). ``engine`` and
    ``tokenizer`` (a Hugging Face tokenizer) replace the ones built from the config (tests)."""
    from psrl.agent_loops.tool_parsers import make_tool_parser

    gen = cfg.gen_actor_rollout_ref
    sessions_dir = Path(cfg.logging.output_dir) / "sessions"
    async with contextlib.AsyncExitStack() as stack:
        if tokenizer is None:
            tokenizer = await anyio.to_thread.run_sync(_load_tokenizer, gen.model.path)
        if engine is None:
            from psrl.engines.factory import open_engine

            try:
                engine = await stack.enter_async_context(open_engine(gen.rollout, gen.model))
            except ValueError as e:
                raise ConfigError(f"gen_actor_rollout_ref.rollout.engine: {e}") from None
        try:
            parser = make_tool_parser(gen.rollout.agent.tool_parser, tokenizer)
        except ValueError as e:
            raise ConfigError(f"gen_actor_rollout_ref.rollout.agent.tool_parser: {e}") from None
        admin_token = secrets.token_urlsafe(24)
        gateway = Gateway(
            engine, ChatTokenizer(tokenizer), settings=cfg.gateway, port=port, admin_token=admin_token,
            default_sampling=_sampling(gen.rollout.sampling), tool_parser=parser,
            max_model_len=getattr(engine, "max_model_len", None) or gen.rollout.engine.max_model_len,
        )  # fmt: skip

        async def on_close(capture: SessionCapture) -> None:
            path = await anyio.to_thread.run_sync(write_capture, capture, sessions_dir)
            log.info("session closed", session=capture.session_id, calls=capture.num_calls, reason=capture.closed_reason, parquet=str(path))

        gateway.sessions.on_close = on_close
        async with anyio.create_task_group() as tg:
            url = await tg.start(gateway.serve)
            try:
                if on_ready is not None:
                    on_ready(ServeInfo(url, admin_token, sessions_dir))
                await anyio.sleep_forever()
            finally:
                with anyio.CancelScope(shield=True):
                    for s in gateway.sessions.all():  # what was captured is written, not lost
                        await gateway.close_session(s.id, "server stopped")
                tg.cancel_scope.cancel()


def _sampling(cfg: SamplingConfig) -> SamplingParams:
    # Not engines.factory.sampling_from_config: importing that module imports vLLM (seconds),
    # which a server given its engine does not need.
    return SamplingParams(
        temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_tokens=cfg.max_tokens,
        stop=tuple(cfg.stop), stop_token_ids=tuple(cfg.stop_token_ids), seed=cfg.seed,
    )


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    from psrl.models import resolve_model_path

    try:
        return AutoTokenizer.from_pretrained(resolve_model_path(path))
    except (FileNotFoundError, OSError) as e:
        raise ConfigError(f"gen_actor_rollout_ref.model.path: {e}") from None


def _announce(info: ServeInfo) -> None:
    print(f"psrl serve: listening on {info.url}", flush=True)
    print(f"  admin token: {info.admin_token}", flush=True)
    print(
        f"  open a session:  curl -s -X POST {info.url}/sessions -H 'Authorization: Bearer {info.admin_token}' -d '{{}}'\n"
        f"  close it:        curl -s -X DELETE {info.url}/sessions/<session_id> -H 'Authorization: Bearer {info.admin_token}'\n"
        f"  trajectories of closed sessions: {info.sessions_dir}/<session_id>.parquet",
        flush=True,
    )


def run_serve(cfg: PSRLConfig, port: int | None = None) -> int:
    """The CLI entry: serve until Ctrl-C or SIGTERM, then close every session (writing it)."""

    async def main() -> None:
        async with anyio.create_task_group() as tg:

            async def stop_on_signal() -> None:
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for _ in signals:
                        print("psrl serve: stopping", file=sys.stderr, flush=True)
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(stop_on_signal)
            await serve(cfg, port=port, on_ready=_announce)

    anyio.run(main, backend="asyncio")  # vLLM runs on asyncio
    return 0
