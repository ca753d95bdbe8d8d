"""Errors a TransferQueue client raises. Each names the service and the keys it concerns."""

from __future__ import annotations

from collections.abc import Sequence

from anyio import WouldBlock

__all__ = [
    "ControllerUnavailable", "QueueError", "RemoteError", "RemoteKeyError", "RemoteTypeError", "RemoteValueError",
    "ServiceUnavailable", "StorageUnitUnavailable", "WouldBlock", "describe_keys", "remote_error",
]


def describe_keys(keys: Sequence[str], limit: int = 8) -> str:
    """``'a', 'b', 'c' and 97 more`` - enough to find the samples without flooding a log."""
    if not keys:
        return "(no keys)"
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown if len(keys) <= limit else f"{shown} and {len(keys) - limit} more"


class QueueError(Exception):
    """Base class of TransferQueue errors."""


class RemoteError(QueueError):
    """A service refused a request (bad input, unknown key, ...). ``kind`` names the Python error
    class raised there; ``keys`` lists the samples concerned."""

    def __init__(self, service: str, kind: str, message: str, keys: Sequence[str] = ()):
        self.service, self.kind, self.keys = service, kind, list(keys)
        super().__init__(f"{service}: {kind}: {message}")


class RemoteValueError(RemoteError, ValueError):
    pass


class RemoteKeyError(RemoteError, KeyError):
    def __str__(self) -> str:  # not KeyError's quoted repr
        return str(self.args[0])


class RemoteTypeError(RemoteError, TypeError):
    pass


_BY_KIND = {"ValueError": RemoteValueError, "KeyError": RemoteKeyError, "MissingData": RemoteKeyError, "TypeError": RemoteTypeError}


def remote_error(service: str, kind: str, message: str, keys: Sequence[str] = ()) -> RemoteError:
    """The error to raise for a refusal; bad input stays a ValueError/KeyError/TypeError."""
    return _BY_KIND.get(kind, RemoteError)(service, kind, message, keys)


class ServiceUnavailable(QueueError):
    """A service did not answer within its timeout: it died, hangs, or cannot be reached."""

    def __init__(self, service: str, endpoint: str, timeout_s: float, keys: Sequence[str] = (), what: str = ""):
        self.service, self.endpoint, self.timeout_s, self.keys = service, endpoint, timeout_s, list(keys)
        doing = f" to {what}" if what else ""
        affected = f"; keys affected: {describe_keys(self.keys)}" if self.keys else ""
        super().__init__(
            f"{service} at {endpoint} did not answer a request{doing} within {timeout_s:g} s "
            f"(dead, hung or unreachable){affected}"
        )


class StorageUnitUnavailable(ServiceUnavailable):
    pass


class ControllerUnavailable(ServiceUnavailable):
    pass
