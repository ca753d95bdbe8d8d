"""Trajectories (or the Arrow record batch the transfer queue hands over) -> validated samples ->
micro-batches of tensors, packed or padded, within a token budget.

Alignment: a sample's tokens are ``prompt + response``; the logits at position ``t`` predict token
``t + 1``, so response token ``j`` is scored at position ``len(prompt) + j - 1``. Every per-token
tensor of a micro-batch is laid out by position and is zero where nothing is trained.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import pyarrow as pa
import torch

from psrl.trajectory import Trajectory, list_column_to_numpy

# The columns the trainer fetches from the transfer queue; a record batch without the per-turn
# ones (used by GAE's ``turn_rewards``) is accepted.
REQUIRED_FIELDS: tuple[str, ...] = (
    "key", "group_id", "reward", "prompt_ids", "response_ids", "loss_mask", "logprobs", "versions",
)
TURN_FIELDS: tuple[str, ...] = ("turn_bounds", "turn_rewards")
# Read by ``algorithm.router_replay`` (mixture-of-experts policies); empty lists otherwise.
ROUTE_FIELDS: tuple[str, ...] = ("routed_experts",)
TRAINER_FIELDS: tuple[str, ...] = REQUIRED_FIELDS + TURN_FIELDS + ROUTE_FIELDS


@dataclass
class Sample:
    key: str
    group_id: str
    reward: float
    prompt_ids: np.ndarray  # int32
    response_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # int8, aligned with response_ids
    logprobs: np.ndarray  # float32, behaviour log-probs aligned with response_ids
    versions: np.ndarray  # int32
    turn_bounds: np.ndarray | None = None  # (turns, 2) [start, end) into the response
    turn_rewards: np.ndarray | None = None  # (turns,)
    routed_experts: np.ndarray | None = None  # flattened (seq_len, layers, top_k); None or empty: no record

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @cached_property
    def num_loss_tokens(self) -> int:  # read per sample several times a mini-batch: counted once
        return int(self.loss_mask.sum())


def _check(samples: Sequence[Sample], vocab_size: int | None) -> None:
    """Raise ``ValueError`` naming the first bad sample. Array rules run once over the whole
    batch's concatenated arrays (a few passes instead of ten small ones per sample)."""
    for s in samples:
        where = f"sample {s.key!r}"
        n = len(s.response_ids)
        if n == 0:
            raise ValueError(f"{where}: empty response")
        if len(s.prompt_ids) == 0:
            raise ValueError(f"{where}: empty prompt (the first response token needs a context)")
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(s, name)) != n:
                raise ValueError(f"{where}: {name} has {len(getattr(s, name))} entries, response_ids has {n}")
        if not math.isfinite(s.reward):
            raise ValueError(f"{where}: reward is {s.reward}")

    def first_bad(field: str, bad: np.ndarray, what: str) -> None:
        if bad.any():
            ends = np.cumsum([len(getattr(s, field)) for s in samples])
            k = int(np.searchsorted(ends, int(np.argmax(bad)), side="right"))
            raise ValueError(f"sample {samples[k].key!r}: {what}")

    mask = np.concatenate([s.loss_mask for s in samples])
    first_bad("loss_mask", ~((mask == 0) | (mask == 1)), "loss_mask holds values other than 0 and 1")
    logprobs = np.concatenate([s.logprobs for s in samples])
    first_bad("logprobs", mask.astype(bool) & ~np.isfinite(logprobs), "non-finite behaviour log-prob on a trained token")
    if vocab_size is not None:
        for name in ("prompt_ids", "response_ids"):
            ids = np.concatenate([getattr(s, name) for s in samples])
            first_bad(name, (ids < 0) | (ids >= vocab_size), f"{name} has token ids outside [0, {vocab_size})")


