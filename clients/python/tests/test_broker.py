"""The Python client against the real broker binary: exactly-once
accounting by (target, seq), end-of-stream, a SIGKILLed consumer's leases,
bad input, stream replacement, non-retryable statuses, and reconnecting
through a cut connection."""

from __future__ import annotations

import asyncio
import collections
import threading
import time

import grpc
import numpy as np
import pytest

from dflash_client import (
    AsyncBrokerClient,
    BrokerCallError,
    BrokerClient,
    ClientOptions,
    InvalidSample,
    StreamClosed,
)
from harness import CuttableRelay, consume_until_end, python_process, wait_until

from samples import synthetic_sample

WIDTH = 16


def check_delivery_matches_what_was_sent(delivery) -> None:
    """The consumer recomputes the sample from its seq: bytes must be equal."""
    input_ids, loss_mask, hidden = synthetic_sample(delivery.seq, WIDTH)
    np.testing.assert_array_equal(delivery.numpy("input_ids"), input_ids)
    np.testing.assert_array_equal(delivery.numpy("loss_mask"), loss_mask)
    assert delivery.tensor("hidden_states").data == hidden
    assert delivery.tensor("hidden_states").shape == (len(input_ids), WIDTH)


def consume_all(client: BrokerClient, drafter_id: str, credit: int, record: dict, ready: threading.Event) -> None:
    with client.consumer(drafter_id, credit_items=credit) as consumer:
        ready.set()
        for delivery in consumer:
            check_delivery_matches_what_was_sent(delivery)
            record["delivered"].append((delivery.target_id, delivery.seq, delivery.delivery_count))
            assert consumer.ack(delivery) == 1
        record["end"] = consumer.end_of_stream


def test_one_producer_two_consumers_every_item_acked_once_and_complete(start_broker):
    broker = start_broker(1)
    items = 60
    with BrokerClient(broker.address) as client:
        records = {name: {"delivered": [], "end": None} for name in ("drafter-a", "drafter-b")}
        threads = []
        for name, record in records.items():
            ready = threading.Event()
            thread = threading.Thread(target=consume_all, args=(client, name, 3, record, ready))
            thread.start()
            assert ready.wait(30), f"{name} did not connect"
            threads.append(thread)

        producer = client.producer("target-0", hidden_width=WIDTH)
        assert producer.resume_after_seq is None and producer.welcome["accepted_items"] == 0
        for seq in range(items):
            producer.send(seq, *synthetic_sample(seq, WIDTH), trace_context={"traceparent": f"00-{seq:032x}-{seq:016x}-01"})
        report = producer.finish()
        assert (report.accepted, report.duplicates, report.rejected, report.accepted_total) == (items, 0, [], items)
        done = producer.report_done()
        assert done["done_targets"] == 1 and done["expected_targets"] == 1 and not done["already_done"]
        producer.close()

        for thread in threads:
            thread.join(60)
            assert not thread.is_alive()
        delivered = [entry for record in records.values() for entry in record["delivered"]]
        keys = collections.Counter((target, seq) for target, seq, _ in delivered)
        assert keys == collections.Counter(("target-0", seq) for seq in range(items)), "every (target, seq) exactly once"
        assert all(count == 1 for _, _, count in delivered)
        assert all(record["delivered"] for record in records.values()), "both consumers got work"
        for record in records.values():
            end = record["end"]
            assert end["status"] == "RUN_STATUS_COMPLETE", end
            summary = end["summary"]
            assert (summary["accepted_items"], summary["acked_items"], summary["dead_letters"]) == (items, items, 0)
            assert (summary["done_targets"], summary["expected_targets"], summary["failed_targets"]) == (1, 1, [])

        status = client.status()
        assert status["state"] == "BROKER_STATE_COMPLETE"
        assert (status["accepted_items"], status["acked_items"], status["redelivered_items"]) == (items, items, 0)
        assert status["targets"][0]["state"] == "TARGET_STATE_DONE"
        assert status["targets"][0]["highest_seq"] == items - 1


