"""`ClientOptions`: the transport settings of a client (message size,
keepalive, the producer's window and reconnect budget, the consumer's
reconnect timeout, the unary call timeout) and its security settings, the
Rust roles' flags in keyword form (see `security`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Mapping, Optional, Tuple

from .security import PathLike, Transport, environment_options, resolve_transport, split_address


@dataclasses.dataclass
class ClientOptions:
    """Transport settings; the defaults suit hidden-state payloads of up to
    256 MiB, like the Rust client's. The security fields are the Rust
    roles' flags in keyword form (`--tls-ca` is `tls_ca`; see `security`);
    none set and an http:// or host:port address: plaintext, no token
    unless DFLASH_TOKEN is set."""

    max_message_bytes: int = (256 << 20) + (1 << 20)
    keepalive_interval_s: float = 10.0
    keepalive_timeout_s: float = 20.0
    #: Items a producer may have sent and not yet had answered.
    producer_window_items: int = 16
    #: Attempts to reopen a broken Produce stream in one outage before
    #: giving up; the count starts again once the stream makes progress.
    producer_max_reconnects: int = 10
    #: How long a consumer keeps reconnecting to a broker that went away.
    consumer_reconnect_timeout_s: float = 60.0
    #: Timeout of unary calls (status, ReportDone).
    call_timeout_s: float = 30.0
    #: PEM CA bundle that signed the broker's certificate; enables TLS (an
    #: https:// address without it uses the system's roots).
    tls_ca: Optional[PathLike] = None
    #: PEM client certificate for mutual TLS (with `tls_key`).
    tls_cert: Optional[PathLike] = None
    #: PEM private key of `tls_cert`.
    tls_key: Optional[PathLike] = None
    #: Name to verify the broker's certificate against, when it is not the
    #: host of the broker address.
    tls_domain: Optional[str] = None
    #: File holding the bearer token; the DFLASH_TOKEN environment variable
    #: may hold the token instead (not both).
    token_file: Optional[PathLike] = None

    @classmethod
    def from_environment(cls, environ: Optional[Mapping[str, str]] = None, **fields: Any) -> "ClientOptions":
        """Options with the security settings of the environment
        (DFLASH_TLS_CA, DFLASH_TLS_CERT, DFLASH_TLS_KEY, DFLASH_TLS_DOMAIN,
        DFLASH_TOKEN_FILE, as the Rust roles read them); `fields` win."""
        return cls(**{**environment_options(environ), **fields})

    def transport(self, address: str, environ: Optional[Mapping[str, str]] = None) -> Transport:
        """Reads the security files and the token for `address` (raises
        SecurityError naming the option and file)."""
        return resolve_transport(
            address,
            tls_ca=self.tls_ca,
            tls_cert=self.tls_cert,
            tls_key=self.tls_key,
            tls_domain=self.tls_domain,
            token_file=self.token_file,
            environ=environ,
        )

    def channel_arguments(self) -> List[Tuple[str, Any]]:
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", int(self.keepalive_interval_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            # Each stream gets its own connection (as in the Rust client), so
            # one large stream never shares a flow-control window with another.
            ("grpc.use_local_subchannel_pool", 1),
        ]


def normalize_address(address: str) -> str:
    """`host:port` of `http://host:port`, `https://host:port` (as the Rust
    tools take them) or `host:port`."""
    return split_address(address)[0]
