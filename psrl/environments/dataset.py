"""veRL-style task rows from parquet or jsonl files.

A row holds ``prompt`` (chat messages, or a string), ``data_source``, ``reward_model``
(``{"ground_truth": ...}``), ``extra_info`` (a dict) and optionally ``agent_name``,
``env_class`` and ``data_class``, which override the config for that row, and ``env_kwargs``
(a dict, or a JSON object as a string), merged over the config's ``env.kwargs``: it carries an
adapter's own environment id and arguments (see :func:`merge_env_kwargs`). A row that breaks
these rules is an error naming the file, the row number and the column; nothing is skipped
silently.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .base import Task

OVERRIDE_COLUMNS = ("agent_name", "env_class", "data_class")


class DatasetError(ValueError):
    pass


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - re-raised with the file named
        raise DatasetError(f"{path}: cannot read as parquet: {e}") from None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open() as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{lineno}: not valid JSON: {e}") from None
    return rows


def check_row(row: Any, where: str) -> dict[str, Any]:
    """The row as a dict, or a :class:`DatasetError` saying what is wrong with it."""
    if not isinstance(row, Mapping):
        raise DatasetError(f"{where}: a row must be a mapping, got {type(row).__name__}")
    row = dict(row)
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise DatasetError(f"{where}: column 'prompt' is empty")
    elif isinstance(prompt, Sequence) and prompt:
        for i, msg in enumerate(prompt):
            if not isinstance(msg, Mapping) or not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
                raise DatasetError(f"{where}: prompt[{i}] must be a {{'role': str, 'content': str}} message, got {msg!r:.120}")
    else:
        raise DatasetError(f"{where}: column 'prompt' must be a non-empty string or list of messages, got {prompt!r:.120}")
    rm = row.get("reward_model")
    if rm is not None and not isinstance(rm, Mapping):
        raise DatasetError(f"{where}: column 'reward_model' must be a mapping with 'ground_truth', got {type(rm).__name__}")
    info = row.get("extra_info")
    if info is not None and not isinstance(info, Mapping):
        raise DatasetError(f"{where}: column 'extra_info' must be a mapping, got {type(info).__name__}")
    ds = row.get("data_source")
    if ds is not None and not isinstance(ds, str):
        raise DatasetError(f"{where}: column 'data_source' must be a string, got {type(ds).__name__}")
    for col in OVERRIDE_COLUMNS:
        v = row.get(col)
        if v is not None and not isinstance(v, str):
            raise DatasetError(f"{where}: column {col!r} must be a registered name (a string), got {v!r:.80}")
    if row.get("env_kwargs") is not None:
        row["env_kwargs"] = row_env_kwargs(row["env_kwargs"], where)
    return row


def row_env_kwargs(value: Any, where: str = "row") -> dict[str, Any]:
    """A row's ``env_kwargs`` as a dict: a mapping with string keys, or a JSON object string.

    ``None`` values are dropped: a parquet struct column cannot tell a key that one row lacks
    from a null, so null means "not set here" and the config's value stays.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where}: column 'env_kwargs' is a string but not JSON: {e}") from None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise DatasetError(f"{where}: column 'env_kwargs' must be a mapping with string keys (or a JSON object), got {value!r:.120}")
    return {k: v for k, v in value.items() if v is not None}


def merge_env_kwargs(base: Mapping[str, Any], row: Mapping[str, Any]) -> dict[str, Any]:
    """The config's ``env.kwargs`` with the row's ``env_kwargs`` merged over them (one level:
    a row key replaces the config's key of the same name)."""
    extra = row.get("env_kwargs")
    return {**base, **row_env_kwargs(extra)} if extra is not None else dict(base)


def load_rows(paths: str | os.PathLike | Iterable[str | os.PathLike], *, max_rows: int | None = None) -> list[dict[str, Any]]:
    """Rows of every file in order (``.parquet``, ``.jsonl``, ``.json`` holding a list)."""
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    rows: list[dict[str, Any]] = []
    files = [Path(p) for p in paths]
    if not files:
        raise DatasetError("no data files given (set data.train_files)")
    for path in files:
        if not path.is_file():
            raise DatasetError(f"data file not found: {path}")
        suffix = path.suffix.lower()
        if suffix == ".parquet":
            raw = _read_parquet(path)
        elif suffix == ".jsonl":
            raw = _read_jsonl(path)
        elif suffix == ".json":
            raw = json.loads(path.read_text())
            if not isinstance(raw, list):
                raise DatasetError(f"{path}: a .json data file must hold a list of rows")
        else:
            raise DatasetError(f"{path}: unknown data file type {suffix!r}; use .parquet, .jsonl or .json")
        for i, row in enumerate(raw):
            rows.append(check_row(row, f"{path} row {i}"))
            if max_rows is not None and len(rows) >= max_rows:
                return rows
    return rows


def row_to_task(row: Mapping[str, Any]) -> Task:
    rm = row.get("reward_model") or {}
    return Task(
        prompt=row["prompt"],
        ground_truth=rm.get("ground_truth"),
        data_source=row.get("data_source") or "",
        extra_info=dict(row.get("extra_info") or {}),
        row=row,
    )


def write_rows(path: str | os.PathLike, rows: Sequence[Mapping[str, Any]]) -> Path:
    """Write rows as parquet or jsonl (by suffix): the inverse of :func:`load_rows`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pa.Table.from_pylist([dict(r) for r in rows])
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise DatasetError(f"{path}: rows do not share one column type per column, as parquet needs ({e}); write .jsonl instead") from None
        pq.write_table(table, path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(dict(r)) + "\n" for r in rows))
    else:
        raise DatasetError(f"{path}: write .parquet or .jsonl")
    return path
