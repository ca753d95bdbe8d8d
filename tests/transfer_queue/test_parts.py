"""The pieces: wire frames, column store, metadata table, samplers, staleness formula, sockets."""

import anyio
import numpy as np
import pyarrow as pa
import pytest
import zmq

from psrl.testing.conformance_queue import make_trajectory
from psrl.trajectory import TRAJECTORY_SCHEMA, from_arrow, to_arrow
from psrl.transfer_queue import ColumnStore, StalenessManager
from psrl.transfer_queue.arrow_frames import decode_batch, decode_columns, encode_batch
from psrl.transfer_queue.columns import min_versions, sample_update
from psrl.transfer_queue.messages import Data, SampleUpdate, UnitGet, UnitPut
from psrl.transfer_queue.samplers import balance_by_length
from psrl.transfer_queue.storage import StorageUnit
from psrl.transfer_queue.table import SampleTable
from psrl.transfer_queue.zsocket import AsyncSocket, make_socket


def _batch(n=6, start=0):
    return to_arrow([make_trajectory(f"k{i}", f"g{i // 2}", length=3 + i, reward=i, turns=1 + i % 2) for i in range(start, start + n)])


def test_frames_round_trip_zero_copy_and_sliced():
    batch = _batch()
    spec, frames = encode_batch(batch)
    assert {c.name for c in spec.zero_copy} >= {"response_ids", "logprobs", "versions", "loss_mask"}
    back = decode_batch(spec, frames, TRAJECTORY_SCHEMA)
    assert back.equals(batch) and back.schema == batch.schema
    values = back.column("response_ids").values.buffers()[1]
    sent = frames[[c.values_frame for c in spec.zero_copy if c.name == "response_ids"][0]]
    assert values.address == sent.address, "decoding must not copy the values buffer"
    part = batch.slice(2, 3)
    spec, frames = encode_batch(part)
    nbytes = sum(memoryview(f).nbytes for f in frames)
    assert decode_batch(spec, frames, TRAJECTORY_SCHEMA).equals(part)
    assert nbytes < sum(memoryview(f).nbytes for f in encode_batch(batch)[1]), "a slice must not ship the whole buffers"


@pytest.mark.timeout(30)
def test_async_socket_outlives_an_event_loop_and_a_cancelled_wait():
    """On asyncio the socket's descriptor stays registered with the loop: a receive cancelled
    half-way leaves the socket usable, and a socket used again under a new loop (a second
    ``anyio.run``) moves its registration there instead of waiting on the dead loop."""
    ctx = zmq.Context()
    a, b = make_socket(ctx, zmq.PAIR), make_socket(ctx, zmq.PAIR)
    a.bind("inproc://two-loops")
    b.connect("inproc://two-loops")
    sa, sb = AsyncSocket(a), AsyncSocket(b)

    async def exchange(tag: bytes) -> None:
        with anyio.move_on_after(0.05):
            await sb.recv()  # nothing sent yet: cancelled while registered and waiting
        async with anyio.create_task_group() as tg:
            got = []

            async def receive() -> None:
                got.append((await sb.recv())[0].bytes)

            tg.start_soon(receive)
            await anyio.sleep(0.01)  # the receiver waits on the descriptor first
            await sa.send([tag])
        assert got == [tag]

    try:
        for tag in (b"first loop", b"second loop"):
            anyio.run(exchange, tag, backend="asyncio")
    finally:
        sa.close()
        sb.close()
        ctx.term()


def test_token_columns_share_one_offsets_frame_and_bad_offsets_are_refused():
    batch = _batch().drop_columns(["key"])
    spec, frames = encode_batch(batch)
    same = [c for c in spec.zero_copy if c.name in ("response_ids", "logprobs", "versions", "loss_mask")]
    assert len(same) == 4 and len({c.offsets_frame for c in same}) == 1, "columns with equal offsets share one frame"
    assert decode_batch(spec, frames, TRAJECTORY_SCHEMA).equals(batch)
    short = list(frames)
    short[same[0].offsets_frame] = np.frombuffer(frames[same[0].offsets_frame], np.int32)[:-1].tobytes()
    first = next(c.name for c in spec.zero_copy if c.offsets_frame == same[0].offsets_frame)
    with pytest.raises(ValueError, match=f"column '{first}'.*do not describe 6 rows"):
        decode_columns(spec, short, TRAJECTORY_SCHEMA)


