"""The asyncio client (grpc.aio): `AsyncBrokerClient`, `AsyncProducer`,
`AsyncConsumer`. The synchronous API in `dflash_client.sync` runs these on
a private event-loop thread, so both flavours behave the same.

Failure policy, mirroring the Rust services: UNAVAILABLE (the broker went
away, restarted or is shutting down; see RETRYABLE_CODES for the transport
failures grpc-core reports otherwise) reopens the stream and resumes: a
producer re-sends its unanswered items after the new welcome's
`resume_after_seq`, a consumer says hello again (the broker has already
returned its leases to the queue). Any other status (FAILED_PRECONDITION for a
run id the broker no longer serves, INVALID_ARGUMENT, NOT_FOUND,
UNAUTHENTICATED, PERMISSION_DENIED, ABORTED for a stream a newer one
replaced, ...) raises `BrokerCallError` at once.

The reconnect budget is per outage, as in the Rust target-server: a
producer's `producer_max_reconnects` counts the reopening attempts since
its stream last made progress (an answer, or a welcome showing more items
accepted than before), so routine broker restarts over a long run never add
up to it; a consumer keeps reconnecting for `consumer_reconnect_timeout_s`
from the first failure of an outage.

No ack or nack is dropped silently: one that cannot go out (its stream
broke, or the writer died with it still queued) is logged at WARNING, left
out of `ack`'s and `nack`'s return value when known at the call, and
recorded in `AsyncConsumer.unsent_acks`. The broker gives those leases back
and the items come again (at-least-once).

TLS, mutual TLS and the bearer token: see `security` (the Rust flags'
names in keyword form, fields of `ClientOptions`).

This module holds the client (its channels, the opening of a stream, the
unary calls: status, watch, ReportDone) and the retry policy its streams
ask it for (`RETRYABLE_CODES`, the backoff); the streams are in `producer`
and `consumer`, the settings in `options`. Every public name is importable
from here.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Dict, Optional, Tuple

import grpc
import grpc.aio

from ._proto import broker_pb2 as pb
from .consumer import AsyncConsumer, Delivery, UnsentAck
from .errors import BrokerCallError
from .options import ClientOptions, normalize_address
from .producer import AsyncProducer, ProduceReport
from .records import message_to_dict

__all__ = [
    "RETRYABLE_CODES",
    "AsyncBrokerClient",
    "AsyncConsumer",
    "AsyncProducer",
    "ClientOptions",
    "Delivery",
    "ProduceReport",
    "UnsentAck",
    "normalize_address",
]

#: Statuses after which a stream is reopened; everything else is final.
#: The broker itself answers UNAVAILABLE when it shuts down; the others are
#: how grpc-core reports a connection that broke under a call (a cut in the
#: middle of a write surfaces as INTERNAL "Internal error from Core"); the
#: broker never sends them. Retrying is bounded either way.
# The same set as the Rust client's `RETRYABLE_CODES` (crates/client/src/lib.rs);
# tests on both sides read the other's.
RETRYABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        # A reconnecting consumer's hello while the broker still holds its
        # old stream (it has not yet seen that stream end): the broker lets
        # the id in once the old stream is gone, as the Rust client expects.
        grpc.StatusCode.ALREADY_EXISTS,
    }
)

_SERVICE = "/dflash.v1.Broker/"


def _backoff(attempt: int) -> float:
    return 0.2 * (2 ** min(attempt, 4))


#: Statuses whose message also says how the client connected.
_CONNECTION_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})


def _connection_note(client: "AsyncBrokerClient", code: Any) -> Optional[str]:
    if code not in _CONNECTION_CODES:
        return None
    note = f"connecting to {client.address} over {client.transport.description}"
    if code == grpc.StatusCode.UNAVAILABLE and not client.uses_tls:
        # grpc says only "Socket closed" when a TLS port hangs up on plaintext.
        note += "; a broker serving TLS needs tls_ca or an https:// address"
    return note


class AsyncBrokerClient:
    """A broker address plus transport options. Unary calls share one
    channel; each Produce or Consume stream opens its own. TLS and the
    token are resolved here, once (SecurityError for a setting that cannot
    be used)."""

    def __init__(self, address: str, options: Optional[ClientOptions] = None):
        self.options = options or ClientOptions()
        self.transport = self.options.transport(address)
        self.address = self.transport.target
        self._channel: Optional[grpc.aio.Channel] = None

    @property
    def uses_tls(self) -> bool:
        return self.transport.credentials is not None

    @property
    def metadata(self) -> Tuple[Tuple[str, str], ...]:
        """What every call carries: the token, when there is one."""
        return self.transport.metadata

    @staticmethod
    def retryable(code: Any) -> bool:
        """Whether a stream (or ReportDone) that failed with `code` is tried
        again (RETRYABLE_CODES); any other status is final."""
        return code in RETRYABLE_CODES

    @staticmethod
    def backoff(attempt: int) -> float:
        """Seconds to wait before reopening attempt `attempt` (1, 2, ...)."""
        return _backoff(attempt)

    def new_channel(self) -> grpc.aio.Channel:
        return self.transport.new_channel(self.options.channel_arguments())

    def call_error(self, call: str, code: Any, details: str) -> BrokerCallError:
        """A BrokerCallError that, for a failure to reach or be let in by the
        broker, also says how this client connected (TLS or plaintext, and
        where its token came from), the usual cause."""
        return BrokerCallError(call, code, details, connection=_connection_note(self, code))

    async def open_stream(self, channel: grpc.aio.Channel, method: str, hello: Any, response_type: Any) -> Tuple[Any, Any]:
        """Opens the bidirectional stream `method` on `channel`, says `hello`
        and reads the first answer: (call, answer or grpc.aio.EOF). A
        failure raises BrokerCallError with the broker's status.

        A broker refuses a missing or wrong token before reading anything,
        so the hello's write races the refusal; when the write loses,
        grpc-core reports its own INTERNAL "Internal error from Core" and the
        broker's status is lost (about one open in four). A unary GetStatus
        on the same channel then gets the refusal for certain, so the caller
        sees UNAUTHENTICATED (not retried) instead of a retryable INTERNAL."""
        call = channel.stream_stream(
            _SERVICE + method,
            request_serializer=type(hello).SerializeToString,
            response_deserializer=response_type.FromString,
        )(metadata=self.metadata)
        try:
            await call.write(hello)
            return call, await call.read()
        except grpc.aio.AioRpcError as error:
            code, details = error.code(), error.details() or ""
        except Exception:
            # The call ended before the welcome: its status says why.
            code, details = await call.code(), (await call.details()) or ""
        if code == grpc.StatusCode.INTERNAL:
            code, details = await self._refusal_behind_internal(channel, code, details)
        raise self.call_error(method, code, details)

    async def _refusal_behind_internal(self, channel: grpc.aio.Channel, code: Any, details: str) -> Tuple[Any, str]:
        """The broker's refusal of this client (UNAUTHENTICATED,
        PERMISSION_DENIED) that a stream's INTERNAL may hide, else the
        INTERNAL itself."""
        probe = channel.unary_unary(
            _SERVICE + "GetStatus",
            request_serializer=pb.GetStatusRequest.SerializeToString,
            response_deserializer=pb.StatusSnapshot.FromString,
        )
        try:
            await probe(pb.GetStatusRequest(), timeout=self.options.call_timeout_s, metadata=self.metadata)
        except grpc.aio.AioRpcError as refusal:
            if refusal.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                return refusal.code(), refusal.details() or ""
        return code, details

    def _unary_channel(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = self.new_channel()
        return self._channel

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> "AsyncBrokerClient":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    async def _unary(self, method: str, request: Any, response_type: Any) -> Any:
        call = self._unary_channel().unary_unary(
            _SERVICE + method,
            request_serializer=type(request).SerializeToString,
            response_deserializer=response_type.FromString,
        )
        try:
            return await call(request, timeout=self.options.call_timeout_s, metadata=self.metadata)
        except grpc.aio.AioRpcError as error:
            raise self.call_error(method, error.code(), error.details() or "") from None

    async def status(self) -> Dict[str, Any]:
        """One snapshot of the broker's state, as a dict (see `records`)."""
        snapshot = await self._unary("GetStatus", pb.GetStatusRequest(), pb.StatusSnapshot)
        return message_to_dict(snapshot)

    async def watch(self, interval_s: float = 1.0) -> AsyncIterator[Dict[str, Any]]:
        """Snapshots every `interval_s` until the broker ends the stream."""
        interval_ms = max(1, min(int(interval_s * 1000), 2**32 - 1))
        call = self._unary_channel().unary_stream(
            _SERVICE + "WatchStatus",
            request_serializer=pb.WatchStatusRequest.SerializeToString,
            response_deserializer=pb.StatusSnapshot.FromString,
        )(pb.WatchStatusRequest(interval_ms=interval_ms), metadata=self.metadata)
        try:
            while True:
                snapshot = await call.read()
                if snapshot is grpc.aio.EOF:
                    return
                yield message_to_dict(snapshot)
        except grpc.aio.AioRpcError as error:
            raise self.call_error("WatchStatus", error.code(), error.details() or "") from None
        finally:
            call.cancel()

    async def report_done(self, target_id: str, total_items: int, epoch: int = 0, run_id: str = "") -> Dict[str, Any]:
        """ReportDone (idempotent): retried while the broker is UNAVAILABLE,
        raised at once on any other status (FAILED_PRECONDITION when
        `total_items` differs from what the broker accepted, or the epoch or
        run id is stale)."""
        request = pb.ReportDoneRequest(target_id=target_id, total_items=total_items, epoch=epoch, run_id=run_id)
        attempt = 0
        while True:
            try:
                response = await self._unary("ReportDone", request, pb.ReportDoneResponse)
                return message_to_dict(response)
            except BrokerCallError as error:
                if error.code not in RETRYABLE_CODES or attempt >= self.options.producer_max_reconnects:
                    raise
                attempt += 1
                await asyncio.sleep(_backoff(attempt))

    def producer(self, target_id: str, hidden_width: Optional[int] = None) -> "AsyncProducer":
        """A Produce stream for `target_id`; open it with `await p.open()` or
        `async with`."""
        return AsyncProducer(self, target_id, hidden_width)

    def consumer(self, drafter_id: str, credit_items: int = 8, credit_bytes: int = 0, extend_leases: bool = True) -> "AsyncConsumer":
        """A Consume stream for `drafter_id` with a credit window of
        `credit_items` deliveries and `credit_bytes` bytes (0: no byte limit)."""
        return AsyncConsumer(self, drafter_id, credit_items, credit_bytes, extend_leases)

