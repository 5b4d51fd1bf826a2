"""`AsyncConsumer`: a drafter's Consume stream (hello/welcome, credit,
deliveries handed out and held, acks and nacks through one writer task,
lease extension, end-of-stream, reconnects for
`consumer_reconnect_timeout_s`), its `Delivery` items and the `UnsentAck`
record of an ack or nack that never went out. Made by
`AsyncBrokerClient.consumer`; the failure policy is the client's (see
`aio`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import grpc
import grpc.aio

from ._proto import broker_pb2 as pb
from .errors import BrokerCallError, BrokerUnavailable, ProtocolError, RunAborted
from .records import message_to_dict
from .tensors import WireTensor, received_tensors

if TYPE_CHECKING:
    from .aio import AsyncBrokerClient

logger = logging.getLogger("dflash_client")


def _status_of(error: BaseException) -> Tuple[Optional[grpc.StatusCode], str]:
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code(), error.details() or ""
    return None, str(error)


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
                if not self.client.retryable(error.code()):
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
            delay = min(self.client.backoff(attempt), max(0.0, deadline - time.monotonic()))
            logger.warning("Consume stream of %s broke (%s); reopening in %.1fs", self.drafter_id, reason, delay)
            await asyncio.sleep(delay)
            try:
                await self._open_stream()
                return deadline
            except BrokerCallError as error:
                if not self.client.retryable(error.code):
                    raise
                reason = str(error)