def test_column_store_sends_back_the_frames_of_a_whole_put():
    """A get of exactly what one put stored replies with that put's own frames (no Arrow array
    built, no copy); a get of part of it, or across puts, still gathers and re-encodes."""
    store = ColumnStore()
    sent = {}
    for keys, part in ((["k0", "k1", "k2", "k3"], _batch(4, 0)), (["k4", "k5", "k6", "k7"], _batch(4, 4))):
        spec, frames = encode_batch(part.drop_columns(["key"]))
        store.put_columns(keys, part.num_rows, decode_columns(spec, [memoryview(f) for f in frames], TRAJECTORY_SCHEMA))
        sent[keys[0]] = (spec, frames)
    fields = ["response_ids", "logprobs", "reward"]
    spec, frames = store.encode(["k0", "k1", "k2", "k3"], fields)
    resp = next(c for c in spec.zero_copy if c.name == "response_ids")
    put_spec, put_frames = sent["k0"]
    put_resp = next(c for c in put_spec.zero_copy if c.name == "response_ids")
    assert memoryview(frames[resp.values_frame]).obj is put_frames[put_resp.values_frame], "the put's own frame goes back"
    assert decode_batch(spec, frames, TRAJECTORY_SCHEMA).equals(_batch(4, 0).select(fields))
    for keys in (["k1", "k2"], ["k3", "k4"], ["k2", "k0"]):
        spec, frames = store.encode(keys, fields)
        want = store.columns(keys, fields)
        assert decode_batch(spec, frames, TRAJECTORY_SCHEMA).to_pydict() == want.to_pydict()
        assert want.column("reward").to_pylist() == [float(k[1:]) for k in keys]


@pytest.mark.timeout(30)
def test_a_storage_unit_replies_with_the_zeromq_frames_a_put_arrived_in():
    """Over a real socket: the reply to a get of a whole put carries the very ``zmq.Frame``
    objects the put arrived in, so pyzmq shares their messages instead of wrapping a view of them
    in a new zero-copy frame (each of those costs the service a wake-up of pyzmq's
    garbage-collector thread when ZeroMQ is done with it); the client reads the data back exactly."""
    part = _batch(4, 0)
    keys = part.column("key").to_pylist()
    spec, frames = encode_batch(part.drop_columns(["key"]))
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://unit-frames")
        b.connect("inproc://unit-frames")
        a.send_multipart(frames, copy=False)
        arrived = b.recv_multipart(copy=False)
        unit = StorageUnit(0)
        unit.handle(UnitPut(keys, spec), arrived)
        fields = ["response_ids", "logprobs", "versions", "loss_mask"]
        reply, out = unit.handle(UnitGet(keys, fields), [])
        assert isinstance(reply, Data)
        for c in reply.batch.zero_copy:
            assert any(out[c.values_frame] is f for f in arrived), f"{c.name}: a new frame, not the received one"
        b.send_multipart(out, copy=False)
        back = a.recv_multipart(copy=False)
        got = decode_batch(reply.batch, [f.buffer for f in back], TRAJECTORY_SCHEMA)
        assert got.equals(part.select(fields))
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


def test_column_store_gathers_across_puts_and_frees_chunks():
    store = ColumnStore()
    a, b = _batch(4, 0), _batch(4, 4)
    store.put(a.column("key").to_pylist(), a.drop_columns(["key"]))
    store.put(b.column("key").to_pylist(), b.drop_columns(["key"]))
    keys = ["k5", "k0", "k1", "k7"]
    got = store.get(keys, list(TRAJECTORY_SCHEMA.names[1:]))
    assert [t.key for t in from_arrow(got)] == keys
    assert from_arrow(got)[1].reward == 0.0 and from_arrow(got)[0].reward == 5.0
    store.put(["k0"], pa.RecordBatch.from_arrays([pa.array([9.0])], names=["reward"]))
    assert store.get(["k0"], ["reward"]).column("reward").to_pylist() == [9.0]
    n_chunks = len(store._chunks)
    assert store.delete([f"k{i}" for i in range(4)]) == 4
    assert len(store._chunks) < n_chunks
    with pytest.raises(KeyError, match="'k0'"):
        store.get(["k0"], ["reward"])
    assert store.num_samples() == 4


def test_column_store_reuses_row_ids_of_deleted_keys():
    """Keys come and go for a whole run: the row ids of deleted keys are handed out again, the
    index grows only with the samples held at once, and no key ever reads another's row."""
    store = ColumnStore()
    held: dict[str, float] = {}
    for step in range(12):
        keys = [f"s{step}-{i}" for i in range(700)]
        store.put(keys, pa.RecordBatch.from_arrays([pa.array(np.arange(700) + step * 1000.0)], names=["reward"]))
        held.update({k: step * 1000.0 + i for i, k in enumerate(keys)})
        gone = [k for k in held if k.startswith(f"s{step - 1}-")]
        assert store.delete(gone + gone[:3]) == len(gone), "a repeated key is deleted once"
        for k in gone:
            del held[k]
    assert store.num_samples() == len(held)
    assert store._n_ids == 1400 and store._cap == 2048, "freed row ids are reused: the index stays at what is held"
    keys = list(held)[::37]
    assert store.get(keys, ["reward"]).column("reward").to_pylist() == [held[k] for k in keys]
    store.delete(list(held))
    assert store.num_samples() == 0 and not store._chunks, "every chunk is freed with its last row"
    with pytest.raises(ValueError, match="without any field"):
        store.put(["a"], pa.RecordBatch.from_arrays([pa.array(["a"])], names=["key"]))


