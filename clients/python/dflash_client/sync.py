"""The blocking API: the asyncio client run on a private event-loop thread.

`BrokerClient` owns the thread; its producers and consumers forward each
call to it and wait for the result, so a plain training loop (or a
transformers script) can use the broker without asyncio. Validation and
encoding of samples run on the caller's thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Coroutine, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, TypeVar, Union

from .aio import AsyncBrokerClient, AsyncConsumer, AsyncProducer, ClientOptions, Delivery, ProduceReport, UnsentAck

T = TypeVar("T")


class _LoopThread:
    """One event loop running forever on a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="dflash-client-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: Optional[float] = None) -> T:
        if threading.current_thread() is self._thread:
            raise RuntimeError("a dflash_client sync call from inside its own event loop (use the aio API)")
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        if not self.loop.is_running():
            self.loop.close()


class BrokerClient:
    """A broker address (`host:port`, `http://host:port` or
    `https://host:port`) and its event loop thread. Close it (or use
    `with`) when done. TLS and the token come from `options` (see
    `ClientOptions`); a setting that cannot be used raises SecurityError
    here."""

    def __init__(self, address: str, options: Optional[ClientOptions] = None):
        # Resolved before the thread starts, so a bad setting leaves nothing behind.
        client = AsyncBrokerClient(address, options)
        self._loop = _LoopThread()
        self._client = client

    @property
    def address(self) -> str:
        return self._client.address

    @property
    def options(self) -> ClientOptions:
        return self._client.options

    @property
    def uses_tls(self) -> bool:
        return self._client.uses_tls

    def close(self) -> None:
        try:
            self._loop.run(self._client.close(), timeout=10)
        finally:
            self._loop.stop()

    def __enter__(self) -> "BrokerClient":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def status(self) -> Dict[str, Any]:
        """One snapshot of the broker's state, as a dict."""
        return self._loop.run(self._client.status())

    def watch(self, interval_s: float = 1.0) -> Iterator[Dict[str, Any]]:
        """Snapshots every `interval_s` until the broker ends the stream."""
        stream = self._client.watch(interval_s)
        try:
            while True:
                try:
                    yield self._loop.run(stream.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._loop.run(stream.aclose(), timeout=10)

    def report_done(self, target_id: str, total_items: int, epoch: int = 0, run_id: str = "") -> Dict[str, Any]:
        return self._loop.run(self._client.report_done(target_id, total_items, epoch, run_id))

    def producer(self, target_id: str, hidden_width: Optional[int] = None) -> "Producer":
        """Opens a target's Produce stream (waits for the welcome)."""
        return Producer(self._loop, self._client, target_id, hidden_width)

    def consumer(self, drafter_id: str, credit_items: int = 8, credit_bytes: int = 0, extend_leases: bool = True) -> "Consumer":
        """Opens a drafter's Consume stream (waits for the welcome)."""
        return Consumer(self._loop, self._client, drafter_id, credit_items, credit_bytes, extend_leases)


class Producer:
    """Blocking twin of AsyncProducer (see there)."""

    def __init__(self, loop: _LoopThread, client: AsyncBrokerClient, target_id: str, hidden_width: Optional[int]):
        self._loop = loop

        async def open_producer() -> AsyncProducer:
            return await AsyncProducer(client, target_id, hidden_width).open()

        self._producer = loop.run(open_producer())

    @property
    def target_id(self) -> str:
        return self._producer.target_id

    @property
    def welcome(self) -> Optional[Dict[str, Any]]:
        return self._producer.welcome

    @property
    def resume_after_seq(self) -> Optional[int]:
        return self._producer.resume_after_seq

    @property
    def epoch(self) -> int:
        return self._producer.epoch

    @property
    def run_id(self) -> str:
        return self._producer.run_id

    @property
    def capture(self) -> Tuple[str, ...]:
        return self._producer.capture

    @property
    def capture_last_hidden_states(self) -> bool:
        return self._producer.capture_last_hidden_states

    @property
    def report(self) -> ProduceReport:
        return self._producer.report

    def send(self, seq: int, input_ids: Any, loss_mask: Any, hidden_states: Any, trace_context: Optional[Mapping[str, str]] = None, last_hidden_states: Any = None) -> None:
        request = self._producer.prepare(seq, input_ids, loss_mask, hidden_states, trace_context, last_hidden_states)
        self._loop.run(self._producer.send_prepared(request))

    def send_stats(self, **fields: Any) -> None:
        self._loop.run(self._producer.send_stats(**fields))

    def finish(self) -> ProduceReport:
        return self._loop.run(self._producer.finish())

    def report_done(self, total_items: Optional[int] = None) -> Dict[str, Any]:
        return self._loop.run(self._producer.report_done(total_items))

    def close(self) -> None:
        self._loop.run(self._producer.close(), timeout=10)

    def __enter__(self) -> "Producer":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


DeliveryRefs = Union[Delivery, int, Iterable[Union[Delivery, int]]]


class Consumer:
    """Blocking twin of AsyncConsumer: `for delivery in consumer:`; the loop
    ends on COMPLETE (`end_of_stream` then holds the summary) and raises
    RunAborted on ABORTED."""

    def __init__(self, loop: _LoopThread, client: AsyncBrokerClient, drafter_id: str, credit_items: int, credit_bytes: int, extend_leases: bool):
        self._loop = loop

        async def open_consumer() -> AsyncConsumer:
            return await AsyncConsumer(client, drafter_id, credit_items, credit_bytes, extend_leases).open()

        self._consumer = loop.run(open_consumer())

    @property
    def drafter_id(self) -> str:
        return self._consumer.drafter_id

    @property
    def welcome(self) -> Optional[Dict[str, Any]]:
        return self._consumer.welcome

    @property
    def end_of_stream(self) -> Optional[Dict[str, Any]]:
        return self._consumer.end_of_stream

    @property
    def run_id(self) -> str:
        return self._consumer.run_id

    @property
    def reconnects(self) -> int:
        return self._consumer.reconnects

    @property
    def held(self) -> List[int]:
        return self._consumer.held

    @property
    def unsent_acks(self) -> List[UnsentAck]:
        """Every ack and nack that never went out (see AsyncConsumer)."""
        return self._consumer.unsent_acks

    def __iter__(self) -> "Consumer":
        return self

    def __next__(self) -> Delivery:
        try:
            return self._loop.run(self._consumer.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def receive(self, timeout_s: Optional[float] = None) -> Optional[Delivery]:
        """The next delivery; None when `timeout_s` passes first or at
        end-of-stream COMPLETE (then `end_of_stream` is set)."""
        return self._loop.run(self._consumer.receive(timeout_s))

    def _call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        async def invoke() -> Any:
            return method(*args, **kwargs)

        return self._loop.run(invoke())

    def ack(self, deliveries: DeliveryRefs) -> int:
        return self._call(self._consumer.ack, deliveries)

    def nack(self, deliveries: DeliveryRefs, reason: str = "", dead_letter: bool = False) -> int:
        return self._call(self._consumer.nack, deliveries, reason, dead_letter)

    def extend(self, deliveries: Optional[DeliveryRefs] = None) -> bool:
        return self._call(self._consumer.extend, deliveries)

    def set_credit(self, items: int, bytes: int = 0) -> bool:
        return self._call(self._consumer.set_credit, items, bytes)

    def send_stats(self, **fields: Any) -> bool:
        return self._call(self._consumer.send_stats, **fields)

    def close(self) -> None:
        self._loop.run(self._consumer.close(), timeout=30)

    def __enter__(self) -> "Consumer":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
