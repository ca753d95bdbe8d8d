"""One profiled step of each arm of ``psrl bench trainer --shape`` on CUDA: where GPU and CPU time go.
Usage (GPU machine, after scripts/gpu_check.sh's install): python3 scripts/gpu_profile.py [shape]"""
import pathlib
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks import trainer_throughput as tt  # noqa: E402

shape = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-0.5b"
path = tt.build_shape(shape, pathlib.Path(tempfile.mkdtemp()))
batch = tt.make_batch(64, 32, 992, tt.SHAPES[shape]["vocab_size"])
for name, cls in (("psrl", tt.MegatronArm), ("hf", tt.HFArm)):
    arm = cls(path, "cuda", 4096)
    for _ in range(2):
        arm.step(batch)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    arm.step(batch)
    torch.cuda.synchronize()
    print(f"== {name}: step {time.perf_counter() - t0:.3f} s", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        arm.step(batch)
        torch.cuda.synchronize()
    ka = p.key_averages()
    print(ka.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70), flush=True)
    print(ka.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=70), flush=True)
    arm.close()
    del arm
    torch.cuda.empty_cache()
