//! TLS, mutual TLS and the bearer token with real clients: the in-process
//! broker on 127.0.0.1:0 and the Rust client (the one every role uses),
//! certificates made in the test with rcgen.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use dflash_broker::auth::{BrokerSecurity, TokenExempt};
use dflash_broker::BrokerConfig;
use dflash_client::{BrokerClient, ClientError, ClientOptions, ClientSecurityArgs};
use dflash_proto::v1 as proto;
use dflash_testkit::{sample, spawn_drafter, TestBroker};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const TOKEN: &str = "t0ken-for-tests";

/// A CA and the PEM files it signed, in a temporary folder.
struct Certificates {
    folder: tempfile::TempDir,
}

impl Certificates {
    fn new() -> Certificates {
        let folder = tempfile::tempdir().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
        std::fs::write(folder.path().join("ca.pem"), ca.pem()).unwrap();
        for (name, names) in [
            (
                "broker",
                vec!["localhost".to_string(), "127.0.0.1".to_string()],
            ),
            ("client", vec!["drafter-0".to_string()]),
        ] {
            let key = KeyPair::generate().unwrap();
            let certificate = CertificateParams::new(names)
                .unwrap()
                .signed_by(&key, &ca)
                .unwrap();
            std::fs::write(folder.path().join(format!("{name}.pem")), certificate.pem()).unwrap();
            std::fs::write(
                folder.path().join(format!("{name}.key")),
                key.serialize_pem(),
            )
            .unwrap();
        }
        // Client certificates that carry a role (a `dflash:ROLE[/ID]` URI).
        for (name, uri) in [
            ("target-zero", "dflash:target/target-0"),
            ("any-drafter", "dflash:drafter"),
        ] {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(vec![name.to_string()]).unwrap();
            params
                .subject_alt_names
                .push(rcgen::SanType::URI(uri.try_into().unwrap()));
            let certificate = params.signed_by(&key, &ca).unwrap();
            std::fs::write(folder.path().join(format!("{name}.pem")), certificate.pem()).unwrap();
            std::fs::write(
                folder.path().join(format!("{name}.key")),
                key.serialize_pem(),
            )
            .unwrap();
        }
        // A CA that signed nothing here: a client trusting only it must fail.
        let other_ca = CertifiedIssuer::self_signed(
            {
                let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
                params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
                params
            },
            KeyPair::generate().unwrap(),
        )
        .unwrap();
        std::fs::write(folder.path().join("other-ca.pem"), other_ca.pem()).unwrap();
        std::fs::write(folder.path().join("token"), format!("{TOKEN}\n")).unwrap();
        std::fs::write(folder.path().join("wrong-token"), "not-the-token\n").unwrap();
        Certificates { folder }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.folder.path().join(name)
    }
}

fn broker_config(security: BrokerSecurity) -> BrokerConfig {
    let mut config = BrokerConfig::for_targets(1);
    config.security = security;
    config
}

/// The broker's https address (the listener is the same, the scheme differs).
fn https(broker: &TestBroker) -> String {
    broker.address.replacen("http://", "https://", 1)
}

async fn connect(address: &str, security: ClientSecurityArgs) -> Result<BrokerClient, ClientError> {
    BrokerClient::connect(address.to_string(), security.client_options()?).await
}

/// Connects and calls GetStatus: the code of the first failure, or Ok.
async fn status_code(address: &str, security: ClientSecurityArgs) -> Result<(), String> {
    match connect(address, security).await {
        Ok(client) => match client.status().await {
            Ok(_) => Ok(()),
            Err(ClientError::Call { status, .. }) => Err(format!("{:?}", status.code())),
            Err(other) => Err(other.to_string()),
        },
        Err(error) => Err(format!("connect: {error}")),
    }
}

fn token_file(path: PathBuf) -> ClientSecurityArgs {
    ClientSecurityArgs {
        token_file: Some(path),
        ..ClientSecurityArgs::default()
    }
}

/// One item through a whole (one target) run: produce, consume, ack, done.
async fn one_item_run(client: &BrokerClient) {
    let drafter = spawn_drafter(client.clone(), "drafter-0", Duration::from_secs(30));
    let mut producer = client.produce("target-0").await.expect("open produce");
    producer
        .send(0, sample(1024, 7), HashMap::new())
        .await
        .expect("send");
    assert_eq!(producer.finish().await.expect("finish").accepted, 1);
    client
        .report_done("target-0", 1)
        .await
        .expect("report done");
    let drained = drafter.await.unwrap().expect("drafter drains");
    assert_eq!(drained.deliveries.len(), 1);
    assert_eq!(
        drained.end_of_stream.status(),
        proto::RunStatus::Complete,
        "{:?}",
        drained.end_of_stream
    );
}

