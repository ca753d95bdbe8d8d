"""Sandboxes: the ``Sandbox`` seam, bubblewrap (default) and docker backends, ``SandboxPool``.

``make_backend(spec)`` builds the backend ``spec.backend`` names; ``open_sandbox(spec)`` gives one
sandbox outside a pool; ``SandboxPool(spec, pool_config)`` is what rollouts use.
"""

from .base import ExecResult, ReapReport, Sandbox, SandboxBackend, SandboxError
from .pool import PoolStatistics, SandboxPool
from .registry import SANDBOX_BACKENDS, make_backend, open_sandbox, register_sandbox_backend

__all__ = [
    "SANDBOX_BACKENDS", "ExecResult", "PoolStatistics", "ReapReport", "Sandbox", "SandboxBackend",
    "SandboxError", "SandboxPool", "make_backend", "open_sandbox", "register_sandbox_backend",
]
