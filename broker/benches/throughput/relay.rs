//! The baseline: a plain TCP store-and-forward relay (this bench binary
//! re-executed with `--serve-relay`) and the same transfer as the broker's
//! through it, with clients that do what the broker's clients must.
//!
//! Apart from the broker's transfer because it is the other side of the
//! comparison: no gRPC, no client library, and half of it runs in its own
//! process.

use std::net::{IpAddr, SocketAddr};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dflash_proto::frames::Copies;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Mutex};

use crate::processes::{ProcessCounters, Received, Server};
use crate::transfer::Transfer;

/// The relay process: `--serve-relay IN_PORT OUT_PORT PRODUCERS CONSUMERS
/// [ADDRESS]` (ADDRESS 127.0.0.1 unless given; a port 0 lets the kernel
/// choose). Accepts `producers` connections on IN_PORT and `consumers` on
/// OUT_PORT, relays length-prefixed items through one FIFO of 8, reads each
/// 8-byte acknowledgement back, and exits when every producer has closed and
/// every item went out. Prints `listening IN_PORT OUT_PORT` (the bound
/// ports) once both are bound.
pub(crate) async fn serve_relay(
    address: IpAddr,
    inbound_port: u16,
    outbound_port: u16,
    producers: usize,
    consumers: usize,
) {
    let inbound = TcpListener::bind((address, inbound_port))
        .await
        .expect("bind");
    let outbound = TcpListener::bind((address, outbound_port))
        .await
        .expect("bind");
    let port = |listener: &TcpListener| listener.local_addr().expect("bound address").port();
    println!("listening {} {}", port(&inbound), port(&outbound));
    let (frames_in, frames_out) = mpsc::channel::<Vec<u8>>(8);
    let frames_out = Arc::new(Mutex::new(frames_out));
    let relay_in = tokio::spawn(async move {
        let mut readers = Vec::new();
        for _ in 0..producers {
            let (mut socket, _) = inbound.accept().await.expect("accept");
            let frames_in = frames_in.clone();
            readers.push(tokio::spawn(async move {
                while let Ok(length) = socket.read_u64().await {
                    let mut frame = vec![0u8; length as usize];
                    socket.read_exact(&mut frame).await.expect("read frame");
                    if frames_in.send(frame).await.is_err() {
                        break;
                    }
                }
            }));
        }
        drop(frames_in);
        for reader in readers {
            let _ = reader.await;
        }
    });
    let mut writers = Vec::new();
    for _ in 0..consumers {
        let (socket, _) = outbound.accept().await.expect("accept");
        let frames_out = frames_out.clone();
        writers.push(tokio::spawn(async move {
            let (mut reading, mut writing) = socket.into_split();
            let acks = tokio::spawn(async move { while reading.read_u64().await.is_ok() {} });
            loop {
                let frame = frames_out.lock().await.recv().await;
                let Some(frame) = frame else { break };
                writing.write_u64(frame.len() as u64).await.expect("write");
                writing.write_all(&frame).await.expect("write");
            }
            let _ = writing.shutdown().await;
            let _ = acks.await;
        }));
    }
    for writer in writers {
        let _ = writer.await;
    }
    let _ = relay_in.await;
}

