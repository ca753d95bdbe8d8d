"""SFT examples as trainer samples: prompt ids, response ids and a loss mask over the response.

Two sources:

- chat rows (``messages``, OpenAI style): tokenized the way a rollout tokenizes a conversation
  (``psrl.environments.tool.ToolAgentData``): the messages before the first assistant turn are the
  prompt (through the chat template; ``tools`` shown by the template or described in the system
  message), each assistant turn is the model's raw text (its ``tool_calls`` written in the tool
  parser's format) followed by the end-of-sequence token, and what follows it (tool results, user
  turns) is rendered as new messages after it. Loss on the assistant turns only.
- trajectories from ``psrl rollout``: their own ids and loss mask (the model's tokens).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from psrl.environments.chat import ChatObservation
from psrl.environments.dataset import DatasetError
from psrl.trainer.batch import Sample
from psrl.trajectory import list_column_to_numpy

TRAJECTORY_COLUMNS = ("prompt_ids", "response_ids", "loss_mask")


class SFTDataError(DatasetError):
    """An SFT file or row that cannot be used (named, with the reason)."""


def read_table(path: str | Path) -> pa.Table:
    p = Path(path)
    if not p.is_file():
        raise SFTDataError(f"{p}: no such file")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p)
    if p.suffix in (".jsonl", ".json"):
        rows = []
        for lineno, line in enumerate(p.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise SFTDataError(f"{p}:{lineno}: not valid JSON: {e}") from None
        if not rows:
            raise SFTDataError(f"{p}: no rows")
        return pa.Table.from_pylist(rows)
    raise SFTDataError(f"{p}: unknown format (expected .parquet or .jsonl)")


def detect_format(table: pa.Table, where: str) -> str:
    names = set(table.schema.names)
    if all(c in names for c in TRAJECTORY_COLUMNS):
        return "trajectories"
    if "messages" in names:
        return "messages"
    raise SFTDataError(f"{where}: neither a 'messages' column nor trajectory columns ({', '.join(TRAJECTORY_COLUMNS)}); got {sorted(names)}")


def assistant_turn_ids(tokenizer: Any, message: Mapping[str, Any]) -> np.ndarray:
    """The ids a model writes for one assistant message: its text, its tool calls in the Hermes
    format (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), then the EOS token."""
    text = message.get("content") or ""
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                raise SFTDataError(f"tool call {fn.get('name')!r}: arguments are not JSON: {args!r:.120}") from None
        body = json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)
        text += f"{chr(10) if text else ''}<tool_call>{body}</tool_call>"
    return text_turn_ids(tokenizer, text)


def text_turn_ids(tokenizer: Any, text: str) -> np.ndarray:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise SFTDataError(f"tokenizer {tokenizer.name_or_path!r} has no EOS token to end a turn with")
    return np.asarray([*tokenizer.encode(text, add_special_tokens=False), eos], np.int32)


def render_messages(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping] | None = None,
    *, system_prompt: str | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prompt ids, response ids, loss mask) of one conversation, token for token what a rollout
    of ``tool_agent_data`` (chat mode) builds for it."""
    from psrl.agent_loops.tool_parsers import make_tool_parser
    from psrl.environments.tool.agent_data import ToolAgentData

    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    if first is None:
        raise SFTDataError("no assistant message: nothing to learn")
    if first == 0:
        raise SFTDataError("the first message is the assistant's: the prompt would be empty")
    codec = ToolAgentData(tokenizer, tool_parser=make_tool_parser("hermes"), system_prompt=system_prompt)
    prompt = codec.obs_to_tokens(ChatObservation([dict(m) for m in messages[:first]], tools=list(tools) if tools else None), first=True)
    parts: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    i = first
    while i < len(messages):
        ids = assistant_turn_ids(tokenizer, messages[i])
        codec.tokens_to_action(ids)  # the codec ends the turn after what the model wrote
        parts.append(ids)
        masks.append(np.ones(len(ids), np.int8))
        j = i + 1
        while j < len(messages) and messages[j].get("role") != "assistant":
            j += 1
        if j > i + 1:
            obs = codec.obs_to_tokens(ChatObservation([dict(m) for m in messages[i + 1 : j]]), first=False)
            parts.append(obs)
            masks.append(np.zeros(len(obs), np.int8))
        i = j
    return prompt, np.concatenate(parts).astype(np.int32), np.concatenate(masks)


