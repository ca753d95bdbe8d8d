"""Low-rank adapters (LoRA) on the Megatron policy: the base stays frozen, only the adapters train.

Each adapted Megatron linear layer gets a :class:`LoraAdapter` submodule named ``lora`` and a
forward hook adding ``alpha / rank * B(A(x))`` to its output. One Megatron layer can stand for
several Hugging Face projections (the fused ``linear_qkv`` is q/k/v, ``linear_fc1`` is
gate/up): the adapter keeps one (A, B) pair per projection, exactly PEFT's, and lays their
outputs out the way the fused layer does (per query group; ``[gate; up]`` per shard).

Tensor parallelism: a column-parallel layer (qkv, fc1) sees its whole input and produces a shard
of its output, so A is whole (replicated) and B is sharded by rows; a row-parallel layer (proj,
fc2) sees a shard of its input, so A is sharded by columns and B is whole. The low-rank
activation ``A x`` crosses the tensor-parallel group once: its gradient is all-reduced
(column), or the activation itself is (row), the same collectives Megatron's own layers use.

The adapters are exported under PEFT's names (``base_model.model.model.layers.N.self_attn.q_proj
.lora_A.weight``): what vLLM loads as an adapter and ``peft.PeftModel`` loads over the base. With
``merge_for_rollout`` the weight export adds ``B A`` to the base weights instead.
"""

from __future__ import annotations

import contextlib
import math
import re
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from psrl.config.trainer import LoraConfig

from .model import HFArch

PEFT_PREFIX = "base_model.model."
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class LoraSite:
    """One adaptable Megatron linear layer: its HF projections and how it is parallel."""

    module: str  # path inside a decoder layer
    hf_parent: str  # HF path inside a layer: "self_attn" or "mlp"
    projections: tuple[str, ...]
    column: bool  # column-parallel (output sharded) or row-parallel (input sharded)
    fused: str = ""  # "qkv" | "gate_up" | ""


SITES = (
    LoraSite("self_attention.linear_qkv", "self_attn", ("q_proj", "k_proj", "v_proj"), True, "qkv"),
    LoraSite("self_attention.linear_proj", "self_attn", ("o_proj",), False),
    LoraSite("mlp.linear_fc1", "mlp", ("gate_proj", "up_proj"), True, "gate_up"),
    LoraSite("mlp.linear_fc2", "mlp", ("down_proj",), False),
)
_SITE_OF = {s.module: s for s in SITES}
_MLP = ("gate_proj", "up_proj", "down_proj")


def resolve_targets(cfg: LoraConfig, arch: HFArch) -> tuple[str, ...]:
    """The projections adapted on ``arch``. A mixture-of-experts MLP has no dense projections:
    ``all-linear`` then means the attention, and naming an MLP projection is an error."""
    targets = cfg.targets()
    if arch.num_experts:
        asked = [t for t in targets if t in _MLP]
        if asked and "all-linear" not in cfg.target_modules:
            raise ValueError(f"trainer.lora.target_modules {asked}: a {arch.family} model's MLP is its experts, which "
                             "take no adapters here (vLLM's CPU engine has no LoRA kernel for experts); adapt q_proj, "
                             "k_proj, v_proj, o_proj")
        targets = tuple(t for t in targets if t not in _MLP)
    return targets


def projection_shape(arch: HFArch, proj: str) -> tuple[int, int]:
    """(out, in) of a whole HF projection."""
    q, kv, h, f = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.hidden_size, arch.ffn_hidden_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}[proj]


def _tp() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