/// The same transfer through the relay process.
pub(crate) async fn relay_transfer(
    item_bytes: usize,
    items: u64,
    producers: u64,
    consumers: u64,
) -> Transfer {
    // Port 0: the relay binds what the kernel gives it and says which (a
    // port found free beforehand could be taken again before it binds).
    let mut child = Command::new(std::env::current_exe().expect("this bench's path"))
        .args([
            "--serve-relay",
            "0",
            "0",
            &producers.to_string(),
            &consumers.to_string(),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the relay");
    let stdout = child.stdout.take().expect("the relay's stdout");
    let relay = Server {
        pid: child.id().to_string(),
        child,
    };
    let (inbound_port, outbound_port) = read_listening_ports(stdout).await;
    let inbound_address = SocketAddr::from(([127, 0, 0, 1], inbound_port));
    let outbound_address = SocketAddr::from(([127, 0, 0, 1], outbound_port));
    let per_producer = items / producers;

    let mut readers = Vec::new();
    for _ in 0..consumers {
        let socket = relay_connect(outbound_address).await;
        readers.push(tokio::spawn(relay_consume(socket)));
    }
    let payload = Arc::new(vec![7u8; item_bytes]);
    let server_before = relay.counters();
    let clients_before = ProcessCounters::read("self");
    let started = Instant::now();
    let mut writers = Vec::new();
    for _ in 0..producers {
        let socket = relay_connect(inbound_address).await;
        writers.push(tokio::spawn(relay_produce(
            socket,
            payload.clone(),
            per_producer,
        )));
    }
    for writer in writers {
        writer.await.expect("writer");
    }
    let mut bytes = 0;
    for reader in readers {
        bytes += reader.await.expect("reader").bytes;
    }
    let seconds = started.elapsed().as_secs_f64();
    let server = relay.counters().since(server_before);
    let clients = ProcessCounters::read("self").since(clients_before);
    assert_eq!(
        bytes,
        per_producer * producers * item_bytes as u64,
        "relay lost bytes"
    );
    Transfer {
        bytes_per_second: bytes as f64 / seconds,
        server,
        clients,
        seconds,
        copies: Copies::default(),
        received: Received::default(),
        second_half: None,
        peak_rss_mib: 0.0,
    }
}

/// The relay's `listening IN_PORT OUT_PORT` line (it prints it once both
/// ports are bound), read on a blocking thread; fails after 60 s.
async fn read_listening_ports(stdout: std::process::ChildStdout) -> (u16, u16) {
    let reading = tokio::task::spawn_blocking(move || {
        use std::io::BufRead as _;
        let mut line = String::new();
        std::io::BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read the relay's stdout");
        line
    });
    let line = tokio::time::timeout(Duration::from_secs(60), reading)
        .await
        .expect("the relay never listened")
        .expect("reader");
    let ports: Vec<u16> = line
        .strip_prefix("listening ")
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|port| port.parse().ok())
        .collect();
    match ports[..] {
        [inbound, outbound] => (inbound, outbound),
        _ => panic!("the relay said {line:?}, not `listening IN_PORT OUT_PORT`"),
    }
}

/// A relay client's connection (no Nagle delay, as gRPC's).
pub(crate) async fn relay_connect(address: SocketAddr) -> TcpStream {
    let socket = TcpStream::connect(address).await.expect("connect");
    socket.set_nodelay(true).expect("nodelay");
    socket
}

/// A relay producer: writes `items` length-prefixed copies of `payload`
/// from memory, then closes its side.
pub(crate) async fn relay_produce(mut socket: TcpStream, payload: Arc<Vec<u8>>, items: u64) {
    relay_write_items(&mut socket, &payload, items).await;
    let _ = socket.shutdown().await;
}

/// Writes `items` length-prefixed copies of `payload`, each from memory.
pub(crate) async fn relay_write_items(socket: &mut TcpStream, payload: &[u8], items: u64) {
    for _ in 0..items {
        socket.write_u64(payload.len() as u64).await.expect("write");
        socket.write_all(payload).await.expect("write");
    }
}

/// What one relay consumer received until the relay closed its socket.
pub(crate) struct RelayConsumed {
    pub(crate) items: u64,
    pub(crate) bytes: u64,
    /// When its last item was read whole.
    pub(crate) last_received: Option<Instant>,
    /// When the relay closed the socket (the relay's end-of-stream).
    pub(crate) closed: Instant,
}

/// A relay consumer: reads each item into a fresh buffer, as a gRPC client
/// decodes one, and answers each with an 8-byte acknowledgement.
pub(crate) async fn relay_consume(socket: TcpStream) -> RelayConsumed {
    let (mut reading, mut writing) = socket.into_split();
    let (mut items, mut bytes, mut last_received) = (0u64, 0u64, None);
    while let Ok(length) = reading.read_u64().await {
        let mut frame = vec![0u8; length as usize];
        reading.read_exact(&mut frame).await.expect("read");
        bytes += frame.len() as u64;
        items += 1;
        last_received = Some(Instant::now());
        writing.write_u64(items).await.expect("ack");
    }
    RelayConsumed {
        items,
        bytes,
        last_received,
        closed: Instant::now(),
    }
}
