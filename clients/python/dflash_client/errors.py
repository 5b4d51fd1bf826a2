"""Exceptions of the client. Every message names the bad value."""

from __future__ import annotations

from typing import Any, Optional


class BrokerError(Exception):
    """Base class of everything this package raises about the broker."""


class InvalidSample(BrokerError, ValueError):
    """A sample failed validation before anything was sent (shape, dtype,
    values, seq order). Nothing reached the broker."""


class ProtocolError(BrokerError):
    """The broker sent something this client does not expect (a message out
    of order, a tensor whose bytes do not match its shape)."""


class BrokerCallError(BrokerError):
    """A call failed with a status that retrying cannot fix
    (FAILED_PRECONDITION, INVALID_ARGUMENT, NOT_FOUND, UNAUTHENTICATED,
    PERMISSION_DENIED, ...): for example a broker that lost the run's state
    refusing this target's old run id. Raised at once, never retried."""

    def __init__(self, call: str, code: Any, details: str, connection: Optional[str] = None):
        self.call = call
        self.code = code
        self.details = details
        #: How the client connected (TLS or plaintext, the token's origin),
        #: for failures to reach the broker or be let in by it.
        self.connection = connection
        code_name = getattr(code, "name", str(code))
        message = f"broker call {call} failed: {code_name}: {details}"
        if connection:
            message += f" ({connection})"
        super().__init__(message)


class SecurityError(BrokerError, ValueError):
    """A TLS or token setting that cannot be used (a file that cannot be
    read or holds no PEM block, a certificate without its key, a token
    given twice or holding spaces, TLS options with an http:// address).
    The message names the option and the file, never the token."""


class BrokerUnavailable(BrokerError):
    """The broker stayed unreachable through every reconnect attempt."""


class StreamClosed(BrokerError):
    """The broker closed this Produce stream (a newer stream for the same
    target replaced it, or the run ended)."""

    def __init__(self, status: str, reason: str):
        self.status = status
        self.reason = reason
        super().__init__(f"the broker closed this Produce stream ({status}): {reason}")


class RunAborted(BrokerError):
    """End-of-stream ABORTED: the run failed; `reason` says why and `summary`
    holds the broker's run summary (a dict)."""

    def __init__(self, reason: str, summary: Optional[dict]):
        self.reason = reason
        self.summary = summary
        super().__init__(f"the run was aborted: {reason}")