def to_samples(batch: pa.RecordBatch | pa.Table | Sequence[Trajectory] | Sequence[Sample], vocab_size: int | None = None) -> list[Sample]:
    """Validate a batch; a bad sample raises ValueError naming its key. Nothing is dropped."""
    if isinstance(batch, (pa.RecordBatch, pa.Table)):
        missing = [f for f in REQUIRED_FIELDS if f not in batch.schema.names]
        if missing:
            raise KeyError(f"record batch lacks trainer fields: {', '.join(missing)}")
        arrays = REQUIRED_FIELDS[3:] + tuple(f for f in TURN_FIELDS if f in batch.schema.names)
        cols = {f: list_column_to_numpy(batch.column(f)) for f in arrays}
        keys = batch.column("key").to_pylist()
        groups = batch.column("group_id").to_pylist()
        rewards = batch.column("reward").to_pylist()
        samples = [
            Sample(keys[i], groups[i], float("nan") if rewards[i] is None else float(rewards[i]),
                   *(np.asarray(cols[f][i]) for f in REQUIRED_FIELDS[3:]))
            for i in range(batch.num_rows)
        ]
        if "turn_bounds" in cols and "turn_rewards" in cols:
            for i, s in enumerate(samples):
                s.turn_bounds = np.asarray(cols["turn_bounds"][i]).reshape(-1, 2)
                s.turn_rewards = np.asarray(cols["turn_rewards"][i])
        if "routed_experts" in batch.schema.names:
            for s, r in zip(samples, list_column_to_numpy(batch.column("routed_experts")), strict=True):
                s.routed_experts = r
    elif all(isinstance(x, Sample) for x in batch):
        samples = list(batch)
    else:
        samples = [
            Sample(t.key, t.group_id, float(t.reward), t.prompt_ids, t.response_ids, t.loss_mask, t.logprobs, t.versions,
                   t.turn_bounds, t.turn_rewards, t.routed_experts)
            for t in batch
        ]
    if not samples:
        raise ValueError("empty batch")
    seen: set[str] = set()
    for s in samples:
        if s.key in seen:
            raise ValueError(f"sample {s.key!r} appears twice in the batch")
        seen.add(s.key)
    _check(samples, vocab_size)
    return samples