def test_asyncio_flavour_end_to_end(start_broker):
    broker = start_broker(2)
    items_per_target = 20

    async def scenario():
        async with AsyncBrokerClient(broker.address) as client:
            delivered = []

            async def drafter(name):
                async with client.consumer(name, credit_items=2) as consumer:
                    async for delivery in consumer:
                        check_delivery_matches_what_was_sent(delivery)
                        delivered.append((delivery.target_id, delivery.seq))
                        await asyncio.sleep(0)  # a "training step"
                        consumer.ack(delivery)
                    return consumer.end_of_stream

            async def target(name):
                async with client.producer(name) as producer:
                    for seq in range(items_per_target):
                        await producer.send(seq, *synthetic_sample(seq, WIDTH))
                    await producer.send_stats(samples_done=items_per_target, samples_total=items_per_target, device="cpu")
                    report = await producer.finish()
                    await producer.report_done()
                    return report

            drafters = [asyncio.ensure_future(drafter(f"drafter-{i}")) for i in range(2)]
            reports = await asyncio.gather(target("target-0"), target("target-1"))
            ends = await asyncio.gather(*drafters)
            watched = None
            async for snapshot in client.watch(0.05):
                watched = snapshot
                break
            return delivered, reports, ends, watched

    delivered, reports, ends, snapshot = asyncio.run(scenario())
    expected = collections.Counter((f"target-{t}", seq) for t in range(2) for seq in range(items_per_target))
    assert collections.Counter(delivered) == expected
    assert [report.accepted for report in reports] == [items_per_target] * 2
    for end in ends:
        assert end["status"] == "RUN_STATUS_COMPLETE"
        assert end["summary"]["acked_items"] == 2 * items_per_target
        # Both targets announced their shard sizes: the broker adds them up.
        assert end["summary"]["expected_items"] == 2 * items_per_target
    assert snapshot["state"] == "BROKER_STATE_COMPLETE" and snapshot["acked_items"] == 2 * items_per_target


CHILD_CONSUMER = """
import json, sys
from dflash_client import BrokerClient
client = BrokerClient(sys.argv[1])
consumer = client.consumer("doomed-drafter", credit_items=int(sys.argv[2]))
for delivery in consumer:
    # Holds every delivery and never acks: the test SIGKILLs this process.
    print(json.dumps({"seq": delivery.seq, "delivery_id": delivery.delivery_id}), flush=True)
"""


def test_sigkilled_consumer_has_its_leases_redelivered(start_broker, tmp_path):
    broker = start_broker(1)
    items, held = 12, 5
    with BrokerClient(broker.address) as client:
        producer = client.producer("target-0")
        for seq in range(items):
            producer.send(seq, *synthetic_sample(seq, WIDTH))
        producer.finish()
        producer.report_done()
        producer.close()

        script = tmp_path / "child_consumer.py"
        script.write_text(CHILD_CONSUMER)
        child = python_process("child-consumer", [script, broker.address, str(held)], tmp_path)
        from harness import json_lines

        leased = wait_until(lambda: (lambda r: r if len(r) == held else None)(json_lines(child.log())), 60, "the child to hold its credit",
                            children=[child, broker.process])
        status = client.status()
        doomed = [drafter for drafter in status["drafters"] if drafter["drafter_id"] == "doomed-drafter"][0]
        assert doomed["leased_items"] == held and status["state"] == "BROKER_STATE_DRAINING"
        child.kill()
        child.stop()

        redelivered, first_time = [], []
        with client.consumer("survivor", credit_items=4) as consumer:
            for delivery in consume_until_end(consumer, [broker.process], 120, "the killed consumer's leases and end-of-stream"):
                (redelivered if delivery.delivery_count > 1 else first_time).append(delivery.seq)
                consumer.ack(delivery)
            end = consumer.end_of_stream
        held_seqs = sorted(record["seq"] for record in leased)
        assert sorted(redelivered) == held_seqs, "exactly the killed consumer's leases come back, as redeliveries"
        assert sorted(first_time + redelivered) == list(range(items))
        assert end["status"] == "RUN_STATUS_COMPLETE" and end["summary"]["acked_items"] == items
        assert client.status()["redelivered_items"] == held


