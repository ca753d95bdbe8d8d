"""Per-rank shards: what the driver receives for a training step is metadata and scalar columns,
whose size does not depend on sequence length; the shard plan keeps groups whole and computes
the advantages a single rank holding the whole batch would."""

from __future__ import annotations

import msgspec
import numpy as np
import pyarrow as pa
import pytest

from psrl.config import TransferQueueConfig
from psrl.pipeline.metrics import METRIC_FIELDS, batch_metrics
from psrl.pipeline.ray.shards import SHARD_FIELDS, merge_share_metrics, plan_shards
from psrl.pipeline.tq_queue import TransferQueueGroups
from psrl.testing.conformance_queue import make_trajectory
from psrl.trainer.advantages import compute_advantages
from psrl.trainer.batch import TRAINER_FIELDS
from psrl.trajectory import to_arrow
from psrl.transfer_queue import start_transfer_queue

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _received(batch: pa.RecordBatch) -> int:
    # get_data decodes zero-copy over the frames it received: its buffers are those bytes.
    return batch.get_total_buffer_size()


async def _driver_bytes(length: int, fields: tuple[str, ...]) -> tuple[int, int]:
    """Put 4 groups of 2 trajectories of ``length`` response tokens; take one step's batch as the
    scheduler does with ``fields``; return (bytes received, bytes of the KVBatchMeta reply)."""
    cfg = TransferQueueConfig(transport="tcp", storage_units=2, in_process=True, request_timeout_s=20)
    async with start_transfer_queue(cfg) as handle, handle.connect() as client:
        q = TransferQueueGroups(client, samples_per_step=8)
        for g in range(4):
            await q.put_group([make_trajectory(f"g{g}/{j}", f"g{g}", length=length, reward=float(j)) for j in range(2)],
                              partition="train")
        taken = await q.take(partition="train", n_groups=4, group_size=2, consumer="trainer", fields=fields)
        assert taken.batch.num_rows == 8 and len(taken.meta) == 8
        if taken.release is not None:  # ranks would fetch by meta here; then the step releases
            shard = await client.get_data(taken.meta.select([0, 1]), list(TRAINER_FIELDS))
            assert len(shard.column("response_ids")[0]) == length
            await taken.release()
        assert await client.list("train") == []
        return _received(taken.batch), len(msgspec.msgpack.encode(taken.meta))


@pytest.mark.timeout(60)
async def test_driver_bytes_per_step_do_not_grow_with_sequence_length():
    sharded = tuple(dict.fromkeys([*SHARD_FIELDS, *METRIC_FIELDS]))
    short = await _driver_bytes(16, sharded)
    long = await _driver_bytes(4096, sharded)
    assert short[0] == long[0], f"scalar columns grew with sequence length: {short[0]} -> {long[0]}"
    # The metadata names each sample's length: a msgpack int of 1 to 5 bytes, not its tokens.
    assert long[1] - short[1] <= 4 * 8, f"metadata grew with sequence length: {short[1]} -> {long[1]}"
    # The same measure sees token data when it is fetched: the whole batch would be ~250x more.
    full_long, _ = await _driver_bytes(4096, tuple(dict.fromkeys([*TRAINER_FIELDS, *METRIC_FIELDS])))
    assert full_long > 100 * long[0]


def test_shard_plan_keeps_groups_whole_balances_tokens_and_matches_whole_batch_advantages():
    lengths = [40, 40, 10, 10, 30, 30, 5, 5, 20, 20, 15, 15]
    trajs = [make_trajectory(f"g{i // 2}/{i % 2}", f"g{i // 2}", length=n, reward=float(i % 3)) for i, n in enumerate(lengths)]
    batch = to_arrow(trajs, list(SHARD_FIELDS))
    for method in ("grpo", "rloo", "reinforce_pp"):
        plan = plan_shards(batch, 2, advantage=method, norm_by_std=True)
        assert sorted(i for rows in plan.rows for i in rows) == list(range(len(trajs)))
        groups = [{trajs[i].group_id for i in rows} for rows in plan.rows]
        assert not groups[0] & groups[1] and all(groups)
        whole = compute_advantages(np.array([t.reward for t in trajs]), [t.group_id for t in trajs], method)
        for rows, adv in zip(plan.rows, plan.advantages):
            np.testing.assert_allclose(adv, whole[rows])
    loads = [sum(trajs[i].seq_len for i in rows) for rows in plan.rows]
    assert abs(loads[0] - loads[1]) <= 43  # within one group's tokens
    assert plan.total_tokens == sum(lengths)
    with pytest.raises(ValueError, match="data.batch_size"):
        plan_shards(batch, 7, advantage="grpo", norm_by_std=True)


def test_metrics_from_scalars_match_and_shares_merge():
    trajs = [make_trajectory(f"g{i // 2}/{i % 2}", f"g{i // 2}", length=8 + i, version=i % 2, reward=float(i % 2)) for i in range(6)]
    m = batch_metrics(to_arrow(trajs, list(METRIC_FIELDS)), version=2)
    assert m["tokens/generated"] == sum(8 + i for i in range(6)) and m["staleness/max"] == 2 and m["staleness/mean"] == 1.5
    shares = [
        {"samples": 2.0, "micro_batches": 1.0, "loss_tokens": 10.0, "tokens": 16.0, "reward_mean": 1.0, "adv_mean": 0.0,
         "adv_abs_mean": 1.0, "response_len_mean": 5.0, "staleness_mean": 0.0, "staleness_max": 0.0, "step_s": 1.0, "loss": 0.5},
        {"samples": 6.0, "micro_batches": 2.0, "loss_tokens": 30.0, "tokens": 48.0, "reward_mean": 0.0, "adv_mean": 0.0,
         "adv_abs_mean": 0.5, "response_len_mean": 5.0, "staleness_mean": 2.0, "staleness_max": 3.0, "step_s": 2.0, "loss": 0.5},
    ]
    out = merge_share_metrics(shares, np.array([1.0, 1.0, 0, 0, 0, 0, 0, 0]))
    assert out["samples"] == 8 and out["reward_mean"] == 0.25 and out["staleness_mean"] == 1.5 and out["staleness_max"] == 3
    assert out["loss"] == 0.5 and out["tokens_per_s"] == 32.0
