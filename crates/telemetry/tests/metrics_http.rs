//! The metrics endpoint over real loopback TCP: scrapes, wrong paths and
//! malformed requests, and shutdown.

// Helpers outside #[test] functions fail the test by panicking, as the tests do.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dflash_telemetry::{serve_metrics, Registry, METRICS_CONTENT_TYPE};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

struct Server {
    address: std::net::SocketAddr,
    shutdown: CancellationToken,
    handle: tokio::task::JoinHandle<()>,
}

async fn start(render: impl Fn() -> String + Send + Sync + 'static) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    let handle = tokio::spawn(serve_metrics(listener, render, shutdown.clone()));
    Server {
        address,
        shutdown,
        handle,
    }
}

/// Sends raw bytes, returns everything the server answered before closing.
async fn exchange(address: std::net::SocketAddr, request: &[u8]) -> String {
    let mut stream = TcpStream::connect(address).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
        .await
        .expect("server answered and closed in time")
        .unwrap();
    String::from_utf8(answer).unwrap()
}

#[tokio::test]
async fn scrape_returns_the_current_exposition() {
    let registry = Arc::new(Registry::new());
    let scrapes = registry
        .counter("test_scrapes_total", "Scrapes served.")
        .unwrap();
    let render_registry = registry.clone();
    let server = start(move || {
        scrapes.increment();
        render_registry.render()
    })
    .await;

    let first = exchange(
        server.address,
        b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n",
    )
    .await;
    assert!(first.starts_with("HTTP/1.1 200 OK\r\n"), "{first}");
    assert!(
        first.contains(&format!("Content-Type: {METRICS_CONTENT_TYPE}\r\n")),
        "{first}"
    );
    let (head, body) = first.split_once("\r\n\r\n").unwrap();
    assert!(
        head.contains(&format!("Content-Length: {}", body.len())),
        "{head}"
    );
    assert!(
        body.contains("# TYPE test_scrapes_total counter\n"),
        "{body}"
    );
    assert!(body.contains("test_scrapes_total 1\n"), "{body}");

    // Each scrape renders anew.
    let second = exchange(server.address, b"GET /metrics?x=1 HTTP/1.0\r\n\r\n").await;
    assert!(second.contains("test_scrapes_total 2\n"), "{second}");

    server.shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(5), server.handle)
        .await
        .expect("serve_metrics returned after shutdown")
        .unwrap();
}

#[tokio::test]
async fn other_paths_and_bad_requests_get_errors_and_the_server_keeps_serving() {
    let renders = Arc::new(AtomicU64::new(0));
    let counted = renders.clone();
    let server = start(move || {
        counted.fetch_add(1, Ordering::Relaxed);
        "up 1\n".to_string()
    })
    .await;

    let not_found = exchange(server.address, b"GET / HTTP/1.1\r\n\r\n").await;
    assert!(not_found.starts_with("HTTP/1.1 404 "), "{not_found}");
    let post = exchange(server.address, b"POST /metrics HTTP/1.1\r\n\r\n").await;
    assert!(post.starts_with("HTTP/1.1 405 "), "{post}");
    let garbage = exchange(server.address, b"\x00\xff garbage\r\n\r\n").await;
    assert!(garbage.starts_with("HTTP/1.1 400 "), "{garbage}");
    // One byte over the limit, all of it read by the server before it answers.
    let huge = vec![b'a'; 8 * 1024 + 1];
    let too_large = exchange(server.address, &huge).await;
    assert!(too_large.starts_with("HTTP/1.1 431 "), "{too_large}");
    // A client that connects and leaves without a request.
    drop(TcpStream::connect(server.address).await.unwrap());
    assert_eq!(renders.load(Ordering::Relaxed), 0, "errors must not render");

    let ok = exchange(server.address, b"GET /metrics HTTP/1.1\r\n\r\n").await;
    assert!(
        ok.starts_with("HTTP/1.1 200 OK\r\n") && ok.ends_with("\r\n\r\nup 1\n"),
        "{ok}"
    );
    let head = exchange(server.address, b"HEAD /metrics HTTP/1.1\r\n\r\n").await;
    assert!(
        head.starts_with("HTTP/1.1 200 OK\r\n") && head.ends_with("\r\n\r\n"),
        "{head}"
    );

    server.shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(5), server.handle)
        .await
        .expect("serve_metrics returned after shutdown")
        .unwrap();
    assert!(
        TcpStream::connect(server.address).await.is_err(),
        "listener still open after shutdown"
    );
}
