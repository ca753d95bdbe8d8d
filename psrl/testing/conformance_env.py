"""``check_environment``: the conformance suite every Environment must pass."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from psrl.environments.base import Environment, Task


class ConformanceError(AssertionError):
    pass


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise ConformanceError(what)


async def _episode(env: Environment, task: Task, actions: Sequence[Any]) -> list[tuple]:
    obs, info = await env.reset(task)
    _expect(isinstance(info, dict), f"reset() must return (observation, dict), got info {type(info).__name__}")
    trace = [("reset", obs)]
    for action in actions:
        out = await env.step(action)
        _expect(isinstance(out, tuple | list) or hasattr(out, "__iter__"), "step() must return a 4-tuple")
        obs, reward, done, info = tuple(out)
        _expect(isinstance(reward, int | float) and math.isfinite(reward), f"reward must be a finite number, got {reward!r}")
        _expect(isinstance(done, bool), f"done must be a bool, got {type(done).__name__}")
        _expect(isinstance(info, dict), f"info must be a dict, got {type(info).__name__}")
        metrics = info.get("metrics", {})
        _expect(
            isinstance(metrics, dict) and all(isinstance(v, int | float) for v in metrics.values()),
            "info['metrics'] must be a dict of numbers",
        )
        trace.append(("step", obs, float(reward), done))
        if done:
            break
    return trace


async def check_environment(
    factory: Callable[[], Environment],
    task: Task,
    actions: Sequence[Any],
    *,
    bad_actions: Sequence[Any] = (),
    timeout_s: float = 60.0,
) -> None:
    """Run the conformance checks; raise ``ConformanceError`` naming the first failure.

    - reset/step return the documented shapes and types, rewards are finite;
    - the same task and actions give the same trace on a fresh instance (deterministic replay);
    - two instances do not share state (interleaved episodes equal separate ones);
    - each of ``bad_actions`` (malformed input) becomes an observation, never an exception;
    - ``aclose()`` works after a full episode, right after ``reset``, twice in a row, and after a
      step that was cancelled part way.
    """
    with anyio.fail_after(timeout_s):
        a = factory()
        try:
            first = await _episode(a, task, actions)
        finally:
            await a.aclose()
        await a.aclose()  # idempotent

        b = factory()
        try:
            second = await _episode(b, task, actions)
        finally:
            await b.aclose()
        _expect(first == second, f"replaying the same task and actions gave a different trace:\n{first}\n{second}")

        # Two live instances: interleave their steps; each must see only its own state.
        x, y = factory(), factory()
        try:
            await x.reset(task)
            await y.reset(task)
            tx, ty = [("reset", first[0][1])], [("reset", first[0][1])]
            for action in actions:
                for env, trace in ((x, tx), (y, ty)):
                    if len(trace) > 1 and trace[-1][3]:
                        continue
                    obs, reward, done, _ = tuple(await env.step(action))
                    trace.append(("step", obs, float(reward), done))
            _expect(tx == first and ty == first, "two instances interfere: interleaved episodes differ from a lone one")
        finally:
            await x.aclose()
            await y.aclose()

        for bad in bad_actions:
            env = factory()
            try:
                await env.reset(task)
                try:
                    out = tuple(await env.step(bad))
                except Exception as e:  # noqa: BLE001 - the point is to report it
                    raise ConformanceError(f"step({bad!r}) raised {type(e).__name__}: {e}; malformed actions must become observations") from e
                _expect(len(out) == 4, f"step({bad!r}) did not return a 4-tuple")
            finally:
                await env.aclose()

        env = factory()
        await env.reset(task)
        await env.aclose()

        if actions:
            env = factory()
            try:
                await env.reset(task)
                with anyio.move_on_after(0):
                    await env.step(actions[0])
            finally:
                with anyio.CancelScope(shield=True), anyio.fail_after(timeout_s):
                    await env.aclose()
