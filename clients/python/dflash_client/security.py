"""Transport security of a connection to the broker, as the Rust client does
it (crates/client/src/security.rs): TLS with the CA that signed the broker's
certificate, a client certificate and key for mutual TLS, and the bearer
token sent on every call as `authorization: Bearer <token>`.

The options are the Rust roles' flags in keyword form, fields of
`ClientOptions`:

    --tls-ca      tls_ca      DFLASH_TLS_CA
    --tls-cert    tls_cert    DFLASH_TLS_CERT
    --tls-key     tls_key     DFLASH_TLS_KEY
    --tls-domain  tls_domain  DFLASH_TLS_DOMAIN
    --token-file  token_file  DFLASH_TOKEN_FILE

`ClientOptions.from_environment()` reads those environment variables and
`add_security_arguments(parser)` adds those flags to an argparse parser, as
the Rust roles take them. The token itself may come from the `DFLASH_TOKEN`
environment variable instead of a file, read whenever a client is made, as
every Rust role does (both set is an error: which one wins would be a
guess). The files are read when the client is made, so a bad path fails
there, naming the option and the file; the token never appears in a repr,
a log line or an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import grpc

from .errors import SecurityError

#: The environment variable that may hold the token itself.
TOKEN_ENV = "DFLASH_TOKEN"

PathLike = Union[str, "os.PathLike[str]"]

#: Each option: its flag and environment variable, as the Rust roles name them.
SECURITY_OPTIONS: Tuple[Tuple[str, str, str], ...] = (
    ("tls_ca", "--tls-ca", "DFLASH_TLS_CA"),
    ("tls_cert", "--tls-cert", "DFLASH_TLS_CERT"),
    ("tls_key", "--tls-key", "DFLASH_TLS_KEY"),
    ("tls_domain", "--tls-domain", "DFLASH_TLS_DOMAIN"),
    ("token_file", "--token-file", "DFLASH_TOKEN_FILE"),
)

_HELP = {
    "tls_ca": "PEM CA bundle that signed the broker's certificate; enables TLS (with an https:// "
    "broker address and no --tls-ca the system's roots are used)",
    "tls_cert": "PEM client certificate for mutual TLS (with --tls-key)",
    "tls_key": "PEM private key of --tls-cert",
    "tls_domain": "name to verify the broker's certificate against, when it is not the host of the broker address",
    "token_file": f"file holding the broker's bearer token (the {TOKEN_ENV} environment variable may hold the token instead)",
}


class Token:
    """A bearer token: printable ASCII without spaces (it travels as an HTTP
    header value), surrounding whitespace removed. Its repr shows its
    length only."""

    __slots__ = ("_value", "origin")

    def __init__(self, text: str, origin: str):
        value = text.strip()
        if not value:
            raise SecurityError(f"{origin} holds an empty token")
        if not all(0x21 <= ord(character) <= 0x7E for character in value):
            raise SecurityError(f"{origin}: the token must be printable ASCII without spaces")
        self._value = value
        #: Where the token came from (`token_file /path` or DFLASH_TOKEN).
        self.origin = origin

    def header(self) -> Tuple[str, str]:
        """The metadata entry every call carries."""
        return ("authorization", f"Bearer {self._value}")

    def __repr__(self) -> str:
        return f"Token(<redacted, {len(self._value)} bytes, from {self.origin}>)"

    __str__ = __repr__


def load_token(token_file: Optional[PathLike], environ: Optional[Mapping[str, str]] = None) -> Optional[Token]:
    """The token from `token_file`, else from DFLASH_TOKEN; None when neither
    is set (the rules of `dflash_proto::credentials::load_token`)."""
    environ = os.environ if environ is None else environ
    from_environment = environ.get(TOKEN_ENV) or None
    if token_file is not None and from_environment is not None:
        raise SecurityError(f"the token is given twice (token_file {os.fspath(token_file)} and {TOKEN_ENV}): keep one")
    if token_file is not None:
        path = os.fspath(token_file)
        try:
            with open(path, encoding="utf-8") as file:
                text = file.read()
        except (OSError, UnicodeDecodeError) as error:
            raise SecurityError(f"token_file {path}: {_describe_os_error(error)}") from None
        return Token(text, f"token_file {path}")
    if from_environment is not None:
        return Token(from_environment, TOKEN_ENV)
    return None


def read_pem(option: str, path: PathLike) -> bytes:
    """The PEM file named by `option`; an error naming both when it cannot
    be read or holds no PEM block (grpc would only fail at the handshake,
    with a message that names neither)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as error:
        raise SecurityError(f"{option} {path}: {_describe_os_error(error)}") from None
    if b"-----BEGIN " not in data:
        raise SecurityError(f"{option} {path}: no PEM block (-----BEGIN ...) in {len(data)} bytes")
    return data


def _describe_os_error(error: BaseException) -> str:
    return getattr(error, "strerror", None) or str(error)


