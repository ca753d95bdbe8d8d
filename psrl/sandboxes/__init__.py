"""Sandboxes: the ``Sandbox`` seam, bubblewrap (default) and docker backends, ``SandboxPool``."""

from .base import ExecResult, Sandbox

__all__ = ["ExecResult", "Sandbox"]
