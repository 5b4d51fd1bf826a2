//! The coordinator's side of the test bed: the bed `scripts/hosts.sh run`
//! describes, the broker, relay and role processes it starts on the bed's
//! hosts (with `ip netns exec`), and the lines those processes write.
//!
//! Apart from the figures (`hosts`) because this is plumbing every figure
//! shares: how to place a process on a host and talk to it, not what to
//! measure.

use std::process::Stdio;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dflash_client::{BrokerClient, ClientOptions};
use dflash_proto::v1 as proto;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

/// The bed `scripts/hosts.sh run` describes in `DFLASH_HOSTS_*`.
pub(crate) struct Bed {
    /// Host i's network namespace.
    pub(crate) namespaces: Vec<String>,
    /// Host i's IPv4 address.
    pub(crate) addresses: Vec<String>,
    /// The bed's script, for `profile NAME` and `link HOST up|down`.
    pub(crate) script: String,
    /// The profiles this kernel can apply, in the script's order.
    pub(crate) profiles: Vec<String>,
    /// The others, each `name:reason`.
    pub(crate) skipped: Vec<String>,
}

impl Bed {
    /// The bed this process runs in, or none outside `scripts/hosts.sh run`.
    pub(crate) fn from_environment() -> Option<Bed> {
        let list = |name: &str| -> Vec<String> {
            std::env::var(name)
                .unwrap_or_default()
                .split_whitespace()
                .map(str::to_string)
                .collect()
        };
        let namespaces = list("DFLASH_HOSTS_NAMESPACES");
        if namespaces.is_empty() {
            return None;
        }
        Some(Bed {
            addresses: list("DFLASH_HOSTS_ADDRESSES"),
            script: std::env::var("DFLASH_HOSTS_SCRIPT").ok()?,
            profiles: list("DFLASH_HOSTS_PROFILES"),
            skipped: list("DFLASH_HOSTS_SKIPPED"),
            namespaces,
        })
    }

    pub(crate) fn script(&self, arguments: &[&str]) {
        let status = std::process::Command::new("bash")
            .arg(&self.script)
            .args(arguments)
            .status()
            .expect("run the bed's script");
        assert!(status.success(), "hosts.sh {arguments:?} failed");
    }

    pub(crate) fn apply_profile(&self, profile: &str) {
        self.script(&["profile", profile]);
    }

    pub(crate) fn set_link(&self, host: usize, up: bool) {
        self.script(&["link", &host.to_string(), if up { "up" } else { "down" }]);
    }

