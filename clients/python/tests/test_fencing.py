"""The fencing fields of issue #9 (run id, producer epoch), which the broker
on main does not act on yet: a small in-process gRPC server stands in for a
broker that does, scripted per test. What is checked is the client's side:
the values it sends back, and that a refusal is raised at once, not retried.
(Everything else is tested against the real broker binary.)"""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
import pytest

from dflash_client import AsyncBrokerClient, BrokerCallError, ClientOptions
from dflash_client._proto import broker_pb2 as pb

from samples import synthetic_sample


class FencingBroker:
    """Answers the first Produce/Consume hello with run "run-A"; breaks that
    stream with UNAVAILABLE after `break_after` items; then acts as a broker
    restarted without its state: every later hello is refused with
    FAILED_PRECONDITION. Records every hello and ReportDone."""

    def __init__(self, break_after: int):
        self.break_after = break_after
        self.producer_hellos = []
        self.consumer_hellos = []
        self.report_dones = []

    async def produce(self, requests, context):
        first = await requests.__anext__()
        self.producer_hellos.append(first.hello)
        if len(self.producer_hellos) > 1:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"run id {first.hello.run_id!r} is not this broker's run 'run-B'")
        yield pb.ProduceResponse(welcome=pb.ProducerWelcome(accepted_items=0, epoch=3, run_id="run-A"))
        received = 0
        async for request in requests:
            if request.WhichOneof("kind") == "item":
                received += 1
                if received > self.break_after:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "broker shutting down")
                yield pb.ProduceResponse(accepted=pb.ItemAccepted(seq=request.item.seq))

    async def consume(self, requests, context):
        first = await requests.__anext__()
        self.consumer_hellos.append(first.hello)
        if len(self.consumer_hellos) > 1:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"run id {first.hello.run_id!r} is not this broker's run 'run-B'")
        yield pb.ConsumeResponse(welcome=pb.ConsumerWelcome(lease_timeout_ms=60000, run_id="run-A"))
        await context.abort(grpc.StatusCode.UNAVAILABLE, "broker shutting down")

    async def report_done(self, request, context):
        self.report_dones.append(request)
        return pb.ReportDoneResponse(done_targets=1, expected_targets=1)

    async def serve(self):
        server = grpc.aio.server()
        handlers = {
            "Produce": grpc.stream_stream_rpc_method_handler(self.produce, pb.ProduceRequest.FromString, pb.ProduceResponse.SerializeToString),
            "Consume": grpc.stream_stream_rpc_method_handler(self.consume, pb.ConsumeRequest.FromString, pb.ConsumeResponse.SerializeToString),
            "ReportDone": grpc.unary_unary_rpc_method_handler(self.report_done, pb.ReportDoneRequest.FromString, pb.ReportDoneResponse.SerializeToString),
        }
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("dflash.v1.Broker", handlers)])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, f"127.0.0.1:{port}"


def test_report_done_carries_the_epoch_and_run_id_of_the_welcome():
    async def scenario():
        broker = FencingBroker(break_after=100)
        server, address = await broker.serve()
        try:
            async with AsyncBrokerClient(address) as client:
                async with client.producer("target-0") as producer:
                    assert (producer.epoch, producer.run_id) == (3, "run-A")
                    await producer.send(0, *synthetic_sample(0, 8))
                    await producer.finish()
                    await producer.report_done()
        finally:
            await server.stop(None)
        return broker

    broker = asyncio.run(scenario())
    assert broker.producer_hellos[0].run_id == "", "the first hello has no run id"
    [done] = broker.report_dones
    assert (done.target_id, done.total_items, done.epoch, done.run_id) == ("target-0", 1, 3, "run-A")


def test_a_refused_run_id_ends_the_producer_at_once():
    async def scenario():
        broker = FencingBroker(break_after=2)
        server, address = await broker.serve()
        try:
            async with AsyncBrokerClient(address, ClientOptions(producer_window_items=1)) as client:
                async with client.producer("target-0") as producer:
                    with pytest.raises(BrokerCallError) as raised:
                        for seq in range(10):
                            await producer.send(seq, *synthetic_sample(seq, 8))
                        await producer.finish()
                    return broker, raised.value, producer.report
        finally:
            await server.stop(None)

    broker, error, report = asyncio.run(scenario())
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION and "run-B" in error.details
    assert [hello.run_id for hello in broker.producer_hellos] == ["", "run-A"], "one reconnect, with the old run id, then no retry"
    assert report.reconnects == 1


def test_a_refused_run_id_ends_the_consumer_at_once():
    async def scenario():
        broker = FencingBroker(break_after=0)
        server, address = await broker.serve()
        try:
            async with AsyncBrokerClient(address) as client:
                async with client.consumer("drafter-0") as consumer:
                    with pytest.raises(BrokerCallError) as raised:
                        async for _ in consumer:
                            pass
                    return broker, raised.value
        finally:
            await server.stop(None)

    broker, error = asyncio.run(scenario())
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert [hello.run_id for hello in broker.consumer_hellos] == ["", "run-A"]
