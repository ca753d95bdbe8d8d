"""Trainer ranks as Ray actors: ``tensor x pipeline x data`` ranks, each holding a
``MegatronTrainer``, rendezvous through torch.distributed at rank 0's node; ``RayPolicyTrainer``
implements ``PolicyTrainer`` over them for the driver's scheduler.

Every call is collective: it goes to all ranks at once. Batches do not pass through the driver
(``train_step_meta``): the driver plans each data-parallel rank's share of the step from scalar
columns (``shards``), and each rank fetches its share from the transfer queue by
``KVBatchMeta``. ``train_step(batch)`` (the whole batch to every rank) remains for callers
without a queue. The weights for the engines are exported by every rank (a collective gather)
right after the step, in the step's own call, and stay on the weight-source ranks (tensor rank 0
of data rank 0, one per pipeline stage). ``publish_weights`` has each of those ranks stream its
part bucket by bucket straight into the engine actors' workers (its own ``WeightSender``; shared
memory on the same machine, tcp otherwise): the driver passes only metadata and never holds a
weight tensor. Blocking by design: the scheduler runs ``train_step`` in a worker thread.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa

from psrl.config.schema import RayConfig
from psrl.config.trainer import AlgorithmConfig, CriticConfig, TrainerConfig
from psrl.config.weight_sync import WeightSyncConfig
from psrl.engines.weight_transfer.sender import SendReport
from psrl.log import get_logger
from psrl.trainer.batch import TRAINER_FIELDS
from psrl.trainer.weight_sync import SyncReport, sync_direct

from .common import RayLaunchError, actor_options, kill_actors, wait_started

log = get_logger("psrl.ray")


class TrainerRankActor:
    """One trainer rank. ``setup`` builds the trainer (collective over the group)."""

    def __init__(self) -> None:
        self.policy: Any = None
        self.sender: Any = None  # a WeightSender on weight-source ranks
        self._zmq: Any = None
        self._exported: list[tuple[str, Any]] = []

    def rendezvous_address(self) -> tuple[str, int]:
        """Where the group meets: this node's address and a port free on it (asked of rank 0)."""
        import ray

        from psrl.trainer.distributed import free_port

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, model_dir: str, trainer_json: str, algo_json: str, temperature: float,
              rank: int, world: int, master: tuple[str, int], weight_sync_json: str = "{}",
              critic_json: str = "{}") -> dict[str, Any]:
        import ray

        from psrl.trainer.trainer import MegatronTrainer

        from ..megatron_policy import MegatronPolicy

        if world > 1:
            # LOCAL_RANK 0: Ray gives each GPU rank its own CUDA_VISIBLE_DEVICES.
            os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), WORLD_SIZE=str(world),
                              RANK=str(rank), LOCAL_RANK="0")
        trainer = MegatronTrainer(
            model_dir, TrainerConfig.model_validate_json(trainer_json), AlgorithmConfig.model_validate_json(algo_json),
            temperature=temperature, critic=CriticConfig.model_validate_json(critic_json),
        )
        self.policy = MegatronPolicy(trainer)
        source = None
        if trainer.is_weight_source:
            import zmq

            from psrl.config.weight_sync import WeightSyncConfig
            from psrl.engines.weight_transfer.sender import WeightSender

            ws = WeightSyncConfig.model_validate_json(weight_sync_json)
            self._zmq = zmq.Context()
            self.sender = WeightSender(self._zmq, host=ray.util.get_node_ip_address(), bucket_bytes=ws.bucket_bytes,
                                       window=ws.window, timeout_s=ws.timeout_s)
            source = self.sender.source()
            self.policy.export_target = self.sender  # exports go into its shared-memory buffers
        return {"rank": rank, "node": ray.util.get_node_ip_address(), "device": trainer.device,
                "weight_source": source, "dp_rank": trainer.layout.dp_rank}

    def train_step(self, batch: pa.RecordBatch) -> tuple[dict[str, float], None]:
        metrics = dict(self.policy.train_step(batch))
        self.export_weights()
        return metrics, None  # the weights stay here until ``send_weights``

    def export_weights(self) -> None:
        """Collective (every rank gathers); the weight-source ranks keep their part."""
        weights = list(self.policy.named_tensors())
        self._exported = [(name, t.detach()) for name, t in weights] if self.sender is not None else []

    def train_shard(self, queue: Any, meta: Any, advantages: Any, total_tokens: int, total_seqs: int
                    ) -> tuple[dict[str, float], None]:
        """Fetch this rank's share (``meta``) from the transfer queue, then step on it."""
        import anyio

        from psrl.trainer.trainer import ShardTotals

        async def fetch() -> pa.RecordBatch:
            async with queue.connect() as client:
                return await client.get_data(meta, list(TRAINER_FIELDS))

        batch = anyio.run(fetch)
        totals = ShardTotals(list(advantages), int(total_tokens), int(total_seqs))
        metrics = dict(self.policy.trainer.step(batch, shard=totals))
        self.export_weights()
        return metrics, None  # the weights stay here until ``send_weights``

    def named_tensors(self) -> list[tuple[str, Any]] | None:
        """The weights themselves, for a caller that wants them in its own process (not the
        pipeline's path: ``send_weights`` streams them to the engines)."""
        self.export_weights()
        return [(n, t.cpu()) for n, t in self._exported] if self.sender is not None else None

    def send_weights(self, version: int, sync: str, receivers: int) -> dict[str, Any]:
        """Stream the exported weights into ``receivers`` engine workers (``WeightSender.send``)."""
        import dataclasses

        return dataclasses.asdict(self.sender.send(self._exported, version, receivers=receivers, sync=sync))

    def cancel_send(self) -> None:
        if self.sender is not None:
            self.sender.cancel()

    def save_checkpoint(self, path: str) -> None:
        self.policy.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.policy.load_checkpoint(path)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self._zmq.term()
            self.sender = None
        if self.policy is not None:
            self.policy.trainer.close()
            self.policy = None


