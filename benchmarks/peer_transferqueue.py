"""The peer's side of ``psrl bench queue``: PyPI ``transferqueue`` (on Ray) on the same workload.

Runs in the separate venv made by ``benchmarks/setup_peer_venv.sh`` (it cannot import psrl) and
prints one JSON line: ``{"gbps": ..., "meta_p50_ms": ..., "meta_p99_ms": ...}``.
Same workload as ``benchmarks/queue.py``: n trajectories x tokens of response ids (int32),
log-probs (float32), loss mask (int8) and versions (int32), put in chunks by key with
``kv_batch_put``, then read back by key with ``kv_batch_get``; then ``get_meta`` round trips for
1,024-sample batches. Ray runs locally on loopback with 4 CPUs (its two storage units and
controller are actors).
"""

from __future__ import annotations

import os
import sys

# This file's folder holds benchmarks/queue.py, which would shadow the stdlib `queue` module.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--meta-batches", type=int, default=20)
    args = ap.parse_args()

    import numpy as np
    import ray
    import torch
    from tensordict import TensorDict

    import transfer_queue as tq

    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        tq.init()
        rng = np.random.default_rng(0)
        n, t = args.n, args.tokens
        cols = {
            "response_ids": torch.from_numpy(rng.integers(0, 150_000, (n, t), dtype=np.int32)),
            "logprobs": torch.from_numpy(-rng.random((n, t), dtype=np.float32)),
            "loss_mask": torch.ones((n, t), dtype=torch.int8),
            "versions": torch.zeros((n, t), dtype=torch.int32),
        }
        nbytes = sum(c.numel() * c.element_size() for c in cols.values())
        fields = list(cols)
        best = 0.0
        for r in range(args.rounds + 1):  # round 0 warms up
            part = f"r{r}"
            keys = [f"s{i}" for i in range(n)]
            t0 = time.perf_counter()
            for i in range(0, n, args.chunk):
                sl = slice(i, i + args.chunk)
                td = TensorDict({k: v[sl] for k, v in cols.items()}, batch_size=len(keys[sl]))
                tq.kv_batch_put(keys=keys[sl], partition_id=part, fields=td)
            for i in range(0, n, args.chunk):
                got = tq.kv_batch_get(keys=keys[i : i + args.chunk], partition_id=part, select_fields=fields)
                assert got.batch_size[0] == len(keys[i : i + args.chunk])
            t2 = time.perf_counter()
            tq.kv_clear(keys=keys, partition_id=part)
            if r:
                best = max(best, nbytes / (t2 - t0) / 1e9)

        client = tq.get_client()
        batches = args.meta_batches
        for b in range(batches):
            keys = [f"m{b}-{i}" for i in range(1024)]
            tq.kv_batch_put(keys=keys, partition_id="meta", fields=TensorDict({"reward": torch.zeros(1024)}, batch_size=1024))
        times = []
        for _ in range(batches):
            t0 = time.perf_counter()
            meta = client.get_meta(data_fields=["reward"], batch_size=1024, partition_id="meta", task_name="bench")
            times.append((time.perf_counter() - t0) * 1e3)
            assert meta.size == 1024, meta.size
        print(json.dumps({
            "gbps": best, "meta_p50_ms": float(np.percentile(times, 50)), "meta_p99_ms": float(np.percentile(times, 99)),
        }))
        tq.close()
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