def test_column_store_dump_and_load(tmp_path):
    store = ColumnStore()
    a = _batch(5)
    store.put(a.column("key").to_pylist(), a.drop_columns(["key"]))
    store.dump(tmp_path / "u", ["k1", "k3"])
    other = ColumnStore()
    assert other.load(tmp_path / "u") == 2
    assert [t.key for t in from_arrow(other.get(["k3", "k1"], list(TRAJECTORY_SCHEMA.names[1:])))] == ["k3", "k1"]


def test_table_compacts_and_checkpoints():
    t = SampleTable(initial=16)
    slots = t.add([f"s{i}" for i in range(6000)], t.partition_index("train"), 0)
    t.update(slots, t.field_mask(["response_ids"]), SampleUpdate(group_ids=[f"g{i // 4}" for i in range(6000)]))
    t.consumed_by("trainer")[slots[10:20]] = True
    t.remove(slots[:4000])  # more than half gone: compacted
    assert t.n == t.live == 2000 and t.slot_of["s4000"] == 0
    cand = t.candidates(t.partition_index("train"), t.field_mask(["response_ids"]), "trainer")
    assert len(cand) == 2000
    arrow, info = t.to_arrow()
    back = SampleTable.from_arrow(arrow, info)
    assert back.keys == t.keys and back.group_names[back.cols["group"][0]] == "g1000"


def test_min_versions_ignore_observation_tokens_and_slices():
    arr = pa.array([[3, -1, 2], [], [-1, -1], [5]], pa.list_(pa.int32()))
    assert min_versions(arr).tolist() == [2, -1, -1, 5]
    assert min_versions(arr.slice(2, 2)).tolist() == [-1, 5]
    batch = _batch()  # to_arrow derives min_version: a put takes it instead of scanning the tokens
    assert sample_update(batch, None).min_versions == min_versions(batch.column("versions")).tolist()
    assert sample_update(batch.drop_columns(["min_version"]), None).min_versions == batch.column("min_version").to_pylist()
    holes = batch.set_column(batch.schema.get_field_index("min_version"), "min_version", pa.nulls(batch.num_rows, pa.int32()))
    assert sample_update(holes, None).min_versions == batch.column("min_version").to_pylist(), "a column with nulls is not trusted"


def test_balance_by_length_keeps_counts_and_evens_tokens():
    lens = np.array([100, 1, 1, 1, 90, 2, 3, 80])
    order = balance_by_length(lens, 2)
    shares = [lens[order[:4]].sum(), lens[order[4:]].sum()]
    assert sorted(order.tolist()) == list(range(8)) and abs(shares[0] - shares[1]) <= 100


def test_staleness_formula():
    m = StalenessManager(max_staleness=2, batch_size=8)
    assert m.capacity() == (2 + 0 + 1) * 8
    assert m.submit(30) == 24 and m.capacity() == 0
    m.finish(accepted=20, rejected=4)
    assert m.capacity() == 4
    m.set_version(1)
    assert m.capacity() == (2 + 1 + 1) * 8 - 20
    m.evicted(5)
    assert m.capacity() == 32 - 15
    with pytest.raises(ValueError, match="backwards"):
        m.set_version(0)
    with pytest.raises(ValueError, match="running"):
        m.finish(accepted=1)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_async_socket_concurrent_send_and_receive(anyio_backend):
    """A receiver waiting on the edge-triggered FD while other tasks send on the same socket must
    never miss a message (the send path can swallow the FD's signal)."""
    ctx = zmq.Context()
    a, b = make_socket(ctx, zmq.PAIR), make_socket(ctx, zmq.PAIR)
    a.bind("inproc://pair")
    b.connect("inproc://pair")
    sa, sb = AsyncSocket(a), AsyncSocket(b)
    n = 2000
    try:
        async def echo():
            for _ in range(n):
                msg = await sb.recv()
                await sb.send(msg)

        got = []

        async def receive():
            for _ in range(n):
                got.append((await sa.recv())[0].bytes)

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(echo)
                tg.start_soon(receive)
                for i in range(n):
                    await sa.send([str(i).encode()])
                    if i % 50 == 0:
                        await anyio.sleep(0)
        assert got == [str(i).encode() for i in range(n)]
    finally:
        sa.close()
        sb.close()
        ctx.term()
