"""Trainer throughput and weight-sync time, each beside a baseline measured in the same run.

Training (``benchmarks/trainer_throughput.py``): tokens/s of ``MegatronTrainer.step`` (GRPO,
packed micro-batches, production settings) on the tiny Qwen2 and on SmolLM2-135M, or with
``--shape`` on random weights in a real model's shape, against plain transformers + torch AdamW
(SDPA; fp32 on CPU, bf16 on CUDA) on the same sequences, in interleaved ABBA rounds, each arm in
its own process: best and median of each arm. On CPU the baseline keeps freed memory as the
trainer does (its fastest mode), and the loop with glibc's defaults is printed beside. Also
SmolLM2's step memory growth from 1,024 to 4,096 tokens per micro-batch (fresh processes) and the
copies per step (torch.profiler). Weight sync: see ``benchmarks/weight_sync.py`` (its figures are
part of this benchmark's JSON). On a GPU also model FLOPs utilisation. Prints a table with the
load average, then with ``--json`` one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import warnings

from benchmarks import trainer_throughput as tt

_batch = tt.make_batch  # the name other scripts used


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="psrl bench trainer", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2, help="timed steps per arm and round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved ABBA rounds (>= 3)")
    ap.add_argument("--tiny-batch", type=int, default=32)
    ap.add_argument("--smollm2-batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--response-len", type=int, default=96)
    ap.add_argument("--micro-batch-tokens", type=int, default=512)
    ap.add_argument("--skip-smollm2", action="store_true")
    ap.add_argument("--lora-rank", type=int, default=8,
                    help="rank of the LoRA arm (trainer.lora) beside full fine-tuning, and of the adapter sync; 0 skips both")
    ap.add_argument("--skip-mem", action="store_true", help="skip mem_growth_4x_tokens")
    ap.add_argument("--skip-sync", action="store_true", help="skip the weight-sync figure")
    ap.add_argument("--skip-vllm", action="store_true", help="skip the weight sync into a real vLLM engine")
    ap.add_argument("--shape", choices=sorted(tt.SHAPES), default=None,
                    help="only this random-weight model shape (real vocabulary), then the weight sync")
    ap.add_argument("--shape-batch", type=int, default=64)
    ap.add_argument("--shape-seq-len", type=int, default=1024)
    ap.add_argument("--shape-micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--peak-tflops", type=float, default=None, help="GPU peak for MFU (default: by device name)")
    ap.add_argument("--json", action="store_true", help="print one JSON line last")
    args = ap.parse_args(argv)
    if args.rounds < 3:
        ap.error("--rounds must be >= 3")
    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from psrl.models import model_dir
    from psrl.trainer.distributed import resolve_device

    device = resolve_device(args.device)
    peak = tt.peak_tflops(device, args.peak_tflops)
    figures: dict[str, float | str | None] = {"device": device, "threads": torch.get_num_threads(),
                                              "rounds": args.rounds, "steps_per_round": args.steps,
                                              "load_before": tt.load()}
    rows = []
    if args.shape:
        tmp = tempfile.mkdtemp(prefix="psrl-shape-")
        path = tt.build_shape(args.shape, __import__("pathlib").Path(tmp))
        vocab = tt.SHAPES[args.shape]["vocab_size"]
        runs = [("shape", path, args.shape_batch, args.shape_seq_len, args.shape_micro_batch_tokens, vocab)]
        figures["shape"] = args.shape
    else:
        seq = args.prompt_len + args.response_len
        runs = [("tiny", str(model_dir("tiny-qwen2")), args.tiny_batch, seq, args.micro_batch_tokens, 800)]
        if not args.skip_smollm2:
            runs.append(("smollm2", str(model_dir("smollm2-135m")), args.smollm2_batch, seq, args.micro_batch_tokens, 49000))
    for key, path, n, seq, budget, vocab in runs:
        prompt = min(args.prompt_len, seq // 2)
        spec = (n, prompt, seq - prompt, vocab)
        kinds = ["psrl", "hf"] + (["hf_default_allocator"] if device == "cpu" else []) + (["psrl_lora"] if args.lora_rank else [])
        arms: dict[str, tt.ArmProcess] = {}
        try:
            for kind in kinds:
                arms[kind] = tt.ArmProcess(kind, path, device, budget, spec, lora_rank=args.lora_rank)
            rates = tt.abba(arms, n * seq, args.steps, args.rounds)
            figures.update(tt.summarize(key, rates))
            figures.update({f"{key}_{k}": v for k, v in arms["psrl"].call("copies").items()})
            figures[f"{key}_mfu"] = tt.mfu(arms["psrl"].n_params, max(rates["psrl"]), peak)
            figures[f"{key}_hf_mfu"] = tt.mfu(arms["hf"].n_params, max(rates["hf"]), peak)
            figures[f"{key}_peak_gb"] = arms["psrl"].call("peak_gb")  # the trainer's process alone
            if "psrl_lora" in arms:
                figures[f"{key}_lora_peak_gb"] = arms["psrl_lora"].call("peak_gb")
                figures[f"{key}_lora_step_s"] = round(n * seq / figures[f"{key}_lora_tokens_per_s"], 4)
                figures[f"{key}_full_step_s"] = round(n * seq / figures[f"{key}_tokens_per_s"], 4)
        finally:
            for arm in arms.values():
                arm.close()
        rows.append((key, figures[f"{key}_tokens_per_s"], figures[f"{key}_hf_tokens_per_s"],
                     figures[f"{key}_tokens_per_s_median"], figures[f"{key}_hf_tokens_per_s_median"]))
        print(f"{key}: " + json.dumps({k: v for k, v in figures.items() if k.startswith(key)}) + f" load {tt.load()}", flush=True)
    if not args.shape and not args.skip_smollm2 and not args.skip_mem:
        try:
            figures.update(tt.mem_growth(str(model_dir("smollm2-135m")), device))
        except RuntimeError as e:  # e.g. the probe killed for memory on a loaded machine: keep the rest
            figures["mem_growth_error"] = str(e)[:500]
            print(f"mem_growth_4x_tokens: not measured: {e}", flush=True)
    figures["load_after"] = tt.load()

    print(f"{'model':10}{'psrl best':>11}{'HF best':>10}{'ratio':>7}{'psrl med':>10}{'HF med':>9}{'ratio':>7}   (tok/s)")
    for key, a, b, am, bm in rows:
        print(f"{key:10}{a:>11.1f}{b:>10.1f}{a / b:>7.2f}{am:>10.1f}{bm:>9.1f}{am / bm:>7.2f}")
    for key, *_ in rows:
        if f"{key}_vs_hf_default_allocator" in figures:
            d = {k: figures[f"{key}_{k}"] for k in ("hf_default_allocator_tokens_per_s", "vs_hf_default_allocator",
                                                    "vs_hf_default_allocator_median")}
            print(f"{key}: HF with glibc's default allocator settings (HF above keeps freed memory, as the trainer) "
                  f"{d['hf_default_allocator_tokens_per_s']} tok/s best; psrl/that {d['vs_hf_default_allocator']} best, "
                  f"{d['vs_hf_default_allocator_median']} median")
    if "mem_growth_4x_tokens" in figures:
        print(f"SmolLM2 step memory above pre-step: {figures['mem_step_gb_1024']} GB at 1,024 tokens, "
              f"{figures['mem_step_gb_4096']} GB at 4,096 (x{figures['mem_growth_4x_tokens']})")
    for key, *_ in rows:
        if f"{key}_vs_hf_cpu_time" in figures:
            print(f"{key} per CPU-second (all threads; less sensitive to other load): psrl/HF "
                  f"{figures[f'{key}_vs_hf_cpu_time']} best, {figures[f'{key}_vs_hf_cpu_time_median']} median")
    print(f"load average (1/5/15 min) before {figures['load_before']}, after {figures['load_after']}; "
          f"{args.rounds} ABBA rounds x {args.steps} steps per arm")
    for key, *_ in rows:
        if f"{key}_lora_vs_full" in figures:
            print(f"{key} LoRA rank {args.lora_rank} vs full fine-tuning: {figures[f'{key}_lora_tokens_per_s']} vs "
                  f"{figures[f'{key}_tokens_per_s']} tokens/s (x{figures[f'{key}_lora_vs_full']} best, "
                  f"x{figures[f'{key}_lora_vs_full_median']} median); peak {figures[f'{key}_lora_peak_gb']} vs "
                  f"{figures[f'{key}_peak_gb']} GB")
    if args.skip_sync or args.shape:
        if args.json:
            print(json.dumps(figures))
        return 0

    from benchmarks import weight_sync  # the weight-sync figures: benchmarks/weight_sync.py

    sync_name = "tiny-qwen2" if args.skip_smollm2 else "smollm2-135m"
    named, path, dtype = weight_sync.export(sync_name, device)
    figures.update(weight_sync.run(named, path, dtype, model_name=sync_name, device=device))
    if not args.skip_vllm:
        figures.update(weight_sync.vllm_figures(named, path, dtype))
        if args.lora_rank:
            from benchmarks.weight_sync_vllm import lora_sync_figures

            del named  # the full weights are exported again beside the adapters
            figures.update(lora_sync_figures(path, device, args.lora_rank, rounds=args.rounds))

    print(weight_sync.format_line(figures))
    if "lora_sync_vs_full" in figures:
        print(f"adapter sync (rank {figures['lora_rank']}, {figures['lora_sync_bytes'] / 1e6:.1f} MB): "
              f"{figures['lora_sync_s']} s vs full {figures['lora_full_sync_s']} s ({figures['lora_full_sync_bytes'] / 1e6:.0f} MB) "
              f"into the same vLLM engine: lora_sync_vs_full {figures['lora_sync_vs_full']} best, "
              f"{figures['lora_sync_vs_full_median']} median")
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
