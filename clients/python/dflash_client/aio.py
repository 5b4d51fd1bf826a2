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
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from typing import Any, AsyncIterator, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import grpc
import grpc.aio

from ._proto import broker_pb2 as pb
from .errors import (
    BrokerCallError,
    BrokerUnavailable,
    InvalidSample,
    ProtocolError,
    RunAborted,
    StreamClosed,
)
from .records import message_to_dict
from .security import PathLike, Transport, environment_options, resolve_transport, split_address
from .tensors import WireTensor, check_trace_context, make_sample, received_tensors

logger = logging.getLogger("dflash_client")

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


@dataclasses.dataclass
class ClientOptions:
    """Transport settings; the defaults suit hidden-state payloads of up to
    256 MiB, like the Rust client's. The security fields are the Rust
    roles' flags in keyword form (`--tls-ca` is `tls_ca`; see `security`);
    none set and an http:// or host:port address: plaintext, no token
    unless DFLASH_TOKEN is set."""

    max_message_bytes: int = (256 << 20) + (1 << 20)
    keepalive_interval_s: float = 10.0
    keepalive_timeout_s: float = 20.0
    #: Items a producer may have sent and not yet had answered.
    producer_window_items: int = 16
    #: Attempts to reopen a broken Produce stream in one outage before
    #: giving up; the count starts again once the stream makes progress.
    producer_max_reconnects: int = 10
    #: How long a consumer keeps reconnecting to a broker that went away.
    consumer_reconnect_timeout_s: float = 60.0
    #: Timeout of unary calls (status, ReportDone).
    call_timeout_s: float = 30.0
    #: PEM CA bundle that signed the broker's certificate; enables TLS (an
    #: https:// address without it uses the system's roots).
    tls_ca: Optional[PathLike] = None
    #: PEM client certificate for mutual TLS (with `tls_key`).
    tls_cert: Optional[PathLike] = None
    #: PEM private key of `tls_cert`.
    tls_key: Optional[PathLike] = None
    #: Name to verify the broker's certificate against, when it is not the
    #: host of the broker address.
    tls_domain: Optional[str] = None
    #: File holding the bearer token; the DFLASH_TOKEN environment variable
    #: may hold the token instead (not both).
    token_file: Optional[PathLike] = None

    @classmethod
    def from_environment(cls, environ: Optional[Mapping[str, str]] = None, **fields: Any) -> "ClientOptions":
        """Options with the security settings of the environment
        (DFLASH_TLS_CA, DFLASH_TLS_CERT, DFLASH_TLS_KEY, DFLASH_TLS_DOMAIN,
        DFLASH_TOKEN_FILE, as the Rust roles read them); `fields` win."""
        return cls(**{**environment_options(environ), **fields})

    def transport(self, address: str, environ: Optional[Mapping[str, str]] = None) -> Transport:
        """Reads the security files and the token for `address` (raises
        SecurityError naming the option and file)."""
        return resolve_transport(
            address,
            tls_ca=self.tls_ca,
            tls_cert=self.tls_cert,
            tls_key=self.tls_key,
            tls_domain=self.tls_domain,
            token_file=self.token_file,
            environ=environ,
        )

    def channel_arguments(self) -> List[Tuple[str, Any]]:
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", int(self.keepalive_interval_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            # Each stream gets its own connection (as in the Rust client), so
            # one large stream never shares a flow-control window with another.
            ("grpc.use_local_subchannel_pool", 1),
        ]


def normalize_address(address: str) -> str:
    """`host:port` of `http://host:port`, `https://host:port` (as the Rust
    tools take them) or `host:port`."""
    return split_address(address)[0]


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


def _status_of(error: BaseException) -> Tuple[Optional[grpc.StatusCode], str]:
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code(), error.details() or ""
    return None, str(error)


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


