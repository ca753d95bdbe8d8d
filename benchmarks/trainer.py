"""Trainer throughput and weight-sync time, each beside a baseline measured in the same run.

Training: tokens/s of ``MegatronTrainer.step`` (GRPO, packed micro-batches) on the tiny Qwen2 and
on SmolLM2-135M, against plain transformers + torch AdamW doing forward, backward and an
optimizer step of a policy-gradient loss on the same sequences (padded batch). Weight sync: see
``benchmarks/weight_sync.py`` (its figures are part of this benchmark's JSON). On a GPU also model FLOPs utilisation.
Prints a table, then with ``--json`` one JSON line: ``tiny_tokens_per_s``,
``smollm2_tokens_per_s``, ``weight_sync_s`` plus the baselines and ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings

import numpy as np

_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0}  # dense bf16


def _batch(n: int, prompt: int, response: int, vocab: int, seed: int = 0):
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


def _train_megatron(path: str, batch, steps: int, budget: int, device: str) -> tuple[float, float, int]:
    """(tokens/s, seconds per step, parameter count)."""
    from psrl.config import OptimConfig, TrainerConfig
    from psrl.trainer.trainer import MegatronTrainer

    cfg = TrainerConfig(device=device, micro_batch_tokens=budget, dtype="float32" if device == "cpu" else "bfloat16",
                        optim=OptimConfig(lr=1e-6))
    with MegatronTrainer(path, cfg) as tr:
        n_params = sum(p.numel() for p in tr.model.parameters())
        tr.step(batch)  # warm-up
        t0 = time.perf_counter()
        tokens = sum(tr.step(batch)["tokens"] for _ in range(steps))
        dt = time.perf_counter() - t0
    return tokens / dt, dt / steps, n_params


def _train_hf(path: str, batch, steps: int, budget: int) -> float:
    """Plain transformers: padded micro-batches of about ``budget`` tokens, AdamW."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    seqs = [torch.from_numpy(np.concatenate([t.prompt_ids, t.response_ids]).astype(np.int64)) for t in batch]
    per_mb = max(1, budget // max(len(s) for s in seqs))
    adv = torch.tensor([t.reward - 0.5 for t in batch])

    def one_step():
        opt.zero_grad()
        for i in range(0, len(seqs), per_mb):
            ids = torch.nn.utils.rnn.pad_sequence(seqs[i : i + per_mb], batch_first=True)
            logp = torch.log_softmax(model(ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
            (-(logp.mean(-1) * adv[i : i + per_mb]).sum() / len(seqs)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    one_step()
    t0 = time.perf_counter()
    for _ in range(steps):
        one_step()
    return sum(len(s) for s in seqs) * steps / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="psrl bench trainer", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2, help="timed steps per model (after one warm-up)")
    ap.add_argument("--tiny-batch", type=int, default=32)
    ap.add_argument("--smollm2-batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--response-len", type=int, default=96)
    ap.add_argument("--micro-batch-tokens", type=int, default=512)
    ap.add_argument("--skip-smollm2", action="store_true")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--peak-tflops", type=float, default=None, help="GPU peak for MFU (default: by device name)")
    ap.add_argument("--json", action="store_true", help="print one JSON line last")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from psrl.models import model_dir
    from psrl.trainer.distributed import resolve_device

    device = resolve_device(args.device)
    figures: dict[str, float | str] = {"device": device, "threads": torch.get_num_threads()}
    rows = []
    models = [("tiny", "tiny-qwen2", args.tiny_batch)] + ([] if args.skip_smollm2 else [("smollm2", "smollm2-135m", args.smollm2_batch)])
    for key, name, n in models:
        path = str(model_dir(name))
        vocab = 800 if key == "tiny" else 49000
        batch = _batch(n, args.prompt_len, args.response_len, vocab)
        tps, step_s, n_params = _train_megatron(path, batch, args.steps, args.micro_batch_tokens, device)
        hf_tps = _train_hf(path, batch, args.steps, args.micro_batch_tokens) if device == "cpu" else float("nan")
        figures[f"{key}_tokens_per_s"] = round(tps, 1)
        figures[f"{key}_hf_tokens_per_s"] = round(hf_tps, 1)
        figures[f"{key}_vs_hf"] = round(tps / hf_tps, 3) if hf_tps == hf_tps else float("nan")
        figures[f"{key}_step_s"] = round(step_s, 3)
        if device == "cuda":
            name_ = torch.cuda.get_device_name()
            peak = args.peak_tflops or next((v for k, v in _PEAK_TFLOPS.items() if k in name_), None)
            if peak:
                figures[f"{key}_mfu"] = round(6 * n_params * tps / (peak * 1e12), 4)
        rows.append((key, tps, hf_tps, step_s))

    from benchmarks import weight_sync  # the weight-sync figures: benchmarks/weight_sync.py

    sync_name = "tiny-qwen2" if args.skip_smollm2 else "smollm2-135m"
    figures.update(weight_sync.run(*weight_sync.export(sync_name, device), model_name=sync_name))

    print(f"{'model':10}{'psrl tok/s':>14}{'HF tok/s':>12}{'ratio':>8}{'step s':>9}")
    for key, tps, hf_tps, step_s in rows:
        print(f"{key:10}{tps:>14.1f}{hf_tps:>12.1f}{tps / hf_tps:>8.2f}{step_s:>9.2f}")
    print(weight_sync.format_line(figures))
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
