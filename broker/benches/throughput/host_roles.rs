//! The processes the test bed runs on its hosts: this bench re-executed as
//! `--host-role ROLE --flag value ...` inside a host's network namespace
//! (`ip netns exec`). Each role drives the same synthetic targets and
//! drafters, or the same relay clients, as the loopback sections, talks to
//! the coordinator (`hosts`) in lines on stdin and stdout, and stamps the
//! moments it reports with the wall clock, which every namespace of the
//! machine shares.
//!
//! Roles and their lines (`>` read from stdin, `<` written to stdout):
//! - `targets --broker URL --first F --count C --item-bytes B --items N
//!   [--pace-us P] [--hold-report]`: opens C Produce streams (target-F ...),
//!   `< ready`, `> go`, sends N items on each and finishes; then reports
//!   done and `< done`, or with `--hold-report` `< finished`, `> report`,
//!   reports done and `< reported WALL_NS` (when ReportDone was sent).
//! - `drafters --broker URL --first F --count C --credit K [--step-us S]
//!   [--reconnect] [--record-items] [--keepalive-ms M]`: runs C synthetic
//!   drafters (d-F ...) until end-of-stream, then one line per drafter,
//!   `< drafter ID ITEMS BYTES FIRST_NS LAST_NS BUSY_US EOS_NS RECONNECTS
//!   ITEMS_BEFORE_RECONNECT` (0 for a moment that never came), and with `--record-items` one
//!   `< item ID TARGET SEQ DELIVERY_COUNT` per delivery.
//! - `relay-producers --relay ADDRESS --count C --item-bytes B --items N
//!   [--hold-report]`: C relay producers, `< ready`, `> go`, N items each;
//!   `--hold-report` then waits for `> report` before closing and answers
//!   `< reported WALL_NS` (when the close was sent).
//! - `relay-consumers --relay ADDRESS --count C`: C relay consumers, `<
//!   ready` once connected, then per consumer `< consumer ITEMS BYTES
//!   LAST_NS CLOSED_NS` once the relay closed it.
//! - `rtt --to ADDRESS --count N`: N TCP connection attempts to a port
//!   nobody listens on (each a SYN answered by a RST: one round trip),
//!   `< rtt P50_US P99_US`.
//!
//! Apart from the coordinator because these run in other processes, on
//! other hosts: they know nothing of the bed, only an address to talk to.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dflash_client::{BrokerClient, ClientOptions};
use tokio::io::AsyncWriteExt;

use crate::drafter::{run_drafter, DrafterLoad};
use crate::relay::{relay_connect, relay_consume, relay_write_items};
use crate::transfer::{sample, send_and_finish};

/// Nanoseconds since the Unix epoch at `instant`: the moment as the other
/// processes on the machine can read it.
pub(crate) fn wall_nanos(instant: Instant) -> u128 {
    let now_wall = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970");
    (now_wall.saturating_sub(instant.elapsed())).as_nanos()
}

fn wall_nanos_or_zero(instant: Option<Instant>) -> u128 {
    instant.map_or(0, wall_nanos)
}

/// A role's `--flag value` pairs and bare `--flag`s.
struct Flags(HashMap<String, Option<String>>);

impl Flags {
    fn parse(arguments: &[String]) -> Flags {
        let mut flags = HashMap::new();
        let mut index = 0;
        while index < arguments.len() {
            let name = arguments[index].trim_start_matches("--").to_string();
            let value = arguments
                .get(index + 1)
                .filter(|value| !value.starts_with("--"))
                .cloned();
            index += if value.is_some() { 2 } else { 1 };
            flags.insert(name, value);
        }
        Flags(flags)
    }

    fn text(&self, name: &str) -> String {
        self.0
            .get(name)
            .cloned()
            .flatten()
            .unwrap_or_else(|| panic!("host role: --{name} VALUE is required"))
    }

    fn number(&self, name: &str) -> u64 {
        self.text(name)
            .parse()
            .unwrap_or_else(|error| panic!("host role: --{name}: {error}"))
    }

    fn optional_number(&self, name: &str) -> Option<u64> {
        self.0.contains_key(name).then(|| self.number(name))
    }

    fn present(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }
}

/// Waits for `word` on stdin (the coordinator's signal). Read on a
/// blocking thread: the workspace's tokio has no `io-std`.
async fn wait_for(word: &'static str) {
    let line = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).map(|_| line)
    })
    .await
    .expect("stdin reader")
    .expect("read stdin");
    assert_eq!(line.trim_end(), word, "host role: expected {word:?}");
}

/// Writes one line to the coordinator at once (stdout is a pipe, so Rust's
/// line buffering would hold it otherwise).
fn say(line: &str) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{line}").expect("stdout");
    stdout.flush().expect("stdout");
}

/// Runs the role named by `arguments[0]` with the flags after it.
pub(crate) async fn run_role(arguments: &[String]) {
    let role = arguments.first().expect("--host-role ROLE").as_str();
    let flags = Flags::parse(&arguments[1..]);
    match role {
        "targets" => targets(&flags).await,
        "drafters" => drafters(&flags).await,
        "relay-producers" => relay_producers(&flags).await,
        "relay-consumers" => relay_consumers(&flags).await,
        "rtt" => round_trips(&flags).await,
        other => panic!("no host role {other:?}"),
    }
}

