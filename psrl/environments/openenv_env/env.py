"""``openenv_env``: one episode against an OpenEnv environment server.

The server is either given (``base_url``, e.g. ``http://127.0.0.1:8000``: the adapter opens its
own WebSocket session there, so one server serves many episodes as far as the server's
``max_concurrent_envs`` allows) or started for the episode from an installed environment
(``app="my_env.server.app:app"``, optionally ``app_dir``): one loopback server per episode,
stopped by ``aclose()``. The session speaks openenv-core's protocol through its own
``GenericEnvClient`` (reset / step / close over ``/ws``, actions and observations as JSON).

Model turn -> action: ``{action_field: text}`` (the template echo env takes ``message``), or with
``action_format="json"`` the reply must be a JSON object that is sent as the action; a reply that
is not one, or an action the server rejects, becomes an error observation (``format_errors``),
not a crash. Observation -> text: ``observation_field`` of the observation, or the observation's
JSON without ``reward``/``done``/``metadata``. Reward and done are the server's.

openenv-core's client runs on asyncio only (it uses ``asyncio.wait_for``), as ``psrl rollout``
and ``psrl train`` do.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any, Literal

from psrl.environments.base import Task
from psrl.environments.chat import ChatObservation, as_messages
from psrl.environments.extras import require
from psrl.environments.registry import register_env

from .server import serve_app

_HIDDEN = ("reward", "done", "metadata")


@register_env("openenv_env")
class OpenEnvEnv:
    def __init__(
        self,
        *,
        base_url: str | None = None,
        app: str | None = None,
        app_dir: str | None = None,
        action_field: str = "message",
        action_format: Literal["field", "json"] = "field",
        observation_field: str | None = None,
        reset_kwargs: Mapping[str, Any] | None = None,
        include_prompt: bool = True,
        message_timeout_s: float = 60.0,
        start_timeout_s: float = 60.0,
    ) -> None:
        if (base_url is None) == (app is None):
            raise ValueError("openenv_env needs exactly one of base_url (a running server) or app ('pkg.server.app:app' to start)")
        if action_format not in ("field", "json"):
            raise ValueError(f"openenv_env: action_format must be field or json, got {action_format!r}")
        self.base_url, self.app, self.app_dir = base_url, app, app_dir
        self.action_field, self.action_format, self.observation_field = action_field, action_format, observation_field
        self.reset_kwargs = dict(reset_kwargs or {})
        self.include_prompt = include_prompt
        self.message_timeout_s, self.start_timeout_s = message_timeout_s, start_timeout_s
        self._stack = contextlib.AsyncExitStack()
        self._client: Any = None
        self.url: str | None = None  # the server of the current episode

    def _text(self, observation: Any) -> str:
        obs = observation if isinstance(observation, Mapping) else {"observation": observation}
        if self.observation_field is not None:
            if self.observation_field not in obs:
                raise KeyError(f"openenv_env: the observation has no field {self.observation_field!r}; it has {sorted(obs)}")
            value = obs[self.observation_field]
            return value if isinstance(value, str) else json.dumps(value)
        return json.dumps({k: v for k, v in obs.items() if k not in _HIDDEN}, ensure_ascii=False)

    async def reset(self, task: Task) -> tuple[ChatObservation, dict[str, Any]]:
        core = require("openenv.core.generic_client", "openenv-core", adapter="openenv_env")
        url = self.base_url
        if url is None:
            url = await self._stack.enter_async_context(serve_app(self.app, app_dir=self.app_dir, start_timeout_s=self.start_timeout_s))
        self.url = url
        client = core.GenericEnvClient(base_url=url, message_timeout_s=self.message_timeout_s)
        self._stack.push_async_callback(client.close)
        await client.connect()
        self._client = client
        result = await client.reset(**self.reset_kwargs)
        text = self._text(result.observation)
        messages = as_messages(task.prompt) if (self.include_prompt and task.prompt) else []
        if messages and messages[-1]["role"] == "user":
            messages[-1] = {**messages[-1], "content": f"{messages[-1]['content']}\n\n{text}"}
        else:
            messages.append({"role": "user", "content": text})
        return ChatObservation(messages=messages), {}

    def _action(self, text: str) -> dict[str, Any]:
        if self.action_format == "field":
            return {self.action_field: text}
        start, end = text.find("{"), text.rfind("}")
        action = json.loads(text[start : end + 1]) if 0 <= start < end else None
        if not isinstance(action, dict):
            raise ValueError("the reply holds no JSON object")
        return action

    async def step(self, action: Any) -> tuple[ChatObservation, float, bool, dict[str, Any]]:
        if self._client is None:
            raise RuntimeError("step() before reset()")
        text = getattr(action, "text", action)
        text = text if isinstance(text, str) else str(text)
        try:
            payload = self._action(text)
        except ValueError as e:
            return self._error(f"Your reply is not a valid action: {e}. Reply with one JSON object.")
        try:
            result = await self._client.step(payload)
        except RuntimeError as e:  # the server answered with an error message: a rejected action
            if "Server error" not in str(e):
                raise
            return self._error(f"The environment rejected the action: {e}")
        reward = float(result.reward or 0.0)
        return ChatObservation(messages=[{"role": "user", "content": self._text(result.observation)}]), reward, bool(result.done), {}

    @staticmethod
    def _error(message: str) -> tuple[ChatObservation, float, bool, dict[str, Any]]:
        return ChatObservation(messages=[{"role": "user", "content": message}]), 0.0, False, {"metrics": {"format_errors": 1.0}}

    async def aclose(self) -> None:
        self._client = None
        await self._stack.aclose()
