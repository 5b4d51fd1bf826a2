//! # dflash-testkit
//!
//! The helpers every test suite of the workspace shares, so each is written
//! once: a dev-dependency only, never linked into a binary.
//!
//! # Layout
//! - [`TestBroker`]: the real broker (`dflash_broker::serve`) in-process on
//!   `127.0.0.1:0`, optionally with its metrics endpoint; stopped with a bound.
//! - [`wait_until`] (and [`wait_until_blocking`], without a runtime): polls a
//!   condition (tests never sleep a fixed time).
//! - [`sample`], [`credit`], [`drafter_status`]: wire values of a chosen size.
//! - [`spawn_drafter`]: a consumer that acks everything until end-of-stream.
//! - [`span_attribute`]: an attribute of an exported span.
//! - [`http_get`], [`parse_metrics`]: a Prometheus scrape over plain HTTP/1.1.
//! - [`workspace_binary`]: a binary of this workspace beside the running test;
//!   [`require_test_hooks`]: fails the test unless a server binary has the
//!   test hooks (cargo feature `test-hooks`, on in `make test`).
//! - [`ClosedPort`]: a loopback port that refuses connections while held.
//! - [`BrokerProcess`]: the real `broker` binary as a child process on a
//!   fixed loopback port, killable with SIGKILL and restartable on the same
//!   port and flags.
//!
//! Depends on the broker, the client and the proto; never on libtorch, so the
//! broker's tests stay free of it. Helpers fail the test by panicking with a
//! message, as tests do.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use dflash_broker::BrokerConfig;
use dflash_client::{BrokerClient, ClientOptions, ConsumerEvent};
use dflash_proto::v1 as proto;
use dflash_telemetry::testing::SpanData;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// How long [`TestBroker::stop`] waits for the broker to return.
const STOP_TIMEOUT: Duration = Duration::from_secs(15);

/// The real broker served in-process on an ephemeral loopback port.
pub struct TestBroker {
    /// `http://127.0.0.1:PORT`, what clients connect to.
    pub address: String,
    /// The Prometheus endpoint, when started with [`TestBroker::start_with_metrics`].
    pub metrics_address: Option<SocketAddr>,
    pub shutdown: CancellationToken,
    /// The task running `serve`; [`TestBroker::stop`] awaits it.
    pub handle: JoinHandle<Result<(), dflash_broker::ServeError>>,
}

impl TestBroker {
    pub async fn start(config: BrokerConfig) -> TestBroker {
        Self::serve(config, false).await
    }

    /// A broker with default settings for `expected_targets` targets.
    pub async fn for_targets(expected_targets: u32) -> TestBroker {
        Self::start(BrokerConfig::for_targets(expected_targets)).await
    }

    /// A broker that also serves its metrics on another ephemeral port.
    pub async fn start_with_metrics(config: BrokerConfig) -> TestBroker {
        Self::serve(config, true).await
    }

    /// Stops this broker (gracefully: what it accepted is in its state
    /// dir, if `config` names one) and starts a new one with `config` on
    /// the same address, so its clients reconnect to it. A port still held
    /// by the old listener's last moments is tried again for up to 60 s.
    pub async fn restart(self, config: BrokerConfig) -> TestBroker {
        self.restart_after(config, || {}).await
    }

