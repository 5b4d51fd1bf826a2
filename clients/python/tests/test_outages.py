"""Outages: the producer's reconnect budget counts the attempts of one
outage, not of the process, so routine broker restarts over a long run
never add up to it (issue #24 (b)), while one outage that never ends still
runs out; and no ack is dropped silently when the consumer's stream breaks
under it (issue #25)."""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
import pytest

from dflash_client import AsyncBrokerClient, BrokerClient, BrokerUnavailable, ClientOptions, ProtocolError, make_sample
from dflash_client._proto import broker_pb2 as pb
from harness import CuttableRelay, wait_until

from samples import synthetic_sample

WIDTH = 16


def answered(report) -> int:
    """Items the producer knows the broker has, however it learned it."""
    return report.accepted + report.duplicates + report.accepted_unanswered + len(report.rejected)


def test_the_producer_budget_is_per_outage_so_routine_restarts_never_add_up(start_broker):
    """Budget 2; the connection is cut six times, each time after the
    stream made progress. Every outage takes one reopening, the budget
    starts again after each, and the run completes. (Counted over the
    process, as before, the third cut raised BrokerUnavailable.)"""
    broker = start_broker(1, "--target-grace", "60s")
    relay = CuttableRelay(broker.address)
    budget, outages, per_round = 2, 6, 5
    options = ClientOptions(producer_window_items=4, producer_max_reconnects=budget)
    try:
        with BrokerClient(relay.address, options) as client, BrokerClient(broker.address) as direct:
            producer = client.producer("target-0")
            seq = 0
            for outage in range(outages + 1):
                for _ in range(per_round):
                    producer.send(seq, *synthetic_sample(seq, WIDTH))
                    seq += 1
                wait_until(lambda sent=seq: answered(producer.report) == sent, 60, f"the {seq} items sent so far to be answered")
                if outage < outages:
                    relay.cut()
            report = producer.finish()
            assert report.reconnects >= outages > budget, report
            assert report.accepted_total == seq and report.rejected == []
            assert producer.report_done()["done_targets"] == 1
            producer.close()
            status = direct.status()
            assert status["targets"][0]["accepted_items"] == seq and status["targets"][0]["state"] == "TARGET_STATE_DONE"
    finally:
        relay.close()


def test_a_reconnect_whose_welcome_changes_the_capture_raises_before_resending(start_broker, tmp_path):
    """The run's capture comes with every welcome: a broker restarted on its
    state dir with another --target-capture is noticed at the reconnect, and
    the producer raises, naming both, before it re-sends an item made for
    the old one."""
    state = tmp_path / "state"
    first = start_broker(1, "--state-dir", str(state), "--target-grace", "60s")
    relay = CuttableRelay(first.address)
    try:
        with BrokerClient(relay.address, ClientOptions(producer_window_items=2)) as client:
            producer = client.producer("target-0", hidden_width=WIDTH)
            assert producer.capture == ()
            producer.send(0, *synthetic_sample(0, WIDTH))
            wait_until(lambda: answered(producer.report) == 1, 30, "the first item to be answered")
            first.stop()
            # A broker refuses a restart on a state dir that records another
            # capture; one written by an older broker (no record, as here)
            # starts, and the producer must notice.
            (state / "target-capture").unlink()
            second = start_broker(1, "--state-dir", str(state), "--target-capture", "last-hidden-states")
            relay.retarget(second.address)
            relay.cut()
            expected = r"first welcome asked for \[\], the welcome after a reconnect for \['last_hidden_states'\]"
            with pytest.raises(ProtocolError, match=expected):
                for seq in range(1, 100):
                    producer.send(seq, *synthetic_sample(seq, WIDTH))
                producer.finish()
            with pytest.raises(ProtocolError, match=expected):
                producer.send(100, *synthetic_sample(100, WIDTH))
            producer.close()
        with BrokerClient(second.address) as direct:
            assert direct.status()["accepted_items"] == 1, "nothing was re-sent"
    finally:
        relay.close()


