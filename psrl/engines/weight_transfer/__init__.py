"""Weight transfer from trainer ranks straight into engine parameters, bucket by bucket.

- ``buckets``: splitting named tensors into buckets of bounded size; packing, zero-copy views.
- ``base``: the seams: ``DataPlane`` (how a bucket's bytes travel: ``shm``, ``tcp``,
  ``collective``, ``cuda_ipc``), ``ParamLoader`` (how an engine loads a stream of tensors).
- ``sender`` / ``receiver``: the control protocol over ZeroMQ both ends speak; the sender runs in a
  trainer rank, the receiver in the engine's worker (``psrl.engines.worker_ext``).
- ``loaders``: a ``ParamLoader`` over any ``torch.nn.Module`` (tests, benchmarks) and the
  keep-previous-version store that lets a failed sync restore the last whole version.

The trainer imports this package (the engines own the receiving seam); nothing here imports the
trainer.
"""

from .base import DataPlane, ParamLoader, WeightTransferError
from .buckets import BucketPlan, TensorSpec, plan_buckets

__all__ = ["BucketPlan", "DataPlane", "ParamLoader", "TensorSpec", "WeightTransferError", "plan_buckets"]