class LoraAdapter(torch.nn.Module):
    """The (A, B) pairs of one Megatron linear layer's projections, this rank's shards of them."""

    def __init__(self, site: LoraSite, projections: tuple[str, ...], arch: HFArch, cfg: LoraConfig, *, layer: int,
                 dtype: torch.dtype, device: torch.device, seed: int) -> None:
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.site, self.projections, self.arch = site, projections, arch
        self.rank_r, self.scale = cfg.rank, cfg.alpha / cfg.rank
        self.dropout = torch.nn.Dropout(cfg.dropout) if cfg.dropout else None
        tp_rank, tp = _tp()
        self.tp = tp
        self.A = torch.nn.ParameterDict()
        self.B = torch.nn.ParameterDict()
        for proj in projections:
            out_f, in_f = projection_shape(arch, proj)
            # The whole A from a generator of its own: the same adapter at any tensor-parallel size.
            gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{layer}/{proj}".encode()))
            a = torch.empty(cfg.rank, in_f)
            if cfg.init == "kaiming":  # PEFT's: kaiming-uniform with a = sqrt(5), as nn.Linear's weight
                bound = 1.0 / math.sqrt(in_f)
                a.uniform_(-bound, bound, generator=gen)
            else:
                a.normal_(0.0, 1.0 / cfg.rank, generator=gen)
            b = torch.zeros(out_f, cfg.rank)
            if site.column:
                b = b.chunk(tp, 0)[tp_rank]
            else:
                a = a.chunk(tp, 1)[tp_rank]
            self.A[proj] = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
            self.B[proj] = torch.nn.Parameter(b.to(device=device, dtype=dtype).contiguous())
            if tp > 1:  # the sharded one of the pair counts on every rank in the grad norm
                sharded, dim = (self.B[proj], 0) if site.column else (self.A[proj], 1)
                set_tensor_model_parallel_attributes(sharded, True, dim, 1)

    def _a(self) -> torch.Tensor:
        """Every projection's A stacked: (r * projections, in_local)."""
        return torch.cat([self.A[p] for p in self.projections], 0) if len(self.projections) > 1 else self.A[self.projections[0]]

    def _b(self) -> torch.Tensor:
        """Every projection's B as one (out_local, r * projections) matrix whose rows are laid out
        as the fused layer's output (block-diagonal in the projections; zero rows for a
        projection not adapted), so the whole delta is one matrix product of the low-rank
        activation: nothing the size of the activations is copied."""
        first = self.B[self.projections[0]]
        if not self.site.fused:
            return first
        r, n = self.rank_r, len(self.projections)
        pieces = {p: F.pad(self.B[p].t(), (0, 0, i * r, (n - 1 - i) * r)) for i, p in enumerate(self.projections)}
        return self._layout(pieces, (n * r,), first.dtype, first.device).t()

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The layer's (local) output ``out`` plus the adapters' delta for its input ``x`` (s, b, in_local)."""
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        if self.dropout is not None:
            x = self.dropout(x)
        h = x @ self._a().t()  # (s, b, r * projections)
        h = copy_to_tensor_model_parallel_region(h) if self.site.column else reduce_from_tensor_model_parallel_region(h)
        b = self._b().to(out.dtype)
        return torch.addmm(out.reshape(-1, out.shape[-1]), h.reshape(-1, h.shape[-1]).to(out.dtype), b.t(),
                           alpha=self.scale).view(out.shape)

    def _layout(self, parts: Mapping[str, torch.Tensor], lead: tuple, dtype, device) -> torch.Tensor:
        """The per-projection (…, out_p_local) pieces laid out as the fused layer's output."""
        site = self.site
        if not site.fused:
            return parts[self.projections[0]]

        def piece(proj: str) -> torch.Tensor:
            if proj in parts:
                return parts[proj]
            return torch.zeros(*lead, projection_shape(self.arch, proj)[0] // self.tp, dtype=dtype, device=device)

        if site.fused == "gate_up":
            return torch.cat([piece("gate_proj"), piece("up_proj")], dim=-1)
        g = self.arch.num_kv_heads // self.tp
        q, k, v = (piece(p).reshape(*lead, g, -1) for p in ("q_proj", "k_proj", "v_proj"))
        return torch.cat([q, k, v], dim=-1).reshape(*lead, -1)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """``scale * B A`` of every projection, laid out as this rank's shard of the layer's weight."""
        return (self._b().float() @ self._a().float()) * self.scale


def _hook(module, args, kwargs, output):
    if not module.lora_enabled:
        return output
    x = args[0] if args else kwargs.get("input_", kwargs.get("input"))
    out, bias = output
    return module.lora(x, out), bias


def adapters(model) -> Iterator[tuple[int, LoraSite, LoraAdapter]]:
    """(global layer index, site, adapter) of every adapted layer on this pipeline stage."""
    while hasattr(model, "module"):
        model = model.module
    decoder = getattr(model, "decoder", None)
    for layer in getattr(decoder, "layers", ()):
        for site in SITES:
            try:
                linear = layer.get_submodule(site.module)
            except AttributeError:
                continue
            adapter = getattr(linear, "lora", None)
            if isinstance(adapter, LoraAdapter):
                yield layer.layer_number - 1, site, adapter


def apply_lora(model, arch: HFArch, cfg: LoraConfig, *, seed: int = 0) -> int:
    """Freeze ``model`` (an unwrapped GPTModel) and give the target layers adapters; returns how
    many adapter parameters this rank holds. Call before wrapping in DDP and building the optimizer."""
    targets = resolve_targets(cfg, arch)
    if not targets:
        raise ValueError("trainer.lora: no projection of this model to adapt")
    model.requires_grad_(False)
    ref = next(model.parameters())
    n = 0
    for layer in model.decoder.layers:
        for site in SITES:
            projections = tuple(p for p in site.projections if p in targets)
            if not projections:
                continue
            try:
                linear = layer.get_submodule(site.module)
            except AttributeError:  # a mixture-of-experts MLP
                continue
            linear.lora = LoraAdapter(site, projections, arch, cfg, layer=layer.layer_number - 1, dtype=ref.dtype,
                                      device=ref.device, seed=seed)
            linear.lora_enabled = True
            linear.register_forward_hook(_hook, with_kwargs=True)
            n += sum(p.numel() for p in linear.lora.parameters())
    return n


@contextlib.contextmanager
def disabled(model):
    """Within it ``model`` computes as its base (the adapters skipped): the reference policy."""
    linears = _linears(model)
    for lin in linears:
        lin.lora_enabled = False
    try:
        yield
    finally:
        for lin in linears:
            lin.lora_enabled = True


def _linears(model):
    while hasattr(model, "module"):
        model = model.module
    return [m for m in model.modules() if isinstance(getattr(m, "lora", None), LoraAdapter)]


def is_lora_param(name: str) -> bool:
    return ".lora." in name


def trainable_state(model) -> dict[str, torch.Tensor]:
    """The trained parameters of a frozen-base ``model`` (its adapters, a critic's value head):
    what a LoRA checkpoint holds (Megatron names, this rank's shards)."""
    while hasattr(model, "module"):
        model = model.module
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model.state_dict().items() if k in names}