class RayPolicyTrainer:
    """Implements ``PolicyTrainer`` over a group of ``TrainerRankActor``; ``close()`` ends it."""

    def __init__(self, ranks: Sequence[Any], info: Sequence[Mapping[str, Any]], algorithm: AlgorithmConfig | None = None,
                 weight_sync: WeightSyncConfig | None = None) -> None:
        self.ranks = list(ranks)
        self.info = list(info)
        self.algorithm = algorithm or AlgorithmConfig()
        self.weight_sync = weight_sync or WeightSyncConfig()
        self.queue: Any = None  # a QueueHandle once ``attach_queue``: ranks then fetch their own shares
        self._exported = False  # the ranks hold the current weights, exported with the last step

    @property
    def fields(self) -> tuple[str, ...]:
        """What the scheduler fetches for a step: scalars only once ranks fetch their shares."""
        from .shards import SHARD_FIELDS

        return SHARD_FIELDS if self.queue is not None else TRAINER_FIELDS

    def attach_queue(self, handle: Any) -> None:
        """From now on each rank fetches its share of a step from this transfer queue."""
        self.queue = handle

    @classmethod
    def create(cls, model_dir: str, trainer: TrainerConfig, algorithm: AlgorithmConfig, ray_cfg: RayConfig,
               *, temperature: float = 1.0, weight_sync: WeightSyncConfig | None = None,
               critic: CriticConfig | None = None) -> RayPolicyTrainer:
        """Start ``tensor x pipeline x data`` rank actors and build the trainer on each (blocking:
        a minute or more for big models; call it in a thread)."""
        import ray

        p = trainer.parallel
        world = p.tensor * p.pipeline * p.data
        weight_sync = weight_sync or WeightSyncConfig()
        # Two calls at once: ``cancel_send`` must reach a rank while its ``send_weights`` runs.
        cls_ = ray.remote(TrainerRankActor).options(**actor_options(ray_cfg.trainer, max_concurrency=2))
        ranks = [cls_.remote() for _ in range(world)]
        try:
            timeout = ray_cfg.actor_start_timeout_s
            (master,) = wait_started([ranks[0].rendezvous_address.remote()], ["trainer rank 0"], timeout)
            refs = [
                r.setup.remote(model_dir, trainer.model_dump_json(), algorithm.model_dump_json(), temperature, i, world, master,
                               weight_sync.model_dump_json(), (critic or CriticConfig()).model_dump_json())
                for i, r in enumerate(ranks)
            ]
            info = wait_started(refs, [f"trainer rank {i}" for i in range(world)], timeout)
        except BaseException:
            kill_actors(ranks)
            raise
        log.info("trainer on ray", ranks=world, nodes=sorted({i["node"] for i in info}), device=info[0]["device"])
        return cls(ranks, info, algorithm, weight_sync)

    def _all(self, method: str, *args: Any) -> list[Any]:
        return self._get([getattr(r, method).remote(*args) for r in self.ranks], method)

    def _get(self, refs: list[Any], method: str) -> list[Any]:
        import ray

        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as e:
            raise RayLaunchError(f"a trainer rank died during {method}: {e}") from None
        except ray.exceptions.RayTaskError as e:
            raise e.as_instanceof_cause() from None

    def train_step(self, batch: pa.RecordBatch) -> Mapping[str, float]:
        out = self._all("train_step", batch)
        self._exported = True
        return out[0][0]

    def train_step_meta(self, meta: Any, batch: pa.RecordBatch) -> Mapping[str, float]:
        """One step on the samples of ``meta`` (``batch``: their ``fields`` scalar columns, in
        ``meta`` order): whole groups to each data-parallel rank, which fetches its own share."""
        import numpy as np

        from .shards import merge_share_metrics, plan_shards

        if self.queue is None:
            raise RuntimeError("train_step_meta needs attach_queue(handle) first")
        dp = 1 + max(int(i.get("dp_rank", 0)) for i in self.info)
        plan = plan_shards(batch, dp, advantage=self.algorithm.advantage, norm_by_std=self.algorithm.norm_adv_by_std)
        shares = [meta.select(rows) for rows in plan.rows]
        refs = [
            r.train_shard.remote(self.queue, shares[d], plan.advantages[d].tolist(), plan.total_tokens, plan.total_seqs)
            for r, d in ((r, int(i.get("dp_rank", 0))) for r, i in zip(self.ranks, self.info))
        ]
        out = self._get(refs, "train_step")
        self._exported = True
        leaders = {}
        for (metrics, _), i in zip(out, self.info):
            leaders.setdefault(int(i.get("dp_rank", 0)), metrics)
        rewards = np.asarray(batch.column("reward").to_numpy(zero_copy_only=False), np.float64)
        return merge_share_metrics([leaders[d] for d in sorted(leaders)], rewards)

    def named_tensors(self) -> Iterable[tuple[str, Any]]:
        """The weights pulled into this process (not the pipeline's path: ``publish_weights``)."""
        return [item for part in self._all("named_tensors") if part for item in part]

    async def publish_weights(self, engine: Any, version: int) -> SyncReport:
        """Each weight-source rank streams its part into every engine worker; only the senders'
        addresses, the version and the outcome pass through here."""
        import anyio
        import ray

        if not self._exported:  # e.g. a resumed run: nothing was exported since the restore
            await anyio.to_thread.run_sync(self._all, "export_weights")
            self._exported = True
        senders = [(r, i["weight_source"]) for r, i in zip(self.ranks, self.info) if i.get("weight_source")]

        async def send(sync: str, receivers: int) -> list[SendReport]:
            refs = [r.send_weights.remote(version, sync, receivers) for r, _ in senders]
            return [SendReport(**d) for d in await anyio.to_thread.run_sync(ray.get, refs, abandon_on_cancel=True)]

        async def cancel() -> None:
            for r, _ in senders:
                r.cancel_send.remote()

        return await sync_direct(engine, [src for _, src in senders], send, cancel, version, self.weight_sync)

    def save_checkpoint(self, path: str) -> None:
        self._all("save_checkpoint", os.path.abspath(path))  # the actors' working directory is not ours

    def load_checkpoint(self, path: str) -> None:
        self._all("load_checkpoint", os.path.abspath(path))

    def close(self) -> None:
        """Close every rank's trainer (bounded), then kill the actors."""
        import ray

        try:
            ray.wait([r.close.remote() for r in self.ranks], num_returns=len(self.ranks), timeout=60)
        finally:
            kill_actors(self.ranks)