def shard_for_rank(samples: Sequence[Sample], dp: int, rank: int, indices: Sequence[int] | None = None) -> list[int]:
    """Indices of this data-parallel rank's samples (of ``indices``, default all): longest first,
    each to the lightest rank. Deterministic, so every rank computes the same assignment."""
    indices = range(len(samples)) if indices is None else indices
    load = [0] * dp
    owner = {}
    for i in sorted(indices, key=lambda i: (-samples[i].seq_len, i)):
        r = min(range(dp), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += samples[i].seq_len
    return [i for i in sorted(indices) if owner[i] == rank]


@dataclass
class MicroBatch:
    """One forward/backward unit. Attention structure is carried as document bounds, never as a
    mask: no tensor here has two sequence-length dimensions (memory stays linear in tokens).

    packed: one row (B = 1) holding the documents back to back; ``cu_seqlens`` are their bounds.
    padded: one document per row, right-padded; ``cu_seqlens`` are the bounds of the rows' real
    tokens counted without padding (row ``b`` holds ``cu_seqlens[b+1] - cu_seqlens[b]`` tokens).
    """

    tokens: torch.Tensor  # (B, T) int64
    position_ids: torch.Tensor  # (B, T) int64, restarting at 0 for every document
    cu_seqlens: torch.Tensor  # (documents + 1,) int32
    max_seqlen: int  # the longest document
    packed: bool
    targets: torch.Tensor  # (B, T) int64, the next token (0 where none)
    loss_mask: torch.Tensor  # (B, T) float32
    sample_index: torch.Tensor  # (B, T) int64, index into the batch's samples, -1 on padding
    samples: list[int]  # batch indices of the samples in this micro-batch
    # Filled per step: per-position values, zero where loss_mask is 0.
    extras: dict[str, torch.Tensor]
    # (K,) int64: the positions, flat over (B, T), whose loss_mask is 1 (position 0 when there is
    # none). The policy's output layer scores these rows only (``psrl.trainer.model``): prompts,
    # tool outputs and padding never reach the vocabulary projection or the log-probs.
    scored: torch.Tensor
    # Flat positions of the samples' whole responses (``_response_positions``), found on first use.
    whole_positions: np.ndarray | None = field(default=None, repr=False, compare=False)
    # Router replay: (tokens in Megatron's order, layers, top_k) recorded experts, -1 where none.
    routes: torch.Tensor | None = None

    def at_scored(self, t: torch.Tensor) -> torch.Tensor:
        """A per-position (B, T) tensor -> (1, K), the layout of the model's output."""
        return t.reshape(-1).index_select(0, self.scored.to(t.device))[None]  # not t[idx]: ~3x the overhead

    def spread(self, t: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`at_scored`: (1, K) -> (B, T), zero at unscored positions."""
        out = t.new_zeros(self.tokens.shape)
        out.view(-1)[self.scored.to(t.device)] = t.reshape(-1)
        return out

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    def to(self, device: str) -> MicroBatch:
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return MicroBatch(
            move(self.tokens), move(self.position_ids), move(self.cu_seqlens), self.max_seqlen, self.packed,
            move(self.targets), move(self.loss_mask), move(self.sample_index), self.samples,
            {k: move(v) for k, v in self.extras.items()}, move(self.scored), self.whole_positions,
            None if self.routes is None else move(self.routes),
        )

    def packed_seq_params(self):
        """Megatron's ``PackedSeqParams`` (thd layout) for a packed micro-batch, else None."""
        if not self.packed:
            return None
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen,
        )


def plan_micro_batches(samples: Sequence[Sample], indices: Sequence[int], budget: int, mode: str) -> list[list[int]]:
    """Group samples into micro-batches of at most ``budget`` tokens (a longer sample goes alone).

    packed: first-fit decreasing on total tokens. padded: by length, counting padding to the
    longest of the micro-batch."""
    order = sorted(indices, key=lambda i: (-samples[i].seq_len, i))
    bins: list[list[int]] = []
    if mode == "packed":
        room: list[int] = []
        for i in order:
            n = samples[i].seq_len
            for b, free in enumerate(room):
                if n <= free:
                    bins[b].append(i)
                    room[b] -= n
                    break
            else:
                bins.append([i])
                room.append(budget - n)
    elif mode == "padded":
        for i in order:
            if bins and (len(bins[-1]) + 1) * samples[bins[-1][0]].seq_len <= budget:
                bins[-1].append(i)
            else:
                bins.append([i])
    else:
        raise ValueError(f"unknown batching mode {mode!r} (packed, padded)")
    return bins


def _rows(samples: Sequence[Sample], idx: Sequence[int]):
    for i in idx:
        s = samples[i]
        tokens = np.concatenate([s.prompt_ids, s.response_ids]).astype(np.int64)
        p, n = len(s.prompt_ids), len(tokens)
        targets = np.zeros(n, np.int64)
        targets[:-1] = tokens[1:]
        mask = np.zeros(n, np.float32)
        mask[p - 1 : n - 1] = s.loss_mask
        yield i, tokens, targets, mask


def build_micro_batch(samples: Sequence[Sample], idx: Sequence[int], mode: str) -> MicroBatch:
    lengths = np.fromiter((samples[i].seq_len for i in idx), np.int64, len(idx))
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    if mode == "packed":  # whole-micro-batch arrays at once: no per-row temporaries
        starts = cu_seqlens[:-1].astype(np.int64)
        tokens = np.concatenate([a for i in idx for a in (samples[i].prompt_ids, samples[i].response_ids)]).astype(np.int64)
        targets = np.empty_like(tokens)
        targets[:-1] = tokens[1:]
        targets[cu_seqlens[1:] - 1] = 0  # a document's last token predicts nothing
        # Response token j of a document starting at s is scored at s + len(prompt) + j - 1.
        resp = np.fromiter((len(samples[i].response_ids) for i in idx), np.int64, len(idx))
        first = starts + lengths - resp - 1
        whole = np.repeat(first - (np.cumsum(resp) - resp), resp) + np.arange(int(resp.sum()))
        mask = np.zeros(len(tokens), np.float32)
        mask[whole] = np.concatenate([samples[i].loss_mask for i in idx])
        sample_index = np.repeat(np.asarray(idx, np.int64), lengths)[None]
        position_ids = (np.arange(len(tokens)) - np.repeat(starts, lengths))[None]
        tokens, targets, mask = tokens[None], targets[None], mask[None]
    elif mode == "padded":
        whole = None
        rows = list(_rows(samples, idx))
        T = int(lengths.max())
        B = len(rows)
        tokens = np.zeros((B, T), np.int64)
        targets = np.zeros((B, T), np.int64)
        mask = np.zeros((B, T), np.float32)
        sample_index = np.full((B, T), -1, np.int64)
        for b, (i, tok, tgt, m) in enumerate(rows):
            n = len(tok)
            tokens[b, :n], targets[b, :n], mask[b, :n], sample_index[b, :n] = tok, tgt, m, i
        position_ids = np.broadcast_to(np.arange(T), (B, T)).copy()
    else:
        raise ValueError(f"unknown batching mode {mode!r} (packed, padded)")
    scored = np.flatnonzero(mask.reshape(-1))
    return MicroBatch(
        tokens=torch.from_numpy(tokens),
        position_ids=torch.from_numpy(np.asarray(position_ids, np.int64)),
        cu_seqlens=torch.from_numpy(cu_seqlens),
        max_seqlen=int(lengths.max()),
        packed=mode == "packed",
        targets=torch.from_numpy(targets),
        loss_mask=torch.from_numpy(mask),
        sample_index=torch.from_numpy(sample_index),
        samples=list(idx),
        extras={},
        scored=torch.from_numpy(scored if len(scored) else np.zeros(1, np.int64)),
        whole_positions=whole,
    )


def _response_positions(mb: MicroBatch, samples: Sequence[Sample], lengths: Sequence[int] | None = None) -> np.ndarray:
    """Flat (B*T) positions predicting each micro-batch sample's first ``lengths[j]`` response
    tokens (sample ``mb.samples[j]``), concatenated in ``mb.samples`` order. ``lengths`` None:
    whole responses (kept on ``mb``: a step asks for them once per per-position column)."""
    whole = lengths is None
    if whole and mb.whole_positions is not None:
        return mb.whole_positions
    if whole:
        lengths = [len(samples[i].response_ids) for i in mb.samples]
    T = mb.tokens.shape[-1]
    starts = mb.cu_seqlens[:-1].numpy().astype(np.int64) if mb.packed else np.arange(len(mb.samples), dtype=np.int64) * T
    first = starts + np.fromiter((len(samples[i].prompt_ids) - 1 for i in mb.samples), np.int64, len(mb.samples))
    lens = np.asarray(lengths, np.int64)
    pos = np.repeat(first - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()), dtype=np.int64)
    if whole:
        mb.whole_positions = pos
    return pos


