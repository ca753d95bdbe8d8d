"""Trajectories: the unit of data between rollout and trainer.

Token data lives in numpy arrays from the engine on (int32 ids, float32 log-probs). A batch of
trajectories becomes one Arrow record batch: list columns built from concatenated numpy buffers
and offsets (no Python lists), and read back zero-copy.

Response layout: everything after the prompt, model turns and observation turns interleaved.
``loss_mask`` is 1 on tokens the model generated, 0 on observation tokens. ``logprobs`` and
``versions`` are aligned with ``response_ids``; on observation tokens they are 0 and -1.
``turn_bounds`` holds one ``[start, end)`` pair per model turn, as offsets into the response.
``routed_experts`` (mixture-of-experts policies, ``algorithm.router_replay``): the experts the
engine routed each token of ``prompt + response`` to, (seq_len, layers, top_k) flattened, -1
where not recorded; empty when the engine records none.

Besides the stored fields, :func:`to_arrow` writes ``DERIVED_FIELDS``: per-sample scalars (lengths,
loss-token count, turns, oldest/newest policy version) computed where the batch is built, i.e.
where the trajectory was produced. The driver's step metrics read only these and other scalar
columns, so what it receives per step does not grow with sequence length.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

NO_VERSION = -1


class Status(enum.StrEnum):
    OK = "ok"
    TRUNCATED = "truncated"
    FAILED = "failed"


@dataclass
class Step:
    """One model turn and what the environment answered.

    ``action_ids`` are generated tokens (loss mask 1); ``obs_ids`` are tokens appended after them
    (the observation, loss mask 0), empty on the last turn.
    """

    action_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    obs_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


@dataclass
class Trajectory:
    key: str
    group_id: str
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    turn_bounds: np.ndarray  # (turns, 2) int32
    turn_rewards: np.ndarray  # (turns,) float32
    reward: float = 0.0
    status: Status = Status.OK
    error: str | None = None
    env_metrics: dict[str, float] = field(default_factory=dict)
    data_source: str = ""
    produced_by: str = ""  # where it was generated: "<worker>@<node id>" (empty: the driver's runner)
    routed_experts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int16))

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt_ids, np.int32)
        self.response_ids = np.asarray(self.response_ids, np.int32)
        self.loss_mask = np.asarray(self.loss_mask, np.int8)
        self.logprobs = np.asarray(self.logprobs, np.float32)
        self.versions = np.asarray(self.versions, np.int32)
        self.turn_bounds = np.asarray(self.turn_bounds, np.int32).reshape(-1, 2)
        self.turn_rewards = np.asarray(self.turn_rewards, np.float32)
        self.routed_experts = np.asarray(self.routed_experts, np.int16)
        self.status = Status(self.status)

    @classmethod
    def from_steps(
        cls,
        key: str,
        group_id: str,
        prompt_ids: np.ndarray,
        steps: Sequence[Step],
        *,
        reward: float | None = None,
        status: Status = Status.OK,
        error: str | None = None,
        env_metrics: Mapping[str, float] | None = None,
        data_source: str = "",
        produced_by: str = "",
    ) -> Trajectory:
        """Lay turns out one after another; ``reward`` defaults to the sum of step rewards."""
        parts_ids, parts_mask, parts_lp, parts_ver, bounds = [], [], [], [], []
        pos = 0
        for s in steps:
            n, m = len(s.action_ids), len(s.obs_ids)
            bounds.append((pos, pos + n))
            parts_ids += [s.action_ids, s.obs_ids]
            parts_mask += [np.ones(n, np.int8), np.zeros(m, np.int8)]
            parts_lp += [s.logprobs, np.zeros(m, np.float32)]
            parts_ver += [s.versions, np.full(m, NO_VERSION, np.int32)]
            pos += n + m
        cat = lambda parts, dt: np.concatenate(parts).astype(dt, copy=False) if parts else np.zeros(0, dt)  # noqa: E731
        rewards = np.array([s.reward for s in steps], np.float32)
        return cls(
            key=key,
            group_id=group_id,
            prompt_ids=prompt_ids,
            response_ids=cat(parts_ids, np.int32),
            loss_mask=cat(parts_mask, np.int8),
            logprobs=cat(parts_lp, np.float32),
            versions=cat(parts_ver, np.int32),
            turn_bounds=np.array(bounds, np.int32).reshape(-1, 2),
            turn_rewards=rewards,
            reward=float(rewards.sum()) if reward is None else float(reward),
            status=status,
            error=error,
            env_metrics=dict(env_metrics or {}),
            data_source=data_source,
            produced_by=produced_by,
        )

    @property
    def num_turns(self) -> int:
        return len(self.turn_bounds)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def min_version(self) -> int:
        """Oldest policy version among generated tokens (NO_VERSION when nothing was generated)."""
        gen = self.versions[self.versions != NO_VERSION]
        return int(gen.min()) if len(gen) else NO_VERSION

    def validate(self) -> None:
        """Raise ValueError naming this sample when its arrays disagree."""
        n = len(self.response_ids)
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"trajectory {self.key!r}: {name} has {len(getattr(self, name))} entries, "
                    f"response_ids has {n}"
                )
        if len(self.turn_rewards) != len(self.turn_bounds):
            raise ValueError(f"trajectory {self.key!r}: {len(self.turn_rewards)} turn rewards for {len(self.turn_bounds)} turns")
        if not np.isfinite(self.reward):
            raise ValueError(f"trajectory {self.key!r}: reward is {self.reward}")
        if len(self.turn_bounds) and (self.turn_bounds.min() < 0 or self.turn_bounds.max() > n):
            raise ValueError(f"trajectory {self.key!r}: turn bounds fall outside the response ({n} tokens)")


# ---- Arrow ---------------------------------------------------------------------------------

TOKEN_FIELDS = {
    "prompt_ids": pa.int32(),
    "response_ids": pa.int32(),
    "loss_mask": pa.int8(),
    "logprobs": pa.float32(),
    "versions": pa.int32(),
    "turn_bounds": pa.int32(),  # flattened (turns * 2)
    "turn_rewards": pa.float32(),
    "routed_experts": pa.int16(),  # flattened (seq_len * layers * top_k); empty: none recorded
}
SCALAR_FIELDS = {
    "key": pa.string(),
    "group_id": pa.string(),
    "reward": pa.float64(),
    "status": pa.string(),
    "error": pa.string(),
    "data_source": pa.string(),
    "env_metrics": pa.map_(pa.string(), pa.float64()),
    "produced_by": pa.string(),
}
# Scalars computed from the token fields by ``to_arrow`` (not stored on ``Trajectory``).
DERIVED_FIELDS = {
    "prompt_length": pa.int32(),
    "response_length": pa.int32(),
    "loss_tokens": pa.int32(),  # generated tokens (loss mask 1)
    "num_turns": pa.int32(),
    "min_version": pa.int32(),  # oldest policy version among generated tokens (NO_VERSION: none)
    "max_version": pa.int32(),  # newest (min != max: a sample that spans a weight update)
}
TRAJECTORY_SCHEMA = pa.schema(
    [pa.field(k, t, nullable=(k == "error")) for k, t in SCALAR_FIELDS.items()]
    + [pa.field(k, pa.list_(t)) for k, t in TOKEN_FIELDS.items()]
    + [pa.field(k, t) for k, t in DERIVED_FIELDS.items()]
)
# The fields a ``Trajectory`` holds (what ``from_arrow`` needs); the schema adds the derived ones.
FIELD_NAMES: tuple[str, ...] = (*SCALAR_FIELDS, *TOKEN_FIELDS)
# Every scalar column: what a consumer that must not receive token data may fetch.
SCALAR_COLUMNS: tuple[str, ...] = (*SCALAR_FIELDS, *DERIVED_FIELDS)


def numpy_list_array(arrays: Sequence[np.ndarray], type_: pa.DataType) -> pa.ListArray:
    """A list column from numpy arrays: one concatenation plus offsets, no Python lists."""
    dtype = type_.to_pandas_dtype()
    lengths = np.fromiter((len(a) for a in arrays), np.int64, len(arrays))
    offsets = np.zeros(len(arrays) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate([np.asarray(a, dtype).ravel() for a in arrays]) if arrays else np.zeros(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=type_))


def list_column_to_numpy(column: pa.ListArray | pa.ChunkedArray) -> list[np.ndarray]:
    """Per-row numpy views into a list column (zero-copy over the values buffer)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    values = column.values.to_numpy(zero_copy_only=False)
    offsets = column.offsets.to_numpy()
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(column))]