def test_one_outage_that_never_ends_still_spends_the_budget(start_broker):
    broker = start_broker(1, "--target-grace", "60s")
    relay = CuttableRelay(broker.address)
    budget = 2
    try:
        with BrokerClient(relay.address, ClientOptions(producer_window_items=2, producer_max_reconnects=budget)) as client:
            producer = client.producer("target-0")
            producer.send(0, *synthetic_sample(0, WIDTH))
            wait_until(lambda: answered(producer.report) == 1, 30, "the first item to be answered")
            broker.stop()  # the relay now closes every connection it takes
            relay.cut()
            with pytest.raises(BrokerUnavailable, match=f"{budget} attempts to reopen it in a row made no progress"):
                for seq in range(1, 1000):
                    producer.send(seq, *synthetic_sample(seq, WIDTH))
                producer.finish()
            assert producer.report.reconnects == budget
            producer.close()
    finally:
        relay.close()


class FlappingBroker:
    """Welcomes every Produce stream (accepted_items never grows) and breaks
    it with UNAVAILABLE at its first item, unanswered: a broker that comes
    back and falls over again. A welcome alone is not progress."""

    def __init__(self):
        self.hellos = 0

    async def produce(self, requests, context):
        await requests.__anext__()
        self.hellos += 1
        yield pb.ProduceResponse(welcome=pb.ProducerWelcome(accepted_items=0, run_id="run-A"))
        async for request in requests:
            if request.WhichOneof("kind") == "item":
                await context.abort(grpc.StatusCode.UNAVAILABLE, "broker shutting down")

    async def serve(self):
        server = grpc.aio.server()
        handler = grpc.stream_stream_rpc_method_handler(self.produce, pb.ProduceRequest.FromString, pb.ProduceResponse.SerializeToString)
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("dflash.v1.Broker", {"Produce": handler})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, f"127.0.0.1:{port}"


def test_a_broker_that_welcomes_and_breaks_again_ends_the_producer_after_the_budget():
    budget = 3

    async def scenario():
        broker = FlappingBroker()
        server, address = await broker.serve()
        try:
            async with AsyncBrokerClient(address, ClientOptions(producer_window_items=1, producer_max_reconnects=budget)) as client:
                async with client.producer("target-0") as producer:
                    with pytest.raises(BrokerUnavailable) as raised:
                        for seq in range(100):
                            await producer.send(seq, *synthetic_sample(seq, 8))
                        await producer.finish()
                    return broker.hellos, producer.report, raised.value
        finally:
            await server.stop(None)

    hellos, report, error = asyncio.run(scenario())
    assert (hellos, report.reconnects) == (1 + budget, budget), "the first stream, then the budget's reopenings, each welcomed"
    assert f"producer_max_reconnects {budget}" in str(error)


# --------------------------------------------------------------- acks


def test_an_ack_after_the_consumer_stream_broke_is_reported_and_its_item_comes_again(start_broker):
    """The consumer holds two deliveries when its connection is cut; its
    writer finds out at the next write. Acking them then sends nothing (the
    broker takes those leases back): `ack` says 0 and `unsent_acks` names
    them, where before it said 2 and they went nowhere. The stream reopens,
    the two items come again, and the run completes with every item acked."""
    broker = start_broker(1)
    relay = CuttableRelay(broker.address)
    items = 6
    try:
        with BrokerClient(broker.address) as direct, BrokerClient(relay.address, ClientOptions(consumer_reconnect_timeout_s=30)) as client:
            producer = direct.producer("target-0")
            for seq in range(items):
                producer.send(seq, *synthetic_sample(seq, WIDTH))
            producer.finish()
            producer.report_done()
            producer.close()

            consumer = client.consumer("drafter-0", credit_items=2)
            held = [consumer.receive(timeout_s=30), consumer.receive(timeout_s=30)]
            assert all(delivery is not None for delivery in held)
            relay.cut()
            # Each probe queues stats; once one fails, the writer has stopped.
            wait_until(lambda: not consumer.send_stats(samples_trained=0), 30, "the consumer's writer to find its stream broken")
            assert consumer.ack(held) == 0, "nothing can go out on a broken stream"
            unsent = consumer.unsent_acks
            assert [(entry.kind, entry.target_id, entry.seq, entry.delivery_id) for entry in unsent] == [
                ("ack", "target-0", delivery.seq, delivery.delivery_id) for delivery in held
            ]
            assert all("Consume stream broke" in entry.reason for entry in unsent), unsent

            counts = {}
            for delivery in consumer:
                counts[delivery.seq] = delivery.delivery_count
                assert consumer.ack(delivery) == 1
            assert sorted(counts) == list(range(items))
            assert all(counts[delivery.seq] >= 2 for delivery in held), ("the unacked items came again", counts)
            assert consumer.end_of_stream["status"] == "RUN_STATUS_COMPLETE"
            assert len(consumer.unsent_acks) == len(held), "every later ack went out"
            consumer.close()
            status = direct.status()
            assert (status["acked_items"], status["state"]) == (items, "BROKER_STATE_COMPLETE")
    finally:
        relay.close()


