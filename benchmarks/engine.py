"""``psrl bench engine``: Router + VLLMEngine against raw ``AsyncLLM``, on one engine, in one run.

Concurrent requests (the same count, prompt length, sampling params and seeds) go through PSRL
(an anyio caller -> Router -> VLLMEngine -> its loop thread -> AsyncLLM) and straight into the
same ``AsyncLLM`` on its own loop. Neither arm is favoured: the arms alternate in ABBA order
(direct, psrl, psrl, direct, ...), every round of every arm gets prompts of its own (fresh random
tokens, so no round finds another's prefix in vLLM's prefix cache), and the prefix cache is reset
before each round. Best and median of ``--rounds`` (>= 3) rounds per arm. Also times in-place
weight updates through the Router.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import time
from typing import Any

import anyio
import numpy as np


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="psrl bench engine", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-qwen2", help="offline model name or local HF directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--requests", type=int, default=64, help="concurrent requests per round")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=6, help="rounds per path (>= 3), in ABBA order")
    p.add_argument("--updates", type=int, default=5, help="weight updates to time")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument("--json", action="store_true", help="print one JSON line last")
    return p


async def _direct_round(llm: Any, prompts: list[list[int]], params: list[Any], tag: str) -> tuple[int, float]:
    """Raw AsyncLLM on its own loop: what a user of vLLM would write."""
    from vllm.inputs import TokensPrompt

    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        async for out in llm.generate(TokensPrompt(prompt_token_ids=prompts[i]), params[i], f"{tag}-{i}"):
            tokens += len(out.outputs[0].token_ids)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return tokens, time.perf_counter() - start


async def _psrl_round(router: Any, requests: list[Any]) -> tuple[int, float]:
    tokens = 0

    async def one(req: Any) -> None:
        nonlocal tokens
        res = await router.generate(req)
        if res.error:
            raise RuntimeError(f"request failed: {res.error}")
        tokens += len(res.output_ids)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for req in requests:
            tg.start_soon(one, req)
    return tokens, time.perf_counter() - start


def abba(rounds: int) -> list[str]:
    """Arm order: direct, psrl, psrl, direct, direct, psrl, ... (``rounds`` of each)."""
    return [arm for r in range(rounds) for arm in (("direct", "psrl") if r % 2 == 0 else ("psrl", "direct"))]


async def _reset_prefix_cache(engine: Any) -> None:
    await engine.run_in_engine_loop(engine.llm.reset_prefix_cache())


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.rounds < 3:
        parser.error("--rounds must be >= 3 (best and median of at least 3 rounds per arm)")
    from psrl.config import EngineConfig
    from psrl.engines import GenerateRequest, Router, SamplingParams, VLLMEngine
    from psrl.engines.vllm_args import sampling_params
    from psrl.models import resolve_model_path

    rng = np.random.default_rng(0)
    model_path = resolve_model_path(args.model)
    cfg = EngineConfig(
        max_model_len=args.max_model_len, cpu_kv_cache_gb=args.kv_cache_gb, max_num_seqs=max(args.requests, 1)
    )
    t0 = time.perf_counter()
    engine = VLLMEngine.launch(model_path, cfg, dtype=args.dtype, name="bench")
    startup_s = time.perf_counter() - t0
    try:
        vocab = engine.vocab_size
        samplings = [SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=i) for i in range(args.requests)]
        vllm_params = [sampling_params(s, s.max_tokens) for s in samplings]
        router = Router({"r0": engine}, close_replicas=False)
        runs: dict[str, list[tuple[int, float]]] = {"psrl": [], "direct": []}
        loads: list[float] = []
        for i, arm in enumerate(abba(args.rounds)):
            prompts = [rng.integers(3, vocab, args.prompt_len).tolist() for _ in range(args.requests)]  # this round's own
            anyio.run(_reset_prefix_cache, engine)
            loads.append(os.getloadavg()[0])
            if arm == "direct":
                runs[arm].append(anyio.run(engine.run_in_engine_loop, _direct_round(engine.llm, prompts, vllm_params, f"direct{i}")))
            else:
                requests = [GenerateRequest(np.asarray(p, np.int32), s) for p, s in zip(prompts, samplings)]
                runs[arm].append(anyio.run(_psrl_round, router, requests))
        psrl_runs, direct_runs = runs["psrl"], runs["direct"]

        import torch
        from safetensors.torch import load_file

        weights: dict[str, torch.Tensor] = {}
        for f in sorted(glob.glob(os.path.join(model_path, "*.safetensors"))):
            weights.update(load_file(f))
        update_s = []
        for v in range(1, args.updates + 1):
            new = {k: t + 0.01 * torch.randn_like(t) if t.is_floating_point() else t for k, t in weights.items()}
            start = time.perf_counter()
            anyio.run(router.update_weights, new.items(), v)
            update_s.append(time.perf_counter() - start)
        engine_update_s = engine.statistics().total_update_s / max(args.updates, 1)
    finally:
        engine.close()

    # Other work on the machine only ever slows a round down: the fastest round of each path is
    # the closest to its own cost (as timeit's min). Medians are reported alongside.
    psrl_rates = [t / s for t, s in psrl_runs]
    direct_rates = [t / s for t, s in direct_runs]
    psrl_tps, direct_tps = max(psrl_rates), max(direct_rates)
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "order": "ABBA (direct first), fresh prompts per round, prefix cache reset per round",
        "load_1min": [round(min(loads), 2), round(max(loads), 2)],
        "startup_s": round(startup_s, 2),
        "psrl_tokens_per_s": round(psrl_tps, 1),
        "direct_tokens_per_s": round(direct_tps, 1),
        "ratio": round(psrl_tps / direct_tps, 4),
        "psrl_tokens_per_s_median": round(statistics.median(psrl_rates), 1),
        "direct_tokens_per_s_median": round(statistics.median(direct_rates), 1),
        "ratio_median": round(statistics.median(psrl_rates) / statistics.median(direct_rates), 4),
        "weight_update_s": round(statistics.median(update_s), 4) if update_s else None,
        "weight_update_engine_s": round(engine_update_s, 4),
    }
    print(f"{args.rounds} rounds per arm in ABBA order, fresh prompts and a prefix-cache reset every round; "
          f"load (1 min) {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores")
    print(f"{'path':<28}{'best tok/s':>12}{'median tok/s':>14}")
    print(f"{'direct AsyncLLM':<28}{direct_tps:>12.1f}{result['direct_tokens_per_s_median']:>14.1f}")
    print(f"{'psrl Router + VLLMEngine':<28}{psrl_tps:>12.1f}{result['psrl_tokens_per_s_median']:>14.1f}")
    print(f"{'ratio (goal >= 0.95)':<28}{result['ratio']:>12.3f}{result['ratio_median']:>14.3f}")
    if update_s:
        print(f"weight update: {statistics.median(update_s):.4f} s median over {len(update_s)} "
              f"(engine side {engine_update_s:.4f} s); start-up {startup_s:.1f} s")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