def _messages_samples(table: pa.Table, tokenizer: Any, where: str, system_prompt: str | None) -> Iterator[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
    tools_col = table.column("tools").to_pylist() if "tools" in table.schema.names else None
    for r, messages in enumerate(table.column("messages").to_pylist()):
        at = f"{where} row {r}"
        if not isinstance(messages, list) or not all(isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in messages):
            raise SFTDataError(f"{at}: 'messages' must be a list of {{'role', 'content'}} mappings")
        tools = tools_col[r] if tools_col else None
        if isinstance(tools, str):
            tools = json.loads(tools)
        try:
            yield (f"{where}#{r}", *render_messages(tokenizer, messages, tools, system_prompt=system_prompt))
        except SFTDataError as e:
            raise SFTDataError(f"{at}: {e}") from None


def _trajectory_samples(table: pa.Table, where: str, min_reward: float | None) -> Iterator[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
    cols = {c: list_column_to_numpy(table.column(c)) for c in TRAJECTORY_COLUMNS}
    rewards = table.column("reward").to_pylist() if "reward" in table.schema.names else [None] * table.num_rows
    for r in range(table.num_rows):
        if min_reward is not None and (rewards[r] is None or rewards[r] < min_reward):
            continue
        yield f"{where}#{r}", *(np.asarray(cols[c][r]) for c in TRAJECTORY_COLUMNS)


def load_samples(
    files: Sequence[str], tokenizer: Any, *, fmt: str = "auto", max_length: int = 2048,
    min_reward: float | None = None, system_prompt: str | None = None,
) -> tuple[list[Sample], dict[str, int]]:
    """Every file's examples as samples cut to ``max_length`` tokens; the counts say what was
    read, cut and skipped (no loss token left, or a prompt longer than ``max_length``)."""
    if not files:
        raise SFTDataError("no SFT data: set sft.data to parquet/jsonl files")
    samples: list[Sample] = []
    counts = {"rows": 0, "cut": 0, "skipped": 0}
    vocab = len(tokenizer)
    for f in files:
        table = read_table(f)
        kind = detect_format(table, f) if fmt == "auto" else fmt
        if kind == "messages" and "messages" not in table.schema.names:
            raise SFTDataError(f"{f}: sft.format=messages but the file has no 'messages' column")
        rows = _messages_samples(table, tokenizer, f, system_prompt) if kind == "messages" else _trajectory_samples(table, f, min_reward)
        for key, prompt, response, mask in rows:
            counts["rows"] += 1
            room = max_length - len(prompt)
            if len(prompt) + len(response) > max_length:
                counts["cut"] += 1
                response, mask = response[: max(room, 0)], mask[: max(room, 0)]
            if room <= 0 or not mask.any():
                counts["skipped"] += 1
                continue
            if response.max() >= vocab or prompt.max() >= vocab:
                raise SFTDataError(f"{key}: token ids beyond the tokenizer's {vocab} (trajectories of another model?)")
            n = len(response)
            samples.append(Sample(key, key, 0.0, prompt.astype(np.int32), response.astype(np.int32), mask.astype(np.int8),
                                  np.zeros(n, np.float32), np.full(n, -1, np.int32)))
    if not samples:
        raise SFTDataError(f"no usable example in {', '.join(files)} ({counts})")
    return samples, counts


def plan_batches(samples: Sequence[Sample], *, batch_size: int, batch_tokens: int | None, epochs: int,
                 shuffle: bool, seed: int) -> list[list[int]]:
    """Indices of each optimizer step's samples: epoch by epoch (shuffled with ``seed``),
    ``batch_size`` sequences a step, or as many as fit in ``batch_tokens`` (at least one)."""
    rng = np.random.default_rng(seed)
    steps: list[list[int]] = []
    for _ in range(epochs):
        order = rng.permutation(len(samples)) if shuffle else np.arange(len(samples))
        cur: list[int] = []
        used = 0
        for i in map(int, order):
            n = samples[i].seq_len
            full = (len(cur) >= batch_size) if batch_tokens is None else (cur and used + n > batch_tokens)
            if full:
                steps.append(cur)
                cur, used = [], 0
            cur.append(i)
            used += n
        if cur:
            steps.append(cur)
    return steps