def load_trainable_state(model, state: Mapping[str, torch.Tensor], where: str) -> None:
    while hasattr(model, "module"):
        model = model.module
    own = trainable_state(model)
    if set(own) != set(state):
        missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        raise ValueError(f"{where}: the checkpoint's adapters do not match this trainer's trainer.lora "
                         f"(missing {missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected {extra[:3]}"
                         f"{'...' if len(extra) > 3 else ''})")
    model.load_state_dict(state, strict=False)


def peft_name(layer: int, site: LoraSite, proj: str, which: str) -> str:
    return f"{PEFT_PREFIX}model.layers.{layer}.{site.hf_parent}.{proj}.lora_{which}.weight"


def peft_config(cfg: LoraConfig, arch: HFArch, base: str) -> dict:
    """``adapter_config.json`` of the adapters (PEFT's LoraConfig fields)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout,
        "target_modules": list(resolve_targets(cfg, arch)), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "modules_to_save": None, "init_lora_weights": True,
        "inference_mode": True,
    }


def _gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    _, tp = _tp()
    if tp == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


@torch.no_grad()
def iter_peft_weights(model, dtype: torch.dtype | None = None, into: Mapping[str, torch.Tensor] | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """PEFT-named whole adapter tensors of this pipeline stage's layers; every tensor-parallel
    rank must iterate (the shards are all-gathered). ``into``: buffers to write into by name."""
    from .weights import export_tensor

    for layer, site, adapter in adapters(model):
        for proj in adapter.projections:
            a, b = adapter.A[proj].detach(), adapter.B[proj].detach()
            a, b = (a, _gather(b, 0)) if site.column else (_gather(a, 1), b)
            for which, t in (("A", a), ("B", b)):
                yield export_tensor(peft_name(layer, site, proj, which), t, dtype, into)


# ---- saved checkpoints (no Megatron running) ------------------------------------------------


def merge_tp(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """A saved adapter parameter's whole tensor from its tensor-parallel shards."""
    site, _, which = _parse(name)
    dim = (0 if which == "B" else None) if site.column else (1 if which == "A" else None)
    return parts[0] if dim is None or len(parts) == 1 else torch.cat(parts, dim=dim)


def _parse(name: str) -> tuple[LoraSite, str, str]:
    """(site, projection, "A"|"B") of ``...<site>.lora.<A|B>.<projection>`` (a layer's part of a name)."""
    m = _LAYER.match(name)
    rest = m.group(2) if m else name
    module, _, tail = rest.partition(".lora.")
    which, _, proj = tail.partition(".")
    if module not in _SITE_OF or which not in ("A", "B"):
        raise ValueError(f"{name!r} is not a LoRA adapter parameter")
    return _SITE_OF[module], proj, which


def peft_tensors(state: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """PEFT-named tensors from merged Megatron adapter parameters (global layer numbers)."""
    out = {}
    for name, t in state.items():
        m = _LAYER.match(name)
        site, proj, which = _parse(name)
        out[peft_name(int(m.group(1)), site, proj, which)] = (t.to(dtype) if dtype is not None else t).contiguous().clone()
    return out


def merge_into(hf: dict[str, torch.Tensor], peft: Mapping[str, torch.Tensor], scale: float) -> None:
    """Add ``scale * B A`` of every PEFT pair to the matching HF base weight, in place."""
    for name, a in peft.items():
        if not name.endswith(".lora_A.weight"):
            continue
        b = peft[name.replace(".lora_A.", ".lora_B.")]
        base = name[len(PEFT_PREFIX):].replace(".lora_A.weight", ".weight")
        w = hf[base]
        hf[base] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
