"""The pipeline's smaller parts: queue contract, data-loader position, metrics, writers, the
pipeline benchmark and the recipes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import anyio
import numpy as np
import pytest

from psrl.config import load_config
from psrl.pipeline.local_queue import LocalGroupQueue
from psrl.pipeline.metrics import FailureGuard, FailureRateExceeded, batch_metrics, staleness_histogram
from psrl.pipeline.report import JsonlWriter, plot_rewards
from psrl.pipeline.tasks import TaskSource
from psrl.environments.rewards import contains_digit_reward as digit_reward
from psrl.trajectory import Status, Step, Trajectory, to_arrow

REPO = Path(__file__).resolve().parents[2]


def traj(key: str, group: str, versions, reward: float = 1.0, status=Status.OK) -> Trajectory:
    v = np.asarray(versions, np.int32)
    step = Step(np.arange(len(v), dtype=np.int32), np.full(len(v), -0.5, np.float32), v, reward=reward, done=True)
    return Trajectory.from_steps(key, group, np.array([1, 2], np.int32), [step], status=status)


@pytest.mark.anyio
@pytest.mark.timeout(20)
async def test_local_queue_admission_eviction_and_whole_groups():
    q = LocalGroupQueue(eta=1, samples_per_step=4)  # capacity (1 + v + 1) * 4 samples
    for _ in range(4):
        await q.acquire(2)
    with anyio.move_on_after(0.05) as scope:
        await q.acquire(2)  # 8 samples running: full
    assert scope.cancelled_caught
    for g in ("a", "b", "c"):
        await q.finish(2, accepted=True)
        await q.put_group([traj(f"{g}0", g, [0, 0]), traj(f"{g}1", g, [0, 1])], partition="train")
    await q.finish(2, accepted=False)
    taken = await q.take(partition="train", n_groups=2, group_size=2, consumer="trainer", fields=["key", "reward"])
    assert taken.group_ids == ["a", "b"] and taken.keys == ["a0", "a1", "b0", "b1"]
    assert taken.batch.schema.names == ["key", "reward"]
    await q.set_version(2)  # oldest allowed: 1; group c has a version-0 token
    assert await q.take_evicted() == ["c"]
    assert q.pending_groups("train") == 0
    await q.put_group([traj("d0", "d", [0]), traj("d1", "d", [2])], partition="train")  # stale on arrival
    assert await q.take_evicted() == ["d"]
    with pytest.raises(ValueError, match="several groups"):
        await q.put_group([traj("x", "x", [2]), traj("y", "y", [2])], partition="train")


def test_task_source_epochs_replay_and_state():
    rows = [{"prompt": str(i)} for i in range(5)]
    src = TaskSource(rows, seed=3)
    first = [src.next()[0] for _ in range(5)]
    assert sorted(first) == list(range(5))
    second = [src.next()[0] for _ in range(5)]
    assert sorted(second) == list(range(5)) and src.epoch == 1
    state = src.state_dict(not_trained=[first[0]])
    again = TaskSource(rows, seed=3)
    again.load_state_dict(state)
    assert again.next()[0] == first[0]  # the untrained row comes back first
    assert [again.next()[0] for _ in range(5)] == [src.next()[0] for _ in range(5)]
    with pytest.raises(ValueError, match="same data.train_files"):
        TaskSource(rows[:3]).load_state_dict(state)
    with pytest.raises(ValueError, match="empty"):
        TaskSource([])


def test_batch_metrics_reward_staleness_and_failures():
    trajs = [traj("a", "g", [3, 3], 1.0), traj("b", "g", [2, 3], 0.0), traj("c", "h", [1], 0.5, Status.FAILED)]
    trajs[0].env_metrics = {"tool_calls": 2.0, "tool_errors": 1.0}
    m = batch_metrics(to_arrow(trajs), version=3)
    assert m["reward/mean"] == pytest.approx(0.5) and m["reward/pass_rate"] == pytest.approx(1 / 3)
    assert staleness_histogram(m) == {0: 1, 1: 1, 2: 1}
    assert m["staleness/mixed_version_samples"] == 1
    assert m["episodes/failed"] == 1 and m["tools/error_rate"] == 0.5
    assert m["response_length/mean"] == pytest.approx(5 / 3)


def test_failure_guard_waits_for_a_full_window():
    guard = FailureGuard(0.5, window=4)
    bad = [traj(f"k{i}", "g", [0], status=Status.FAILED) for i in range(3)]
    for t in bad:
        t.error = "boom"
    guard.record(bad)  # 3 of 3 failed, but the window is not full yet
    with pytest.raises(FailureRateExceeded, match="boom"):
        guard.record([traj("ok", "g", [0])])


def test_jsonl_and_plot(tmp_path):
    w = JsonlWriter(tmp_path / "m.jsonl")
    for step in range(1, 4):
        w.log(step, {"reward/mean": step / 4, "x": float("nan")}, kind="train")
    w.log(3, {"val/reward/mean": 0.9}, kind="val")
    w.close()
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert lines[0] == {"kind": "train", "step": 1, "reward/mean": 0.25, "x": None}
    png = plot_rewards(tmp_path / "m.jsonl", tmp_path / "r.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_digit_reward():
    assert digit_reward("I pick 7") == 1.0 and digit_reward("seven") == 0.0


@pytest.mark.timeout(120)
def test_pipeline_benchmark_prints_its_json_line():
    out = subprocess.run(
        ["python", "-c", "from benchmarks.pipeline import main; main(['--steps', '6', '--warmup', '2', '--time-scale', '0.003', '--json'])"],
        capture_output=True, text=True, timeout=110, cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    assert "SIMULATED" in out.stdout
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["simulated"] is True
    assert set(line["samples_per_s"]) == {"sync", "one_step_off", "async_eta1", "async_eta2", "async_eta4"}
    assert line["max_staleness"]["sync"] == 0 and line["max_staleness"]["async_eta4"] <= 4
    # timed at 3 ms per simulated second, a loaded machine can starve any mode: the computed
    # bounds carry the model's verdict, the timed figures only have to exist
    bound = line["bound_samples_per_s"]
    assert bound["async_eta4"] > 2 * bound["sync"] and line["speedup_async_eta4"] > 0 and 0 < line["efficiency"]
    # the option reached the model, and the headline is printed with what it assumes
    assert line["latency_model"]["time_scale"] == 0.003 and line["model_source"].startswith("stated defaults")
    headline = next(x for x in out.stdout.splitlines() if x.startswith("headline: async eta=4 "))
    assert abs(float(headline.split()[3].rstrip("x")) - line["speedup_async_eta4"]) < 0.01
    assert "ASSUMING train_fixed_s=2," in headline and "shared_hardware=False" in headline


@pytest.mark.parametrize("recipe", ["quickstart", "retool", "swe"])
def test_recipes_load_and_ship_their_data(recipe):
    d = REPO / "recipes" / recipe
    cfg = load_config(d / "config.yaml")
    for f in [*cfg.data.train_files, *cfg.data.val_files]:
        assert (REPO / f).is_file(), f
    run = (d / "run.sh").read_text()
    assert 'exec psrl train "$DIR/config.yaml"' in run and '"$@"' in run
