"""``ParamLoader``s: into any ``torch.nn.Module`` by HF name, and the keep-previous store.

``ModuleLoader`` is the loading code for a model whose parameters carry the HF names (a
transformers model); vLLM's own loader is in ``psrl.engines.worker_ext``. Both check every
tensor's name and shape as it arrives, so a bad tensor fails its bucket, not the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch

from .buckets import copy_into

Shapes = Mapping[str, tuple[int, ...]]


def check_tensor(name: str, t: torch.Tensor, shapes: Shapes) -> None:
    """Raise ``ValueError`` if the served model has no tensor ``name`` of ``t``'s shape.
    ``lm_head.weight`` may come for a model whose tied embeddings the checkpoint stores once."""
    if not shapes:
        return
    want = shapes.get(name)
    if want is None and name == "lm_head.weight":
        want = shapes.get("model.embed_tokens.weight")
    if want is None:
        raise ValueError(f"{name!r} is not a parameter of the served model")
    if tuple(t.shape) != tuple(want):
        raise ValueError(f"{name!r} has shape {tuple(t.shape)}, the model's is {tuple(want)}")


class PreviousVersion:
    """A CPU copy of the last whole version (HF names), kept so a failed sync can restore it.

    ``seed`` gives the version the engine started with (its checkpoint), read only when first
    needed. Costs one copy of the model in memory and one memcpy per sync: opt in with
    ``weight_sync.keep_previous``."""

    def __init__(self, seed: Callable[[], Mapping[str, torch.Tensor]] | None = None) -> None:
        self._seed = seed
        self._previous: dict[str, torch.Tensor] | None = None
        self._pending: dict[str, torch.Tensor] = {}

    def record(self, stream: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass the stream through, copying each tensor into the pending version."""
        self._pending = {}
        for name, t in stream:
            self._pending[name] = t.detach().to("cpu", copy=True)
            yield name, t

    def commit(self) -> None:
        if self._previous is None and self._seed is not None:
            self._previous = dict(self._seed())
        base = dict(self._previous or {})
        base.update(self._pending)
        self._previous, self._pending = base, {}

    def load(self, stream: Iterator[tuple[str, torch.Tensor]], apply: Callable[[Iterator], int]) -> int:
        """``apply(stream)`` while recording what passes; that becomes the version once it returns."""
        n = apply(self.record(stream))
        self.commit()
        return n

    def restore(self, apply: Callable[[Iterator], int]) -> bool:
        """``apply`` the kept version again; False when there is none."""
        old = self.tensors()
        if old is None:
            return False
        apply(iter(old.items()))
        return True

    def tensors(self) -> Mapping[str, torch.Tensor] | None:
        if self._previous is None and self._seed is not None:
            self._previous = dict(self._seed())
        self._pending = {}
        return self._previous


class ModuleLoader:
    """Copies each arriving tensor into the module's parameter (or buffer) of that name
    (``copy_into``: a memmove where the two are CPU tensors of one dtype)."""

    def __init__(self, module: torch.nn.Module, *, keep_previous: bool = False) -> None:
        self.module = module
        self._tensors = {**dict(module.named_buffers()), **dict(module.named_parameters(remove_duplicate=False))}
        self._shapes = {n: tuple(t.shape) for n, t in self._tensors.items()}
        self.previous = PreviousVersion(lambda: {n: t.detach().clone() for n, t in self._tensors.items()}) if keep_previous else None
        if self.previous is not None:
            self.previous.commit()  # the module as it is now is the version to fall back to

    def load(self, stream: Iterator[tuple[str, torch.Tensor]]) -> int:
        return self.previous.load(stream, self._copy) if self.previous is not None else self._copy(stream)

    def restore(self) -> bool:
        return self.previous.restore(self._copy) if self.previous is not None else False

    def _copy(self, stream: Iterator[tuple[str, torch.Tensor]]) -> int:
        n = 0
        with torch.no_grad():
            for name, t in stream:
                check_tensor(name, t, self._shapes)
                copy_into(self._tensors[name], t)
                n += 1
        return n
