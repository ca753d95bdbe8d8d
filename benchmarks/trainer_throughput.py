"""The throughput half of ``psrl bench trainer``: MegatronTrainer against plain transformers + AdamW.

Each arm lives in a process of its own (:class:`ArmProcess`), and the arms run in interleaved
rounds, order alternating (ABBA), one at a time; each round times ``steps`` optimizer steps after
one warm-up step per arm, and the best and the median round of each arm are reported. The
baseline is a hand-written loop: transformers (SDPA attention) + torch AdamW (fused, as ours),
fp32 on CPU, bf16 on CUDA, padded micro-batches of the same token budget over the same sequences
(all of one length, so neither arm pays for padding), on CPU with the trainer's allocator setting
(its fastest mode); a third arm there runs the loop with glibc's defaults (``hf_default_allocator``).

``--shape`` builds a random-weight HF checkpoint in a real model's shape (vocabulary included) so
the output layer costs what it costs in real use. ``mem_growth_4x_tokens`` runs :func:`mem_probe`
in fresh processes.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# Real layer shapes (Hugging Face configs of the released models).
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}
_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0}  # dense bf16


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def make_batch(n: int, prompt: int, response: int, vocab: int, seed: int = 0):
    from psrl.trajectory import Trajectory

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        r = rng.integers(0, vocab, response)
        out.append(
            Trajectory(
                key=f"b{i}", group_id=f"g{i // 4}", prompt_ids=rng.integers(0, vocab, prompt), response_ids=r,
                loss_mask=np.ones(response), logprobs=np.full(response, -5.0), versions=np.zeros(response),
                turn_bounds=[[0, response]], turn_rewards=[float(i % 2)], reward=float(i % 2),
            )
        )
    return out


def build_shape(name: str, directory: Path) -> str:
    """A random-weight Qwen2 checkpoint (bf16 safetensors) in the shape ``name``; reused if present."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r} ({', '.join(SHAPES)})")
    out = directory / name
    if (out / "config.json").is_file():
        return str(out)
    cfg = Qwen2Config(**SHAPES[name], max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    return str(out)


def trainer_config(device: str, budget: int, recompute: str = "none", lora_rank: int = 0):
    """The production settings the bench measures: only the device-dependent dtype is chosen.
    ``lora_rank`` > 0: LoRA adapters of that rank on every projection (``trainer.lora``)."""
    from psrl.config import LoraConfig, OptimConfig, TrainerConfig

    return TrainerConfig(device=device, micro_batch_tokens=budget, dtype="float32" if device == "cpu" else "bfloat16",
                         recompute=recompute, optim=OptimConfig(lr=1e-6), lora=LoraConfig(rank=lora_rank))


class MegatronArm:
    def __init__(self, path: str, device: str, budget: int, lora_rank: int = 0) -> None:
        from psrl.trainer.trainer import MegatronTrainer

        self.trainer = MegatronTrainer(path, trainer_config(device, budget, lora_rank=lora_rank))
        self.n_params = sum(p.numel() for p in self.trainer.model.parameters())

    def step(self, batch) -> None:
        self.trainer.step(batch)

    def close(self) -> None:
        self.trainer.close()


class HFArm:
    """transformers + torch AdamW: padded micro-batches of about ``budget`` tokens."""

    def __init__(self, path: str, device: str, budget: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch, self.device, self.budget = torch, device, budget
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device)
        # Its fastest mode, as ours: the fused kernel (on CPU the default path is a Python loop
        # over the parameters, ~7x slower on SmolLM2).
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-6, fused=True)
        self.n_params = sum(p.numel() for p in self.model.parameters())

    def step(self, batch) -> None:
        torch = self.torch
        seqs = [torch.from_numpy(np.concatenate([t.prompt_ids, t.response_ids]).astype(np.int64)) for t in batch]
        per_mb = max(1, self.budget // max(len(s) for s in seqs))
        adv = torch.tensor([t.reward - 0.5 for t in batch], device=self.device)
        self.opt.zero_grad()
        for i in range(0, len(seqs), per_mb):
            ids = torch.nn.utils.rnn.pad_sequence(seqs[i : i + per_mb], batch_first=True).to(self.device)
            logp = torch.log_softmax(self.model(ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
            (-(logp.mean(-1) * adv[i : i + per_mb]).sum() / len(seqs)).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()

    def close(self) -> None:
        del self.model, self.opt


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


ARM_KINDS = ("psrl", "hf", "hf_default_allocator", "psrl_lora")


def _arm_main(conn, kind: str, path: str, device: str, budget: int, batch_spec: tuple, lora_rank: int = 8) -> None:
    """One arm's process: build the arm, then answer ``(command, arg)`` until ``close``."""
    import traceback
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        keeps = False  # whether glibc keeps freed memory in this process (psrl.allocator)
        if kind == "hf" and device == "cpu":  # its fastest mode: what MegatronTrainer does on CPU
            from psrl.allocator import keep_freed_memory

            keeps = keep_freed_memory()
        if kind == "psrl_lora":  # the same trainer, adapters of ``lora_rank`` over a frozen base
            arm = MegatronArm(path, device, budget, lora_rank)
        else:
            arm = (MegatronArm if kind == "psrl" else HFArm)(path, device, budget)
        if kind.startswith("psrl"):
            keeps = arm.trainer.keeps_freed_memory
        batch = make_batch(*batch_spec)
        if device == "cuda":  # the peak of the steps, not of loading the checkpoint
            import torch

            torch.cuda.reset_peak_memory_stats()
        conn.send(("ok", (arm.n_params, keeps)))
        while True:
            command, arg = conn.recv()
            if command == "close":
                arm.close()
                conn.send(("ok", None))
                return
            if command == "run":  # arg steps: (wall seconds, CPU seconds of this process, all threads)
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(arg):
                    arm.step(batch)
                _sync(device)
                elapsed = (time.perf_counter() - t0, time.process_time() - c0)
                if device == "cuda":  # the arms share one GPU: an idle one holds no cached blocks
                    import torch

                    torch.cuda.empty_cache()
                conn.send(("ok", elapsed))
            elif command == "copies":
                conn.send(("ok", count_copies(arm.trainer, batch)))
            elif command == "peak_gb":
                conn.send(("ok", _peak_gb(device)))
            else:
                conn.send(("error", f"unknown command {command!r}"))
    except BaseException:  # the parent gets the traceback, not a bare EOF
        conn.send(("error", traceback.format_exc()))


class ArmProcess:
    """One arm of the throughput bench in a process of its own.

    Process-wide settings never cross from one arm to the other this way: each arm's are chosen.
    MegatronTrainer on CPU tells glibc to keep freed memory (``trainer.cpu_keep_freed_memory``);
    when both arms shared a process the transformers loop got that by accident. It is the loop's
    fastest mode (a tiny step 60-66 ms with it, 71-96 ms without; 2026-12-06, separate processes,
    alternating), so the ``hf`` arm on CPU sets it on purpose, and ``hf_default_allocator`` is the
    loop as users write it, printed beside. Only one arm runs at a time: the others wait on their
    pipe."""

    def __init__(self, kind: str, path: str, device: str, budget: int, batch_spec: tuple, lora_rank: int = 8) -> None:
        import multiprocessing as mp

        if kind not in ARM_KINDS:
            raise ValueError(f"unknown arm {kind!r} ({', '.join(ARM_KINDS)})")
        ctx = mp.get_context("spawn")  # a fresh interpreter: no state inherited from this one
        self.kind = kind
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_arm_main, args=(child, kind, path, device, budget, batch_spec, lora_rank),
                                name=f"bench-arm-{kind}", daemon=True)
        self.proc.start()
        child.close()
        try:
            self.n_params, self.keeps_freed_memory = self._reply()
        except RuntimeError:
            self._reap()  # the worker has returned after its error
            raise

    def _reply(self):
        try:
            status, value = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(f"the {self.kind} arm's process died (exit code {self.proc.exitcode})") from None
        if status != "ok":
            raise RuntimeError(f"the {self.kind} arm failed:\n{value}")
        return value

    def call(self, command: str, arg=None):
        self.conn.send((command, arg))
        return self._reply()

    def run(self, steps: int) -> tuple[float, float]:
        return self.call("run", steps)

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.call("close")
        finally:
            self._reap()

    def _reap(self) -> None:
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


def abba(arms: dict[str, ArmProcess], tokens: int, steps: int, rounds: int) -> dict[str, list[float]]:
    """tokens/s of every round for each arm; round r runs the arms in order, reversed when r is odd.

    Also ``<arm>_cpu``: tokens per second of the arm process's CPU time (all threads). On a shared
    CPU machine wall time counts the other tenants' load; CPU time mostly does not, so the two
    ratios together say how much of a difference is the code. Not meaningful on CUDA."""
    names = list(arms)
    for name in names:  # warm-up: kernels, allocator, optimizer state
        arms[name].run(1)
    out: dict[str, list[float]] = {n: [] for n in names} | {f"{n}_cpu": [] for n in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            wall, cpu = arms[name].run(steps)
            out[name].append(tokens * steps / wall)
            out[f"{name}_cpu"].append(tokens * steps / max(cpu, 1e-9))
    return out


def summarize(prefix: str, rates: dict[str, list[float]]) -> dict[str, float]:
    a, b = rates["psrl"], rates["hf"]
    figures = {
        f"{prefix}_tokens_per_s": round(max(a), 1),
        f"{prefix}_tokens_per_s_median": round(statistics.median(a), 1),
        f"{prefix}_hf_tokens_per_s": round(max(b), 1),
        f"{prefix}_hf_tokens_per_s_median": round(statistics.median(b), 1),
        f"{prefix}_vs_hf": round(max(a) / max(b), 3),
        f"{prefix}_vs_hf_median": round(statistics.median(a) / statistics.median(b), 3),
    }
    if rates.get("psrl_cpu"):
        ac, bc = rates["psrl_cpu"], rates["hf_cpu"]
        figures[f"{prefix}_vs_hf_cpu_time"] = round(max(ac) / max(bc), 3)
        figures[f"{prefix}_vs_hf_cpu_time_median"] = round(statistics.median(ac) / statistics.median(bc), 3)
    if rates.get("psrl_lora"):  # LoRA against full fine-tuning, the same trainer and batch
        c = rates["psrl_lora"]
        figures[f"{prefix}_lora_tokens_per_s"] = round(max(c), 1)
        figures[f"{prefix}_lora_tokens_per_s_median"] = round(statistics.median(c), 1)
        figures[f"{prefix}_lora_vs_full"] = round(max(c) / max(a), 3)
        figures[f"{prefix}_lora_vs_full_median"] = round(statistics.median(c) / statistics.median(a), 3)
    if rates.get("hf_default_allocator"):
        c = rates["hf_default_allocator"]
        figures[f"{prefix}_hf_default_allocator_tokens_per_s"] = round(max(c), 1)
        figures[f"{prefix}_vs_hf_default_allocator"] = round(max(a) / max(c), 3)
        figures[f"{prefix}_vs_hf_default_allocator_median"] = round(statistics.median(a) / statistics.median(c), 3)
    return figures


def mfu(n_params: int, tokens_per_s: float, peak_tflops: float | None) -> float | None:
    """6 N flops per trained token (the attention term is left out: it is small at these lengths)."""
    return None if not peak_tflops else round(6 * n_params * tokens_per_s / (peak_tflops * 1e12), 4)


def peak_tflops(device: str, given: float | None) -> float | None:
    if device != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name()
    return given or next((v for k, v in _PEAK_TFLOPS.items() if k in name), None)


def count_copies(trainer, batch) -> dict[str, int]:
    """One profiled step: ``aten::copy_`` calls, the conversions of whole tensors among the
    ``to()`` calls (0-dim ones are Python scalars wrapped by an op, not dtype churn), and the
    scalar reads of a tensor by the host (``.item()``, ``float(t)``: on CUDA each waits for the
    GPU's queue to drain)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        trainer.step(batch)
    copies = casts = reads = 0
    for e in prof.events():
        if e.name == "aten::copy_":
            copies += 1
        elif e.name == "aten::_to_copy" and e.input_shapes and len(e.input_shapes[0]) > 0:
            casts += 1
        elif e.name == "aten::_local_scalar_dense":
            reads += 1
    return {"copy_calls_per_step": copies, "tensor_casts_per_step": casts, "host_scalar_reads_per_step": reads}


# ---- memory growth: one fresh process per size ----------------------------------------------------


def _rss_hwm_reset() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (peak RSS) to the current RSS
        return True
    except OSError:
        return False


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def mem_probe(path: str, tokens: int, device: str, recompute: str = "none") -> dict[str, float]:
    """Peak memory of one step at ``tokens`` per micro-batch above the level before it. Model,
    gradient buffers and optimizer state exist before (a small warm-up step creates Adam's state)."""
    import gc

    import torch

    from psrl.trainer.trainer import MegatronTrainer

    seq = 1024 if tokens >= 1024 else tokens
    batch = make_batch(max(1, tokens // seq), 32, seq - 32, 49000)
    with MegatronTrainer(path, trainer_config(device, tokens, recompute)) as tr:
        tr.step(make_batch(1, 8, 24, 49000, seed=1))
        gc.collect()
        if device == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            metrics = tr.step(batch)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            if not _rss_hwm_reset():
                raise RuntimeError("cannot reset the peak RSS (/proc/self/clear_refs)")
            base = _status_kb("VmRSS") * 1024
            t0 = time.perf_counter()
            metrics = tr.step(batch)
            peak = _status_kb("VmHWM") * 1024
    return {"tokens": tokens, "base_gb": base / 1e9, "growth_gb": (peak - base) / 1e9, "loss": metrics["loss"],
            "grad_norm": metrics["grad_norm"], "micro_batches": metrics["micro_batches"],
            "step_s": time.perf_counter() - t0 if device == "cpu" else float("nan")}


def mem_growth(path: str, device: str, small: int = 1024, factor: int = 4) -> dict[str, float]:
    res = {}
    for n in (small, small * factor):
        cmd = [sys.executable, "-m", "benchmarks.trainer_throughput", "--mem-probe", path, str(n), device]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=os.environ.copy())
        if out.returncode != 0:
            raise RuntimeError(f"memory probe at {n} tokens failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
        res[n] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"memory probe, {n} tokens: {res[n]} load {load()}", flush=True)
    a, b = res[small]["growth_gb"], res[small * factor]["growth_gb"]
    return {
        f"mem_growth_{factor}x_tokens": round(b / a, 2),
        f"mem_step_gb_{small}": round(a, 3),
        f"mem_step_gb_{small * factor}": round(b, 3),
    }


def _peak_gb(device: str) -> float:
    """This process's peak: CUDA's allocator, or on CPU the resident set."""
    if device == "cuda":
        import torch

        return round(torch.cuda.max_memory_allocated() / 1e9, 2)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 2)


if __name__ == "__main__":  # python -m benchmarks.trainer_throughput --mem-probe PATH TOKENS DEVICE
    import warnings

    warnings.filterwarnings("ignore")
    if len(sys.argv) in (5, 6) and sys.argv[1] == "--mem-probe":
        print(json.dumps(mem_probe(sys.argv[2], int(sys.argv[3]), sys.argv[4], *sys.argv[5:])))
    else:
        raise SystemExit("usage: python -m benchmarks.trainer_throughput --mem-probe PATH TOKENS DEVICE [RECOMPUTE]")