    /// [`TestBroker::restart`], calling `between` once the old broker has
    /// stopped and before the new one starts (to change its state dir as an
    /// operator or an older broker would).
    pub async fn restart_after(self, config: BrokerConfig, between: impl FnOnce()) -> TestBroker {
        let address = self.address.clone();
        self.stop_checked()
            .await
            .expect("the broker stopped cleanly");
        between();
        let bound = address.trim_start_matches("http://").to_string();
        let deadline = Instant::now() + Duration::from_secs(60);
        let listener = loop {
            match TcpListener::bind(&bound).await {
                Ok(listener) => break listener,
                Err(error) if Instant::now() < deadline => {
                    eprintln!("rebinding {bound}: {error}; trying again");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(error) => panic!("rebinding {bound}: {error}"),
            }
        };
        Self::serve_on(listener, config, false).await
    }

    async fn serve(config: BrokerConfig, with_metrics: bool) -> TestBroker {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        Self::serve_on(listener, config, with_metrics).await
    }

    async fn serve_on(
        listener: TcpListener,
        config: BrokerConfig,
        with_metrics: bool,
    ) -> TestBroker {
        let address = format!("http://{}", listener.local_addr().expect("local address"));
        let metrics_listener = if with_metrics {
            Some(
                TcpListener::bind("127.0.0.1:0")
                    .await
                    .expect("bind metrics"),
            )
        } else {
            None
        };
        let metrics_address = metrics_listener
            .as_ref()
            .map(|listener| listener.local_addr().expect("metrics address"));
        let shutdown = CancellationToken::new();
        let handle = tokio::spawn(dflash_broker::serve_with_metrics(
            listener,
            metrics_listener,
            config,
            shutdown.clone(),
        ));
        TestBroker {
            address,
            metrics_address,
            shutdown,
            handle,
        }
    }

    pub async fn client(&self) -> BrokerClient {
        BrokerClient::connect(self.address.clone(), ClientOptions::default())
            .await
            .expect("connect to test broker")
    }

    pub async fn status(&self) -> proto::StatusSnapshot {
        self.client().await.status().await.expect("broker status")
    }

    /// Cancels the broker and waits (bounded) for `serve` to return.
    pub async fn stop(self) {
        let _ = self.stop_checked().await;
    }

    /// [`TestBroker::stop`], returning what `serve` returned; panics when it
    /// does not return within the bound.
    pub async fn stop_checked(self) -> Result<(), dflash_broker::ServeError> {
        self.shutdown.cancel();
        tokio::time::timeout(STOP_TIMEOUT, self.handle)
            .await
            .expect("broker stopped in time")
            .expect("broker task")
    }
}

/// Polls `condition` until it holds or `timeout` passes; true if it held.
pub async fn wait_until<F, Fut>(timeout: Duration, mut condition: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if condition().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// [`wait_until`] for tests without a runtime: polls `condition` from the
/// calling thread every 100 ms until it holds or `timeout` passes.
pub fn wait_until_blocking(timeout: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A DFlash sample (`dflash_proto::sample` schema: 4 tokens, hidden states
/// `[4, width]` bf16) whose hidden states take `payload_bytes` rounded down to
/// a multiple of 8 (at least 8), with `marker` in their first 8 bytes so a
/// test can tell items apart.
pub fn sample(payload_bytes: usize, marker: u64) -> proto::Sample {
    const TOKENS: usize = 4;
    let width = (payload_bytes / (TOKENS * 2)).max(1);
    let mut hidden = vec![0u8; TOKENS * width * 2];
    hidden[..8].copy_from_slice(&marker.to_le_bytes());
    dflash_proto::sample::encode(
        &[1, 2, 3, 4],
        &[0, 1, 1, 1],
        Bytes::from(hidden),
        proto::Dtype::Bf16,
        width as u64,
    )
}

/// A credit window of `items` with no byte limit.
pub fn credit(items: u32) -> proto::Credit {
    proto::Credit { items, bytes: 0 }
}

/// This drafter's entry in a status snapshot.
pub fn drafter_status<'a>(
    status: &'a proto::StatusSnapshot,
    drafter_id: &str,
) -> Option<&'a proto::DrafterStatus> {
    status
        .drafters
        .iter()
        .find(|drafter| drafter.drafter_id == drafter_id)
}

/// What a [`spawn_drafter`] drafter saw.
pub struct Drained {
    pub deliveries: Vec<proto::Delivery>,
    pub end_of_stream: proto::EndOfStream,
    /// Time from the last delivery (or the stream's start, without any) to
    /// end-of-stream: how long the broker took to end a run gone quiet.
    pub quiet_before_end: Duration,
}

/// A drafter that acks every delivery and returns everything it saw once
/// end-of-stream arrives (or fails after `timeout`).
pub fn spawn_drafter(
    client: BrokerClient,
    drafter_id: &str,
    timeout: Duration,
) -> JoinHandle<anyhow::Result<Drained>> {
    let drafter_id = drafter_id.to_string();
    tokio::spawn(async move {
        let mut consumer = client.consume(&drafter_id, credit(64)).await?;
        let handle = consumer.handle();
        let mut deliveries = Vec::new();
        let mut last_delivery = std::time::Instant::now();
        let drain = async {
            loop {
                match consumer.next().await? {
                    ConsumerEvent::Delivery(delivery) => {
                        handle.ack(vec![delivery.delivery_id]);
                        deliveries.push(delivery);
                        last_delivery = std::time::Instant::now();
                    }
                    ConsumerEvent::EndOfStream(end) => return Ok::<_, anyhow::Error>(end),
                }
            }
        };
        let end_of_stream = tokio::time::timeout(timeout, drain)
            .await
            .context("no end-of-stream in time")??;
        Ok(Drained {
            deliveries,
            end_of_stream,
            quiet_before_end: last_delivery.elapsed(),
        })
    })
}

/// The value of attribute `key` of an exported span, as text.
pub fn span_attribute(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|attribute| attribute.key.as_str() == key)
        .map(|attribute| attribute.value.to_string())
}

/// One HTTP/1.1 GET over a fresh connection; the whole answer, headers included.
pub async fn http_get(address: SocketAddr, path: &str) -> String {
    let mut stream = tokio::net::TcpStream::connect(address)
        .await
        .expect("connect metrics");
    let request = format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .expect("send request");
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_string(&mut answer))
        .await
        .expect("answer in time")
        .expect("read answer");
    answer
}