async fn health(address: &str, security: ClientSecurityArgs) -> Result<i32, tonic::Code> {
    let options = security.client_options().unwrap();
    let channel = dflash_client::connect_channel(address, &options)
        .await
        .expect("connect for health");
    HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: "dflash.v1.Broker".to_string(),
        })
        .await
        .map(|response| response.into_inner().status)
        .map_err(|status| status.code())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rpc_needs_the_token_and_a_refused_call_changes_nothing() {
    let certificates = Certificates::new();
    let broker = TestBroker::start(broker_config(BrokerSecurity {
        token_file: Some(certificates.path("token")),
        ..BrokerSecurity::none()
    }))
    .await;
    let address = broker.address.clone();

    // GetStatus: without the token, with a wrong one.
    assert_eq!(
        status_code(&address, ClientSecurityArgs::default()).await,
        Err("Unauthenticated".to_string())
    );
    assert_eq!(
        status_code(&address, token_file(certificates.path("wrong-token"))).await,
        Err("Unauthenticated".to_string())
    );

    // Produce, Consume and ReportDone without the token: refused, and
    // nothing was accepted, registered or counted.
    let anonymous = connect(&address, ClientSecurityArgs::default())
        .await
        .unwrap();
    let produce = anonymous.produce("target-0").await;
    assert!(
        matches!(&produce, Err(ClientError::Call { status, .. }) if status.code() == tonic::Code::Unauthenticated)
            || matches!(&produce, Err(ClientError::StreamEnded { detail, .. }) if detail.contains("Unauthenticated") || detail.contains("token")),
        "{:?}",
        produce.err()
    );
    let consume = anonymous
        .consume("drafter-x", dflash_testkit::credit(4))
        .await;
    assert!(consume.is_err(), "consume without a token was accepted");
    let done = anonymous.report_done("target-0", 0).await;
    assert!(
        matches!(&done, Err(ClientError::Call { status, .. }) if status.code() == tonic::Code::Unauthenticated),
        "{done:?}"
    );
    let wrong = connect(&address, token_file(certificates.path("wrong-token")))
        .await
        .unwrap();
    assert!(wrong.produce("target-0").await.is_err());

    let client = connect(&address, token_file(certificates.path("token")))
        .await
        .unwrap();
    let status = client.status().await.expect("status with the token");
    assert_eq!(status.accepted_items, 0);
    assert_eq!(status.done_targets, 0);
    assert!(status.targets.is_empty(), "{:?}", status.targets);
    assert!(status.drafters.is_empty(), "{:?}", status.drafters);

    // Health stays open for probes (the default exemption).
    assert_eq!(
        health(&address, ClientSecurityArgs::default()).await,
        Ok(tonic_health::pb::health_check_response::ServingStatus::Serving as i32)
    );

    // With the token the whole run works.
    one_item_run(&client).await;
    broker.stop().await;

    // `--token-exempt none`: health needs the token too.
    let strict = TestBroker::start(broker_config(BrokerSecurity {
        token_file: Some(certificates.path("token")),
        token_exempt: vec![TokenExempt::None],
        ..BrokerSecurity::none()
    }))
    .await;
    assert_eq!(
        health(&strict.address, ClientSecurityArgs::default()).await,
        Err(tonic::Code::Unauthenticated)
    );
    assert!(
        health(&strict.address, token_file(certificates.path("token")))
            .await
            .is_ok()
    );
    strict.stop().await;
}

