//! A minimal HTTP/1.1 server for Prometheus scrapes: `GET /metrics` (and
//! `HEAD`), 404 for other paths, one request per connection.
//!
//! Hand-written on tokio rather than on hyper because a scrape endpoint
//! needs one route and no keep-alive, and anything that can reach the port
//! can send it anything: every request is bounded in size and time,
//! malformed ones get a 400, and nothing a client sends can panic or stall
//! the server.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// The content type of the text exposition format.
pub const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Longest request head read; a scrape's is a few hundred bytes.
const MAX_REQUEST_HEAD_BYTES: usize = 8 * 1024;
/// A connection that has not sent its request and read the answer by then
/// is dropped, so slow or idle clients cannot pile up.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once; more are closed on accept.
const MAX_CONNECTIONS: usize = 64;
/// On shutdown, answers in progress get this long before they are cut.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(1);
/// After a failed accept (e.g. out of file descriptors), wait before the next.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Serves `render()` at `/metrics` on `listener` until `shutdown` is
/// cancelled, followed by the process's span export counts
/// (`dflash_trace_spans_*`) when it exports spans. `render` runs on the async runtime once per scrape, so it
/// should be quick (take a snapshot, format it).
pub async fn serve_metrics<F>(listener: TcpListener, render: F, shutdown: CancellationToken)
where
    F: Fn() -> String + Send + Sync + 'static,
{
    // Every process's scrape also says what became of its spans (nothing
    // when it exports none).
    let render = Arc::new(move || render() + &crate::export::process_export_metrics());
    let mut connections = JoinSet::new();
    loop {
        // Reap finished connections so the set does not grow.
        while let Some(finished) = connections.try_join_next() {
            if let Err(error) = finished {
                warn!(%error, "metrics connection task failed");
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    if connections.len() >= MAX_CONNECTIONS {
                        debug!(%peer, "metrics endpoint busy; closing connection");
                        continue;
                    }
                    let render = render.clone();
                    connections.spawn(async move {
                        match tokio::time::timeout(CONNECTION_TIMEOUT, answer(stream, &*render)).await {
                            Ok(Ok(())) => {}
                            Ok(Err(error)) => debug!(%peer, %error, "metrics connection failed"),
                            Err(_) => debug!(%peer, "metrics connection timed out"),
                        }
                    });
                }
                Err(error) => {
                    warn!(%error, "metrics endpoint cannot accept connections");
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep(ACCEPT_BACKOFF) => {}
                    }
                }
            },
        }
    }
    drop(listener);
    let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        connections.shutdown().await;
    }
}

/// Reads one request and writes its response, then closes.
async fn answer<F: Fn() -> String>(mut stream: TcpStream, render: &F) -> std::io::Result<()> {
    let response = match read_request_head(&mut stream).await? {
        RequestHead::Complete(head) => respond(parse_request_line(&head), render),
        RequestHead::TooLarge => Response::plain(431, "Request Header Fields Too Large"),
        // The client went away before finishing its request: nobody to answer.
        RequestHead::Closed => return Ok(()),
    };
    stream.write_all(&response.into_bytes()).await?;
    stream.shutdown().await
}

enum RequestHead {
    Complete(Vec<u8>),
    TooLarge,
    Closed,
}

/// Reads up to the blank line that ends the head.
async fn read_request_head(stream: &mut TcpStream) -> std::io::Result<RequestHead> {
    let mut head = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    loop {
        let read = stream.read(&mut chunk).await?;
        if read == 0 {
            return Ok(RequestHead::Closed);
        }
        head.extend_from_slice(&chunk[..read]);
        if let Some(end) = find_head_end(&head) {
            head.truncate(end);
            return Ok(RequestHead::Complete(head));
        }
        if head.len() > MAX_REQUEST_HEAD_BYTES {
            return Ok(RequestHead::TooLarge);
        }
    }
}