@dataclasses.dataclass
class ProduceReport:
    """What the broker answered for this producer's items (all streams)."""

    #: Items the broker holds from this target in all (its count, which
    #: ReportDone must match): the last welcome's plus those accepted since.
    accepted_total: int = 0
    #: Items newly accepted by answers this producer saw.
    accepted: int = 0
    #: Items answered `accepted, duplicate` (the broker had them already).
    duplicates: int = 0
    #: Items accepted before a stream broke whose answers were lost (the new
    #: welcome's resume_after_seq covered them).
    accepted_unanswered: int = 0
    rejected: List[Tuple[int, str]] = dataclasses.field(default_factory=list)
    #: Times a broken stream was reopened, over the producer's life (the
    #: budget, `producer_max_reconnects`, is per outage).
    reconnects: int = 0


class AsyncProducer:
    """A target's pipelined Produce stream: at most `producer_window_items`
    items unanswered; reconnects and resumes on UNAVAILABLE."""

    def __init__(self, client: AsyncBrokerClient, target_id: str, hidden_width: Optional[int] = None):
        if not target_id:
            raise ValueError("target_id is empty")
        self.client = client
        self.target_id = target_id
        self.hidden_width = hidden_width
        self.window = max(1, client.options.producer_window_items)
        #: The last welcome: resume_after_seq (None when the broker had
        #: nothing), accepted_items, epoch, run_id.
        self.welcome: Optional[Dict[str, Any]] = None
        self._run_id = ""
        self._channel: Optional[grpc.aio.Channel] = None
        self._call: Any = None
        self._reader: Optional[asyncio.Task] = None
        #: Sent and not yet answered, by seq (in send order).
        self._pending: "collections.OrderedDict[int, pb.ProduceRequest]" = collections.OrderedDict()
        self._accepted_before = 0
        self._accepted_on_stream = 0
        self._report = ProduceReport()
        self._last_seq: Optional[int] = None
        self._broken: Optional[str] = None
        self._fatal: Optional[BaseException] = None
        self._finishing = False
        self._progress = asyncio.Event()
        #: Reopening attempts in the current outage (the budget is
        #: `producer_max_reconnects`); back to 0 when the stream makes
        #: progress: an answer arrives, or a welcome shows more items
        #: accepted than the broken stream's did.
        self._outage_attempts = 0

    # ------------------------------------------------------------ public

    @property
    def resume_after_seq(self) -> Optional[int]:
        """The highest seq the broker already has from this target: skip it
        and everything before it."""
        return None if self.welcome is None else self.welcome["resume_after_seq"]

    @property
    def epoch(self) -> int:
        return 0 if self.welcome is None else self.welcome["epoch"]

    @property
    def run_id(self) -> str:
        return self._run_id

    @property
    def report(self) -> ProduceReport:
        self._report.accepted_total = self._accepted_before + self._accepted_on_stream
        return dataclasses.replace(self._report, rejected=list(self._report.rejected))

    async def open(self) -> "AsyncProducer":
        await self._open_stream()
        return self

    async def __aenter__(self) -> "AsyncProducer":
        return await self.open()

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    def prepare(self, seq: int, input_ids: Any, loss_mask: Any, hidden_states: Any, trace_context: Optional[Mapping[str, str]] = None) -> pb.ProduceRequest:
        """Validates and encodes one item without sending it (raises
        InvalidSample). `send` calls it; the sync client calls it on the
        caller's thread."""
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0 or seq >= 2**64:
            raise InvalidSample(f"seq {seq!r} is not an integer in [0, 2^64)")
        if self._last_seq is not None and seq <= self._last_seq:
            raise InvalidSample(f"seq {seq} does not increase (the last seq sent was {self._last_seq})")
        sample = make_sample(input_ids, loss_mask, hidden_states, self.hidden_width)
        trace = check_trace_context(trace_context)
        return pb.ProduceRequest(item=pb.Item(seq=seq, sample=sample, trace_context=trace))

    async def send(self, seq: int, input_ids: Any, loss_mask: Any, hidden_states: Any, trace_context: Optional[Mapping[str, str]] = None) -> None:
        """Validates (InvalidSample before anything is sent), then sends one
        item; waits while the window of unanswered items is full (and while
        HTTP/2 flow control holds the stream back because the broker's queue
        is full)."""
        await self.send_prepared(self.prepare(seq, input_ids, loss_mask, hidden_states, trace_context))

    async def send_prepared(self, request: pb.ProduceRequest) -> None:
        seq = request.item.seq
        if self._last_seq is not None and seq <= self._last_seq:
            raise InvalidSample(f"seq {seq} does not increase (the last seq sent was {self._last_seq})")
        self._require_open()
        await self._wait_for_room()
        self._last_seq = seq
        self._pending[seq] = request
        await self._write_or_reconnect(request)

    async def send_stats(self, **fields: Any) -> None:
        """ProducerStats (tokens_per_second, busy_fraction, device,
        samples_done, samples_total, tokens_done), shown in the broker's
        status. Best effort: a broken stream drops them."""
        request = pb.ProduceRequest(stats=pb.ProducerStats(**fields))
        if self._call is not None and self._broken is None and self._fatal is None:
            try:
                await self._call.write(request)
            except Exception as error:  # the reader records why the stream broke
                logger.debug("stats not sent: %s", error)

    async def finish(self) -> ProduceReport:
        """Waits until every sent item is answered (reconnecting and
        re-sending if the stream breaks), then ends the stream."""
        self._require_open()
        while True:
            self._raise_if_fatal()
            if self._broken is not None:
                await self._reconnect()
                continue
            if not self._pending:
                break
            self._progress.clear()
            await self._progress.wait()
        self._finishing = True
        try:
            await self._call.done_writing()
        except Exception as error:
            logger.debug("done_writing: %s", error)
        if self._reader is not None:
            await self._reader
        self._raise_if_fatal()
        return self.report

    async def report_done(self, total_items: Optional[int] = None) -> Dict[str, Any]:
        """ReportDone with this stream's epoch and run id; `total_items`
        defaults to the broker's own count for this target (call `finish`
        first so every item is answered)."""
        total = self.report.accepted_total if total_items is None else total_items
        return await self.client.report_done(self.target_id, total, epoch=self.epoch, run_id=self._run_id)

    async def close(self) -> None:
        """Drops the stream and its connection (without ReportDone)."""
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
        if self._call is not None:
            self._call.cancel()
        if self._channel is not None:
            await self._channel.close()
        self._channel = None

    # ------------------------------------------------------------ internals

    def _require_open(self) -> None:
        if self._call is None:
            raise RuntimeError("the producer is not open: call open() (or use it as a context manager)")
        if self._finishing:
            raise RuntimeError("the producer is finished")

    def _raise_if_fatal(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    async def _open_stream(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = self.client.new_channel()
        hello = pb.ProduceRequest(hello=pb.ProducerHello(target_id=self.target_id, run_id=self._run_id))
        call, response = await self.client.open_stream(self._channel, "Produce", hello, pb.ProduceResponse)
        if response is grpc.aio.EOF:
            raise self.client.call_error("Produce", grpc.StatusCode.UNAVAILABLE, "the stream ended before the welcome")
        kind = response.WhichOneof("kind")
        if kind == "closed":
            raise StreamClosed(pb.RunStatus.Name(response.closed.status), response.closed.reason)
        if kind != "welcome":
            raise ProtocolError(f"Produce: expected welcome, got {kind}")
        welcome = response.welcome
        if self.welcome is not None and welcome.accepted_items > self._accepted_before:
            # The broken stream had items accepted whose answers were lost:
            # that was progress, so this outage is over.
            self._outage_attempts = 0
        self.welcome = message_to_dict(welcome)
        self._run_id = welcome.run_id
        self._accepted_before = welcome.accepted_items
        self._accepted_on_stream = 0
        self._call = call
        self._broken = None
        self._reader = asyncio.ensure_future(self._read_answers(call))

    async def _read_answers(self, call: Any) -> None:
        try:
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    if not self._finishing:
                        self._broken = "the broker ended the Produce stream"
                    return
                kind = response.WhichOneof("kind")
                if kind in ("accepted", "rejected"):
                    # An answer: the stream works, the outage (if any) is over.
                    self._outage_attempts = 0
                if kind == "accepted":
                    self._pending.pop(response.accepted.seq, None)
                    if response.accepted.duplicate:
                        self._report.duplicates += 1
                    else:
                        self._report.accepted += 1
                        self._accepted_on_stream += 1
                elif kind == "rejected":
                    self._pending.pop(response.rejected.seq, None)
                    self._report.rejected.append((response.rejected.seq, response.rejected.reason))
                    logger.warning("item %d of %s rejected: %s", response.rejected.seq, self.target_id, response.rejected.reason)
                elif kind == "closed":
                    self._fatal = StreamClosed(pb.RunStatus.Name(response.closed.status), response.closed.reason)
                    return
                self._progress.set()
        except grpc.aio.AioRpcError as error:
            if error.code() in RETRYABLE_CODES:
                self._broken = f"{error.code().name}: {error.details()}"
            else:
                self._fatal = self.client.call_error("Produce", error.code(), error.details() or "")
        except asyncio.CancelledError:
            if not self._finishing:
                self._broken = "the Produce stream was cancelled"
            raise
        finally:
            self._progress.set()

    async def _wait_for_room(self) -> None:
        while True:
            self._raise_if_fatal()
            if self._broken is not None:
                await self._reconnect()
                continue
            if len(self._pending) < self.window:
                return
            self._progress.clear()
            await self._progress.wait()

    async def _write_or_reconnect(self, request: pb.ProduceRequest) -> None:
        try:
            await self._call.write(request)
            return
        except Exception as error:
            logger.debug("Produce write failed: %s", error)
        # The reader sees why the call ended (retryable or not).
        if self._reader is not None:
            await asyncio.wait([self._reader])
        if self._broken is None and self._fatal is None:
            self._broken = "the Produce stream ended"
        self._raise_if_fatal()
        await self._reconnect()

    async def _reconnect(self) -> None:
        """Reopens the stream and re-sends the unanswered items that the new
        welcome does not cover; BrokerUnavailable once this outage has
        spent `producer_max_reconnects` attempts without progress."""
        last_reason = self._broken or "the stream broke"
        budget = self.client.options.producer_max_reconnects
        while True:
            self._raise_if_fatal()
            if self._outage_attempts >= budget:
                raise BrokerUnavailable(
                    f"Produce stream of {self.target_id} broke and {self._outage_attempts} attempts to reopen it "
                    f"in a row made no progress (producer_max_reconnects {budget}; "
                    f"{self._report.reconnects} reconnects in all): {last_reason}"
                )
            self._outage_attempts += 1
            self._report.reconnects += 1
            delay = _backoff(self._outage_attempts)
            logger.warning(
                "Produce stream of %s broke (%s); reopening in %.1fs (attempt %d of %d in this outage)",
                self.target_id,
                last_reason,
                delay,
                self._outage_attempts,
                budget,
            )
            await asyncio.sleep(delay)
            if self._reader is not None and not self._reader.done():
                self._reader.cancel()
                await asyncio.wait([self._reader])
            try:
                await self._open_stream()
            except BrokerCallError as error:
                if error.code not in RETRYABLE_CODES:
                    raise
                last_reason = str(error)
                continue
            resume = self.resume_after_seq
            for seq in list(self._pending):
                if resume is not None and seq <= resume:
                    del self._pending[seq]
                    self._report.accepted_unanswered += 1
            try:
                for request in list(self._pending.values()):
                    await self._call.write(request)
            except Exception as error:
                if self._reader is not None:
                    await asyncio.wait([self._reader])
                self._raise_if_fatal()
                last_reason = self._broken or str(error)
                continue
            logger.info("Produce stream of %s reopened after seq %s; %d items re-sent", self.target_id, resume, len(self._pending))
            self._progress.set()
            return


@dataclasses.dataclass
class Delivery:
    """One leased item. Ack it (after the step that used it) or nack it
    before the lease runs out; the consumer extends held leases itself."""

    delivery_id: int
    target_id: str
    seq: int
    #: 1 on the first delivery, 2 on the first redelivery, ...
    delivery_count: int
    trace_context: Dict[str, str]
    tensors: Dict[str, WireTensor]
    #: Which stream of the consumer delivered it (acks of an older stream are stale).
    stream_generation: int = 0

    @property
    def key(self) -> Tuple[str, int]:
        return (self.target_id, self.seq)

    @property
    def payload_bytes(self) -> int:
        return sum(len(tensor.data) for tensor in self.tensors.values())

    def tensor(self, name: str) -> WireTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise ProtocolError(f"sample has no tensor named {name!r} (has {sorted(self.tensors)})") from None

    def numpy(self, name: str) -> Any:
        """A read-only zero-copy numpy view (bf16 as uint16 bit patterns)."""
        return self.tensor(name).numpy()

    def torch(self, name: str) -> Any:
        """A zero-copy torch view (bf16 as torch.bfloat16); clone before writing."""
        return self.tensor(name).torch()


DeliveryRef = Union[Delivery, int]


@dataclasses.dataclass(frozen=True)
class UnsentAck:
    """An ack or nack that never went out: its stream broke before it was
    written (or it was asked for after). The broker gives the lease back
    when it sees the stream end, so the item comes again."""

    #: "ack" or "nack".
    kind: str
    delivery_id: int
    target_id: str
    seq: int
    #: Why it was not sent.
    reason: str


@dataclasses.dataclass
class _Outgoing:
    """A request waiting for the Consume stream's writer, with the
    deliveries it settles when it is an ack or a nack."""

    request: pb.ConsumeRequest
    #: "ack", "nack", "extend", "credit" or "stats".
    kind: str
    deliveries: Tuple[Delivery, ...] = ()


class AsyncConsumer:
    """A drafter's Consume stream: `async for delivery in consumer`. The
    iteration ends when the broker sends end-of-stream COMPLETE (then
    `end_of_stream` holds the run summary) and raises RunAborted on ABORTED.
    Acks, nacks, extensions and credit are plain methods that never block;
    an ack or nack that cannot go out is reported (`unsent_acks`), never
    dropped silently."""

    def __init__(self, client: AsyncBrokerClient, drafter_id: str, credit_items: int, credit_bytes: int, extend_leases: bool = True):
        if not drafter_id:
            raise ValueError("drafter_id is empty")
        if credit_items < 1 or credit_items >= 2**32:
            raise ValueError(f"credit_items {credit_items} is not in [1, 2^32)")
        if credit_bytes < 0:
            raise ValueError(f"credit_bytes {credit_bytes} is negative")
        self.client = client
        self.drafter_id = drafter_id
        self.credit = pb.Credit(items=credit_items, bytes=credit_bytes)
        self.extend_leases_automatically = extend_leases
        #: The last welcome: summary, lease_timeout_ms, run_id.
        self.welcome: Optional[Dict[str, Any]] = None
        #: status, reason, summary of the end-of-stream, once it came.
        self.end_of_stream: Optional[Dict[str, Any]] = None
        self.reconnects = 0
        self._run_id = ""
        self._generation = 0
        self._channel: Optional[grpc.aio.Channel] = None
        self._call: Any = None
        self._requests: Optional[asyncio.Queue] = None
        self._tasks: List[asyncio.Task] = []
        #: The read in progress (kept across receive timeouts).
        self._read_task: Optional[asyncio.Future] = None
        #: Delivery ids of the current stream handed out and not acked or nacked.
        self._held: Dict[int, Delivery] = {}
        self._closed = False
        #: Why the current stream's writer stopped; None while it runs.
        #: Nothing more goes out on this stream once it is set.
        self._writer_stopped: Optional[str] = None
        #: Every ack and nack that never went out, oldest first.
        self._unsent: List[UnsentAck] = []

    @property
    def run_id(self) -> str:
        return self._run_id

    @property
    def held(self) -> List[int]:
        return sorted(self._held)

    @property
    def unsent_acks(self) -> List[UnsentAck]:
        """Every ack and nack that never went out on a stream (each was also
        logged at WARNING), oldest first. Their items come again."""
        return list(self._unsent)

    async def open(self) -> "AsyncConsumer":
        await self._open_stream()
        return self

    async def __aenter__(self) -> "AsyncConsumer":
        return await self.open()

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    def __aiter__(self) -> "AsyncConsumer":
        return self

    async def __anext__(self) -> Delivery:
        delivery = await self.receive()
        if delivery is None:
            raise StopAsyncIteration
        return delivery

    async def receive(self, timeout_s: Optional[float] = None) -> Optional[Delivery]:
        """The next delivery; None when `timeout_s` passes first (a trainer
        then steps on what it holds) or at end-of-stream COMPLETE (then
        `end_of_stream` is set). Raises RunAborted on ABORTED,
        BrokerCallError on a non-retryable status, BrokerUnavailable when
        reconnecting fails. A timeout never cancels the read underneath."""
        if self.end_of_stream is not None or self._closed:
            return None
        if self._call is None:
            raise RuntimeError("the consumer is not open: call open() (or use it as a context manager)")
        loop = asyncio.get_running_loop()
        give_up_at = None if timeout_s is None else loop.time() + timeout_s
        reconnect_deadline: Optional[float] = None
        while True:
            if self._read_task is None:
                self._read_task = asyncio.ensure_future(self._call.read())
            remaining = None if give_up_at is None else max(0.0, give_up_at - loop.time())
            done, _ = await asyncio.wait({self._read_task}, timeout=remaining)
            if not done:
                return None
            read_task, self._read_task = self._read_task, None
            try:
                response = read_task.result()
            except grpc.aio.AioRpcError as error:
                if error.code() not in RETRYABLE_CODES:
                    raise self.client.call_error("Consume", error.code(), error.details() or "") from None
                reconnect_deadline = await self._reconnect(f"{error.code().name}: {error.details()}", reconnect_deadline)
                continue
            except asyncio.CancelledError:
                if self._closed:
                    return None
                raise
            if response is grpc.aio.EOF:
                reconnect_deadline = await self._reconnect("the stream ended without end-of-stream", reconnect_deadline)
                continue
            reconnect_deadline = None
            kind = response.WhichOneof("kind")
            if kind == "delivery":
                return self._accept_delivery(response.delivery)
            if kind == "end_of_stream":
                end = response.end_of_stream
                self.end_of_stream = {
                    "status": pb.RunStatus.Name(end.status),
                    "reason": end.reason,
                    "summary": message_to_dict(end.summary) if end.HasField("summary") else None,
                }
                self._held.clear()
                await self._stop_tasks()
                if end.status == pb.RUN_STATUS_ABORTED:
                    raise RunAborted(end.reason, self.end_of_stream["summary"])
                if end.status != pb.RUN_STATUS_COMPLETE:
                    raise ProtocolError(f"end-of-stream with status {end.status}")
                return None
            # A repeated welcome or an unknown kind: nothing to hand out.

    def ack(self, deliveries: Union[DeliveryRef, Iterable[DeliveryRef]]) -> int:
        """Acks deliveries (Delivery objects or ids). Returns how many were
        queued on the live stream. Those that cannot go out (of an older
        stream, which the broker took back when it broke, or on a stream
        whose writer has died) are logged at WARNING and recorded in
        `unsent_acks`; their items come again."""
        held = self._take_held("ack", deliveries)
        if not held:
            return 0
        request = pb.ConsumeRequest(ack=pb.Ack(delivery_ids=[delivery.delivery_id for delivery in held]))
        return len(held) if self._send(_Outgoing(request, "ack", tuple(held))) else 0

    def nack(self, deliveries: Union[DeliveryRef, Iterable[DeliveryRef]], reason: str = "", dead_letter: bool = False) -> int:
        """Gives deliveries back: to the head of the queue, or (dead_letter)
        straight to the dead letters for an item that is bad anywhere.
        Returns how many were queued, like `ack`."""
        held = self._take_held("nack", deliveries)
        if not held:
            return 0
        disposition = pb.NACK_DISPOSITION_DEAD_LETTER if dead_letter else pb.NACK_DISPOSITION_REQUEUE
        request = pb.ConsumeRequest(
            nack=pb.Nack(delivery_ids=[delivery.delivery_id for delivery in held], reason=reason, disposition=disposition)
        )
        return len(held) if self._send(_Outgoing(request, "nack", tuple(held))) else 0

    def extend(self, deliveries: Optional[Union[DeliveryRef, Iterable[DeliveryRef]]] = None) -> bool:
        """Renews leases: these deliveries, or every held one. False when
        they could not be queued (the stream is gone, and its leases with it)."""
        held = list(self._held.values()) if deliveries is None else self._take_held("extend", deliveries, release=False)
        if not held:
            return True
        request = pb.ConsumeRequest(extend_leases=pb.ExtendLeases(delivery_ids=sorted(delivery.delivery_id for delivery in held)))
        return self._send(_Outgoing(request, "extend"))

    def set_credit(self, items: int, bytes: int = 0) -> bool:
        """A new credit window; False when the stream is gone (the next
        stream's hello carries it)."""
        self.credit = pb.Credit(items=items, bytes=bytes)
        return self._send(_Outgoing(pb.ConsumeRequest(credit=self.credit), "credit"))

    def send_stats(self, **fields: Any) -> bool:
        """ConsumerStats (tokens_per_second, loss, busy_fraction, device,
        steps, samples_trained, accuracy), shown in the broker's status.
        Best effort: False when the stream is gone."""
        return self._send(_Outgoing(pb.ConsumeRequest(stats=pb.ConsumerStats(**fields)), "stats"))

    async def close(self, flush_timeout_s: float = 5.0) -> None:
        """Sends what is queued (acks, nacks), then ends the stream; the
        broker returns any held leases to the queue. Acks still queued
        after `flush_timeout_s` are reported like any unsent ack."""
        self._closed = True
        if self._requests is not None and self._tasks and not self._tasks[0].done():
            try:
                await asyncio.wait_for(self._requests.join(), flush_timeout_s)
            except asyncio.TimeoutError:
                pass  # stopping the writer below reports what it did not send
        await self._stop_tasks()
        self._writer_stopped = "the consumer is closed"
        if self._read_task is not None:
            self._read_task.cancel()
            self._read_task = None
        if self._call is not None:
            self._call.cancel()
        if self._channel is not None:
            await self._channel.close()
        self._channel = None

    # ------------------------------------------------------------ internals

    def _take_held(self, kind: str, deliveries: Any, release: bool = True) -> List[Delivery]:
        """The held deliveries of the current stream among `deliveries`
        (released from `held` when `release`). An ack or nack of a delivery
        from an older stream is recorded as unsent; one of a delivery this
        consumer does not hold (acked twice, an unknown id) is logged."""
        if isinstance(deliveries, (Delivery, int)):
            deliveries = [deliveries]
        taken = []
        stale = []
        for reference in deliveries:
            if isinstance(reference, Delivery):
                if reference.stream_generation != self._generation:
                    stale.append(reference)
                    continue
                delivery_id = reference.delivery_id
            else:
                delivery_id = int(reference)
            delivery = self._held.pop(delivery_id, None) if release else self._held.get(delivery_id)
            if delivery is None:
                logger.warning(
                    "%s of delivery %d by %s not sent: it is not held (already acked or nacked, or of a stream that broke)",
                    kind,
                    delivery_id,
                    self.drafter_id,
                )
                continue
            taken.append(delivery)
        if stale and kind in ("ack", "nack"):
            self._record_unsent(kind, stale, "its stream broke before the ack; the broker took the lease back")
        return taken

    def _send(self, outgoing: _Outgoing) -> bool:
        """Queues `outgoing` for the writer; False (an ack or nack recorded
        as unsent) when the writer has stopped."""
        if self.end_of_stream is not None:
            return False  # the run is over: nothing is held, nothing to say
        reason = "the consumer is not open" if self._requests is None else self._writer_stopped
        if reason is None:
            self._requests.put_nowait(outgoing)
            return True
        if outgoing.deliveries:
            self._record_unsent(outgoing.kind, outgoing.deliveries, reason)
        else:
            logger.debug("%s of %s not sent: %s", outgoing.kind, self.drafter_id, reason)
        return False

    def _record_unsent(self, kind: str, deliveries: Sequence[Delivery], reason: str) -> None:
        self._unsent.extend(UnsentAck(kind, delivery.delivery_id, delivery.target_id, delivery.seq, reason) for delivery in deliveries)
        logger.warning(
            "%d %s(s) of %s not sent (%s); the broker gives those leases back and the items come again: %s",
            len(deliveries),
            kind,
            self.drafter_id,
            reason,
            ", ".join(f"{delivery.target_id} seq {delivery.seq}" for delivery in deliveries),
        )

    def _accept_delivery(self, message: pb.Delivery) -> Delivery:
        delivery = Delivery(
            delivery_id=message.delivery_id,
            target_id=message.target_id,
            seq=message.seq,
            delivery_count=message.delivery_count,
            trace_context=dict(message.trace_context),
            tensors=received_tensors(message.sample),
            stream_generation=self._generation,
        )
        self._held[delivery.delivery_id] = delivery
        return delivery

    async def _open_stream(self) -> None:
        await self._stop_tasks()
        if self._read_task is not None:
            self._read_task.cancel()
            self._read_task = None
        if self._channel is not None:
            await self._channel.close()
        self._channel = self.client.new_channel()
        hello = pb.ConsumeRequest(hello=pb.ConsumerHello(drafter_id=self.drafter_id, credit=self.credit, run_id=self._run_id))
        call, response = await self.client.open_stream(self._channel, "Consume", hello, pb.ConsumeResponse)
        if response is grpc.aio.EOF:
            raise self.client.call_error("Consume", grpc.StatusCode.UNAVAILABLE, "the stream ended before the welcome")
        if response.WhichOneof("kind") != "welcome":
            raise ProtocolError(f"Consume: expected welcome, got {response.WhichOneof('kind')}")
        welcome = response.welcome
        self.welcome = message_to_dict(welcome)
        self._run_id = welcome.run_id
        self._generation += 1
        self._held.clear()
        self._call = call
        self._requests = asyncio.Queue()
        self._writer_stopped = None
        self._tasks = [asyncio.ensure_future(self._write_requests(call, self._requests))]
        if self.extend_leases_automatically and welcome.lease_timeout_ms > 0:
            interval = max(welcome.lease_timeout_ms / 3000.0, 0.02)
            self._tasks.append(asyncio.ensure_future(self._extend_held_leases(interval)))

    async def _write_requests(self, call: Any, requests: asyncio.Queue) -> None:
        """Writes queued requests in order until the stream fails or the
        task is stopped; then reports what it did not write."""
        current: Optional[_Outgoing] = None
        try:
            while True:
                current = await requests.get()
                await call.write(current.request)
                current = None
                requests.task_done()
        except asyncio.CancelledError:
            self._writer_stop(requests, current, "the stream was closed before they were written")
            raise
        except Exception as error:
            # The read side sees why the stream ended and reconnects.
            code, details = _status_of(error)
            cause = f"{code.name}: {details}" if code is not None else (details or type(error).__name__)
            self._writer_stop(requests, current, f"the Consume stream broke ({cause})")

    def _writer_stop(self, requests: asyncio.Queue, current: Optional[_Outgoing], reason: str) -> None:
        """Marks the writer of `requests` stopped and reports every ack and
        nack it had not written (unless the run is over: then none is owed)."""
        unsent = [current] if current is not None else []
        while True:
            try:
                unsent.append(requests.get_nowait())
            except asyncio.QueueEmpty:
                break
        for _ in unsent:
            requests.task_done()
        if requests is self._requests:
            self._writer_stopped = reason
        if self.end_of_stream is not None:
            return
        for outgoing in unsent:
            if outgoing.deliveries:
                self._record_unsent(outgoing.kind, outgoing.deliveries, reason)

    async def _extend_held_leases(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            if self._held:
                self.extend()

    async def _stop_tasks(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def _reconnect(self, reason: str, deadline: Optional[float]) -> float:
        """Reopens the stream until the reconnect timeout passes; returns the
        deadline so a stream that breaks again keeps counting from the first
        failure."""
        now = time.monotonic()
        if deadline is None:
            deadline = now + self.client.options.consumer_reconnect_timeout_s
        attempt = 0
        while True:
            if time.monotonic() >= deadline:
                raise BrokerUnavailable(
                    f"Consume stream of {self.drafter_id} broke and reconnecting for "
                    f"{self.client.options.consumer_reconnect_timeout_s:g}s failed: {reason}"
                )
            attempt += 1
            self.reconnects += 1
            delay = min(_backoff(attempt), max(0.0, deadline - time.monotonic()))
            logger.warning("Consume stream of %s broke (%s); reopening in %.1fs", self.drafter_id, reason, delay)
            await asyncio.sleep(delay)
            try:
                await self._open_stream()
                return deadline
            except BrokerCallError as error:
                if error.code not in RETRYABLE_CODES:
                    raise
                reason = str(error)