fn tls_client(
    certificates: &Certificates,
    ca: &str,
    mutual: bool,
    token: bool,
) -> ClientSecurityArgs {
    ClientSecurityArgs {
        tls_ca: Some(certificates.path(ca)),
        tls_cert: mutual.then(|| certificates.path("client.pem")),
        tls_key: mutual.then(|| certificates.path("client.key")),
        tls_domain: None,
        token_file: token.then(|| certificates.path("token")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_the_token_works_and_plaintext_or_an_unknown_ca_do_not() {
    let certificates = Certificates::new();
    let broker = TestBroker::start(broker_config(BrokerSecurity {
        tls_cert: Some(certificates.path("broker.pem")),
        tls_key: Some(certificates.path("broker.key")),
        token_file: Some(certificates.path("token")),
        ..BrokerSecurity::none()
    }))
    .await;
    let address = https(&broker);

    // Plaintext to a TLS port fails; a client that does not trust the
    // broker's CA fails; TLS without the token is UNAUTHENTICATED.
    assert!(
        status_code(&broker.address, token_file(certificates.path("token")))
            .await
            .is_err()
    );
    let untrusted = status_code(
        &address,
        tls_client(&certificates, "other-ca.pem", false, true),
    )
    .await;
    assert!(
        untrusted.is_err() && untrusted != Err("Unauthenticated".to_string()),
        "{untrusted:?}"
    );
    assert_eq!(
        status_code(&address, tls_client(&certificates, "ca.pem", false, false)).await,
        Err("Unauthenticated".to_string())
    );
    // TLS settings with an http:// address are refused, naming the address.
    let error = status_code(
        &broker.address,
        tls_client(&certificates, "ca.pem", false, true),
    )
    .await
    .unwrap_err();
    assert!(
        error.contains(&broker.address) && error.contains("https"),
        "{error}"
    );

    let client = connect(&address, tls_client(&certificates, "ca.pem", false, true))
        .await
        .expect("connect over TLS");
    one_item_run(&client).await;
    broker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_refuses_a_client_without_a_certificate() {
    let certificates = Certificates::new();
    let broker = TestBroker::start(broker_config(BrokerSecurity {
        tls_cert: Some(certificates.path("broker.pem")),
        tls_key: Some(certificates.path("broker.key")),
        tls_client_ca: Some(certificates.path("ca.pem")),
        token_file: Some(certificates.path("token")),
        ..BrokerSecurity::none()
    }))
    .await;
    let address = https(&broker);
    let anonymous = status_code(&address, tls_client(&certificates, "ca.pem", false, true)).await;
    assert!(
        anonymous.is_err(),
        "a client without a certificate got through"
    );
    assert_eq!(
        status_code(&address, tls_client(&certificates, "ca.pem", true, true)).await,
        Ok(())
    );
    let client = connect(&address, tls_client(&certificates, "ca.pem", true, true))
        .await
        .unwrap();
    one_item_run(&client).await;
    broker.stop().await;
}

/// The broker's flags never echo the token: `--help` holds no value of
/// DFLASH_TOKEN, and a bad token file is named by path, not content.
#[test]
fn broker_help_and_errors_never_show_the_token() {
    let broker = dflash_testkit::workspace_binary("broker");
    let output = std::process::Command::new(&broker)
        .arg("--help")
        .env("DFLASH_TOKEN", "secret-from-env")
        .output()
        .expect("run broker --help");
    let help = String::from_utf8_lossy(&output.stdout);
    assert!(help.contains("--token-file"), "{help}");
    assert!(help.contains("--tls-cert"), "{help}");
    assert!(!help.contains("secret-from-env"), "{help}");
    let folder = tempfile::tempdir().unwrap();
    let token = folder.path().join("token");
    std::fs::write(&token, "file-secret").unwrap();
    let output = std::process::Command::new(&broker)
        .args(["--expected-targets", "1", "--listen", "127.0.0.1:0"])
        .arg("--token-file")
        .arg(&token)
        .env("DFLASH_TOKEN", "secret-from-env")
        .output()
        .expect("run broker");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("given twice"), "{stderr}");
    assert!(
        !stderr.contains("file-secret") && !stderr.contains("secret-from-env"),
        "{stderr}"
    );
}

/// Writes `text` to `name` in `folder`; its path.
fn write_in(folder: &std::path::Path, name: &str, text: &str) -> PathBuf {
    let path = folder.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// A broker that takes the credentials file `text` (written in `folder`).
async fn broker_with_credentials(folder: &std::path::Path, text: &str) -> TestBroker {
    let credentials = write_in(folder, "credentials", text);
    TestBroker::start(broker_config(BrokerSecurity {
        credentials: Some(credentials),
        ..BrokerSecurity::none()
    }))
    .await
}

/// A ModelSync.Session hello as drafter-0.
fn drafter_zero_hello() -> proto::SyncRequest {
    proto::SyncRequest {
        kind: Some(proto::sync_request::Kind::Hello(proto::SyncHello {
            drafter_id: "drafter-0".to_string(),
            model_config_json: "{}".to_string(),
        })),
    }
}

/// The code of a failed call, however the client reports it (a status on
/// open, or a stream that ended with one).
fn refusal_code<T: std::fmt::Debug>(result: Result<T, ClientError>) -> String {
    match result {
        Ok(value) => panic!("expected a refusal, got {value:?}"),
        Err(ClientError::Call { status, .. }) => format!("{:?}", status.code()),
        Err(other) => other.to_string(),
    }
}

/// #22 roles: with `--credentials`, each credential may call only its
/// role's RPCs for its own identity; a refused call is PERMISSION_DENIED (an
/// unknown or missing token UNAUTHENTICATED), names no other target's
/// state, and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_role_may_call_only_its_own_rpcs_and_a_refusal_changes_nothing() {
    let folder = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| write_in(folder.path(), name, text);
    let broker = broker_with_credentials(
        folder.path(),
        "# role identity token\n\
         target   target-0 token-of-target-zero\n\
         target   target-1 token-of-target-one\n\
         drafter  *        token-of-every-drafter\n\
         operator *        token-of-the-operator\n",
    )
    .await;
    let address = broker.address.clone();
    let client_for = |name: &'static str, token: &'static str| {
        let path = write(name, token);
        let address = address.clone();
        async move { connect(&address, token_file(path)).await.unwrap() }
    };
    let target_zero = client_for("t0", "token-of-target-zero").await;
    let target_one = client_for("t1", "token-of-target-one").await;
    let drafter = client_for("d", "token-of-every-drafter").await;
    let operator = client_for("o", "token-of-the-operator").await;

    // Unknown and missing credentials.
    assert_eq!(
        status_code(&address, ClientSecurityArgs::default()).await,
        Err("Unauthenticated".to_string())
    );
    assert_eq!(
        status_code(&address, token_file(write("x", "token-of-a-stranger"))).await,
        Err("Unauthenticated".to_string())
    );

    // A drafter credential may not produce or end a shard.
    assert_eq!(
        refusal_code(drafter.produce("target-0").await),
        "PermissionDenied"
    );
    assert_eq!(
        refusal_code(drafter.report_done("target-0", 0).await),
        "PermissionDenied"
    );
    // A target credential may not produce or report as another target;
    // the refusal tells nothing of target-0's epoch or counts.
    assert_eq!(
        refusal_code(target_one.produce("target-0").await),
        "PermissionDenied"
    );
    match target_one.report_done("target-0", 7).await {
        Err(ClientError::Call { status, .. }) => {
            assert_eq!(status.code(), tonic::Code::PermissionDenied);
            assert!(!status.message().contains("epoch"), "{}", status.message());
        }
        other => panic!("expected PERMISSION_DENIED, got {other:?}"),
    }
    // Nor consume, nor open the model sync.
    assert_eq!(
        refusal_code(
            target_zero
                .consume("drafter-0", dflash_testkit::credit(4))
                .await
        ),
        "PermissionDenied"
    );
    let channel = dflash_client::connect_channel(
        &address,
        &token_file(write("t0-again", "token-of-target-zero"))
            .client_options()
            .unwrap(),
    )
    .await
    .unwrap();
    let hello = drafter_zero_hello();
    let session = proto::model_sync_client::ModelSyncClient::new(channel)
        .session(tokio_stream::iter(vec![hello]))
        .await;
    assert_eq!(
        session.map(|_| ()).unwrap_err().code(),
        tonic::Code::PermissionDenied
    );
    // An operator credential reads status but may not consume.
    assert_eq!(
        refusal_code(
            operator
                .consume("drafter-0", dflash_testkit::credit(4))
                .await
        ),
        "PermissionDenied"
    );

    // Nothing changed.
    let status = operator.status().await.expect("status as the operator");
    assert_eq!(status.accepted_items, 0);
    assert_eq!(status.done_targets, 0);
    assert!(status.targets.is_empty(), "{:?}", status.targets);
    assert!(status.drafters.is_empty(), "{:?}", status.drafters);
    assert!(!status.model_sync.unwrap_or_default().has_model);

    // Each role doing its own part completes the run.
    let consumer = spawn_drafter(drafter.clone(), "drafter-0", Duration::from_secs(30));
    let mut producer = target_zero
        .produce("target-0")
        .await
        .expect("produce as itself");
    producer
        .send(0, sample(1024, 7), HashMap::new())
        .await
        .unwrap();
    assert_eq!(producer.finish().await.unwrap().accepted, 1);
    target_zero
        .report_done("target-0", 1)
        .await
        .expect("its own ReportDone");
    let drained = consumer.await.unwrap().expect("the drafter drains");
    assert_eq!(drained.deliveries.len(), 1);
    assert_eq!(drained.end_of_stream.status(), proto::RunStatus::Complete);
    broker.stop().await;
}

/// #22 roles over mutual TLS: a client certificate whose SAN carries
/// `dflash:target/target-0` acts as target-0 only, one with `dflash:drafter`
/// as any drafter; no token needed, the same refusals as with tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_can_carry_the_role() {
    let certificates = Certificates::new();
    std::fs::write(
        certificates.path("credentials"),
        "operator * token-of-the-operator\n",
    )
    .unwrap();
    let broker = TestBroker::start(broker_config(BrokerSecurity {
        tls_cert: Some(certificates.path("broker.pem")),
        tls_key: Some(certificates.path("broker.key")),
        tls_client_ca: Some(certificates.path("ca.pem")),
        credentials: Some(certificates.path("credentials")),
        ..BrokerSecurity::none()
    }))
    .await;
    let address = https(&broker);
    let as_certificate = |name: &str| ClientSecurityArgs {
        tls_ca: Some(certificates.path("ca.pem")),
        tls_cert: Some(certificates.path(&format!("{name}.pem"))),
        tls_key: Some(certificates.path(&format!("{name}.key"))),
        tls_domain: None,
        token_file: None,
    };
    let target_zero = connect(&address, as_certificate("target-zero"))
        .await
        .unwrap();
    let drafter = connect(&address, as_certificate("any-drafter"))
        .await
        .unwrap();
    // A certificate without a role, and no token: not authenticated.
    assert_eq!(
        status_code(&address, as_certificate("client")).await,
        Err("Unauthenticated".to_string())
    );
    assert_eq!(
        refusal_code(target_zero.produce("target-1").await),
        "PermissionDenied"
    );
    assert_eq!(
        refusal_code(
            target_zero
                .consume("drafter-0", dflash_testkit::credit(4))
                .await
        ),
        "PermissionDenied"
    );
    assert_eq!(
        refusal_code(drafter.report_done("target-0", 0).await),
        "PermissionDenied"
    );
    let consumer = spawn_drafter(drafter.clone(), "drafter-7", Duration::from_secs(30));
    let mut producer = target_zero.produce("target-0").await.expect("as target-0");
    producer
        .send(0, sample(1024, 7), HashMap::new())
        .await
        .unwrap();
    assert_eq!(producer.finish().await.unwrap().accepted, 1);
    target_zero.report_done("target-0", 1).await.unwrap();
    let drained = consumer.await.unwrap().expect("the drafter drains");
    assert_eq!(drained.end_of_stream.status(), proto::RunStatus::Complete);
    broker.stop().await;
}

/// #25: a connection that never finishes its TLS handshake (here: sends
/// nothing at all) is closed after `--tls-handshake-timeout`, instead of
/// holding a connection slot forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_never_finishes_its_tls_handshake_is_closed() {
    use tokio::io::AsyncReadExt;
    let certificates = Certificates::new();
    let mut config = broker_config(BrokerSecurity {
        tls_cert: Some(certificates.path("broker.pem")),
        tls_key: Some(certificates.path("broker.key")),
        ..BrokerSecurity::none()
    });
    config.tls_handshake_timeout = std::time::Duration::from_millis(500);
    let broker = TestBroker::start(config).await;
    let address = broker.address.trim_start_matches("http://").to_string();
    let mut silent = tokio::net::TcpStream::connect(&address).await.unwrap();
    let mut buffer = [0u8; 16];
    let read = tokio::time::timeout(std::time::Duration::from_secs(20), silent.read(&mut buffer))
        .await
        .expect("the broker closes a connection whose handshake never starts");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    // A client that does its handshake is served as before.
    let served = status_code(
        &https(&broker),
        tls_client(&certificates, "ca.pem", false, false),
    )
    .await;
    assert!(served.is_ok(), "{served:?}");
    broker.stop().await;
}

/// The code of a call's answer (OK when it succeeded).
fn code_of<T>(result: Result<tonic::Response<T>, tonic::Status>) -> tonic::Code {
    match result {
        Ok(_) => tonic::Code::Ok,
        Err(status) => status.code(),
    }
}

/// #23 the evaluator role: an evaluator credential may read the run's model and
/// report τ for its own evaluator_id only, and nothing else (no Produce,
/// ReportDone, Consume or ModelSync.Session); no other role may read the
/// model or report τ. Every refusal is PERMISSION_DENIED and changes
/// nothing; the evaluator's own calls pass authorization (they fail later
/// for want of a model, FAILED_PRECONDITION, or of a served version).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_an_evaluator_reads_the_model_or_reports_tau_and_it_does_nothing_else() {
    let folder = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| write_in(folder.path(), name, text);
    let broker = broker_with_credentials(
        folder.path(),
        "target    target-0 token-of-target-zero\n\
         drafter   *        token-of-every-drafter\n\
         evaluator eval-0   token-of-eval-zero\n\
         operator  *        token-of-the-operator\n",
    )
    .await;
    let address = broker.address.clone();
    let options =
        |name: &str, token: &str| token_file(write(name, token)).client_options().unwrap();
    let sync_client = |options: ClientOptions| {
        let address = address.clone();
        async move {
            proto::model_sync_client::ModelSyncClient::new(
                dflash_client::connect_channel(&address, &options)
                    .await
                    .unwrap(),
            )
        }
    };
    let read = |evaluator_id: &str| proto::ReadModelRequest {
        evaluator_id: evaluator_id.to_string(),
        ..Default::default()
    };
    let report = |evaluator_id: &str| proto::TauReport {
        evaluator_id: evaluator_id.to_string(),
        point: Some(proto::TauPoint {
            model_version: 1,
            tau: 2.0,
            prompts: 1,
            verification_steps: 1,
            ..Default::default()
        }),
    };

    // Other roles may neither read the run's model nor report τ.
    for (name, token) in [
        ("t0", "token-of-target-zero"),
        ("d", "token-of-every-drafter"),
        ("o", "token-of-the-operator"),
    ] {
        let mut client = sync_client(options(name, token)).await;
        assert_eq!(
            code_of(client.read_model(read("eval-0")).await),
            tonic::Code::PermissionDenied,
            "{name} read the run's model"
        );
        assert_eq!(
            code_of(client.report_tau(report("eval-0")).await),
            tonic::Code::PermissionDenied,
            "{name} reported tau"
        );
    }

    let evaluator_options = options("e0", "token-of-eval-zero");
    let mut evaluator_sync = sync_client(evaluator_options.clone()).await;
    // Not as another evaluator.
    assert_eq!(
        code_of(evaluator_sync.read_model(read("eval-1")).await),
        tonic::Code::PermissionDenied
    );
    assert_eq!(
        code_of(evaluator_sync.report_tau(report("eval-1")).await),
        tonic::Code::PermissionDenied
    );
    // As itself it passes authorization: no model yet, no version served.
    assert_eq!(
        code_of(evaluator_sync.read_model(read("eval-0")).await),
        tonic::Code::FailedPrecondition
    );
    let refused = evaluator_sync
        .report_tau(report("eval-0"))
        .await
        .unwrap_err();
    assert_ne!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains("not served"), "{refused:?}");

    // No other RPC but status.
    let evaluator = BrokerClient::connect(address.clone(), evaluator_options.clone())
        .await
        .unwrap();
    assert_eq!(
        refusal_code(evaluator.produce("target-0").await),
        "PermissionDenied"
    );
    assert_eq!(
        refusal_code(evaluator.report_done("target-0", 0).await),
        "PermissionDenied"
    );
    assert_eq!(
        refusal_code(
            evaluator
                .consume("drafter-0", dflash_testkit::credit(4))
                .await
        ),
        "PermissionDenied"
    );
    let hello = drafter_zero_hello();
    assert_eq!(
        evaluator_sync
            .session(tokio_stream::iter(vec![hello]))
            .await
            .map(|_| ())
            .unwrap_err()
            .code(),
        tonic::Code::PermissionDenied
    );

    // Nothing changed.
    let status = evaluator.status().await.expect("status as the evaluator");
    assert_eq!(status.accepted_items, 0);
    assert_eq!(status.done_targets, 0);
    assert!(status.drafters.is_empty(), "{:?}", status.drafters);
    let model_sync = status.model_sync.unwrap_or_default();
    assert!(!model_sync.has_model);
    assert!(
        model_sync.tau_history.is_empty(),
        "{:?}",
        model_sync.tau_history
    );
    assert!(model_sync.evaluations_pending.is_empty());
    broker.stop().await;
}