    /// This bench as `--host-role ROLE ARGUMENTS` on `host`.
    pub(crate) fn spawn_role(&self, host: usize, role: &str, arguments: &[String]) -> RoleProcess {
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.namespaces[host]])
            .arg(std::env::current_exe().expect("this bench's path"))
            .args(["--host-role", role])
            .args(arguments)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start a host role");
        RoleProcess {
            stdin: child.stdin.take().expect("piped stdin"),
            lines: BufReader::new(child.stdout.take().expect("piped stdout")).lines(),
            child,
            description: format!("{role} on h{host}"),
        }
    }

    /// A broker process on `host` for `targets` targets, killed on drop.
    pub(crate) async fn start_broker(
        &self,
        host: usize,
        port: u16,
        targets: usize,
        extra: &[&str],
    ) -> (BrokerProcess, String) {
        let listen = format!("{}:{port}", self.addresses[host]);
        let child = Command::new("ip")
            .args(["netns", "exec", &self.namespaces[host]])
            .arg(env!("CARGO_BIN_EXE_broker"))
            .args(["--listen", &listen, "--expected-targets"])
            .arg(targets.to_string())
            .args(["--max-queue-bytes", "1GiB"])
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start the broker binary");
        let address = format!("http://{listen}");
        let deadline = Instant::now() + Duration::from_secs(30);
        let client = loop {
            if let Ok(client) =
                BrokerClient::connect(address.clone(), ClientOptions::default()).await
            {
                break client;
            }
            assert!(Instant::now() < deadline, "no broker on {listen}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        (
            BrokerProcess {
                _child: child,
                client,
            },
            address,
        )
    }

    /// The relay process on `host` for `producers` and `consumers`, once it
    /// listens; its two addresses.
    pub(crate) async fn start_relay(
        &self,
        host: usize,
        port: u16,
        producers: usize,
        consumers: usize,
    ) -> (RoleProcess, String, String) {
        let address = &self.addresses[host];
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.namespaces[host]])
            .arg(std::env::current_exe().expect("this bench's path"))
            .arg("--serve-relay")
            .args([
                port.to_string(),
                (port + 1).to_string(),
                producers.to_string(),
                consumers.to_string(),
                address.clone(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start the relay");
        let mut relay = RoleProcess {
            stdin: child.stdin.take().expect("piped stdin"),
            lines: BufReader::new(child.stdout.take().expect("piped stdout")).lines(),
            child,
            description: format!("relay on h{host}"),
        };
        // Its own namespace: the ports are this host's to give, and the
        // relay names the ones it bound.
        let bound = relay.expect_value("listening").await;
        assert_eq!(
            bound,
            format!("{port} {}", port + 1),
            "{}",
            relay.description
        );
        (
            relay,
            format!("{address}:{port}"),
            format!("{address}:{}", port + 1),
        )
    }
}

/// A broker on a host; the coordinator's client reads its status.
pub(crate) struct BrokerProcess {
    _child: Child,
    client: BrokerClient,
}

impl BrokerProcess {
    pub(crate) async fn status(&self) -> proto::StatusSnapshot {
        self.client.status().await.expect("status")
    }

    /// Polls the status until `condition` holds (within `bound`).
    pub(crate) async fn wait_until(
        &self,
        what: &str,
        bound: Duration,
        condition: impl Fn(&proto::StatusSnapshot) -> bool,
    ) -> proto::StatusSnapshot {
        let deadline = Instant::now() + bound;
        loop {
            let status = self.status().await;
            if condition(&status) {
                return status;
            }
            assert!(Instant::now() < deadline, "waited {bound:?} for {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    pub(crate) async fn wait_connected_drafters(&self, drafters: usize) {
        self.wait_until(
            "the drafters to connect",
            Duration::from_secs(60),
            |status| connected_drafters(status) >= drafters,
        )
        .await;
    }
}

pub(crate) fn connected_drafters(status: &proto::StatusSnapshot) -> usize {
    status
        .drafters
        .iter()
        .filter(|drafter| drafter.connected)
        .count()
}

/// A role process on a host and its lines.
pub(crate) struct RoleProcess {
    child: Child,
    stdin: ChildStdin,
    lines: tokio::io::Lines<BufReader<ChildStdout>>,
    description: String,
}

impl RoleProcess {
    pub(crate) async fn next_line(&mut self) -> Option<String> {
        self.lines.next_line().await.expect("read a role's line")
    }

    /// The next line must be `word`.
    pub(crate) async fn expect(&mut self, word: &str) {
        let line = self.next_line().await;
        assert_eq!(
            line.as_deref(),
            Some(word),
            "{}: expected {word:?}",
            self.description
        );
    }

    /// The next line must start with `word`; the rest of it.
    pub(crate) async fn expect_value(&mut self, word: &str) -> String {
        let line = self.next_line().await.unwrap_or_default();
        line.strip_prefix(word)
            .map(|rest| rest.trim().to_string())
            .unwrap_or_else(|| panic!("{}: expected {word:?}, got {line:?}", self.description))
    }

    pub(crate) async fn say(&mut self, line: &str) {
        self.stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .expect("write to a role");
        self.stdin.flush().await.expect("write to a role");
    }

    /// Every remaining line, once the process exited successfully.
    pub(crate) async fn finish(mut self) -> Vec<String> {
        let mut lines = Vec::new();
        while let Some(line) = self.next_line().await {
            lines.push(line);
        }
        let status = self.child.wait().await.expect("wait for a role");
        assert!(status.success(), "{} failed: {status}", self.description);
        lines
    }
}

pub(crate) fn now_nanos() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_nanos()
}

/// A drafter's line as `host_roles` writes it.
pub(crate) struct DrafterLine {
    pub(crate) drafter_id: String,
    pub(crate) items: u64,
    pub(crate) bytes: u64,
    pub(crate) first_ns: u128,
    pub(crate) last_ns: u128,
    pub(crate) busy_us: u64,
    pub(crate) end_of_stream_ns: u128,
    pub(crate) reconnects: u64,
    pub(crate) items_before_reconnect: u64,
}

pub(crate) fn drafter_lines(lines: &[String]) -> Vec<DrafterLine> {
    lines
        .iter()
        .filter_map(|line| line.strip_prefix("drafter "))
        .map(|rest| {
            let fields: Vec<&str> = rest.split_whitespace().collect();
            let number = |index: usize| -> u128 { fields[index].parse().expect("a number") };
            DrafterLine {
                drafter_id: fields[0].to_string(),
                items: number(1) as u64,
                bytes: number(2) as u64,
                first_ns: number(3),
                last_ns: number(4),
                busy_us: number(5) as u64,
                end_of_stream_ns: number(6),
                reconnects: number(7) as u64,
                items_before_reconnect: number(8) as u64,
            }
        })
        .collect()
}

/// Ports for the next broker or relay: each gets fresh ones, so no start
/// waits on a previous listener's TIME_WAIT.
pub(crate) struct Ports(pub(crate) u16);

impl Ports {
    pub(crate) fn next(&mut self) -> u16 {
        self.0 += 2;
        self.0
    }
}

pub(crate) fn arguments(pairs: &[(&str, String)], bare: &[&str]) -> Vec<String> {
    let mut list = Vec::new();
    for (name, value) in pairs {
        list.push(format!("--{name}"));
        list.push(value.clone());
    }
    list.extend(bare.iter().map(|name| format!("--{name}")));
    list
}