@dataclasses.dataclass(frozen=True)
class Transport:
    """What a channel to the broker applies, resolved from the options: TLS
    or plaintext, and the token. Made once per client (the files are read
    then)."""

    #: host:port, without a scheme.
    target: str
    #: TLS credentials, or None for a plaintext channel.
    credentials: Optional[grpc.ChannelCredentials]
    #: Extra channel arguments (the name the certificate is checked against).
    channel_arguments: Tuple[Tuple[str, Any], ...]
    #: The metadata of every call: the token, when there is one (left out
    #: of the repr).
    metadata: Tuple[Tuple[str, str], ...] = dataclasses.field(repr=False)
    #: For error messages: `TLS (CA ca.pem, client certificate c.pem)` or
    #: `plaintext`, and where the token came from.
    description: str = ""

    def new_channel(self, options: Any) -> "grpc.aio.Channel":
        import grpc.aio

        arguments = list(options) + list(self.channel_arguments)
        if self.credentials is None:
            return grpc.aio.insecure_channel(self.target, options=arguments)
        return grpc.aio.secure_channel(self.target, self.credentials, options=arguments)


def split_address(address: str) -> Tuple[str, Optional[str]]:
    """(`host:port`, scheme or None) of `http://host:port`,
    `https://host:port`, `grpc://host:port` or `host:port`."""
    scheme = None
    for prefix in ("http://", "https://", "grpc://"):
        if address.startswith(prefix):
            scheme = prefix[:-3]
            address = address[len(prefix) :]
            break
    address = address.rstrip("/")
    if not address or "://" in address or "/" in address:
        raise ValueError(f"invalid broker address {address!r}: expected host:port, http://host:port or https://host:port")
    return address, scheme


def resolve_transport(
    address: str,
    tls_ca: Optional[PathLike] = None,
    tls_cert: Optional[PathLike] = None,
    tls_key: Optional[PathLike] = None,
    tls_domain: Optional[str] = None,
    token_file: Optional[PathLike] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> Transport:
    """Reads the files and the token and decides TLS the way the Rust client
    does: any TLS option or an https:// address means TLS (the system's
    roots without `tls_ca`); a TLS option with an http:// address is an
    error rather than a silent plaintext connection."""
    target, scheme = split_address(address)
    if (tls_cert is None) != (tls_key is None):
        raise SecurityError("tls_cert and tls_key go together")
    tls_configured = tls_ca is not None or tls_cert is not None or tls_domain is not None
    if tls_configured and scheme in ("http", "grpc"):
        raise SecurityError(f"TLS is configured but the broker address {address!r} is not https://")
    token = load_token(token_file, environ)
    metadata = (token.header(),) if token is not None else ()
    token_part = f", token from {token.origin}" if token is not None else ", no token"
    if not tls_configured and scheme != "https":
        return Transport(target, None, (), metadata, f"plaintext{token_part}")
    root_certificates = read_pem("tls_ca", tls_ca) if tls_ca is not None else None
    private_key = certificate_chain = None
    if tls_cert is not None and tls_key is not None:
        certificate_chain = read_pem("tls_cert", tls_cert)
        private_key = read_pem("tls_key", tls_key)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=root_certificates,
        private_key=private_key,
        certificate_chain=certificate_chain,
    )
    channel_arguments: Tuple[Tuple[str, Any], ...] = ()
    if tls_domain is not None:
        channel_arguments = (("grpc.ssl_target_name_override", tls_domain),)
    parts = [f"CA {os.fspath(tls_ca)}" if tls_ca is not None else "the system's CA roots"]
    if tls_cert is not None:
        parts.append(f"client certificate {os.fspath(tls_cert)}")
    if tls_domain is not None:
        parts.append(f"checked as {tls_domain}")
    return Transport(target, credentials, channel_arguments, metadata, f"TLS ({', '.join(parts)}){token_part}")


def environment_options(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The security options set in the environment (DFLASH_TLS_CA, ...), by
    keyword."""
    environ = os.environ if environ is None else environ
    return {keyword: environ[variable] for keyword, _, variable in SECURITY_OPTIONS if environ.get(variable)}


def add_security_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds --tls-ca, --tls-cert, --tls-key, --tls-domain and --token-file,
    each defaulting to its environment variable, as the Rust roles take
    them. `security_options(arguments)` picks them out of the parsed
    arguments for `ClientOptions(**...)`."""
    group = parser.add_argument_group("broker security (as the Rust roles take it)")
    for keyword, flag, variable in SECURITY_OPTIONS:
        group.add_argument(flag, dest=keyword, default=os.environ.get(variable) or None, help=f"{_HELP[keyword]} [env {variable}]")
    return parser


def security_options(arguments: argparse.Namespace) -> Dict[str, Any]:
    """The security options of arguments parsed with
    `add_security_arguments`, by keyword (those not given left out)."""
    return {keyword: getattr(arguments, keyword) for keyword, _, _ in SECURITY_OPTIONS if getattr(arguments, keyword, None) is not None}
