//! The processes the bench measures and how it reads them: the broker
//! binary started on a port the kernel chose (and killed on drop), and their minor page
//! faults, CPU time and peak RSS from `/proc`, and the broker's own payload
//! counters from its `/metrics`.
//!
//! Apart from the sections because every section starts brokers and reads
//! these counters the same way; the relay reuses [`Server`] too.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Linux reports CPU time in /proc in units of USER_HZ, which the kernel ABI
/// fixes at 100 per second on every architecture Rust targets here.
const USER_HZ: f64 = 100.0;

/// Minor page faults and CPU seconds (user + system) of a process so far.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ProcessCounters {
    pub(crate) minor_faults: u64,
    pub(crate) cpu_seconds: f64,
}

impl ProcessCounters {
    /// Reads `/proc/<pid>/stat` (`self` for this process). The command name
    /// (field 2) may hold spaces, so fields are counted after its `)`.
    pub(crate) fn read(pid: &str) -> ProcessCounters {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
        let fields: Vec<&str> = after_name.split_whitespace().collect();
        // After the name: state is field 3, so field N is fields[N - 3].
        let field = |number: usize| -> u64 {
            fields
                .get(number - 3)
                .and_then(|value| value.parse().ok())
                .unwrap_or(0)
        };
        ProcessCounters {
            minor_faults: field(10),
            cpu_seconds: (field(14) + field(15)) as f64 / USER_HZ,
        }
    }

    pub(crate) fn since(self, earlier: ProcessCounters) -> ProcessCounters {
        ProcessCounters {
            minor_faults: self.minor_faults.saturating_sub(earlier.minor_faults),
            cpu_seconds: (self.cpu_seconds - earlier.cpu_seconds).max(0.0),
        }
    }
}

/// CPU time a process's threads have run so far, from each thread's
/// `schedstat` (nanoseconds, unlike `stat`'s 10 ms ticks, so a fan-out of a
/// few milliseconds is measured, not sampled).
pub(crate) fn process_cpu(pid: &str) -> Duration {
    let Ok(threads) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Duration::ZERO;
    };
    threads
        .filter_map(Result::ok)
        .filter_map(|thread| std::fs::read_to_string(thread.path().join("schedstat")).ok())
        .filter_map(|line| line.split_whitespace().next()?.parse::<u64>().ok())
        .map(Duration::from_nanos)
        .sum()
}

/// A relaying process (the broker binary or the relay), killed on drop.
pub(crate) struct Server {
    pub(crate) child: Child,
    pub(crate) pid: String,
}

impl Server {
    pub(crate) fn counters(&self) -> ProcessCounters {
        ProcessCounters::read(&self.pid)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts the broker binary for `targets` targets on a port the kernel
/// chooses (`--listen 127.0.0.1:0`, read back from its `--ready-file`),
/// with `extra` flags; its log goes to `log` (a temporary folder's file).
pub(crate) async fn start_broker_with(targets: u64, extra: &[String]) -> (Server, String) {
    let (server, address, _log) = start_broker_logging(targets, extra, "warn").await;
    (server, address)
}

/// [`start_broker_with`] with `RUST_LOG` set to `log_filter`; also returns
/// the folder holding its `broker.log` (kept while the folder lives).
pub(crate) async fn start_broker_logging(
    targets: u64,
    extra: &[String],
    log_filter: &str,
) -> (Server, String, tempfile::TempDir) {
    let folder = tempfile::tempdir().expect("a temporary folder");
    let ready = folder.path().join("broker.address");
    let log = std::fs::File::create(folder.path().join("broker.log")).expect("the broker's log");
    let child = Command::new(env!("CARGO_BIN_EXE_broker"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--expected-targets",
            &targets.to_string(),
            "--max-queue-bytes",
            "1GiB",
        ])
        .arg("--ready-file")
        .arg(&ready)
        .args(extra)
        .env("RUST_LOG", log_filter)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start the broker binary");
    let pid = child.id().to_string();
    let mut server = Server { child, pid };
    let deadline = Instant::now() + Duration::from_secs(60);
    let address = loop {
        // Written whole (by rename) once the broker listens.
        if let Ok(address) = std::fs::read_to_string(&ready) {
            break address.trim().to_string();
        }
        if let Ok(Some(status)) = server.child.try_wait() {
            let log = std::fs::read_to_string(folder.path().join("broker.log")).unwrap_or_default();
            panic!("the broker exited ({status}) before it listened:\n{log}");
        }
        assert!(Instant::now() < deadline, "the broker never listened");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    (server, format!("http://{address}"), folder)
}

/// Starts the broker with its metrics endpoint on a port the kernel
/// chooses: the broker's address and the endpoint's, read from its log
/// line `metrics listening address=Some(127.0.0.1:PORT)`.
pub(crate) async fn start_broker_with_metrics(
    targets: u64,
    extra: &[String],
) -> (Server, String, SocketAddr) {
    let mut flags = vec!["--metrics-listen".to_string(), "127.0.0.1:0".to_string()];
    flags.extend_from_slice(extra);
    let (server, address, folder) =
        start_broker_logging(targets, &flags, "warn,dflash_broker::server=info").await;
    let log_path = folder.path().join("broker.log");
    let deadline = Instant::now() + Duration::from_secs(60);
    let metrics = loop {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        let found = log
            .lines()
            .filter(|line| line.contains("metrics listening"))
            .find_map(|line| {
                let after = line.split("address=Some(").nth(1)?;
                after.split(')').next()?.parse::<SocketAddr>().ok()
            });
        if let Some(metrics) = found {
            break metrics;
        }
        assert!(
            Instant::now() < deadline,
            "the broker never said where its metrics listen:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    (server, address, metrics)
}

pub(crate) async fn start_broker(targets: u64) -> (Server, String) {
    start_broker_with(targets, &[]).await
}

/// A process's peak resident set (VmHWM) in MiB.
pub(crate) fn peak_rss_mib(pid: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|line| line.starts_with("VmHWM:"))
                .and_then(|line| line.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

/// The broker's `dflash_broker_received_payloads_total` by frames.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Received {
    pub(crate) one_frame: f64,
    pub(crate) several_frames: f64,
    pub(crate) slices: f64,
}

/// GET `/metrics` from the broker's metrics port and read the counters of
/// how payloads arrived.
pub(crate) fn scrape_received(metrics_port: u16) -> Received {
    use std::io::{Read, Write};
    let mut text = String::new();
    if let Ok(mut socket) = std::net::TcpStream::connect(("127.0.0.1", metrics_port)) {
        let _ = socket.write_all(b"GET /metrics HTTP/1.0\r\nHost: bench\r\n\r\n");
        let _ = socket.read_to_string(&mut text);
    }
    let value = |prefix: &str| -> f64 {
        text.lines()
            .find(|line| line.starts_with(prefix))
            .and_then(|line| line.rsplit(' ').next())
            .and_then(|value| value.parse().ok())
            .unwrap_or(0.0)
    };
    Received {
        one_frame: value("dflash_broker_received_payloads_total{frames=\"one\"}"),
        several_frames: value("dflash_broker_received_payloads_total{frames=\"several\"}"),
        slices: value("dflash_broker_received_payload_slices_total"),
    }
}
