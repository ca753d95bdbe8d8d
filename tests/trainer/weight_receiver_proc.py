"""A separate engine-side process for the cross-process weight-sync test: the tiny model in
transformers, loaded by the production receive loop (``weight_transfer.receive`` +
``ModuleLoader``). Reads one JSON spec per line on stdin, receives that version, then prints
``{version, tensors, buckets, digests}`` (a digest of every parameter after the load)."""

from __future__ import annotations

import json
import sys

import torch
import zmq
from transformers import AutoModelForCausalLM

from psrl.engines.weight_transfer import WeightTransferError
from psrl.engines.weight_transfer.loaders import ModuleLoader
from psrl.engines.weight_transfer.planes import ShmReader, TcpReader
from psrl.engines.weight_transfer.receiver import receive
from trainer_helpers import tensor_digest


def main(model_path: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    loader = ModuleLoader(model)
    readers = {"shm": ShmReader(), "tcp": TcpReader()}
    ctx = zmq.Context()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        spec = json.loads(line)
        try:
            report = receive(ctx, spec, loader, readers, name="proc")
        except WeightTransferError as exc:
            report = {"error": str(exc), "bucket": exc.bucket}
        report["digests"] = {n: tensor_digest(p) for n, p in model.named_parameters()}
        print(json.dumps(report), flush=True)
    ctx.term()


if __name__ == "__main__":
    main(sys.argv[1])
