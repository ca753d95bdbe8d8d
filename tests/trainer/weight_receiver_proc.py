"""A separate engine process for the cross-process weight-sync test: a ZeroMQ receiver in front of
an engine that records a digest of every tensor it is given. Prints its endpoint, then serves
until killed; after each update it writes ``{version, digests}`` to the file named in argv[1]."""

from __future__ import annotations

import json
import sys

import anyio
import zmq

from psrl.testing import ScriptedEngine
from psrl.trainer.weight_sync import ZmqWeightReceiver
from trainer_helpers import tensor_digest


class DigestEngine(ScriptedEngine):
    def __init__(self, out: str) -> None:
        super().__init__([[1]])
        self.out = out

    async def update_weights(self, named_tensors, version):
        named = list(named_tensors)
        digests = {n: tensor_digest(t) for n, t in named}
        await super().update_weights(named, version)
        with open(self.out, "w") as f:
            json.dump({"version": version, "digests": digests}, f)


async def main(out: str) -> None:
    ctx = zmq.Context()
    receiver = ZmqWeightReceiver(ctx, DigestEngine(out))
    try:
        async with anyio.create_task_group() as tg:
            endpoint = await tg.start(receiver.serve)
            print(endpoint, flush=True)
    finally:
        await receiver.aclose()
        ctx.term()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], backend=sys.argv[2] if len(sys.argv) > 2 else "asyncio")