/// `name{labels}` → value from a Prometheus scrape's answer (headers skipped).
pub fn parse_metrics(answer: &str) -> HashMap<String, f64> {
    let body = answer
        .split_once("\r\n\r\n")
        .map_or(answer, |(_, body)| body);
    body.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            Some((series.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// A loopback port that refuses connections for as long as this value
/// lives: a socket bound to it that never listens (the kernel answers a
/// connection attempt with a reset). A port found by binding a listener and
/// dropping it is free for anyone to take again: another test's listener,
/// or a client's own ephemeral source port (a loopback connection to itself
/// then succeeds), and the "closed" port answers.
pub struct ClosedPort {
    /// Bound, never listening; held so no one else can bind the port.
    socket: tokio::net::TcpSocket,
}

impl ClosedPort {
    /// Binds `127.0.0.1:0` without listening. Needs no runtime.
    pub fn bind() -> ClosedPort {
        let socket = tokio::net::TcpSocket::new_v4().expect("a TCP socket");
        socket
            .bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .expect("bind 127.0.0.1:0");
        ClosedPort { socket }
    }

    /// `127.0.0.1:PORT`.
    pub fn address(&self) -> SocketAddr {
        self.socket.local_addr().expect("the bound address")
    }

    /// `http://127.0.0.1:PORT`, an endpoint nothing answers.
    pub fn url(&self) -> String {
        format!("http://{}", self.address())
    }
}

/// A binary of this workspace in the same target folder as the running
/// test (`target/<profile>/deps/<test>` → `target/<profile>/<name>`).
pub fn workspace_binary(name: &str) -> PathBuf {
    let test_binary = std::env::current_exe().expect("test binary path");
    let profile_dir = test_binary
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target profile folder");
    let path = profile_dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: build the binaries first (cargo build --workspace --bins)",
        path.display()
    );
    path
}

/// Whether this runs on the project's CI (`CI` set to `true` or `1`, as
/// `.ci/run` sets it): there every test's environment is there by
/// definition (root, Docker, `ip netns`, tmpfs mounts), so none may skip.
pub fn on_ci() -> bool {
    matches!(
        std::env::var("CI")
            .as_deref()
            .map(str::to_ascii_lowercase)
            .as_deref(),
        Ok("true" | "1")
    )
}

/// A test that cannot run here reports a skip, never a pass: it prints
/// `SKIPPED: <test>: <why>` on a line of its own, which `.ci/run` counts
/// apart (and takes off libtest's passes, which count the returning test),
/// then the caller returns. The line is written to the process's stderr
/// itself, past libtest's capture, so it shows without `--nocapture`. On CI
/// a missing environment is a failure: this panics instead.
pub fn skip(test: &str, why: &str) {
    assert!(
        !on_ci(),
        "{test}: cannot run on CI, where its environment must be: {why}"
    );
    use std::io::Write;
    // One line, whatever the reason holds (a command's stderr may span lines).
    let why = why.split_whitespace().collect::<Vec<_>>().join(" ");
    let _ = writeln!(std::io::stderr().lock(), "\nSKIPPED: {test}: {why}");
}

/// Fails the test, saying what to do, unless `binary` (a `target-server` or
/// `drafter-server`) was built with the cargo feature `test-hooks`, which its
/// `--version` shows with `+test-hooks`: the hidden hooks a test relies on (a
/// thread that hangs on purpose) exist only in such a build, never in a
/// release one. `make test` builds the binaries with it.
pub fn require_test_hooks(binary: &Path) {
    let output = std::process::Command::new(binary)
        .arg("--version")
        .output()
        .expect("run the binary's --version");
    let version = String::from_utf8_lossy(&output.stdout);
    assert!(
        version.contains("+test-hooks"),
        "{} ({}) was built without feature test-hooks: run make test, which builds the \
         binaries with --features dflash-target-server/test-hooks,dflash-drafter-server/test-hooks",
        binary.display(),
        version.trim()
    );
}

/// The `broker` binary as a child process (for crash tests: SIGKILL, then a
/// restart on the same port and flags).
pub struct BrokerProcess {
    /// `http://127.0.0.1:PORT`.
    pub address: String,
    port: u16,
    args: Vec<String>,
    child: Option<std::process::Child>,
    log_path: PathBuf,
}

impl BrokerProcess {
    /// Starts `broker --listen 127.0.0.1:0 <args>`, reads the port the
    /// kernel gave it from its `--ready-file` (no port is picked and let go
    /// before the broker holds it) and waits until it answers GetStatus; its
    /// output goes to `log_path` (appended to).
    pub async fn start(args: &[&str], log_path: PathBuf) -> BrokerProcess {
        let mut process = BrokerProcess {
            address: String::new(),
            port: 0,
            args: args.iter().map(|arg| arg.to_string()).collect(),
            child: None,
            log_path,
        };
        process.spawn().await;
        process
    }

    /// The ready file beside the log: the broker writes its bound address
    /// there once it listens.
    fn ready_file(&self) -> PathBuf {
        self.log_path.with_extension("ready")
    }

    /// Starts the binary on `self.port` (0 the first time) and waits for its
    /// ready file and its first answer. A restart must reuse the port its
    /// clients know; while the kernel still lends that port to another
    /// socket (an outgoing connection may take any free port) the bind
    /// fails at once and is tried again, for up to 60 s.
    async fn spawn(&mut self) {
        let ready_file = self.ready_file();
        let deadline = Instant::now() + Duration::from_secs(60);
        let bound = loop {
            let _ = std::fs::remove_file(&ready_file);
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.log_path)
                .expect("broker log file");
            let mut child = std::process::Command::new(workspace_binary("broker"))
                .arg("--listen")
                .arg(format!("127.0.0.1:{}", self.port))
                .arg("--ready-file")
                .arg(&ready_file)
                .args(&self.args)
                .stdout(log.try_clone().expect("log handle"))
                .stderr(log)
                .spawn()
                .expect("start the broker binary");
            let bound = loop {
                if let Ok(text) = std::fs::read_to_string(&ready_file) {
                    break Some(text);
                }
                if child.try_wait().expect("poll the broker").is_some() {
                    break None;
                }
                assert!(
                    Instant::now() < deadline,
                    "the broker wrote no ready file; log: {}",
                    self.log()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            };
            match bound {
                Some(text) => {
                    self.child = Some(child);
                    break text;
                }
                None => {
                    let log = self.log();
                    assert!(
                        self.port != 0
                            && log.contains("cannot listen")
                            && Instant::now() < deadline,
                        "the broker exited before listening; log: {log}"
                    );
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        };
        let address: SocketAddr = bound.trim().parse().expect("the ready file's address");
        self.port = address.port();
        self.address = format!("http://{address}");
        let address = self.address.clone();
        let answered = wait_until(Duration::from_secs(60), || {
            let address = address.clone();
            async move {
                match BrokerClient::connect(address, ClientOptions::default()).await {
                    Ok(client) => client.status().await.is_ok(),
                    Err(_) => false,
                }
            }
        })
        .await;
        assert!(answered, "the broker did not answer; log: {}", self.log());
    }

    /// SIGKILL, and waits for the process to be gone.
    pub fn kill_9(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().expect("SIGKILL the broker");
            child.wait().expect("reap the broker");
        }
    }

    /// Starts the binary again on the same port with the same flags.
    pub async fn restart(&mut self) {
        self.kill_9();
        self.spawn().await;
    }

    pub async fn client(&self) -> BrokerClient {
        BrokerClient::connect(self.address.clone(), ClientOptions::default())
            .await
            .expect("connect to the broker process")
    }

    /// Everything the broker logged so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }
}

impl Drop for BrokerProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Tokens of each [`tiny_drafter_sample`].
pub const TINY_SAMPLE_TOKENS: usize = 16;
/// Hidden width of each [`tiny_drafter_sample`]: the `dflash init-tiny`
/// target's hidden size times a 2-layer drafter's target layers.
pub const TINY_SAMPLE_HIDDEN_WIDTH: u64 = 2 * 64;

/// A sample a 2-layer drafter of the `dflash init-tiny` target accepts:
/// tokens inside its vocabulary, a supervised tail, bf16 hidden states of
/// small deterministic values (exact in bf16), different for each `seq`.
pub fn tiny_drafter_sample(seq: u64) -> proto::Sample {
    let tokens = TINY_SAMPLE_TOKENS;
    let input_ids: Vec<i64> = (0..tokens as u64)
        .map(|position| 3 + (seq * 7 + position * 13) as i64 % 290)
        .collect();
    let loss_mask: Vec<u8> = (0..tokens)
        .map(|position| u8::from(position >= tokens / 4))
        .collect();
    let hidden: Vec<u8> = (0..tokens as u64 * TINY_SAMPLE_HIDDEN_WIDTH)
        .flat_map(|index| {
            let value = ((index * 31 + seq * 5) % 17) as f32 / 8.0 - 1.0;
            // At most 8 significant bits: bf16 is exact.
            ((value.to_bits() >> 16) as u16).to_le_bytes()
        })
        .collect();
    dflash_proto::sample::encode(
        &input_ids,
        &loss_mask,
        Bytes::from(hidden),
        proto::Dtype::Bf16,
        TINY_SAMPLE_HIDDEN_WIDTH,
    )
}

/// The tiny target `dflash init-tiny` writes, in `work/tiny`.
pub fn init_tiny(work: &Path) -> PathBuf {
    let tiny = work.join("tiny");
    let init = std::process::Command::new(workspace_binary("dflash"))
        .arg("init-tiny")
        .arg(&tiny)
        .output()
        .expect("run dflash init-tiny");
    assert!(init.status.success(), "{init:?}");
    tiny
}

/// The broker's lighthouse status (the default when it cannot be read,
/// so a poll goes on).
pub async fn data_parallel_status(client: &BrokerClient) -> proto::LighthouseStatus {
    client
        .status()
        .await
        .ok()
        .and_then(|status| status.lighthouse)
        .unwrap_or_default()
}

/// The samples of each committed data-parallel step, from the broker's
/// per-step record (its log line of each durable commit, `data
/// parallelism: step committed ... step=N ... keys=target:seq,...`): every
/// (target, seq) with the steps that trained it.
pub fn committed_samples(log: &str) -> std::collections::BTreeMap<(String, u64), Vec<u64>> {
    let mut trained: std::collections::BTreeMap<(String, u64), Vec<u64>> = Default::default();
    for line in log
        .lines()
        .filter(|line| line.contains("data parallelism: step committed"))
    {
        let field = |name: &str| {
            line.split_whitespace()
                .find_map(|word| word.strip_prefix(name))
                .map(|value| value.trim_matches('"').to_string())
        };
        let step: u64 = field("step=")
            .and_then(|step| step.parse().ok())
            .unwrap_or(0);
        let keys = field("keys=").unwrap_or_default();
        for key in keys.split(',').filter(|key| !key.is_empty()) {
            let (target_id, seq) = key.rsplit_once(':').expect("target:seq");
            let seq: u64 = seq.parse().expect("a seq");
            trained
                .entry((target_id.to_string(), seq))
                .or_default()
                .push(step);
        }
    }
    trained
}

/// Waits (polling) for `child` to exit; `None` if it is still running
/// after `timeout`.
pub async fn wait_for_exit(
    child: &mut std::process::Child,
    timeout: Duration,
) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
