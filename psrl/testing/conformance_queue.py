"""``check_transfer_queue``: the conformance suite every TransferQueue must pass."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import anyio
import numpy as np

from psrl.config.transfer_queue import TransferQueueConfig
from psrl.trajectory import Trajectory
from psrl.transfer_queue import (
    GRPOGroupSampler, SeqLenBalancedSampler, SequentialSampler, TransferQueue, WouldBlock,
)

from .conformance_env import ConformanceError

QueueFactory = Callable[[TransferQueueConfig], AbstractAsyncContextManager[TransferQueue]]


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise ConformanceError(what)


def make_trajectory(key: str, group: str, *, length: int = 8, version: int = 0, reward: float = 0.0, turns: int = 1) -> Trajectory:
    """A small valid trajectory whose token ids encode its key (so mix-ups show)."""
    seed = sum(key.encode()) % 1000
    per = max(1, length // turns)
    bounds = [[t * per, (t + 1) * per] for t in range(turns)]
    n = per * turns
    return Trajectory(
        key=key, group_id=group, prompt_ids=np.arange(3, dtype=np.int32) + seed,
        response_ids=(np.arange(n, dtype=np.int32) * 7 + seed), loss_mask=np.ones(n, np.int8),
        logprobs=np.linspace(-1, 0, n, dtype=np.float32), versions=np.full(n, version, np.int32),
        turn_bounds=bounds, turn_rewards=np.full(turns, reward / turns, np.float32), reward=reward,
        env_metrics={"steps": float(turns)}, data_source="conformance",
    )


def _same(a: Trajectory, b: Trajectory) -> bool:
    arrays = ("prompt_ids", "response_ids", "loss_mask", "logprobs", "versions", "turn_bounds", "turn_rewards")
    scalars = ("key", "group_id", "reward", "status", "error", "env_metrics", "data_source")
    return all(np.array_equal(getattr(a, n), getattr(b, n)) for n in arrays) and all(
        getattr(a, n) == getattr(b, n) for n in scalars
    )


async def check_transfer_queue(factory: QueueFactory, *, timeout_s: float = 120.0) -> None:
    """Run the conformance checks; raise ``ConformanceError`` naming the first failure.

    ``factory(cfg)`` must yield a fresh, empty queue honouring ``cfg`` (capacity, staleness,
    admission batch size). Checks: round trip of every field; column subsets; field-level
    readiness; consumers are independent and never get a sample twice; partitions; GRPO-group
    and seq-len balanced samplers; staleness drop and refill; admission capacity; backpressure
    (``WouldBlock``, waiting put); ``get_batch``; cancelled calls lose nothing; concurrent producers and
    consumers with exact key accounting; bad input is refused and stores nothing; checkpoint
    and restore into a fresh queue.
    """
    with anyio.fail_after(timeout_s):
        base = TransferQueueConfig(capacity_samples=10_000, max_staleness=100, admission_batch_size=4)
        async with factory(base) as q:
            await _round_trip(q)
            await _field_readiness(q)
            await _consumers_and_partitions(q)
            await _samplers(q)
            await _cancellation(q)
            await _concurrency(q)
            await _bad_input(q)
        await _staleness(factory, base)
        await _backpressure(factory, base)
        await _checkpoint(factory, base)


async def _round_trip(q: TransferQueue) -> None:
    trajs = [make_trajectory(f"rt{i}", f"rt-g{i // 2}", length=4 + 3 * i, turns=1 + i % 3, reward=i) for i in range(6)]
    await q.batch_put(trajs[:4], partition="rt")
    await q.put(trajs[4], partition="rt")
    await q.put(trajs[5], partition="rt")
    meta = await q.get_meta("rt", 6, consumer="c")
    _expect(sorted(meta.keys) == sorted(t.key for t in trajs), f"get_meta returned keys {meta.keys}")
    _expect(meta.keys == [t.key for t in trajs], "the sequential sampler must return samples in arrival order")
    _expect(meta.seq_lens == [t.seq_len for t in trajs], f"seq_lens {meta.seq_lens} differ from the trajectories'")
    _expect(all(tag.get("status") == "ok" for tag in meta.tags), "tags must carry the status")
    back = await q.get_trajectories(meta)
    for a, b in zip(trajs, back, strict=True):
        _expect(_same(a, b), f"trajectory {a.key!r} changed on its way through the queue")
    sub = await q.get_data(meta, ["logprobs", "reward"])
    _expect(sub.schema.names == ["key", "logprobs", "reward"], f"get_data(fields) returned columns {sub.schema.names}")
    _expect(sub.column("key").to_pylist() == meta.keys, "get_data must return rows in meta order")
    half = meta.select([5, 0, 3])
    rows = await q.get_data(half, ["reward"])
    _expect(rows.column("reward").to_pylist() == [5.0, 0.0, 3.0], "get_data of a reordered meta returned the wrong rows")
    # get_batch: get_meta and get_data of the same fields in one call.
    more = [make_trajectory(f"gb{i}", f"gb-g{i}", length=3 + i, reward=10 + i) for i in range(3)]
    await q.batch_put(more, partition="gb")
    meta, data = await q.get_batch("gb", 3, ["response_ids", "reward"], consumer="c")
    _expect(meta.keys == [t.key for t in more], f"get_batch returned keys {meta.keys}")
    _expect(data.schema.names == ["key", "response_ids", "reward"], f"get_batch returned columns {data.schema.names}")
    _expect(data.column("key").to_pylist() == meta.keys, "get_batch must return rows in meta order")
    _expect(data.column("reward").to_pylist() == [10.0, 11.0, 12.0], "get_batch returned the wrong rewards")
    _expect(all(np.array_equal(np.asarray(r.values), t.response_ids) for r, t in zip(data.column("response_ids"), more, strict=True)),
            "get_batch returned the wrong tokens")
    meta, data = await q.get_batch("gb", 3, ["response_ids"], consumer="c", partial=True)
    _expect(len(meta) == 0 and data.num_rows == 0, f"a second get_batch of consumer 'c' returned {meta.keys}")


async def _field_readiness(q: TransferQueue) -> None:
    trajs = [make_trajectory(f"fr{i}", f"fr-g{i}") for i in range(4)]
    tokens = ["key", "group_id", "prompt_ids", "response_ids", "loss_mask", "logprobs", "versions"]
    from psrl.trajectory import to_arrow

    await q.batch_put(to_arrow(trajs, tokens), partition="fr")
    meta = await q.get_meta("fr", 4, ["response_ids", "reward"], consumer="c", partial=True)
    _expect(len(meta) == 0, "a sample whose reward has not arrived must not be handed out for a batch needing reward")
    meta = await q.get_meta("fr", 4, ["response_ids"], consumer="tokens-only", partial=True)
    _expect(len(meta) == 4, "samples whose requested fields are ready must be handed out")
    await q.put_fields(["fr1", "fr3"], {"reward": [1.5, 3.5]}, partition="fr")
    meta = await q.get_meta("fr", 4, ["response_ids", "reward"], consumer="c", partial=True)
    _expect(meta.keys == ["fr1", "fr3"], f"after rewards for fr1, fr3 arrived, get_meta returned {meta.keys}")
    data = await q.get_data(meta, ["reward", "response_ids"])
    _expect(data.column("reward").to_pylist() == [1.5, 3.5], "the late reward was not stored")
    infos = {s.key: s for s in await q.list("fr")}
    _expect(set(infos) == {f"fr{i}" for i in range(4)}, "list() must show every sample of the partition")
    _expect("reward" in infos["fr1"].ready_fields and "reward" not in infos["fr0"].ready_fields, "list() ready fields wrong")


async def _consumers_and_partitions(q: TransferQueue) -> None:
    await q.batch_put([make_trajectory(f"cp{i}", f"cp{i}") for i in range(4)], partition="cp-train")
    await q.batch_put([make_trajectory(f"cv{i}", f"cv{i}") for i in range(2)], partition="cp-val")
    a = await q.get_meta("cp-train", 4, consumer="trainer")
    again = await q.get_meta("cp-train", 4, consumer="trainer", partial=True)
    _expect(len(again) == 0, f"consumer 'trainer' got {again.keys} a second time")
    b = await q.get_meta("cp-train", 4, consumer="critic")
    _expect(sorted(a.keys) == sorted(b.keys), "another consumer must still see samples 'trainer' took")
    v = await q.get_meta("cp-val", 8, consumer="trainer", partial=True)
    _expect(sorted(v.keys) == ["cv0", "cv1"], f"partition 'cp-val' returned {v.keys}")
    try:
        await q.put(make_trajectory("cp0", "cp0"), partition="cp-val")
    except ValueError:
        pass
    else:
        raise ConformanceError("putting a live key into another partition must raise ValueError")
    removed = await q.clear("cp-val")
    _expect(removed == 2, f"clear('cp-val') removed {removed} samples, expected 2")
    _expect(await q.list("cp-val") == [], "clear() left samples behind")


async def _samplers(q: TransferQueue) -> None:
    # Groups of 4 arrive interleaved; group g3 stays incomplete.
    order = [(g, i) for i in range(4) for g in range(3)] + [(3, 0), (3, 1)]
    await q.batch_put([make_trajectory(f"s-g{g}-{i}", f"s-g{g}") for g, i in order], partition="grpo")
    sampler = GRPOGroupSampler(group_size=4)
    meta = await q.get_meta("grpo", 8, consumer="c", sampler=sampler)
    groups = meta.group_ids
    _expect(groups == ["s-g0"] * 4 + ["s-g1"] * 4, f"GRPO sampler must return whole groups, oldest first; got {groups}")
    rest = await q.get_meta("grpo", 8, consumer="c", sampler=sampler, partial=True)
    _expect(rest.group_ids == ["s-g2"] * 4, f"an incomplete group must not be returned; got {rest.group_ids}")
    await q.batch_put([make_trajectory(f"s-g3-{i}", "s-g3") for i in (2, 3)], partition="grpo")
    last = await q.get_meta("grpo", 4, consumer="c", sampler=sampler)
    _expect(last.group_ids == ["s-g3"] * 4, "a group completed later must be returned")

    lengths = [40, 3, 25, 8, 31, 2, 17, 12]
    await q.batch_put([make_trajectory(f"sl{i}", f"sl{i}", length=n) for i, n in enumerate(lengths)], partition="sl")
    meta = await q.get_meta("sl", 8, consumer="c", sampler=SeqLenBalancedSampler(dp_size=2))
    shares = meta.split(2)
    totals = [s.total_tokens() for s in shares]
    _expect(sorted(meta.keys) == sorted(f"sl{i}" for i in range(8)), "seq-len balanced batch lost samples")
    _expect(all(len(s) == 4 for s in shares), "each data-parallel rank must get the same number of samples")
    _expect(abs(totals[0] - totals[1]) <= max(m + 3 for m in lengths), f"rank token totals {totals} are not balanced")
    naive = [sum(n + 3 for n in lengths[:4]), sum(n + 3 for n in lengths[4:])]
    _expect(abs(totals[0] - totals[1]) <= abs(naive[0] - naive[1]), f"balanced totals {totals} worse than arrival order {naive}")


async def _cancellation(q: TransferQueue) -> None:
    await q.batch_put([make_trajectory(f"cx{i}", f"cx{i}") for i in range(2)], partition="cx")
    with anyio.move_on_after(0.3):
        await q.get_meta("cx", 4, consumer="c")  # cannot complete: only 2 ready
        raise ConformanceError("get_meta returned a batch of 4 with only 2 samples ready")
    await q.batch_put([make_trajectory(f"cx{i}", f"cx{i}") for i in range(2, 4)], partition="cx")
    with anyio.fail_after(10):
        meta = await q.get_meta("cx", 4, consumer="c")
    _expect(sorted(meta.keys) == [f"cx{i}" for i in range(4)], f"after a cancelled get_meta, got {meta.keys}")
    await q.batch_put([make_trajectory(f"cy{i}", f"cy{i}") for i in range(2)], partition="cy")
    with anyio.move_on_after(0.3):
        await q.get_batch("cy", 4, consumer="c")
        raise ConformanceError("get_batch returned a batch of 4 with only 2 samples ready")
    await q.batch_put([make_trajectory(f"cy{i}", f"cy{i}") for i in range(2, 4)], partition="cy")
    with anyio.fail_after(10):
        meta, data = await q.get_batch("cy", 4, consumer="c")
    _expect(sorted(meta.keys) == [f"cy{i}" for i in range(4)] and data.num_rows == 4, f"after a cancelled get_batch, got {meta.keys}")


async def _concurrency(q: TransferQueue, producers: int = 16, per_producer: int = 4, consumers: int = 4) -> None:
    total = producers * per_producer
    seen: list[str] = []

    async def produce(p: int) -> None:
        for i in range(per_producer):
            await q.put(make_trajectory(f"cc{p}-{i}", f"cc{p}-{i}", length=5 + i), partition="cc")

    async def consume(c: int) -> None:
        while True:
            if c % 2:
                meta, data = await q.get_batch("cc", 4, ["response_ids"], consumer="trainer", partial=True)
            else:
                meta = await q.get_meta("cc", 4, ["response_ids"], consumer="trainer", partial=True)
                data = await q.get_data(meta, ["response_ids"]) if len(meta) else None
            if len(meta):
                _expect(data.column("key").to_pylist() == meta.keys, "get_data rows out of order")
                seen.extend(meta.keys)
            elif len(seen) >= total:
                return
            else:
                await anyio.sleep(0.005)

    async with anyio.create_task_group() as tg:
        for c in range(consumers):
            tg.start_soon(consume, c)
        for p in range(producers):
            tg.start_soon(produce, p)
    expected = {f"cc{p}-{i}" for p in range(producers) for i in range(per_producer)}
    _expect(len(seen) == len(set(seen)), f"{len(seen) - len(set(seen))} samples were handed out twice")
    _expect(set(seen) == expected, f"{len(expected - set(seen))} samples were lost")


async def _bad_input(q: TransferQueue) -> None:
    bad = make_trajectory("bad0", "bad")
    bad.logprobs = bad.logprobs[:-1]
    for what, call in [
        ("a trajectory with mismatched arrays", lambda: q.batch_put([make_trajectory("ok0", "ok"), bad], partition="bad")),
        ("a batch repeating a key", lambda: q.batch_put([make_trajectory("dup", "d"), make_trajectory("dup", "d")], partition="bad")),
        ("a put without fields", lambda: q.batch_put({"key": ["x"]}, partition="bad")),
        ("batch_size not a multiple of group_size", lambda: q.get_meta("bad", 6, consumer="c", sampler=GRPOGroupSampler(group_size=4))),
        ("batch_size 0", lambda: q.get_meta("bad", 0, consumer="c", sampler=SequentialSampler())),
    ]:
        try:
            await call()
        except ValueError:
            continue
        raise ConformanceError(f"{what} must raise ValueError")
    _expect(await q.list("bad") == [], "a refused put must store nothing")
    await q.batch_put([make_trajectory("bk0", "bk")], partition="bad-get")
    meta = await q.get_meta("bad-get", 1, consumer="c")
    try:
        await q.get_data(meta, ["no_such_field"])
    except KeyError as exc:
        _expect("bk0" in str(exc), f"a missing field's error must name the key: {exc}")
    else:
        raise ConformanceError("get_data of a field never put must raise KeyError")


async def _staleness(factory: QueueFactory, base: TransferQueueConfig) -> None:
    for mode in ("drop", "refill"):
        cfg = base.model_copy(update={"max_staleness": 1, "on_stale": mode})
        async with factory(cfg) as q:
            await q.batch_put([make_trajectory(f"v0-{i}", "old", version=0) for i in range(2)])
            await q.batch_put([make_trajectory(f"v1-{i}", "mid", version=1) for i in range(2)])
            await q.set_version(2)  # oldest allowed: 1
            meta = await q.get_meta("train", 4, consumer="c", partial=True)
            _expect(sorted(meta.keys) == ["v1-0", "v1-1"], f"[{mode}] after set_version(2), eta=1: got {meta.keys}")
            stats = await q.statistics()
            _expect(stats.dropped_stale == 2, f"[{mode}] dropped_stale = {stats.dropped_stale}, expected 2")
            # A late member of an evicted group is evicted on arrival; a sample arriving stale too.
            await q.batch_put([make_trajectory("v0-2", "old", version=1), make_trajectory("late", "late", version=0)])
            meta = await q.get_meta("train", 4, consumer="c", partial=True)
            _expect(len(meta) == 0, f"[{mode}] stale arrivals were handed out: {meta.keys}")
            refills = await q.take_refills()
            if mode == "refill":
                groups = sorted(r.group_id for r in refills)
                _expect(groups == ["late", "old", "old"], f"[refill] refills name groups {groups}")
                _expect(sorted(k for r in refills for k in r.keys) == ["late", "v0-0", "v0-1", "v0-2"], "refill keys wrong")
            else:
                _expect(refills == [], "[drop] must not queue refills")
    # Admission: (eta + v + 1) * B - (accepted + running)
    async with factory(base.model_copy(update={"max_staleness": 1, "admission_batch_size": 4})) as q:
        granted = await q.acquire_rollouts(100)
        _expect(granted == 8, f"admission at version 0, eta 1, B 4 must be 8; got {granted}")
        await q.finish_rollouts(accepted=6, rejected=2)
        _expect(await q.acquire_rollouts(10) == 2, "rejected rollouts must free admission capacity")
        await q.finish_rollouts(accepted=2)
        with anyio.move_on_after(0.3):
            await q.acquire_rollouts(1)
            raise ConformanceError("acquire_rollouts must wait while capacity is 0")
        await q.set_version(1)
        _expect(await q.acquire_rollouts(10) == 4, "a new policy version must admit one more batch")


async def _backpressure(factory: QueueFactory, base: TransferQueueConfig) -> None:
    async with factory(base.model_copy(update={"capacity_samples": 4})) as q:
        await q.batch_put([make_trajectory(f"bp{i}", f"bp{i}") for i in range(4)])
        try:
            await q.put_nowait(make_trajectory("bp4", "bp4"))
        except WouldBlock:
            pass
        else:
            raise ConformanceError("put_nowait into a full queue must raise WouldBlock")
        try:
            await q.batch_put([make_trajectory(f"huge{i}", "h") for i in range(5)])
        except ValueError:
            pass
        else:
            raise ConformanceError("a put larger than the capacity must raise ValueError")
        # Updating a field of a live sample needs no room.
        await q.put_fields(["bp0"], {"reward": [2.0]})
        done = anyio.Event()

        async def waiting_put() -> None:
            await q.put(make_trajectory("bp4", "bp4"))
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiting_put)
            await anyio.sleep(0.3)
            _expect(not done.is_set(), "put into a full queue must wait")
            # A put given up while waiting holds no room.
            with anyio.move_on_after(0.2):
                await q.put(make_trajectory("bp5", "bp5"))
            meta = await q.get_meta("train", 2, consumer="c")
            await q.clear(keys=meta.keys)
            with anyio.fail_after(10):
                await done.wait()
        # The abandoned put's reservation may be released a moment later (its late reply is undone).
        with anyio.move_on_after(5):
            while (keys := sorted(s.key for s in await q.list())) != ["bp2", "bp3", "bp4"]:
                await anyio.sleep(0.05)
        _expect(keys == ["bp2", "bp3", "bp4"], f"after backpressure the queue holds {keys}")


async def _checkpoint(factory: QueueFactory, base: TransferQueueConfig) -> None:
    trajs = [make_trajectory(f"ck{i}", f"ck{i // 2}", length=6 + i) for i in range(8)]
    with tempfile.TemporaryDirectory(prefix="psrl-tq-ckpt-") as tmp:
        async with factory(base) as q:
            await q.batch_put(trajs)
            await q.set_version(3)
            taken = await q.get_meta("train", 4, consumer="trainer")
            await q.checkpoint(f"{tmp}/ck", with_data=True)
        async with factory(base) as q2:
            report = await q2.restore(f"{tmp}/ck")
            _expect(report.samples == 8 and report.version == 3, f"restore report {report}")
            rest = await q2.get_meta("train", 8, consumer="trainer", partial=True)
            _expect(sorted(rest.keys) == sorted(set(t.key for t in trajs) - set(taken.keys)),
                    f"after restore 'trainer' got {rest.keys}: a sample was repeated or skipped")
            back = {t.key: t for t in await q2.get_trajectories(rest)}
            for t in trajs:
                if t.key in back:
                    _expect(_same(t, back[t.key]), f"{t.key} changed across checkpoint/restore")
            other = await q2.get_meta("train", 8, consumer="critic", partial=True)
            _expect(len(other) == 8, "another consumer must still see all restored samples")
            _expect((await q2.statistics()).version == 3, "the policy version must survive a restore")
