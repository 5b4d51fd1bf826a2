"""The Python client retries after the same gRPC statuses as the Rust client
(`RETRYABLE_CODES` in crates/client/src/error.rs; the Rust side has the mirror
of this test)."""

import re

from dflash_client.aio import RETRYABLE_CODES
from harness import PACKAGE_ROOT


def rust_retryable_codes():
    source = (PACKAGE_ROOT.parent.parent / "crates" / "client" / "src" / "error.rs").read_text()
    block = re.search(r"pub const RETRYABLE_CODES: \[tonic::Code; \d+\] = \[(.*?)\];", source, re.S)
    assert block, "RETRYABLE_CODES not found in the Rust client"
    names = re.findall(r"tonic::Code::(\w+)", block.group(1))
    # DeadlineExceeded -> DEADLINE_EXCEEDED, as grpc's Python names it.
    return {re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper() for name in names}


def test_the_rust_client_retries_the_same_statuses():
    rust = rust_retryable_codes()
    assert "ALREADY_EXISTS" in rust and "UNAVAILABLE" in rust, rust
    assert {code.name for code in RETRYABLE_CODES} == rust
