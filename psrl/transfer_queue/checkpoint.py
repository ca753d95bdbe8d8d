"""Controller checkpoints: metadata and consumption state, and optionally each unit's data.

Layout under ``path``: ``controller.arrow`` (one row per sample holding data: key, partition,
group, status, tags, unit, seq_len, oldest version, ready fields, one consumed flag column per
consumer), ``controller.json`` (policy version, admission counters, refills), and with data
``unit-<i>/`` per storage unit. Written to ``path.tmp`` then renamed, so a crash mid-way leaves
the previous checkpoint intact.
"""

from __future__ import annotations

import json
import shutil
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .messages import UnitDump, UnitLoad
from .meta import Refill, RestoreReport
from .table import SampleTable

if TYPE_CHECKING:
    from .controller import Controller


async def save_checkpoint(ctl: Controller, path: str, with_data: bool) -> int:
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    async with ctl.unit_lock:  # no deletions reach the units while they dump
        table, info = ctl.table.to_arrow()  # snapshot before any await
        info.update(
            staleness=ctl.staleness.state(), dropped_stale=ctl.dropped_stale, with_data=with_data,
            units=len(ctl.units), refills=[[r.partition, r.group_id, r.keys] for r in ctl.refills],
        )
        with pa.OSFile(str(tmp / "controller.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
            w.write_table(table)
        (tmp / "controller.json").write_text(json.dumps(info))
        if with_data:
            per_unit: list[list[str]] = [[] for _ in ctl.units]
            for k, u in zip(table.column("key").to_pylist(), table.column("unit").to_pylist(), strict=True):
                per_unit[u].append(k)
            async with anyio.create_task_group() as tg:
                for u, ks in enumerate(per_unit):
                    tg.start_soon(ctl.unit_call, u, UnitDump(str(tmp / f"unit-{u}"), ks), ks)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return table.num_rows


async def load_checkpoint(ctl: Controller, path: str) -> RestoreReport:
    src = Path(path)
    info = json.loads((src / "controller.json").read_text())
    if info["with_data"] and info["units"] != len(ctl.units):
        raise ValueError(f"checkpoint {path} holds data of {info['units']} storage units; this queue has {len(ctl.units)}")
    table = pa.ipc.open_file(pa.memory_map(str(src / "controller.arrow"))).read_all()
    if table.num_rows and pc.max(table.column("unit")).as_py() >= len(ctl.units):
        raise ValueError(f"checkpoint {path} places samples on more storage units than this queue's {len(ctl.units)}")
    async with ctl.unit_lock:
        if info["with_data"]:
            async with anyio.create_task_group() as tg:
                for u in range(len(ctl.units)):
                    tg.start_soon(ctl.unit_call, u, UnitLoad(str(src / f"unit-{u}")), [])
        ctl.table = SampleTable.from_arrow(table, info)
        ctl.unit_load = np.bincount(ctl.table.cols["unit"][: ctl.table.n], minlength=len(ctl.units)).tolist()
        ctl.staleness.load_state(info["staleness"])
        ctl.dropped_stale = info["dropped_stale"]
        ctl.refills = deque(Refill(p, g, ks) for p, g, ks in info["refills"])
        ctl.stale_groups = set()
    return RestoreReport(ctl.table.live, info["with_data"], ctl.staleness.version, info["consumers"])
