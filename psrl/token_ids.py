"""Text <-> token ids with a Hugging Face tokenizer, on every turn's hot path (agent loops, the
session gateway).

A fast HF tokenizer's ``encode`` goes through its Rust backend's ``encode_batch``, which hands
even one short text to rayon's thread pool: a thread wake-up per call (on a machine whose cores
are busy with an engine and a trainer, a wait for the scheduler while the calling event loop is
blocked) plus ~25 us of Python; ``decode`` adds ~15 us. ``TokenIds`` calls the backend directly
where that gives exactly what the wrapper gives: no truncation or padding set on the backend,
special tokens matched whole, no clean-up of spaces after decoding, and the same ids and text on
a probe (~0.14 ms, once per tokenizer object; the settings are re-checked for every
``TokenIds``). Otherwise it calls the wrapper.

The backend's single-text ``encode``/``decode`` hold the GIL throughout (a 1 MB text: about a
second with every other thread stopped); its batch calls release it. Texts from
``HOLD_GIL_BELOW`` characters (ids from a quarter of that) take the batch calls, so a long text
tokenized in a worker thread does not stop the event loop.
"""

from __future__ import annotations

from typing import Any

import numpy as np

HOLD_GIL_BELOW = 2048

# The probe's verdict per tokenizer object (kept alive here, so an id is never reused while cached).
_PROBED: dict[int, tuple[Any, bool]] = {}


class TokenIds:
    """``encode(text) -> int32 ids`` without special tokens added (templates write their own),
    and ``decode(ids) -> text``, equal to the HF tokenizer's own calls."""

    def __init__(self, tokenizer: Any) -> None:
        self.hf = tokenizer
        self.direct = _direct_backend(tokenizer)  # the Rust backend, or None: the wrapper

    def encode(self, text: str) -> np.ndarray:
        rust = self.direct
        if rust is None:
            return np.asarray(self.hf.encode(text, add_special_tokens=False), np.int32)
        if len(text) < HOLD_GIL_BELOW:
            return np.asarray(rust.encode(text, add_special_tokens=False).ids, np.int32)
        return np.asarray(rust.encode_batch([text], add_special_tokens=False)[0].ids, np.int32)

    def decode(self, ids: Any, *, skip_special_tokens: bool = True) -> str:
        ids = np.asarray(ids).tolist()
        rust = self.direct
        if rust is None:
            return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
        if len(ids) < HOLD_GIL_BELOW // 4:
            return rust.decode(ids, skip_special_tokens=skip_special_tokens)
        return rust.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]


def _direct_backend(tokenizer: Any) -> Any | None:
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch"):
        return None  # a slow (Python) tokenizer
    if (
        getattr(tokenizer, "clean_up_tokenization_spaces", True)
        or getattr(tokenizer, "split_special_tokens", False)
        or getattr(backend, "encode_special_tokens", False)
        or backend.truncation is not None
        or backend.padding is not None
    ):
        return None
    hit = _PROBED.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer:
        if len(_PROBED) > 16:
            _PROBED.clear()
        hit = _PROBED[id(tokenizer)] = (tokenizer, _same_on_probe(tokenizer, backend))
    return backend if hit[1] else None


def _same_on_probe(tokenizer: Any, backend: Any) -> bool:
    eos = getattr(tokenizer, "eos_token", None) or ""
    probe = f"Hello, world!\n  {eos} x = [1, 2]\t\u00e9\u4e2d {eos}"
    ids = list(tokenizer.encode(probe, add_special_tokens=False))
    return backend.encode(probe, add_special_tokens=False).ids == ids and all(
        backend.decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)
        for skip in (True, False)
    )
