"""Everything Megatron-Core 0.16 needs to run on a CPU (gloo). Used only when the trainer's device
is cpu; the CUDA path never enters this module.

Megatron-Core assumes CUDA in a few places that do not depend on the math:
- the model-parallel RNG tracker snapshots CUDA generator states (the inference tracker does not);
- buffers (DDP grad buffers, the attention workspace) are allocated on ``torch.cuda.current_device()``;
- the optimizer wrapper and tied-embedding setup allocate with ``device="cuda"`` or call
  ``.cuda()`` at construction (``cuda_allocations_on_cpu``, a TorchFunctionMode: it sees every
  torch call, so it is never held around the hot path);
- the pipeline schedules allocate one token counter with ``device="cuda"`` per forward-backward;
  their module's ``torch`` is swapped for a proxy whose ``zeros`` allocates on cpu;
  pipeline p2p calls ``torch.cuda.synchronize()``;
- its grad-norm/clip code asserts CUDA tensors, so clipping is done here instead (``clip_grad_norm``);
- activation recompute snapshots the CUDA generator;
- the MoE all-to-all token dispatcher copies its split counts to the host on a side CUDA stream;
  its module's ``torch`` is swapped for a proxy whose ``cuda`` streams and events do nothing
  (on CPU every op has finished when it returns), and its host copy hands out numpy counts for
  CPU tensors too (it converts CUDA tensors only; ``all_to_all_single`` refuses tensor splits).

Not Megatron's doing but the CPU's: ``psrl.allocator.keep_freed_memory`` stops glibc from
unmapping what a step frees (``trainer.cpu_keep_freed_memory``).
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode


def _is_cuda(device: Any) -> bool:
    if isinstance(device, int):  # a bare ordinal means a CUDA device to torch
        return True
    if isinstance(device, (str, torch.device)):
        return torch.device(device).type == "cuda"
    return False


class _CudaToCpu(TorchFunctionMode):
    """Rewrites ``device="cuda"`` (and ``.cuda()``) to cpu for the calls made inside it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


# Pipeline p2p synchronizes the (absent) CUDA stream around gloo send/recv; on CPU ops are eager.
_CUDA_PATCHES = {
    "current_device": lambda: "cpu",
    "synchronize": lambda device=None: None,
}


# Activation recompute (tensor_parallel.checkpoint) saves and restores the CUDA generator around
# the recomputed forward; on CPU the CPU generator (restored by the same code) is all there is.
_RNG_PATCHES = {
    "_get_cuda_rng_state": lambda *args, **kwargs: None,
    "_set_cuda_rng_state": lambda *args, **kwargs: None,
}


class _TorchZerosOnCpu(types.ModuleType):
    """``torch`` as seen by Megatron's pipeline schedules: ``zeros(..., device="cuda")`` lands
    on cpu; every other attribute is torch's own."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)


class _NoStream:
    """A CUDA stream or event on CPU: nothing to wait for."""

    def wait_stream(self, _other) -> None:
        pass

    def record_event(self, _event=None) -> _NoStream:
        return self

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> _NoStream:
        return self

    def __exit__(self, *exc) -> None:
        return None


class _CudaStreamsOnCpu(types.SimpleNamespace):
    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def Stream(*_args, **_kwargs) -> _NoStream:  # noqa: N802 (torch's name)
        return _NoStream()

    @staticmethod
    def current_stream(*_args, **_kwargs) -> _NoStream:
        return _NoStream()

    @staticmethod
    def stream(_stream) -> _NoStream:
        return _NoStream()


class _TorchStreamsOnCpu(types.ModuleType):
    """``torch`` as seen by Megatron's MoE token dispatcher: ``torch.cuda``'s streams do nothing."""

    cuda = _CudaStreamsOnCpu()

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _counts_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.cpu().numpy()
    return tensor


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Held for a trainer's whole life: the RNG tracker, ``torch.cuda.current_device``,
    ``torch.cuda.synchronize``, the CUDA RNG state calls of activation recompute and the
    schedules' token counter."""
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mc_random
    from megatron.core.transformer.moe import token_dispatcher

    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    patches = (
        [(torch.cuda, n, r) for n, r in _CUDA_PATCHES.items()]
        + [(mc_random, n, r) for n, r in _RNG_PATCHES.items()]
        + [(schedules, "torch", _TorchZerosOnCpu()), (token_dispatcher, "torch", _TorchStreamsOnCpu()),
           (token_dispatcher, "maybe_move_tensor_to_cpu", _counts_to_host)]
    )
    originals = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, replacement in patches:
        setattr(obj, name, replacement)
    try:
        yield
    finally:
        for obj, name, original in originals:
            setattr(obj, name, original)


@contextlib.contextmanager
def cuda_allocations_on_cpu() -> Iterator[None]:
    """Around Megatron's construction calls that allocate with ``device="cuda"`` (optimizer
    wrapper, tied embeddings). Every torch call inside pays a Python dispatch: keep it off the
    forward-backward and the optimizer step."""
    with _CudaToCpu():
        yield


def clip_grad_norm(
    params: Iterable[torch.nn.Parameter],
    max_norm: float,
    model_parallel_group: dist.ProcessGroup | None,
    expert_group: dist.ProcessGroup | None = None,
) -> float:
    """The global L2 norm of the gradients (clipped to ``max_norm`` when > 0).

    Parameters replicated across tensor-parallel ranks (norms, biases of row-parallel layers) and
    the last stage's copy of tied embeddings count once, as in Megatron; the rest sum over the
    model-parallel (tensor x pipeline) group. Experts (``allreduce`` False: each expert-parallel
    rank holds different ones) sum over ``expert_group`` (expert x pipeline ranks) instead.
    """
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    grads: list[torch.Tensor] = []
    counted: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # dense, experts
    for p in params:
        g = getattr(p, "main_grad", None)
        if g is None:
            g = p.grad
        if g is None:
            continue
        grads.append(g)
        expert = not getattr(p, "allreduce", True)
        if expert or (param_is_not_tensor_parallel_duplicate(p) and param_is_not_shared(p)):
            counted[expert].append(g)
    total = torch.zeros((), dtype=torch.float64)
    for part, group in zip(counted, (model_parallel_group, expert_group), strict=True):
        if not part and group is None:
            continue
        sq = torch.zeros((), dtype=torch.float64)
        if part:
            norms = torch._foreach_norm([g.detach() for g in part])  # float32 per tensor, no copies
            sq += torch.stack(norms).double().square().sum()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(sq, group=group)
        total += sq
    norm = math.sqrt(float(total))  # the one read back
    if max_norm > 0 and norm > max_norm and math.isfinite(norm):
        scale = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(scale)
    return norm
