"""TLS, mutual TLS and the bearer token against the real broker binary, with
certificates made by openssl in the test (harness.Certificates): a Python
producer and consumer complete a run over mutual TLS with the token; a
missing or wrong token is refused with UNAUTHENTICATED, at once; a client
that cannot verify the broker (no CA, another CA, plaintext) or has no
client certificate fails at once with a message that says how it
connected. The option names are checked against the Rust client's flags."""

from __future__ import annotations

import argparse
import collections
import re
import threading

import grpc
import pytest

from dflash_client import (
    BrokerCallError,
    BrokerClient,
    ClientOptions,
    SecurityError,
    add_security_arguments,
    security_options,
)
from dflash_client.security import SECURITY_OPTIONS, TOKEN_ENV, Token
from harness import REPO_ROOT, Certificates

from samples import synthetic_sample

WIDTH = 16


@pytest.fixture
def certificates(tmp_path):
    return Certificates(tmp_path / "tls")


@pytest.fixture
def no_security_environment(monkeypatch):
    """Neither this process nor the brokers it starts see a developer's
    DFLASH_TOKEN or TLS variables."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    for _, _, variable in SECURITY_OPTIONS:
        monkeypatch.delenv(variable, raising=False)


def start_secure_broker(start_broker, certificates: Certificates, mutual: bool = True):
    flags = ["--tls-cert", certificates.path("broker.pem"), "--tls-key", certificates.path("broker.key")]
    if mutual:
        flags += ["--tls-client-ca", certificates.path("ca.pem")]
    flags += ["--token-file", certificates.path("token")]
    return start_broker(1, *[str(flag) for flag in flags])


def mutual_tls(certificates: Certificates, **fields) -> ClientOptions:
    return ClientOptions(
        tls_ca=certificates.path("ca.pem"),
        tls_cert=certificates.path("client.pem"),
        tls_key=certificates.path("client.key"),
        **fields,
    )


def test_a_producer_and_consumer_complete_a_run_over_mutual_tls_with_the_token(start_broker, certificates, no_security_environment, monkeypatch):
    broker = start_secure_broker(start_broker, certificates)
    address = f"https://{broker.address}"
    items = 24
    # The consumer takes everything from the environment, as a pod would:
    # the TLS files by DFLASH_TLS_*, the token itself in DFLASH_TOKEN.
    monkeypatch.setenv("DFLASH_TLS_CA", str(certificates.path("ca.pem")))
    monkeypatch.setenv("DFLASH_TLS_CERT", str(certificates.path("client.pem")))
    monkeypatch.setenv("DFLASH_TLS_KEY", str(certificates.path("client.key")))
    monkeypatch.setenv(TOKEN_ENV, Certificates.TOKEN)
    consumer_client = BrokerClient(address, ClientOptions.from_environment(consumer_reconnect_timeout_s=10))
    monkeypatch.delenv(TOKEN_ENV)
    assert consumer_client.uses_tls
    record = {"delivered": [], "end": None}

    def drain(consumer):
        for delivery in consumer:
            record["delivered"].append(delivery.seq)
            assert consumer.ack(delivery) == 1
        record["end"] = consumer.end_of_stream

    with consumer_client, BrokerClient(address, mutual_tls(certificates, token_file=certificates.path("token"))) as client:
        assert client.uses_tls
        consumer = consumer_client.consumer("drafter-0", credit_items=4)
        thread = threading.Thread(target=drain, args=(consumer,), daemon=True)
        thread.start()
        producer = client.producer("target-0", hidden_width=WIDTH)
        for seq in range(items):
            producer.send(seq, *synthetic_sample(seq, WIDTH))
        report = producer.finish()
        assert (report.accepted, report.rejected, report.reconnects) == (items, [], 0)
        assert producer.report_done()["done_targets"] == 1
        producer.close()
        thread.join(60)
        assert not thread.is_alive()
        consumer.close()
        assert sorted(record["delivered"]) == list(range(items))
        assert record["end"]["status"] == "RUN_STATUS_COMPLETE"
        assert consumer.unsent_acks == []
        status = client.status()
        assert (status["state"], status["accepted_items"], status["acked_items"]) == ("BROKER_STATE_COMPLETE", items, items)


def test_a_missing_or_wrong_token_is_refused_with_unauthenticated_at_once(start_broker, certificates, no_security_environment, monkeypatch):
    broker = start_secure_broker(start_broker, certificates, mutual=False)
    address = f"https://{broker.address}"
    ca = certificates.path("ca.pem")
    # DFLASH_TOKEN is read when the client is made.
    monkeypatch.setenv(TOKEN_ENV, Certificates.WRONG_TOKEN)
    clients = {"a wrong token in DFLASH_TOKEN": BrokerClient(address, ClientOptions(tls_ca=ca))}
    monkeypatch.delenv(TOKEN_ENV)
    clients["no token"] = BrokerClient(address, ClientOptions(tls_ca=ca))
    clients["a wrong token file"] = BrokerClient(address, ClientOptions(tls_ca=ca, token_file=certificates.path("wrong-token")))
    for name, client in clients.items():
        with client:
            refusals = []
            for call in (
                client.status,
                lambda: client.producer("target-0"),
                lambda: client.consumer("drafter-0"),
                lambda: client.report_done("target-0", 0),
            ):
                with pytest.raises(BrokerCallError) as raised:
                    call()
                refusals.append(raised.value)
            for refusal in refusals:
                assert refusal.code == grpc.StatusCode.UNAUTHENTICATED, (name, refusal)
                # The message says how the client connected and where its
                # token came from, never the token.
                assert "over TLS" in str(refusal), (name, str(refusal))
                assert ("no token" if name == "no token" else "token from") in str(refusal), (name, str(refusal))
                assert Certificates.WRONG_TOKEN not in str(refusal) and Certificates.TOKEN not in str(refusal)

    # The hello's write races the broker's refusal; when it loses, grpc
    # hides the refusal behind its own INTERNAL (about one open in four).
    # Every open must still say UNAUTHENTICATED, which is not retried.
    with BrokerClient(address, ClientOptions(tls_ca=ca)) as client:
        codes = collections.Counter()
        for attempt in range(25):
            for open_stream in (lambda: client.producer("target-0"), lambda: client.consumer("drafter-0")):
                with pytest.raises(BrokerCallError) as raised:
                    open_stream()
                codes[raised.value.code.name] += 1
        assert codes == {"UNAUTHENTICATED": 50}, codes

    with BrokerClient(address, ClientOptions(tls_ca=certificates.path("ca.pem"), token_file=certificates.path("token"))) as client:
        status = client.status()
        assert (status["accepted_items"], status["done_targets"], status["drafters"]) == (0, 0, []), "the refused calls changed nothing"


def test_a_client_that_cannot_verify_the_broker_or_has_no_client_certificate_fails_at_once(start_broker, certificates, no_security_environment):
    broker = start_secure_broker(start_broker, certificates)
    token = certificates.path("token")
    attempts = {
        # Plaintext to a TLS port.
        "plaintext": (f"http://{broker.address}", ClientOptions(token_file=token), "over plaintext"),
        # TLS without the CA: the system's roots do not know the test CA.
        "no CA": (f"https://{broker.address}", ClientOptions(token_file=token), "the system's CA roots"),
        # A CA that did not sign the broker's certificate.
        "another CA": (
            f"https://{broker.address}",
            ClientOptions(tls_ca=certificates.path("other-ca.pem"), token_file=token),
            "other-ca.pem",
        ),
        # The right CA, but the broker wants a client certificate.
        "no client certificate": (
            f"https://{broker.address}",
            ClientOptions(tls_ca=certificates.path("ca.pem"), token_file=token),
            "ca.pem",
        ),
    }
    for name, (address, options, connection) in attempts.items():
        with BrokerClient(address, options) as client:
            for call in (client.status, lambda: client.producer("target-0"), lambda: client.consumer("drafter-0")):
                with pytest.raises(BrokerCallError) as raised:
                    call()
                error = raised.value
                assert error.code == grpc.StatusCode.UNAVAILABLE, (name, error)
                assert connection in str(error) and broker.address in str(error), (name, str(error))
    with BrokerClient(f"https://{broker.address}", mutual_tls(certificates, token_file=token)) as client:
        status = client.status()
        assert (status["accepted_items"], status["drafters"]) == (0, []), "the failed clients changed nothing"


def test_settings_that_cannot_be_used_fail_when_the_client_is_made_naming_the_option(tmp_path, certificates, no_security_environment, monkeypatch):
    cases = [
        (dict(tls_ca=tmp_path / "missing.pem"), "https://broker:1", f"tls_ca {tmp_path / 'missing.pem'}: No such file"),
        (dict(tls_ca=certificates.path("token")), "https://broker:1", "no PEM block"),
        (dict(tls_cert=certificates.path("client.pem")), "https://broker:1", "tls_cert and tls_key go together"),
        (dict(tls_ca=certificates.path("ca.pem")), "http://broker:1", "TLS is configured but the broker address 'http://broker:1' is not https://"),
        (dict(token_file=tmp_path / "missing-token"), "broker:1", "token_file"),
    ]
    (tmp_path / "spaced-token").write_text("two words\n")
    (tmp_path / "empty-token").write_text("\n")
    cases += [
        (dict(token_file=tmp_path / "spaced-token"), "broker:1", "printable ASCII without spaces"),
        (dict(token_file=tmp_path / "empty-token"), "broker:1", "holds an empty token"),
    ]
    for fields, address, message in cases:
        with pytest.raises(SecurityError, match=re.escape(message)):
            BrokerClient(address, ClientOptions(**fields))
    monkeypatch.setenv(TOKEN_ENV, "from-the-environment")
    with pytest.raises(SecurityError, match="the token is given twice"):
        BrokerClient("broker:1", ClientOptions(token_file=certificates.path("token")))
    monkeypatch.delenv(TOKEN_ENV)
    # The token goes as the Rust client sends it, and never shows.
    token = Token(" s3cret\n", "test")
    assert token.header() == ("authorization", "Bearer s3cret")
    with BrokerClient("https://broker:1", ClientOptions(tls_ca=certificates.path("ca.pem"), token_file=certificates.path("token"))) as client:
        shown = f"{client.options!r} {client._client.transport!r} {token!r} {token}"
        assert Certificates.TOKEN not in shown and "s3cret" not in shown, shown
        assert client.uses_tls and client.address == "broker:1"


def rust_client_security_flags():
    """Each field of the Rust `ClientSecurityArgs`: its name and env variable."""
    source = (REPO_ROOT / "crates" / "client" / "src" / "security.rs").read_text()
    block = re.search(r"pub struct ClientSecurityArgs \{(.*?)\n\}", source, re.S)
    assert block, "ClientSecurityArgs not found in crates/client/src/security.rs"
    fields = re.findall(r'#\[arg\(long, env = "(\w+)"[^\]]*\)\]\s*pub (\w+):', block.group(1))
    assert fields, block.group(1)
    return {name: variable for variable, name in fields}


def test_the_option_names_are_the_rust_clients_flags():
    rust = rust_client_security_flags()
    assert {keyword: variable for keyword, _, variable in SECURITY_OPTIONS} == rust
    assert all(flag == "--" + keyword.replace("_", "-") for keyword, flag, _ in SECURITY_OPTIONS)
    assert set(rust) <= {field.name for field in __import__("dataclasses").fields(ClientOptions)}
    credentials = (REPO_ROOT / "proto" / "src" / "credentials.rs").read_text()
    assert f'pub const TOKEN_ENV: &str = "{TOKEN_ENV}";' in credentials


def test_the_argparse_flags_default_to_the_environment(no_security_environment, monkeypatch):
    monkeypatch.setenv("DFLASH_TLS_CA", "/from/env/ca.pem")
    parser = add_security_arguments(argparse.ArgumentParser())
    arguments = parser.parse_args(["--token-file", "/run/token", "--tls-domain", "broker.internal"])
    assert security_options(arguments) == {"tls_ca": "/from/env/ca.pem", "tls_domain": "broker.internal", "token_file": "/run/token"}
    assert security_options(parser.parse_args(["--tls-ca", "/flag/ca.pem"]))["tls_ca"] == "/flag/ca.pem"