/// #37 the lighthouse: only a drafter credential may ask for a quorum or
/// vote, for its own drafter id when the credential names one; every other
/// role is refused PERMISSION_DENIED and changes nothing (the broker's data
/// parallelism status stays empty). A drafter's own ask passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_drafter_asks_for_a_quorum_or_votes_and_only_as_itself() {
    let folder = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| write_in(folder.path(), name, text);
    let broker = broker_with_credentials(
        folder.path(),
        "target    target-0  token-of-target-zero\n\
         drafter   drafter-0 token-of-drafter-zero\n\
         evaluator *         token-of-evaluators\n\
         operator  *         token-of-the-operator\n",
    )
    .await;
    let address = broker.address.clone();
    let options =
        |name: &str, token: &str| token_file(write(name, token)).client_options().unwrap();
    let lighthouse_client = |options: ClientOptions| {
        let address = address.clone();
        async move {
            proto::lighthouse_client::LighthouseClient::new(
                dflash_client::connect_channel(&address, &options)
                    .await
                    .unwrap(),
            )
        }
    };
    let ask = |drafter_id: &str| proto::QuorumRequest {
        drafter_id: drafter_id.to_string(),
        store_address: "127.0.0.1:29500".to_string(),
        samples_ready: 4,
        collective_timeout_ms: 5_000,
        ..Default::default()
    };
    let vote = |drafter_id: &str| proto::CommitVote {
        drafter_id: drafter_id.to_string(),
        quorum_id: 1,
        ok: true,
        ..Default::default()
    };
    for (name, token) in [
        ("t0", "token-of-target-zero"),
        ("e", "token-of-evaluators"),
        ("o", "token-of-the-operator"),
    ] {
        let mut client = lighthouse_client(options(name, token)).await;
        assert_eq!(
            code_of(client.quorum(ask("drafter-0")).await),
            tonic::Code::PermissionDenied,
            "{name} asked for a quorum"
        );
        assert_eq!(
            code_of(client.commit(vote("drafter-0")).await),
            tonic::Code::PermissionDenied,
            "{name} voted"
        );
    }
    let mut drafter = lighthouse_client(options("d0", "token-of-drafter-zero")).await;
    assert_eq!(
        code_of(drafter.quorum(ask("drafter-1")).await),
        tonic::Code::PermissionDenied,
        "drafter-0's credential asked as drafter-1"
    );
    assert_eq!(
        code_of(drafter.commit(vote("drafter-1")).await),
        tonic::Code::PermissionDenied
    );
    // A bad store address names itself and changes nothing.
    let bad = drafter
        .quorum(proto::QuorumRequest {
            store_address: "nowhere".to_string(),
            ..ask("drafter-0")
        })
        .await
        .unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument);
    assert!(bad.message().contains("\"nowhere\""), "{bad:?}");
    let operator = BrokerClient::connect(address.clone(), options("o2", "token-of-the-operator"))
        .await
        .unwrap();
    let status = operator.status().await.unwrap();
    let parallel = status.lighthouse.unwrap_or_default();
    assert_eq!(parallel.quorums_formed, 0, "{parallel:?}");
    // As itself it is answered: a quorum of one once the first round gathered.
    let formed = drafter.quorum(ask("drafter-0")).await.unwrap().into_inner();
    assert_eq!(formed.members, vec!["drafter-0".to_string()]);
    assert_eq!(formed.world_size, 1);
    let decision = drafter
        .commit(proto::CommitVote {
            quorum_id: formed.quorum_id,
            step: formed.step,
            instance: formed.instance,
            nonce: formed.nonce,
            ..vote("drafter-0")
        })
        .await
        .unwrap()
        .into_inner();
    assert!(decision.commit, "{decision:?}");
    assert_eq!(decision.outcome(), proto::StepOutcome::Commit);
    assert_eq!(decision.record.map(|record| record.step), Some(1));
    broker.stop().await;
}