def test_bad_inputs_are_rejected_before_anything_is_sent(start_broker):
    broker = start_broker(1)
    with BrokerClient(broker.address) as client:
        producer = client.producer("target-0", hidden_width=WIDTH)
        ids, mask, hidden = synthetic_sample(0, WIDTH)
        with pytest.raises(InvalidSample, match="'hidden_states': numpy array float32"):
            producer.send(0, ids, mask, np.zeros((len(ids), WIDTH), np.float32))
        with pytest.raises(InvalidSample, match="'loss_mask': value 7 is not 0 or 1"):
            producer.send(0, ids, np.full(len(ids), 7), hidden)
        with pytest.raises(InvalidSample, match="seq -1 is not an integer"):
            producer.send(-1, ids, mask, hidden)
        with pytest.raises(InvalidSample, match="trace_context entry"):
            producer.send(0, ids, mask, hidden, trace_context={"traceparent": 5})
        with pytest.raises(InvalidSample, match=f"width {WIDTH + 1}, expected {WIDTH}"):
            producer.send(0, *synthetic_sample(0, WIDTH + 1))
        status = client.status()
        assert (status["accepted_items"], status["rejected_items"]) == (0, 0), "nothing reached the broker"
        # The stream is intact: good items still go through.
        producer.send(0, ids, mask, hidden)
        producer.send(1, *synthetic_sample(1, WIDTH))
        with pytest.raises(InvalidSample, match="seq 1 does not increase"):
            producer.send(1, *synthetic_sample(1, WIDTH))
        assert producer.finish().accepted == 2
        assert client.status()["accepted_items"] == 2


def test_the_welcome_says_what_the_run_captures_and_send_holds_to_it(start_broker):
    """The broker's --target-capture reaches the producer in its welcome; in
    such a run an item without the tensor is refused before it is sent."""
    broker = start_broker(1, "--target-capture", "last-hidden-states")
    with BrokerClient(broker.address) as client:
        producer = client.producer("target-0", hidden_width=WIDTH)
        assert producer.capture == ("last_hidden_states",) and producer.capture_last_hidden_states
        assert producer.welcome["capture"] == ["CAPTURED_TENSOR_LAST_HIDDEN_STATES"]
        ids, mask, hidden = synthetic_sample(0, WIDTH)
        with pytest.raises(InvalidSample, match="--target-capture last-hidden-states"):
            producer.send(0, ids, mask, hidden)
        assert client.status()["accepted_items"] == 0, "nothing reached the broker"
        producer.send(0, ids, mask, hidden, last_hidden_states=bytes(len(ids) * 8 * 2))
        assert producer.finish().accepted == 1
        producer.close()

    plain = start_broker(1)
    with BrokerClient(plain.address) as client:
        producer = client.producer("target-0", hidden_width=WIDTH)
        assert producer.capture == () and not producer.capture_last_hidden_states
        assert producer.welcome["capture"] == []
        producer.send(0, ids, mask, hidden)
        assert producer.finish().accepted == 1
        producer.close()


def test_wrong_total_is_failed_precondition_raised_at_once(start_broker):
    broker = start_broker(1)
    with BrokerClient(broker.address) as client:
        producer = client.producer("target-0")
        producer.send(0, *synthetic_sample(0, WIDTH))
        producer.finish()
        with pytest.raises(BrokerCallError) as raised:
            producer.report_done(total_items=5)
        assert raised.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "ReportDone" in str(raised.value)
        status = client.status()
        assert status["done_targets"] == 0 and status["targets"][0]["state"] != "TARGET_STATE_DONE"
        assert producer.report_done()["done_targets"] == 1


def test_a_newer_stream_replaces_the_old_one_which_fails_loudly(start_broker):
    broker = start_broker(1)
    with BrokerClient(broker.address) as client:
        first = client.producer("target-0")
        for seq in range(5):
            first.send(seq, *synthetic_sample(seq, WIDTH))
        wait_until(lambda: client.status()["accepted_items"] == 5, 30, "5 accepted items")
        second = client.producer("target-0")
        assert second.resume_after_seq == 4 and second.welcome["accepted_items"] == 5
        assert second.epoch >= first.epoch  # a broker with fencing raises it (#9)
        with pytest.raises(StreamClosed):
            # The closed message may arrive while the first sends go out.
            for seq in range(5, 1000):
                first.send(seq, *synthetic_sample(seq, WIDTH))
        for seq in range(5, 8):
            second.send(seq, *synthetic_sample(seq, WIDTH))
        assert second.finish().accepted_total == 8
        assert second.report_done()["done_targets"] == 1


