"""dflash_client: the Python client of the dflash broker.

Layout
- `sync`: `BrokerClient`, `Producer`, `Consumer`, the blocking API (runs the
  asyncio client on a private event-loop thread).
- `aio`: `AsyncBrokerClient` on grpc.aio, the one implementation of the
  protocol: its channels, the opening of a stream, the unary calls (status,
  watch, ReportDone) and the retry policy (`RETRYABLE_CODES`, backoff); it
  also exports the names of the next three modules.
- `producer`: `AsyncProducer`, `ProduceReport` (hello/welcome, the window
  of unanswered items, resume, the per-outage reconnect budget, the
  run-id/epoch fencing fields).
- `consumer`: `AsyncConsumer`, `Delivery`, `UnsentAck` (credit, leases and
  their extension, acks and nacks, end-of-stream, reconnects with the
  last run id).
- `options`: `ClientOptions`, the transport and security settings.
- `tensors`: sample validation and encoding (the rules of
  proto/src/tensor.rs), zero-copy numpy/torch views of deliveries.
- `records`: broker messages as dicts (status snapshots, run summaries).
- `security`: TLS, mutual TLS and the bearer token (the Rust roles' flags
  in keyword form: `tls_ca`, `tls_cert`, `tls_key`, `tls_domain`,
  `token_file`, and DFLASH_TOKEN).
- `errors`: the exceptions.
- `_proto`: stubs generated from proto/dflash/v1/broker.proto by
  tools/generate_proto.py (checked current by the tests).

Depends on grpcio, protobuf and numpy; torch only when torch tensors are
given or asked for. No model code.
"""

from .aio import AsyncBrokerClient, AsyncConsumer, AsyncProducer, ClientOptions, Delivery, ProduceReport, UnsentAck
from .errors import (
    BrokerCallError,
    BrokerError,
    BrokerUnavailable,
    InvalidSample,
    ProtocolError,
    RunAborted,
    SecurityError,
    StreamClosed,
)
from .security import add_security_arguments, security_options
from .sync import BrokerClient, Consumer, Producer
from .tensors import (
    HIDDEN_STATES,
    INPUT_IDS,
    LOSS_MASK,
    WireTensor,
    bf16_bits_to_float32,
    float32_to_bf16_bytes,
    make_sample,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncBrokerClient",
    "AsyncConsumer",
    "AsyncProducer",
    "BrokerCallError",
    "BrokerClient",
    "BrokerError",
    "BrokerUnavailable",
    "ClientOptions",
    "Consumer",
    "Delivery",
    "HIDDEN_STATES",
    "INPUT_IDS",
    "InvalidSample",
    "LOSS_MASK",
    "ProduceReport",
    "Producer",
    "ProtocolError",
    "RunAborted",
    "SecurityError",
    "StreamClosed",
    "UnsentAck",
    "WireTensor",
    "add_security_arguments",
    "bf16_bits_to_float32",
    "float32_to_bf16_bytes",
    "make_sample",
    "security_options",
]
