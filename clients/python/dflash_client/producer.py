"""`AsyncProducer`: a target's pipelined Produce stream (hello/welcome, a
window of unanswered items, resume after the new welcome's
`resume_after_seq`, the per-outage reconnect budget) and its
`ProduceReport`. Made by `AsyncBrokerClient.producer`; the failure policy
is the client's (see `aio`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple

import grpc
import grpc.aio

from ._proto import broker_pb2 as pb
from .errors import BrokerCallError, BrokerUnavailable, InvalidSample, ProtocolError, StreamClosed
from .records import message_to_dict
from .tensors import LAST_HIDDEN_STATES, check_trace_context, make_sample

if TYPE_CHECKING:
    from .aio import AsyncBrokerClient

logger = logging.getLogger("dflash_client")

#: `ProducerWelcome.capture` values → the sample tensor each asks for.
CAPTURED_TENSORS: Dict[int, str] = {
    pb.CAPTURED_TENSOR_LAST_HIDDEN_STATES: LAST_HIDDEN_STATES,
}


def captured_tensor_names(values: Any) -> Tuple[str, ...]:
    """The tensor names a welcome's `capture` asks for, each once, sorted;
    ProtocolError for a value this client does not know (a sample without
    that tensor would fail on every drafter)."""
    names = set()
    for value in values:
        if value not in CAPTURED_TENSORS:
            raise ProtocolError(
                f"Produce: the broker's welcome asks for captured tensor {value} (ProducerWelcome.capture), "
                "which this client does not know: upgrade dflash-broker-client to the broker's version"
            )
        names.add(CAPTURED_TENSORS[value])
    return tuple(sorted(names))


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
        #: The first welcome's `capture` as tensor names; every later
        #: welcome must ask the same.
        self._capture: Optional[Tuple[str, ...]] = None
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
    def capture(self) -> Tuple[str, ...]:
        """The tensors the run asks every sample to carry beyond DFlash's
        three, by name (the welcome's `capture`, the broker's
        `--target-capture`): `("last_hidden_states",)` in a DSpark run, `()`
        otherwise. `send` refuses an item without one of them."""
        return self._capture or ()

    @property
    def capture_last_hidden_states(self) -> bool:
        """The run asks for `last_hidden_states` (bf16 [T, hidden], the
        target's last hidden state after its final norm): pass it to `send`."""
        return LAST_HIDDEN_STATES in self.capture

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

    def prepare(self, seq: int, input_ids: Any, loss_mask: Any, hidden_states: Any, trace_context: Optional[Mapping[str, str]] = None, last_hidden_states: Any = None) -> pb.ProduceRequest:
        """Validates and encodes one item without sending it (raises
        InvalidSample). `send` calls it; the sync client calls it on the
        caller's thread."""
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0 or seq >= 2**64:
            raise InvalidSample(f"seq {seq!r} is not an integer in [0, 2^64)")
        if self._last_seq is not None and seq <= self._last_seq:
            raise InvalidSample(f"seq {seq} does not increase (the last seq sent was {self._last_seq})")
        if last_hidden_states is None and self.capture_last_hidden_states:
            raise InvalidSample(
                f"seq {seq}: the run asks every sample for {LAST_HIDDEN_STATES!r} "
                "(the broker's --target-capture last-hidden-states) and this one has none"
            )
        sample = make_sample(input_ids, loss_mask, hidden_states, self.hidden_width, last_hidden_states)
        trace = check_trace_context(trace_context)
        return pb.ProduceRequest(item=pb.Item(seq=seq, sample=sample, trace_context=trace))

    async def send(self, seq: int, input_ids: Any, loss_mask: Any, hidden_states: Any, trace_context: Optional[Mapping[str, str]] = None, last_hidden_states: Any = None) -> None:
        """Validates (InvalidSample before anything is sent), then sends one
        item; waits while the window of unanswered items is full (and while
        HTTP/2 flow control holds the stream back because the broker's queue
        is full)."""
        await self.send_prepared(self.prepare(seq, input_ids, loss_mask, hidden_states, trace_context, last_hidden_states))

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
        capture = captured_tensor_names(welcome.capture)
        if self._capture is not None and capture != self._capture:
            # The items waiting to be re-sent were made for the old one.
            self._fatal = ProtocolError(
                f"Produce: the run's capture changed under {self.target_id}: the first welcome asked for "
                f"{list(self._capture)}, the welcome after a reconnect for {list(capture)} (was the broker "
                "restarted with another --target-capture?); the items made so far do not match it"
            )
            raise self._fatal
        self._capture = capture
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
            if self.client.retryable(error.code()):
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
            delay = self.client.backoff(self._outage_attempts)
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
                if not self.client.retryable(error.code):
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