def per_position(mb: MicroBatch, samples: Sequence[Sample], values: Sequence[np.ndarray]) -> torch.Tensor:
    """Scatter per-response-token values (one array per batch sample) onto ``mb``'s positions."""
    picked = [values[i] for i in mb.samples]
    lens = [len(v) for v in picked]
    whole = all(n == len(samples[i].response_ids) for n, i in zip(lens, mb.samples, strict=True))
    pos = _response_positions(mb, samples, None if whole else lens)
    flat = np.zeros(mb.tokens.numel(), np.float32)  # numpy: a few us where torch's indexing costs tens
    flat[pos] = np.concatenate(picked)
    flat *= mb.loss_mask.numpy().reshape(-1)
    return torch.from_numpy(flat).view(mb.tokens.shape)


def per_response(mb: MicroBatch, samples: Sequence[Sample], values: torch.Tensor) -> dict[int, np.ndarray]:
    """The inverse of :func:`per_position`: response-aligned arrays (0 where loss_mask is 0)."""
    flat = (values * mb.loss_mask).reshape(-1).detach().float().cpu().numpy()
    lens = [len(samples[i].response_ids) for i in mb.samples]
    got = flat[_response_positions(mb, samples)]  # a copy: fancy indexing
    return dict(zip(mb.samples, np.split(got, np.cumsum(lens)[:-1]), strict=True))