/// Where the head ends: at `\r\n\r\n`, or `\n\n` from lenient clients.
fn find_head_end(bytes: &[u8]) -> Option<usize> {
    let crlf = bytes.windows(4).position(|window| window == b"\r\n\r\n");
    let lf = bytes.windows(2).position(|window| window == b"\n\n");
    match (crlf, lf) {
        (Some(crlf), Some(lf)) => Some(crlf.min(lf)),
        (found, None) | (None, found) => found,
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Request<'a> {
    /// Method and path (the query string removed).
    Valid {
        method: &'a str,
        path: &'a str,
    },
    Malformed(&'static str),
}

/// Parses `METHOD SP TARGET SP HTTP/1.x` from the head's first line.
fn parse_request_line(head: &[u8]) -> Request<'_> {
    let line_end = head
        .iter()
        .position(|&byte| byte == b'\n')
        .unwrap_or(head.len());
    let Ok(line) = std::str::from_utf8(&head[..line_end]) else {
        return Request::Malformed("request line is not UTF-8");
    };
    let mut parts = line.trim_end_matches('\r').split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Request::Malformed("expected \"METHOD /path HTTP/1.1\"");
    };
    if method.is_empty() || !method.bytes().all(|byte| byte.is_ascii_uppercase()) {
        return Request::Malformed("invalid method");
    }
    if !target.starts_with('/') {
        return Request::Malformed("request target must be an absolute path");
    }
    if !matches!(version, "HTTP/1.0" | "HTTP/1.1") {
        return Request::Malformed("unsupported HTTP version");
    }
    let path = target.split(['?', '#']).next().unwrap_or(target);
    Request::Valid { method, path }
}

fn respond<F: Fn() -> String>(request: Request<'_>, render: &F) -> Response {
    match request {
        Request::Malformed(reason) => Response::plain(400, reason),
        Request::Valid {
            method: "GET",
            path: "/metrics",
        } => Response {
            status: 200,
            content_type: METRICS_CONTENT_TYPE,
            body: render(),
            head_only: false,
            allow: None,
        },
        Request::Valid {
            method: "HEAD",
            path: "/metrics",
        } => Response {
            status: 200,
            content_type: METRICS_CONTENT_TYPE,
            body: render(),
            head_only: true,
            allow: None,
        },
        Request::Valid {
            path: "/metrics", ..
        } => Response {
            allow: Some("GET, HEAD"),
            ..Response::plain(405, "only GET and HEAD are served")
        },
        Request::Valid { .. } => Response::plain(404, "not found: metrics are at /metrics"),
    }
}

struct Response {
    status: u16,
    content_type: &'static str,
    body: String,
    /// HEAD: the headers of the GET answer, no body.
    head_only: bool,
    allow: Option<&'static str>,
}

impl Response {
    fn plain(status: u16, body: &str) -> Response {
        Response {
            status,
            content_type: "text/plain; charset=utf-8",
            body: format!("{body}\n"),
            head_only: false,
            allow: None,
        }
    }

    fn into_bytes(self) -> Vec<u8> {
        let reason = match self.status {
            200 => "OK",
            400 => "Bad Request",
            404 => "Not Found",
            405 => "Method Not Allowed",
            431 => "Request Header Fields Too Large",
            _ => "Error",
        };
        let mut head = format!(
            "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n",
            self.status,
            self.content_type,
            self.body.len()
        );
        if let Some(allow) = self.allow {
            head.push_str("Allow: ");
            head.push_str(allow);
            head.push_str("\r\n");
        }
        head.push_str("\r\n");
        let mut bytes = head.into_bytes();
        if !self.head_only {
            bytes.extend_from_slice(self.body.as_bytes());
        }
        bytes
    }
}

/// How long a metrics endpoint gets to stop once its run is over.
pub const METRICS_STOP_TIMEOUT: Duration = Duration::from_secs(3);

/// Binds a service's `--metrics-listen` address (`None`: no endpoint),
/// before anything else starts, so a taken port fails the service at once.
/// The error names the address.
pub async fn bind_metrics_listener(
    address: Option<std::net::SocketAddr>,
) -> Result<Option<TcpListener>, (std::net::SocketAddr, std::io::Error)> {
    match address {
        Some(address) => TcpListener::bind(address)
            .await
            .map(Some)
            .map_err(|source| (address, source)),
        None => Ok(None),
    }
}

