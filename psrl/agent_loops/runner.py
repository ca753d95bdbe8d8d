"""The rollout runner: rows -> GRPO groups of episodes, all concurrent under one task group.

Each row is one task; each task runs ``n`` episodes (its GRPO group), each with its own
Environment and AgentData built for it, under a cap of ``agent.max_concurrency`` episodes at
once. A bad row (unknown component name, a prompt that breaks the row rules, a component that
fails to build) gives FAILED trajectories naming the problem, never an exception out of the
batch. Cancelling the batch cancels every episode; each closes its env (giving its sandbox back)
and aborts its engine request before the cancellation finishes.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc

from psrl.config import RolloutConfig
from psrl.engines import InferenceEngine, SamplingParams
from psrl.environments import ComponentContext, build_component
from psrl.environments.dataset import OVERRIDE_COLUMNS, DatasetError, check_row, merge_env_kwargs, row_to_task
from psrl.trajectory import Status, Trajectory

from .base import EpisodeContext
from .registry import ResolvedComponents, resolve_components
from .tool_parsers import make_tool_parser

OnTrajectory = Callable[[Trajectory], None]


@dataclass
class RolloutResult:
    """A batch's trajectories after the failure policy: ``trajectories`` go to training,
    ``dropped`` are whole groups removed by ``on_failure=drop_group`` (kept here, not lost)."""

    trajectories: list[Trajectory] = field(default_factory=list)
    dropped: list[Trajectory] = field(default_factory=list)

    @property
    def failed(self) -> list[Trajectory]:
        return [t for t in (*self.trajectories, *self.dropped) if t.status is Status.FAILED]


def apply_failure_policy(groups: Sequence[Sequence[Trajectory]], policy: str) -> RolloutResult:
    """``keep_group``: every trajectory stays (failed ones carry their status for the trainer to
    mask); ``drop_group``: a group with any failed episode goes to ``dropped`` whole."""
    if policy not in ("keep_group", "drop_group"):
        raise ValueError(f"on_failure must be keep_group or drop_group, got {policy!r}")
    out = RolloutResult()
    for group in groups:
        if policy == "drop_group" and any(t.status is Status.FAILED for t in group):
            out.dropped.extend(group)
        else:
            out.trajectories.extend(group)
    return out


def sampling_params(cfg: RolloutConfig, key: str) -> SamplingParams:
    s = cfg.sampling
    # A fixed seed would make all n episodes of a group identical: mix the episode key in.
    seed = None if s.seed is None else (s.seed ^ zlib.crc32(key.encode())) & 0x7FFFFFFF
    return SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens,
        stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids), seed=seed, logprobs=True,
    )


def _failed(key: str, group_id: str, error: str, data_source: str = "") -> Trajectory:
    return Trajectory.from_steps(key, group_id, [], [], status=Status.FAILED, error=error, data_source=data_source)


class _Group:
    """One row's GRPO group while it runs: what its episodes share, and their results."""

    __slots__ = ("comp", "context", "group_id", "loop", "n", "on_trajectory", "results", "row", "validation")

    def __init__(self, group_id: str, n: int, validation: bool, on_trajectory: OnTrajectory | None) -> None:
        self.group_id, self.n, self.validation, self.on_trajectory = group_id, n, validation, on_trajectory
        self.results: list[Trajectory | None] = [None] * n
        self.row: Mapping[str, Any] = {}
        self.comp: Any = None
        self.loop: Any = None
        self.context: ComponentContext | None = None

    def finish(self, j: int, traj: Trajectory) -> None:
        self.results[j] = traj
        if self.on_trajectory is not None:
            self.on_trajectory(traj)

    def fail_all(self, error: str) -> None:
        self.loop = None
        for j in range(self.n):
            self.finish(j, _failed(f"{self.group_id}/{j}", self.group_id, error, str(self.row.get("data_source") or "")))

    def trajectories(self) -> list[Trajectory]:
        return [t for t in self.results if t is not None]


