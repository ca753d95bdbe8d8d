"""``textarena_env``: one TextArena game per episode, the policy as ``player`` vs a fixed opponent.

The game is built by ``textarena.make(env_id, **env_args)`` with its registered wrappers (so the
action wrappers the game ships with apply to every move), reset with ``num_players`` and
``seed``. Observations are read from the unwrapped game, which hands each player only the
messages that are new to it: each model turn sees what happened since its last move, as one user
message (``[GAME] ...`` / ``[Player k] ...`` lines, TextArena's own labels). The opponent's
moves are played in between. When the game ends, the reward is the game's reward for the
policy's player (``close()``'s rewards: win 1, loss -1, draw 0 in most two-player games).

Metrics: ``invalid_moves`` (TextArena rejected the policy's move), ``opponent_moves``, ``win``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from psrl.environments.base import Task
from psrl.environments.chat import ChatObservation
from psrl.environments.extras import require
from psrl.environments.registry import register_env

from .opponents import make_opponent


def _render(messages: Sequence[Any], skip_sender: int | None = None) -> str:
    """TextArena's labels; the reader's own moves echoed back are left out (it wrote them)."""
    lines = []
    for sender, text, *_ in messages:
        if sender == skip_sender:
            continue
        label = "[GAME]" if sender == -1 else f"[Player {sender}]"
        lines.append(f"{label} {str(text).strip()}")
    return "\n".join(lines)


@register_env("textarena_env")
class TextArenaEnv:
    def __init__(
        self,
        *,
        env_id: str = "TicTacToe-v0",
        num_players: int = 2,
        player: int = 0,
        seed: int = 0,
        opponent: str | list[str] = "random_valid",
        env_args: Mapping[str, Any] | None = None,
        max_opponent_moves: int = 500,
    ) -> None:
        if not 0 <= player < num_players:
            raise ValueError(f"textarena_env: player must be in [0, {num_players}), got {player}")
        self.env_id, self.num_players, self.player, self.seed = env_id, num_players, player, int(seed)
        self.env_args = dict(env_args or {})
        self.opponent = make_opponent(opponent)
        self.max_opponent_moves = max_opponent_moves
        self._game: Any = None
        self._raw: Any = None
        self._rng = random.Random(self.seed)
        self._pending: dict[int, list[Any]] = {}

    async def reset(self, task: Task) -> tuple[ChatObservation, dict[str, Any]]:
        ta = require("textarena", "textarena", adapter="textarena_env")
        try:
            self._game = ta.make(self.env_id, **self.env_args)
        except ValueError as e:
            raise ValueError(f"textarena_env: {e} (textarena.envs.registration.ENV_REGISTRY lists the ids)") from None
        self._raw = getattr(self._game, "unwrapped", None) or self._game
        while hasattr(self._raw, "env"):
            self._raw = self._raw.env
        self._rng = random.Random(self.seed)
        self._game.reset(num_players=self.num_players, seed=self.seed)
        done, moves = self._play_opponents()
        if done:
            raise RuntimeError(f"textarena_env: {self.env_id} ended before player {self.player} moved")
        return ChatObservation(messages=[{"role": "user", "content": self._policy_view()}]), {"metrics": {"opponent_moves": float(moves)}}

    def _observe(self) -> tuple[int, list[Any]]:
        pid, messages = self._raw.get_observation()
        return pid, list(messages or [])

    def _policy_view(self) -> str:
        pid, messages = self._observe()
        if pid != self.player:
            raise RuntimeError(f"textarena_env: expected player {self.player} to move, the game says player {pid}")
        return _render(messages, skip_sender=self.player)

    def _play_opponents(self) -> tuple[bool, int]:
        """Opponent moves until it is the policy's turn or the game is over."""
        moves = 0
        while self._raw.state.current_player_id != self.player:
            if moves >= self.max_opponent_moves:
                raise RuntimeError(f"textarena_env: the opponents made {moves} moves in a row (max_opponent_moves)")
            pid, messages = self._observe()
            done, _ = self._game.step(self.opponent(_render(messages), self._rng))
            moves += 1
            if done:
                return True, moves
        return False, moves

    async def step(self, action: Any) -> tuple[ChatObservation, float, bool, dict[str, Any]]:
        if self._game is None:
            raise RuntimeError("step() before reset()")
        text = getattr(action, "text", action)
        text = text if isinstance(text, str) else str(text)
        done, _ = self._game.step(text.strip())
        metrics = {"invalid_moves": 0.0, "opponent_moves": 0.0}
        if not done:
            done, moves = self._play_opponents()
            metrics["opponent_moves"] = float(moves)
        if done:
            rewards, _info = self._game.close()
            self._game = None
            reward = float((rewards or {}).get(self.player, 0.0))
            metrics["win"] = float(reward > 0)
            return ChatObservation(messages=[]), reward, True, {"metrics": metrics}
        view = self._policy_view()
        if f"Player {self.player} attempted an invalid move" in view:
            metrics["invalid_moves"] = 1.0
        return ChatObservation(messages=[{"role": "user", "content": view}]), 0.0, False, {"metrics": metrics}

    async def aclose(self) -> None:
        game, self._game = self._game, None
        if game is not None:
            try:
                game.close()
            except Exception:  # noqa: BLE001 - closing an unfinished game may complain; nothing is held
                pass