def _derived(t: Trajectory, name: str) -> int:
    if name == "prompt_length":
        return len(t.prompt_ids)
    if name == "response_length":
        return len(t.response_ids)
    if name == "loss_tokens":
        return int(np.count_nonzero(t.loss_mask))
    if name == "num_turns":
        return t.num_turns
    gen = t.versions[t.versions != NO_VERSION]
    if not len(gen):
        return NO_VERSION
    return int(gen.min()) if name == "min_version" else int(gen.max())


def to_arrow(trajectories: Iterable[Trajectory], fields: Sequence[str] | None = None) -> pa.RecordBatch:
    """A record batch of ``fields`` (default: every field of the schema, derived ones included)."""
    trajs = list(trajectories)
    names = list(fields) if fields is not None else list(TRAJECTORY_SCHEMA.names)
    cols = []
    for name in names:
        if name in DERIVED_FIELDS:
            cols.append(pa.array(np.fromiter((_derived(t, name) for t in trajs), np.int32, len(trajs)), DERIVED_FIELDS[name]))
        elif name in TOKEN_FIELDS:
            arrays = [getattr(t, name).ravel() for t in trajs]
            cols.append(numpy_list_array(arrays, TOKEN_FIELDS[name]))
        elif name == "env_metrics":
            cols.append(pa.array([list(t.env_metrics.items()) for t in trajs], type=SCALAR_FIELDS[name]))
        elif name == "status":
            cols.append(pa.array([str(t.status) for t in trajs], pa.string()))
        elif name in SCALAR_FIELDS:
            cols.append(pa.array([getattr(t, name) for t in trajs], SCALAR_FIELDS[name]))
        else:
            raise KeyError(f"unknown trajectory field {name!r}; known: {', '.join(TRAJECTORY_SCHEMA.names)}")
    return pa.RecordBatch.from_arrays(cols, schema=pa.schema([TRAJECTORY_SCHEMA.field(n) for n in names]))


