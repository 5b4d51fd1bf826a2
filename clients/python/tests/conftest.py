import pathlib

import pytest

from harness import Broker


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