/// A run's metrics endpoint: serves `registry` on an optional listener as an
/// owned task, and stops it (bounded) when the run is over. One shape for
/// every service that serves a [`crate::Registry`].
pub struct MetricsEndpoint {
    task: Option<tokio::task::JoinHandle<()>>,
    stop: CancellationToken,
}

impl MetricsEndpoint {
    /// Starts serving when `listener` is given; stops with `parent` or [`MetricsEndpoint::stop`].
    pub fn start(
        listener: Option<TcpListener>,
        registry: Arc<crate::Registry>,
        parent: &CancellationToken,
    ) -> Self {
        let stop = parent.child_token();
        let task = listener.map(|listener| {
            tracing::info!(address = ?listener.local_addr().ok(), "metrics listening");
            tokio::spawn(serve_metrics(
                listener,
                move || registry.render(),
                stop.clone(),
            ))
        });
        MetricsEndpoint { task, stop }
    }

    /// Serves `registry` on `listener` (if any) while `run` runs, then stops
    /// the endpoint within [`METRICS_STOP_TIMEOUT`]: the shape of a service's
    /// whole run.
    pub async fn during<T>(
        listener: Option<TcpListener>,
        registry: Arc<crate::Registry>,
        parent: &CancellationToken,
        run: impl std::future::Future<Output = T>,
    ) -> T {
        let endpoint = MetricsEndpoint::start(listener, registry, parent);
        let outcome = run.await;
        endpoint.stop(METRICS_STOP_TIMEOUT).await;
        outcome
    }

    /// Stops the endpoint and waits for it at most `timeout`, then aborts it.
    pub async fn stop(self, timeout: Duration) {
        self.stop.cancel();
        if let Some(mut task) = self.task {
            if tokio::time::timeout(timeout, &mut task).await.is_err() {
                warn!("metrics endpoint did not stop in time");
                task.abort();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_lines_parse() {
        assert_eq!(
            parse_request_line(b"GET /metrics HTTP/1.1\r\nHost: x"),
            Request::Valid {
                method: "GET",
                path: "/metrics"
            }
        );
        assert_eq!(
            parse_request_line(b"GET /metrics?name[]=x HTTP/1.0"),
            Request::Valid {
                method: "GET",
                path: "/metrics"
            }
        );
        for bad in [
            &b""[..],
            b"GET",
            b"GET /metrics",
            b"GET /metrics HTTP/2",
            b"GET  /metrics HTTP/1.1",
            b"get /metrics HTTP/1.1",
            b"GET metrics HTTP/1.1",
            b"GET /metrics HTTP/1.1 extra",
            b"\xff\xfe /metrics HTTP/1.1",
        ] {
            assert!(
                matches!(parse_request_line(bad), Request::Malformed(_)),
                "{:?} accepted",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn head_end_is_found_with_either_line_ending() {
        assert_eq!(find_head_end(b"GET / HTTP/1.1\r\n\r\nbody"), Some(14));
        assert_eq!(find_head_end(b"GET / HTTP/1.1\n\n"), Some(14));
        assert_eq!(find_head_end(b"GET / HTTP/1.1\r\nHost: x\r\n"), None);
    }

    #[test]
    fn routes() {
        let render = || "m 1\n".to_string();
        let ok = respond(
            Request::Valid {
                method: "GET",
                path: "/metrics",
            },
            &render,
        );
        assert_eq!((ok.status, ok.body.as_str()), (200, "m 1\n"));
        let head = respond(
            Request::Valid {
                method: "HEAD",
                path: "/metrics",
            },
            &render,
        )
        .into_bytes();
        let head = String::from_utf8(head).unwrap();
        assert!(head.contains("Content-Length: 4\r\n") && head.ends_with("\r\n\r\n"));
        let post = respond(
            Request::Valid {
                method: "POST",
                path: "/metrics",
            },
            &render,
        );
        assert_eq!((post.status, post.allow), (405, Some("GET, HEAD")));
        let other = respond(
            Request::Valid {
                method: "GET",
                path: "/",
            },
            &render,
        );
        assert_eq!(other.status, 404);
    }
}