def from_arrow(batch: pa.RecordBatch | pa.Table) -> list[Trajectory]:
    """Inverse of :func:`to_arrow` for a batch holding every field (``produced_by`` may be absent:
    files written before it existed)."""
    optional = ("produced_by", "routed_experts")  # files written before they existed lack them
    missing = [n for n in FIELD_NAMES if n not in batch.schema.names and n not in optional]
    if missing:
        raise KeyError(f"record batch lacks trajectory fields: {', '.join(missing)}")
    tokens = {n: list_column_to_numpy(batch.column(n)) for n in TOKEN_FIELDS if n in batch.schema.names}
    scalars = {n: batch.column(n).to_pylist() for n in SCALAR_FIELDS if n in batch.schema.names}
    scalars.setdefault("produced_by", [""] * batch.num_rows)
    out = []
    for i in range(batch.num_rows):
        out.append(
            Trajectory(
                key=scalars["key"][i],
                group_id=scalars["group_id"][i],
                reward=scalars["reward"][i],
                status=Status(scalars["status"][i]),
                error=scalars["error"][i],
                data_source=scalars["data_source"][i],
                env_metrics=dict(scalars["env_metrics"][i] or []),
                produced_by=scalars["produced_by"][i] or "",
                **{n: col[i] for n, col in tokens.items()},
            )
        )
    return out