class ScriptedConsumeCall:
    """A Consume call without a network: reads return the scripted
    responses, then wait forever; the first write after the hello hangs
    until `break_stream` is set, then fails as a broken connection does."""

    def __init__(self, responses):
        self.responses = list(responses)
        self.write_started = asyncio.Event()
        self.break_stream = asyncio.Event()

    async def write(self, request):
        if request.WhichOneof("kind") == "hello":
            return
        self.write_started.set()
        await self.break_stream.wait()
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="connection reset")

    async def read(self):
        if self.responses:
            return self.responses.pop(0)
        await asyncio.Event().wait()

    def cancel(self):
        return True


class ScriptedChannel:
    def __init__(self, call):
        self.call = call

    def stream_stream(self, *arguments, **keywords):
        return lambda **call_keywords: self.call

    async def close(self):
        pass


class ScriptedClient(AsyncBrokerClient):
    """The real client, its channel replaced by the scripted call."""

    def __init__(self, call):
        super().__init__("broker:1")
        self.scripted_call = call

    def new_channel(self):
        return ScriptedChannel(self.scripted_call)


def scripted_delivery(delivery_id: int, seq: int) -> pb.ConsumeResponse:
    sample = make_sample(*synthetic_sample(seq, 8))
    return pb.ConsumeResponse(delivery=pb.Delivery(delivery_id=delivery_id, target_id="target-0", seq=seq, delivery_count=1, sample=sample))


def test_acks_queued_when_the_writer_dies_are_reported_not_dropped():
    """Three acks and a nack queue behind a write that then fails: each is
    reported in `unsent_acks` with the reason. Before, the writer returned
    and left them in its queue, unsent and unreported."""

    async def scenario():
        welcome = pb.ConsumeResponse(welcome=pb.ConsumerWelcome(lease_timeout_ms=60000, run_id="run-A"))
        call = ScriptedConsumeCall([welcome] + [scripted_delivery(100 + seq, seq) for seq in range(4)])
        async with ScriptedClient(call) as client:
            consumer = await client.consumer("drafter-0", credit_items=4, extend_leases=False).open()
            deliveries = [await consumer.receive(timeout_s=5) for _ in range(4)]
            assert consumer.ack(deliveries[0]) == 1
            await asyncio.wait_for(call.write_started.wait(), 5)  # the writer is in that write
            assert consumer.ack(deliveries[1:3]) == 2 and consumer.nack(deliveries[3], "bad sample") == 1
            call.break_stream.set()
            for _ in range(500):
                if len(consumer.unsent_acks) == 4:
                    break
                await asyncio.sleep(0.01)
            unsent = consumer.unsent_acks
            after = (consumer.ack(deliveries[0]), consumer.send_stats(steps=1), consumer.extend())
            await consumer.close()
            return deliveries, unsent, after

    deliveries, unsent, after = asyncio.run(scenario())
    assert [(entry.kind, entry.seq, entry.delivery_id) for entry in unsent] == [
        ("ack", 0, 100),
        ("ack", 1, 101),
        ("ack", 2, 102),
        ("nack", 3, 103),
    ]
    assert all(entry.reason == "the Consume stream broke (UNAVAILABLE: connection reset)" for entry in unsent), unsent
    # After the writer died: an ack of an already settled delivery sends
    # nothing, and stats say they were not sent.
    assert after == (0, False, True)
