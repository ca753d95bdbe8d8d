import numpy as np
import pyarrow as pa
import pytest

from psrl.trajectory import NO_VERSION, TRAJECTORY_SCHEMA, Status, Step, Trajectory, from_arrow, to_arrow


def make(key="k0", turns=2, seed=0):
    rng = np.random.default_rng(seed)
    steps = []
    for t in range(turns):
        n = int(rng.integers(1, 6))
        steps.append(
            Step(
                action_ids=rng.integers(0, 100, n).astype(np.int32),
                logprobs=-rng.random(n).astype(np.float32),
                versions=np.full(n, t, np.int32),
                obs_ids=rng.integers(0, 100, 3).astype(np.int32) if t < turns - 1 else np.zeros(0, np.int32),
                reward=float(t == turns - 1),
            )
        )
    return Trajectory.from_steps(key, "g0", np.arange(4), steps, env_metrics={"tool_errors": 1.0}, data_source="toy")


def test_from_steps_lays_out_masks_versions_and_turn_bounds():
    steps = [
        Step(np.array([5, 6]), np.array([-0.1, -0.2]), np.array([3, 3]), obs_ids=np.array([7, 8, 9]), reward=0.0),
        Step(np.array([10]), np.array([-0.3]), np.array([4]), reward=1.0, done=True),
    ]
    t = Trajectory.from_steps("k", "g", np.array([1, 2]), steps)
    np.testing.assert_array_equal(t.response_ids, [5, 6, 7, 8, 9, 10])
    np.testing.assert_array_equal(t.loss_mask, [1, 1, 0, 0, 0, 1])
    np.testing.assert_array_equal(t.versions, [3, 3, NO_VERSION, NO_VERSION, NO_VERSION, 4])
    np.testing.assert_allclose(t.logprobs, [-0.1, -0.2, 0, 0, 0, -0.3], rtol=1e-6)
    np.testing.assert_array_equal(t.turn_bounds, [[0, 2], [5, 6]])
    assert t.reward == 1.0 and t.num_turns == 2 and t.seq_len == 8 and t.min_version() == 3
    assert t.response_ids.dtype == np.int32 and t.logprobs.dtype == np.float32


def test_arrow_round_trip_is_lossless():
    trajs = [make(f"k{i}", turns=1 + i % 3, seed=i) for i in range(5)]
    trajs[2].status, trajs[2].error = Status.FAILED, "env crashed"
    batch = to_arrow(trajs)
    assert batch.schema.equals(TRAJECTORY_SCHEMA)
    back = from_arrow(batch)
    for a, b in zip(trajs, back, strict=True):
        for name in ("prompt_ids", "response_ids", "loss_mask", "logprobs", "versions", "turn_bounds", "turn_rewards"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and np.array_equal(x, y), name
        assert (a.key, a.group_id, a.reward, a.status, a.error, a.env_metrics, a.data_source) == (
            b.key, b.group_id, b.reward, b.status, b.error, b.env_metrics, b.data_source)


def test_arrow_ipc_round_trip_and_column_subset():
    trajs = [make(f"k{i}", seed=i) for i in range(3)]
    sink = pa.BufferOutputStream()
    batch = to_arrow(trajs)
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    read = pa.ipc.open_stream(sink.getvalue()).read_all()
    assert [t.key for t in from_arrow(read)] == ["k0", "k1", "k2"]
    sub = to_arrow(trajs, fields=["key", "response_ids"])
    assert sub.schema.names == ["key", "response_ids"]
    with pytest.raises(KeyError, match="unknown trajectory field"):
        to_arrow(trajs, fields=["nope"])
    with pytest.raises(KeyError, match="lacks trajectory fields"):
        from_arrow(sub)


def test_empty_batch_and_empty_response():
    assert to_arrow([]).num_rows == 0
    t = Trajectory.from_steps("e", "g", np.array([1]), [], status=Status.FAILED, error="reset failed")
    assert len(t.response_ids) == 0 and t.num_turns == 0 and t.min_version() == NO_VERSION
    assert from_arrow(to_arrow([t]))[0].error == "reset failed"


def test_validate_names_the_sample():
    t = make("bad-sample")
    t.logprobs = t.logprobs[:-1]
    with pytest.raises(ValueError, match="bad-sample.*logprobs"):
        t.validate()
    t2 = make("nan-sample")
    t2.reward = float("nan")
    with pytest.raises(ValueError, match="nan-sample.*reward"):
        t2.validate()
