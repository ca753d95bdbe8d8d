"""Mixture-of-experts pieces of the trainer: router metrics and router replay.

``RouterTaps`` watches every router of a model during training forwards and reports, per step,
how the tokens spread over the experts (``router/load_max_over_mean``, ``..._min_over_mean``:
the most and least loaded expert of the worst layer against an even spread), the load-balancing
loss (``router/aux_loss``, the switch loss ``E * sum_e f_e P_e`` without its coefficient: 1.0 when
the load is even) and the share of routed token slots that experts dropped
(``router/dropped_frac``; 0 unless a capacity factor is set). Everything stays on the device
until ``metrics()`` reads it once.

``ReplayRoutes`` is the object Megatron's router consults for its top-k choice
(``router.router_replay``): with routes set for a micro-batch, each token whose experts the
engine recorded goes to those experts (their probabilities are the router's own scores for them,
so the router still learns); a token without a record (-1) keeps the router's choice.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist


def routers(model) -> Iterator[tuple[int, torch.nn.Module]]:
    """(global layer index, router) of every MoE layer of ``model`` (possibly DDP-wrapped)."""
    while hasattr(model, "module"):
        model = model.module
    decoder = getattr(model, "decoder", None)
    for layer in getattr(decoder, "layers", []):
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if router is not None:
            yield layer.layer_number - 1, router


class RouterTaps:
    def __init__(self, model, num_experts: int, top_k: int, dp_group=None) -> None:
        self.num_experts, self.top_k, self._dp_group = num_experts, top_k, dp_group
        self._layers = dict(routers(model))
        self._handles = [r.register_forward_hook(self._hook) for r in self._layers.values()]
        self._index = {id(r): i for i, r in enumerate(self._layers.values())}
        self.reset()

    def reset(self) -> None:
        n = len(self._layers)
        self._load = torch.zeros(n, self.num_experts, dtype=torch.float64)  # token slots per expert
        self._aux = torch.zeros(n, dtype=torch.float64)  # sum over forwards of the switch loss
        self._calls = torch.zeros(n, dtype=torch.float64)
        self._slots = torch.zeros(n, dtype=torch.float64)  # tokens x top_k

    def _hook(self, router, args, output) -> None:
        if not (router.training and torch.is_grad_enabled()):
            return  # forward-only passes (log-probs, validation) are not the step's routing
        with torch.no_grad():
            self._record(self._index[id(router)], router, args[0], output[1])

    def _record(self, i: int, router, hidden: torch.Tensor, routing_map: torch.Tensor) -> None:
        tokens = routing_map.shape[0]
        load = routing_map.sum(0).double()
        logits = router.gating(hidden.detach()).reshape(tokens, -1).float()
        mean_prob = torch.softmax(logits, dim=-1).mean(0).double()
        frac = load / max(tokens * self.top_k, 1)
        dev = self._load.device
        self._load[i] += load.to(dev)
        self._aux[i] += (self.num_experts * (frac * mean_prob).sum()).to(dev)
        self._calls[i] += 1
        self._slots[i] += tokens * self.top_k

    def metrics(self) -> dict[str, float]:
        if not self._layers or not float(self._calls.sum()):
            return {}
        load, slots = self._load, self._slots
        if self._dp_group is not None and dist.get_world_size(self._dp_group) > 1:
            both = torch.cat([load.reshape(-1), slots])
            dist.all_reduce(both, group=self._dp_group)
            load, slots = both[: load.numel()].view_as(load), both[load.numel():]
        mean = load.mean(1).clamp(min=1e-12)
        out = {
            "router/load_max_over_mean": float((load.amax(1) / mean).max()),
            "router/load_min_over_mean": float((load.amin(1) / mean).min()),
            "router/aux_loss": float((self._aux / self._calls.clamp(min=1)).mean()),
            "router/dropped_frac": float(1.0 - load.sum() / slots.sum().clamp(min=1)),
        }
        self.reset()
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class ReplayRoutes:
    """Megatron's ``router_replay`` protocol (``get_replay_topk``) with routes of our own."""

    def __init__(self) -> None:
        self.target: torch.Tensor | None = None  # (tokens, top_k) int64, -1 rows: no record

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        probs, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target is None:
            return probs, idx
        target = self.target.to(idx.device)
        if target.shape != idx.shape:
            raise ValueError(f"router replay: routes of shape {tuple(target.shape)} for {tuple(idx.shape)} routed tokens")
        recorded = (target >= 0).all(-1, keepdim=True)
        idx = torch.where(recorded, target, idx)
        return scores.gather(1, idx), idx


def install_replay(model) -> dict[int, ReplayRoutes]:
    """Put a :class:`ReplayRoutes` on every router of ``model``: global layer index -> it."""
    out = {}
    for layer, router in routers(model):
        router.router_replay = out[layer] = ReplayRoutes()
    return out


def micro_batch_routes(routes: Sequence[np.ndarray | None], lengths: Sequence[int], layers: int, top_k: int,
                       packed: bool, width: int, keys: Sequence[str]) -> torch.Tensor:
    """(tokens in Megatron's order, layers, top_k) int64 for a micro-batch of samples with these
    per-sample routes (each (seq_len, layers, top_k), or None: no record). Megatron routes the
    (seq, batch) hidden states flattened sequence-major: a packed row is in token order; padded
    rows (``width`` positions each) interleave."""
    def one(r, n, key):
        if r is None or not len(r):
            return np.full((n, layers, top_k), -1, np.int64)
        if r.size != n * layers * top_k:
            raise ValueError(f"router replay: sample {key!r} records {r.size} expert ids; its {n} tokens x {layers} "
                             f"MoE layers x top-{top_k} need {n * layers * top_k}")
        return np.asarray(r, np.int64).reshape(n, layers, top_k)

    parts = [one(r, n, key) for r, n, key in zip(routes, lengths, keys, strict=True)]
    if packed:
        return torch.from_numpy(np.concatenate(parts))
    grid = np.full((width, len(parts), layers, top_k), -1, np.int64)
    for b, p in enumerate(parts):
        grid[: len(p), b] = p
    return torch.from_numpy(grid.reshape(-1, layers, top_k))
