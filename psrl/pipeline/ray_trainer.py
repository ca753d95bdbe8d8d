"""Trainer ranks as Ray actors: ``tensor x pipeline x data`` ranks, each holding a
``MegatronTrainer``, rendezvous through torch.distributed at rank 0's node; ``RayPolicyTrainer``
implements ``PolicyTrainer`` over them for the driver's scheduler.

Every call is collective: it goes to all ranks at once and the step's metrics come from rank 0
(they are identical on every rank). The weights for the engines are exported by every rank (a
collective gather) right after the step, in the step's own call, and only the weight-source
ranks (tensor rank 0 of data rank 0, one per pipeline stage) send theirs back, as CPU tensors.
Blocking by design: the scheduler runs ``train_step`` in a worker thread.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa

from psrl.config.schema import RayConfig
from psrl.config.trainer import AlgorithmConfig, TrainerConfig
from psrl.log import get_logger
from psrl.trainer.batch import TRAINER_FIELDS

from .ray_common import RayLaunchError, actor_options, kill_actors, wait_started

log = get_logger("psrl.ray")


class TrainerRankActor:
    """One trainer rank. ``setup`` builds the trainer (collective over the group)."""

    def __init__(self) -> None:
        self.policy: Any = None

    def rendezvous_address(self) -> tuple[str, int]:
        """Where the group meets: this node's address and a port free on it (asked of rank 0)."""
        import ray

        from psrl.trainer.distributed import free_port

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, model_dir: str, trainer_json: str, algo_json: str, temperature: float,
              rank: int, world: int, master: tuple[str, int]) -> dict[str, Any]:
        import ray

        from psrl.trainer.trainer import MegatronTrainer

        from .megatron_policy import MegatronPolicy

        if world > 1:
            # LOCAL_RANK 0: Ray gives each GPU rank its own CUDA_VISIBLE_DEVICES.
            os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), WORLD_SIZE=str(world),
                              RANK=str(rank), LOCAL_RANK="0")
        trainer = MegatronTrainer(
            model_dir, TrainerConfig.model_validate_json(trainer_json), AlgorithmConfig.model_validate_json(algo_json),
            temperature=temperature,
        )
        self.policy = MegatronPolicy(trainer)
        return {"rank": rank, "node": ray.util.get_node_ip_address(), "device": trainer.device,
                "weight_source": trainer.is_weight_source}

    def train_step(self, batch: pa.RecordBatch) -> tuple[dict[str, float], list[tuple[str, Any]] | None]:
        metrics = dict(self.policy.train_step(batch))
        return metrics, self._weights()

    def named_tensors(self) -> list[tuple[str, Any]] | None:
        return self._weights()

    def _weights(self) -> list[tuple[str, Any]] | None:
        weights = list(self.policy.named_tensors())  # collective: every rank gathers
        if not self.policy.trainer.is_weight_source:
            return None
        return [(name, t.detach().cpu()) for name, t in weights]

    def save_checkpoint(self, path: str) -> None:
        self.policy.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.policy.load_checkpoint(path)

    def close(self) -> None:
        if self.policy is not None:
            self.policy.trainer.close()
            self.policy = None


class RayPolicyTrainer:
    """Implements ``PolicyTrainer`` over a group of ``TrainerRankActor``; ``close()`` ends it."""

    fields = TRAINER_FIELDS

    def __init__(self, ranks: Sequence[Any], info: Sequence[Mapping[str, Any]]) -> None:
        self.ranks = list(ranks)
        self.info = list(info)
        self._weights: list[tuple[str, Any]] = []

    @classmethod
    def create(cls, model_dir: str, trainer: TrainerConfig, algorithm: AlgorithmConfig, ray_cfg: RayConfig,
               *, temperature: float = 1.0) -> RayPolicyTrainer:
        """Start ``tensor x pipeline x data`` rank actors and build the trainer on each (blocking:
        a minute or more for big models; call it in a thread)."""
        import ray

        p = trainer.parallel
        world = p.tensor * p.pipeline * p.data
        cls_ = ray.remote(TrainerRankActor).options(**actor_options(ray_cfg.trainer))
        ranks = [cls_.remote() for _ in range(world)]
        try:
            timeout = ray_cfg.actor_start_timeout_s
            (master,) = wait_started([ranks[0].rendezvous_address.remote()], ["trainer rank 0"], timeout)
            refs = [
                r.setup.remote(model_dir, trainer.model_dump_json(), algorithm.model_dump_json(), temperature, i, world, master)
                for i, r in enumerate(ranks)
            ]
            info = wait_started(refs, [f"trainer rank {i}" for i in range(world)], timeout)
        except BaseException:
            kill_actors(ranks)
            raise
        log.info("trainer on ray", ranks=world, nodes=sorted({i["node"] for i in info}), device=info[0]["device"])
        return cls(ranks, info)

    def _all(self, method: str, *args: Any) -> list[Any]:
        import ray

        refs = [getattr(r, method).remote(*args) for r in self.ranks]
        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as e:
            raise RayLaunchError(f"a trainer rank died during {method}: {e}") from None
        except ray.exceptions.RayTaskError as e:
            raise e.as_instanceof_cause() from None

    def _merge(self, parts: Iterable[list[tuple[str, Any]] | None]) -> list[tuple[str, Any]]:
        return [item for part in parts if part for item in part]

    def train_step(self, batch: pa.RecordBatch) -> Mapping[str, float]:
        out = self._all("train_step", batch)
        self._weights = self._merge(w for _, w in out)
        return out[0][0]

    def named_tensors(self) -> Iterable[tuple[str, Any]]:
        """The weights exported with the last step (then forgotten), else exported now."""
        weights, self._weights = self._weights, []
        return weights or self._merge(self._all("named_tensors"))

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
