"""The peer's side of ``psrl bench queue``: PyPI ``transferqueue`` (on Ray) on the same workload.

Runs in the separate venv that ``benchmarks/setup_peer_venv.sh`` builds (it cannot import psrl),
as a server driven round by round over stdin, so that ``benchmarks/queue.py`` can interleave its
rounds with ours (ABBA). Protocol, one JSON line per answer on stdout:

- start-up: ``{"ready": true, "transport": "tcp", "units": N}`` (the peer binds tcp only; it has
  no ipc transport);
- ``round``: ``{"seconds": s}``: ``--concurrency`` producers put every chunk with
  ``async_kv_batch_put`` (by key), then as many consumers take batches with the client's
  ``async_get_meta`` (consumption tracked per task, like our ``get_meta``) and fetch them with
  ``async_get_data``; every round uses fresh keys and a fresh partition, cleared afterwards;
- ``meta_fill``: puts ``--meta-batches`` x 1,024 reward-only samples (the same number ours holds);
- ``meta K``: times K ``async_get_meta`` calls of 1,024 samples: ``{"ms": [...]}``;
- ``quit``.

Same workload as ours: n trajectories x tokens of response ids (int32), log-probs (float32),
loss mask (int8) and versions (int32), and the scalar ``min_version`` (int32; production derives
it from the versions as it builds a batch), in chunks of ``--chunk``. Settings: the package defaults
(SimpleStorage, metrics off, no SSD offload, polling off) with ``--units`` storage units (default
2, the documented default and the recommendation for one node). Ray runs locally on loopback.
"""

from __future__ import annotations

import os
import sys

# This file's folder holds benchmarks/queue.py, which would shadow the stdlib `queue` module.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def serve(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    from omegaconf import OmegaConf
    from tensordict import TensorDict

    import transfer_queue as tq

    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": args.units}}}))
    client = tq.get_client()
    rng = np.random.default_rng(0)
    n, t = args.n, args.tokens
    cols = {
        "response_ids": torch.from_numpy(rng.integers(0, 150_000, (n, t), dtype=np.int32)),
        "logprobs": torch.from_numpy(-rng.random((n, t), dtype=np.float32)),
        "loss_mask": torch.ones((n, t), dtype=torch.int8),
        "versions": torch.zeros((n, t), dtype=torch.int32),
        "min_version": torch.zeros(n, dtype=torch.int32),  # the scalar column ours and the relay carry
    }
    fields = list(cols)
    starts = list(range(0, n, args.chunk))
    chunks = [TensorDict({k: v[i : i + args.chunk] for k, v in cols.items()}, batch_size=min(args.chunk, n - i)) for i in starts]
    loop = asyncio.get_running_loop()
    say({"ready": True, "transport": "tcp", "units": args.units})
    rounds = 0
    while True:
        line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
        if not line or line[0] == "quit":
            return
        if line[0] == "round":
            part = f"r{rounds}"
            keys = [[f"r{rounds}-s{i + j}" for j in range(c.batch_size[0])] for i, c in zip(starts, chunks, strict=True)]
            rounds += 1
            todo = list(range(len(chunks)))

            async def produce() -> None:
                while todo:
                    i = todo.pop()
                    await tq.async_kv_batch_put(keys=keys[i], partition_id=part, fields=chunks[i])

            async def consume() -> None:
                while todo:
                    size = chunks[todo.pop()].batch_size[0]
                    meta = await client.async_get_meta(data_fields=fields, batch_size=size, partition_id=part, task_name="bench")
                    data = await client.async_get_data(meta)
                    assert data.batch_size[0] == size, data.batch_size

            t0 = time.perf_counter()
            async with asyncio.TaskGroup() as tg:
                for _ in range(args.concurrency):
                    tg.create_task(produce())
            todo = list(range(len(chunks)))
            async with asyncio.TaskGroup() as tg:
                for _ in range(args.concurrency):
                    tg.create_task(consume())
            seconds = time.perf_counter() - t0
            await client.async_clear_partition(part)
            say({"seconds": seconds})
        elif line[0] == "meta_fill":
            for b in range(args.meta_batches):
                await tq.async_kv_batch_put(
                    keys=[f"m{b}-{i}" for i in range(1024)], partition_id="meta",
                    fields=TensorDict({"reward": torch.zeros(1024)}, batch_size=1024),
                )
            say({"held": args.meta_batches * 1024})
        elif line[0] == "meta":
            times = []
            for _ in range(int(line[1])):
                t0 = time.perf_counter()
                meta = await client.async_get_meta(data_fields=["reward"], batch_size=1024, partition_id="meta", task_name="bench")
                times.append((time.perf_counter() - t0) * 1e3)
                assert meta.size == 1024, meta.size
            say({"ms": times})
        else:
            say({"error": f"unknown command {line[0]!r}"})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--meta-batches", type=int, default=100)
    ap.add_argument("--units", type=int, default=2)
    args = ap.parse_args()

    import ray

    import transfer_queue as tq

    # address="local": a private cluster, never one another process on this machine started.
    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        asyncio.run(serve(args))
        tq.close()
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