async fn targets(flags: &Flags) {
    let client = BrokerClient::connect(flags.text("broker"), ClientOptions::default())
        .await
        .expect("connect");
    let (first, count, items) = (
        flags.number("first"),
        flags.number("count"),
        flags.number("items"),
    );
    let payload = sample(flags.number("item-bytes") as usize);
    let pace = flags.optional_number("pace-us").map(Duration::from_micros);
    let mut producers = Vec::new();
    for index in first..first + count {
        let target_id = format!("target-{index}");
        producers.push((
            client.produce(&target_id).await.expect("produce"),
            target_id,
        ));
    }
    say("ready");
    wait_for("go").await;
    let mut sending = Vec::new();
    let mut target_ids = Vec::new();
    for (producer, target_id) in producers {
        sending.push(tokio::spawn(send_and_finish(
            producer,
            payload.clone(),
            items,
            pace,
        )));
        target_ids.push(target_id);
    }
    for task in sending {
        task.await.expect("target");
    }
    let reported = if flags.present("hold-report") {
        say("finished");
        wait_for("report").await;
        Some(Instant::now())
    } else {
        None
    };
    for target_id in &target_ids {
        client.report_done(target_id, items).await.expect("done");
    }
    match reported {
        Some(reported) => say(&format!("reported {}", wall_nanos(reported))),
        None => say("done"),
    }
}

async fn drafters(flags: &Flags) {
    let mut options = ClientOptions::default();
    if let Some(milliseconds) = flags.optional_number("keepalive-ms") {
        // A cut link is noticed within interval + timeout on this side too.
        options.keepalive_interval = Duration::from_millis(milliseconds);
        options.keepalive_timeout = Duration::from_millis(2 * milliseconds);
        options.connect_timeout = Duration::from_millis(2 * milliseconds);
    }
    let client = BrokerClient::connect(flags.text("broker"), options)
        .await
        .expect("connect");
    let load = DrafterLoad {
        credit: flags.number("credit") as u32,
        step: flags.optional_number("step-us").map(Duration::from_micros),
        reconnect: flags.present("reconnect"),
        record_items: flags.present("record-items"),
    };
    let first = flags.number("first");
    let mut running = Vec::new();
    for index in first..first + flags.number("count") {
        let drafter_id = format!("d-{index}");
        running.push((
            drafter_id.clone(),
            tokio::spawn(run_drafter(client.clone(), drafter_id, load, None)),
        ));
    }
    for (drafter_id, task) in running {
        let record = task.await.expect("drafter");
        say(&format!(
            "drafter {drafter_id} {} {} {} {} {} {} {} {}",
            record.items,
            record.bytes,
            wall_nanos_or_zero(record.first_received),
            wall_nanos_or_zero(record.last_done),
            record.busy.as_micros(),
            wall_nanos_or_zero(record.end_of_stream),
            record.reconnects,
            record.items_before_reconnect,
        ));
        for received in &record.received {
            say(&format!(
                "item {drafter_id} {} {} {}",
                received.target_id, received.seq, received.delivery_count
            ));
        }
    }
}

async fn relay_producers(flags: &Flags) {
    let address: SocketAddr = flags.text("relay").parse().expect("--relay IP:PORT");
    let payload = Arc::new(vec![7u8; flags.number("item-bytes") as usize]);
    let items = flags.number("items");
    let mut sockets = Vec::new();
    for _ in 0..flags.number("count") {
        sockets.push(relay_connect(address).await);
    }
    say("ready");
    wait_for("go").await;
    let mut writing = Vec::new();
    for mut socket in sockets {
        let payload = payload.clone();
        writing.push(tokio::spawn(async move {
            relay_write_items(&mut socket, &payload, items).await;
            socket
        }));
    }
    let mut sockets = Vec::new();
    for task in writing {
        sockets.push(task.await.expect("relay producer"));
    }
    let reported = if flags.present("hold-report") {
        say("finished");
        wait_for("report").await;
        Some(Instant::now())
    } else {
        None
    };
    for mut socket in sockets {
        let _ = socket.shutdown().await;
    }
    match reported {
        Some(reported) => say(&format!("reported {}", wall_nanos(reported))),
        None => say("done"),
    }
}

async fn relay_consumers(flags: &Flags) {
    let address: SocketAddr = flags.text("relay").parse().expect("--relay IP:PORT");
    let mut sockets = Vec::new();
    for _ in 0..flags.number("count") {
        sockets.push(relay_connect(address).await);
    }
    say("ready");
    let consuming: Vec<_> = sockets
        .into_iter()
        .map(|socket| tokio::spawn(relay_consume(socket)))
        .collect();
    for task in consuming {
        let consumed = task.await.expect("relay consumer");
        say(&format!(
            "consumer {} {} {} {}",
            consumed.items,
            consumed.bytes,
            wall_nanos_or_zero(consumed.last_received),
            wall_nanos(consumed.closed),
        ));
    }
}

async fn round_trips(flags: &Flags) {
    let address: SocketAddr = flags.text("to").parse().expect("--to IP:PORT");
    let mut times = Vec::new();
    for _ in 0..flags.number("count") {
        let started = Instant::now();
        // Refused (a RST) is the answer: one round trip, no listener needed.
        let _ = tokio::net::TcpStream::connect(address).await;
        times.push(started.elapsed());
    }
    times.sort();
    let percentile =
        |fraction: f64| times[((times.len() - 1) as f64 * fraction).round() as usize].as_micros();
    say(&format!("rtt {} {}", percentile(0.5), percentile(0.99)));
}
