import os
import pathlib
import signal

import pytest

import harness
from harness import Broker

# The per-test hang guard: a test that runs longer than this fails, naming
# every child process it started with its last log lines (a test waiting on
# a child that is stuck or gone would otherwise wait for the broker's own
# timeouts, up to 30 minutes). Each wait in the tests has its own, shorter
# guard; this one catches a wait that has none.
TEST_TIMEOUT_S = int(os.environ.get("DFLASH_PYTHON_TEST_TIMEOUT_S", "600"))


@pytest.fixture(autouse=True)
def hang_guard():
    first = len(harness.STARTED)

    def expired(signum, frame):
        children = "".join(child.state_and_last_lines() for child in harness.STARTED[first:])
        raise AssertionError(f"the test ran past {TEST_TIMEOUT_S}s (DFLASH_PYTHON_TEST_TIMEOUT_S){children or ' and started no child'}")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(TEST_TIMEOUT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def start_broker(tmp_path: pathlib.Path):
    """Starts real brokers (`start_broker(expected_targets, *flags)`); stops
    them after the test."""
    brokers = []

    def start(expected_targets: int, *extra: str) -> Broker:
        log_dir = tmp_path / f"broker-{len(brokers)}"
        log_dir.mkdir()
        broker = Broker(log_dir, expected_targets, *extra)
        brokers.append(broker)
        return broker

    yield start
    for broker in brokers:
        broker.stop()