def test_streams_reconnect_and_resume_when_the_connection_is_cut(start_broker):
    """Every connection through the relay is cut twice mid-run: the producer
    reopens with the run id of its welcome, re-sends what the broker did not
    answer, the consumer says hello again and gets its returned leases. By
    (target, seq): every item is acked, exactly as many as were sent."""
    broker = start_broker(1, "--target-grace", "60s")
    relay = CuttableRelay(broker.address)
    items = 80
    options = ClientOptions(producer_window_items=8, consumer_reconnect_timeout_s=30)
    seen = collections.Counter()
    acked = set()
    end = {}
    with BrokerClient(relay.address, options) as client, BrokerClient(broker.address) as direct:
        consumer = client.consumer("drafter-0", credit_items=4)
        run_id = consumer.run_id

        def drain():
            for delivery in consumer:
                check_delivery_matches_what_was_sent(delivery)
                seen[delivery.seq] += 1
                if consumer.ack(delivery):
                    acked.add(delivery.seq)
            if consumer.end_of_stream:
                end.update(consumer.end_of_stream)

        thread = threading.Thread(target=drain, daemon=True)
        thread.start()
        try:
            producer = client.producer("target-0")
            for seq in range(items):
                producer.send(seq, *synthetic_sample(seq, WIDTH))
                if seq in (25, 55):
                    wait_until(lambda sent=seq: direct.status()["accepted_items"] >= sent - 8, 30, "the broker to catch up")
                    relay.cut()
            report = producer.finish()
            assert report.reconnects >= 1, report
            assert report.accepted_total == items
            producer.report_done()
            thread.join(120)
            assert not thread.is_alive()
        finally:
            consumer.close()
            relay.close()
        assert consumer.reconnects >= 1 and consumer.run_id == run_id
        assert sorted(seen) == list(range(items)), "every seq delivered"
        assert end["status"] == "RUN_STATUS_COMPLETE"
        assert end["summary"]["accepted_items"] == items and end["summary"]["acked_items"] == items
        status = direct.status()
        assert status["targets"][0]["accepted_items"] == items and status["acked_items"] == items


def test_held_deliveries_keep_their_leases_through_a_long_step(start_broker):
    """Lease timeout 600 ms; a "training step" holds one delivery for four
    lease timeouts. The consumer's automatic extension keeps the lease: no
    expiry, no redelivery. Without it (the control), the broker takes the
    lease back."""
    lease_timeout_s = 0.6

    def drafter_status(client, name):
        return [drafter for drafter in client.status()["drafters"] if drafter["drafter_id"] == name][0]

    for extend in (True, False):
        broker = start_broker(1, "--lease-timeout", "600ms")
        with BrokerClient(broker.address) as client:
            producer = client.producer("target-0")
            producer.send(0, *synthetic_sample(0, WIDTH))
            producer.finish()
            producer.report_done()
            name = f"drafter-extend-{extend}"
            consumer = client.consumer(name, credit_items=1, extend_leases=extend)
            delivery = consumer.receive(timeout_s=30)
            assert delivery is not None and delivery.delivery_count == 1
            assert consumer.welcome["lease_timeout_ms"] == 600
            if extend:
                step_ends = time.monotonic() + 4 * lease_timeout_s
                while time.monotonic() < step_ends:  # the step; the broker is watched meanwhile
                    status = drafter_status(client, name)
                    assert status["expired_leases"] == 0 and status["leased_items"] == 1, status
                    time.sleep(0.05)
                assert consumer.ack(delivery) == 1
                assert consumer.receive(timeout_s=30) is None
                assert consumer.end_of_stream["status"] == "RUN_STATUS_COMPLETE"
                assert client.status()["redelivered_items"] == 0
            else:
                wait_until(lambda drafter=name: drafter_status(client, drafter)["expired_leases"] == 1, 30, "the unextended lease to expire")
            consumer.close()
        broker.stop()