class RolloutRunner:
    """Runs episodes for one rollout config subtree (``validation`` picks the second one).

    ``tokenizer`` is the policy's Hugging Face tokenizer (needed by chat codecs such as
    ``tool_agent_data``); ``sandbox_pool`` lends sandboxes to environments that need them.
    Implements ``psrl.pipeline.protocols.GroupRollout``.
    """

    def __init__(
        self,
        rollout: RolloutConfig,
        *,
        tokenizer: Any = None,
        sandbox_pool: Any = None,
        max_prompt_length: int | None = None,
        validation_rollout: RolloutConfig | None = None,
        samples: Any = None,
    ) -> None:
        self.configs = {False: rollout, True: validation_rollout or rollout}
        self.samples = samples  # a samples.RolloutSampleWriter: training rollouts as text, on this side
        self.tokenizer = tokenizer
        self.sandbox_pool = sandbox_pool
        self.max_prompt_length = max_prompt_length
        self._parsers = {v: make_tool_parser(c.agent.tool_parser, tokenizer) for v, c in self.configs.items()}
        self._limiter: anyio.CapacityLimiter | None = None
        self._resolved: dict[tuple[Any, ...], ResolvedComponents] = {}
        self._loops: dict[Any, Any] = {}
        self._contexts: dict[tuple[bool, str], ComponentContext] = {}
        self._shared_sampling: dict[int, SamplingParams] = {}
        for validation, cfg in self.configs.items():
            loop_cls = resolve_components({}, cfg.agent).agent_loop_cls
            if getattr(loop_cls, "requires_multi_turn", False) and not cfg.multi_turn.enable:
                tree = "train_actor_rollout_ref" if validation else "gen_actor_rollout_ref"
                raise ValueError(
                    f"{tree}.rollout.agent.default_agent_loop={cfg.agent.default_agent_loop} needs "
                    f"{tree}.rollout.multi_turn.enable=true"
                )

    @property
    def limiter(self) -> anyio.CapacityLimiter:
        if self._limiter is None:  # made lazily: it belongs to the running event loop
            self._limiter = anyio.CapacityLimiter(self.configs[False].agent.max_concurrency)
        return self._limiter

    def _resolve(self, row: Mapping[str, Any], validation: bool) -> ResolvedComponents:
        key = (validation, row.get("agent_name"), row.get("env_class"), row.get("data_class"))
        comp = self._resolved.get(key)
        if comp is None:
            comp = self._resolved[key] = resolve_components({c: row.get(c) for c in OVERRIDE_COLUMNS}, self.configs[validation].agent)
        if row.get("env_kwargs"):  # per row: not part of the cache key
            comp = dataclasses.replace(comp, env_kwargs=merge_env_kwargs(comp.env_kwargs, row))
        return comp

    def _group(self, row: Mapping[str, Any], group_id: str, n: int, validation: bool, on_trajectory: OnTrajectory | None) -> _Group:
        """A row's group with its components resolved once; bad rows fail here, whole."""
        group = _Group(group_id, n, validation, on_trajectory)
        try:
            group.row = check_row(row, f"row {group_id}")
            group.comp = comp = self._resolve(group.row, validation)
            loop = self._loops.get(comp.agent_loop_cls)
            if loop is None:  # loops hold no episode state: one instance serves every episode
                loop = self._loops[comp.agent_loop_cls] = comp.agent_loop_cls()
            group.loop = loop
            mode = getattr(loop, "observation_mode", "chat")
            group.context = self._contexts.get((validation, mode))
            if group.context is None:
                group.context = self._contexts[(validation, mode)] = ComponentContext(
                    tokenizer=self.tokenizer, tool_parser=self._parsers[validation], observation_mode=mode,
                    sandbox_pool=self.sandbox_pool,
                )
        except DatasetError as e:
            group.fail_all(str(e))
        except Exception as e:  # noqa: BLE001 - unknown names, a loop that cannot be built
            group.fail_all(f"cannot build the episode's components: {type(e).__name__}: {e}")
        return group

    async def _episode(self, group: _Group, j: int, engine: InferenceEngine) -> None:
        """One episode into ``group.results[j]``. Flat on purpose: thousands of these are alive
        at once, and every object or await level each holds costs time on every scheduler pass."""
        limiter = self.limiter
        try:
            limiter.acquire_nowait()  # the common case needs no trip through the scheduler
        except anyio.WouldBlock:
            await limiter.acquire()
        try:
            key = f"{group.group_id}/{j}"
            task = row_to_task(group.row)  # a Task per episode: an env that mutates it cannot reach a sibling
            comp, ctx = group.comp, group.context
            try:
                env = build_component(comp.env_cls, ctx, comp.env_kwargs)
                data = build_component(comp.data_cls, ctx, comp.data_kwargs)
            except Exception as e:  # noqa: BLE001 - a bad row fails its own episodes only
                traj = _failed(key, group.group_id, f"cannot build the episode's components: {type(e).__name__}: {e}", task.data_source)
            else:
                cfg = self.configs[group.validation]
                episode = EpisodeContext(
                    key=key, group_id=group.group_id, engine=engine, env=env, agent_data=data,
                    sampling=self._sampling(cfg, key), multi_turn=cfg.multi_turn, max_prompt_length=self.max_prompt_length,
                )
                traj = await group.loop.run(episode, task)
        finally:
            limiter.release()
        group.finish(j, traj)

    def _sampling(self, cfg: RolloutConfig, key: str) -> SamplingParams:
        if cfg.sampling.seed is not None:
            return sampling_params(cfg, key)
        shared = self._shared_sampling.get(id(cfg))
        if shared is None:
            shared = self._shared_sampling[id(cfg)] = sampling_params(cfg, key)
        return shared

    def _spawn_group(
        self, tg: anyio.abc.TaskGroup, row: Mapping[str, Any], group_id: str, n: int, engine: InferenceEngine,
        validation: bool, on_trajectory: OnTrajectory | None,
    ) -> _Group:
        """Start the group's episodes in ``tg``; its ``results`` fill in as they finish."""
        group = self._group(row, group_id, n, validation, on_trajectory)
        if group.loop is not None:
            for j in range(n):
                tg.start_soon(self._episode, group, j, engine)
        return group

    async def run_group(
        self,
        row: Mapping[str, Any],
        *,
        group_id: str,
        n: int | None = None,
        engine: InferenceEngine,
        validation: bool = False,
        on_trajectory: OnTrajectory | None = None,
    ) -> list[Trajectory]:
        """The ``n`` episodes of one row (default ``sampling.n``), concurrently, in key order
        (keys ``{group_id}/{j}``). Every trajectory is returned, failed ones included."""
        n = n if n is not None else self.configs[validation].sampling.n
        async with anyio.create_task_group() as tg:
            group = self._spawn_group(tg, row, group_id, n, engine, validation, on_trajectory)
        if self.samples is not None and not validation:
            self.samples.record(group.trajectories())
        return group.trajectories()

    async def run_batch(
        self,
        rows: Sequence[Mapping[str, Any]],
        *,
        engine: InferenceEngine,
        n: int | None = None,
        batch_id: str = "batch",
        validation: bool = False,
        on_trajectory: OnTrajectory | None = None,
    ) -> RolloutResult:
        """Every episode of every row in one task group (at most ``max_concurrency`` running),
        then the ``agent.on_failure`` policy. Group ids are ``{batch_id}/{row index}``."""
        n = n if n is not None else self.configs[validation].sampling.n
        async with anyio.create_task_group() as tg:
            groups = [self._spawn_group(tg, row, f"{batch_id}/{i}", n, engine, validation, on_trajectory) for i, row in enumerate(rows)]
        return apply_failure_policy([g.trajectories() for g in groups], self.configs[validation].agent.on_failure)
