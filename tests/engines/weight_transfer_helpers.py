"""Shared pieces of the weight-transfer tests: a module with HF-like names, fresh weights for
it, a receive spec, and a receiver thread."""

from __future__ import annotations

import threading
import uuid

import torch

from psrl.engines.weight_transfer.planes import IpcReader, ShmReader, TcpReader
from psrl.engines.weight_transfer.receiver import receive
from psrl.engines.weight_transfer.sender import WeightSender

READERS = lambda: {"shm": ShmReader(), "tcp": TcpReader(), "ipc": IpcReader()}  # noqa: E731


class Layers(torch.nn.Module):
    """Parameters named like an HF decoder: model.layers.<i>.{a,b}.weight."""

    def __init__(self, n: int = 6, width: int = 64) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict({"a": torch.nn.Linear(width, width, bias=False), "b": torch.nn.Linear(width, width)})
            for _ in range(n)
        )


def new_weights(module: torch.nn.Module, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(p.shape, generator=g)) for n, p in module.named_parameters()]


def spec_for(sender: WeightSender, version: int, plane: str, timeout_s: float = 10) -> dict:
    return {"sync": uuid.uuid4().hex, "version": version, "sources": [sender.source()], "plane": plane, "timeout_s": timeout_s}


def run_receiver(ctx, spec, loader, out: dict, name: str = "r", connections: dict | None = None) -> threading.Thread:
    """``receive`` in a thread; its report, or the exception it raised, lands in ``out[name]``."""

    def target() -> None:
        try:
            out[name] = receive(ctx, spec, loader, READERS(), name=name, connections=connections)
        except Exception as exc:
            out[name] = exc

    t = threading.Thread(target=target)
    t.start()
    return t
