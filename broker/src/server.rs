//! Serving the broker: the tonic server with health and reflection, the
//! background ticker, and a shutdown bounded in time.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use dflash_proto::v1::model_sync_server::ModelSyncServer;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Server;
use tonic_health::ServingStatus;
use tracing::{info, warn};

use crate::config::{BrokerConfig, ConfigError};
use crate::service::{BrokerService, Shared};
use crate::zero_copy::BrokerRoutes;
use dflash_proto::v1::broker_server::BrokerServer;

use dflash_proto::transport::{
    BROKER_RECEIVE_STREAM_WINDOW_BYTES, CONNECTION_WINDOW_BYTES, MAX_FRAME_BYTES,
};

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("reflection service: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("grpc server: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error(transparent)]
    Security(#[from] crate::auth::SecurityError),
    #[error("model sync: {0}")]
    ModelSync(#[from] crate::model_sync::checkpoint::CheckpointError),
    #[error("write-ahead log: {0}")]
    StateDir(#[from] crate::wal::WalError),
    #[error("cannot listen for metrics on {address}: {source}")]
    MetricsListen {
        address: SocketAddr,
        source: std::io::Error,
    },
}

/// How long the metrics endpoint gets to stop once the broker is stopping.
const METRICS_STOP_TIMEOUT: Duration = Duration::from_secs(3);

/// Serves the broker on `listener` until `shutdown` is cancelled, then ends
/// every open stream (UNAVAILABLE), reports NOT_SERVING, and returns within
/// `config.shutdown_timeout` even if a peer does not go away. When
/// `config.metrics_listen` is set, also serves Prometheus metrics there.
pub async fn serve(
    listener: TcpListener,
    config: BrokerConfig,
    shutdown: CancellationToken,
) -> Result<(), ServeError> {
    config.validate()?;
    let metrics_listener = match config.metrics_listen {
        Some(address) => Some(
            TcpListener::bind(address)
                .await
                .map_err(|source| ServeError::MetricsListen { address, source })?,
        ),
        None => None,
    };
    serve_with_metrics(listener, metrics_listener, config, shutdown).await
}

/// [`serve`] with the metrics endpoint on an already bound listener (tests
/// bind `127.0.0.1:0` to learn the port) instead of `config.metrics_listen`,
/// or none.
pub async fn serve_with_metrics(
    listener: TcpListener,
    metrics_listener: Option<TcpListener>,
    config: BrokerConfig,
    shutdown: CancellationToken,
) -> Result<(), ServeError> {
    config.validate()?;
    let keepalive_detection = config.keepalive_interval + config.keepalive_timeout;
    if keepalive_detection >= config.target_grace {
        warn!(
            keepalive_seconds = keepalive_detection.as_secs_f64(),
            grace_seconds = config.target_grace.as_secs_f64(),
            "--keepalive-interval + --keepalive-timeout is not below --target-grace: a frozen target is noticed only when keepalive drops its stream, after its grace"
        );
    }
    let security = config.security.load()?;
    let internal = CancellationToken::new();
    let shared = Shared::new(config.clone(), internal.clone())?;
    let service = BrokerService::new(shared.clone());
    let model_sync =
        crate::model_sync::ModelSyncShared::start(config.model_sync.clone(), internal.clone())?;
    shared.set_model_sync(model_sync.clone());
    let message_limit = dflash_proto::transport::message_limit_bytes(config.max_item_bytes);

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<BrokerServer<BrokerService>>()
        .await;
    health_reporter
        .set_serving::<ModelSyncServer<crate::model_sync::ModelSyncService>>()
        .await;
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(dflash_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(dflash_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()?;

    let ticker = tokio::spawn(shared.clone().run_ticker());
    let mut center_writer = tokio::spawn(model_sync.clone().run_background({
        let shared = shared.clone();
        move || shared.run_state()
    }));
    let metrics_stop = CancellationToken::new();
    let metrics = metrics_listener.map(|metrics_listener| {
        info!(address = ?metrics_listener.local_addr().ok(), "metrics listening");
        let shared = shared.clone();
        tokio::spawn(dflash_telemetry::serve_metrics(
            metrics_listener,
            move || shared.metrics_text(),
            metrics_stop.clone(),
        ))
    });
    let local_address = listener.local_addr().ok();
    info!(
        address = ?local_address,
        target_ids = %config.target_ids().join(","),
        tls = security.tls.is_some(),
        token = security.token.is_some(),
        "broker listening"
    );

    let server_stop = CancellationToken::new();
    let mut builder = Server::builder();
    if let Some(tls) = security.tls.clone() {
        builder = builder.tls_config(tls)?;
    }
    // Every service sits behind the token check (a no-op without a token,
    // or for a service the operator exempts).
    let broker_check = security.check(false);
    let server = builder
        // Bounds what a producer pushes beyond --max-queue-bytes while the
        // broker is not reading its stream (see the constant).
        .initial_stream_window_size(Some(BROKER_RECEIVE_STREAM_WINDOW_BYTES))
        .initial_connection_window_size(Some(CONNECTION_WINDOW_BYTES))
        .max_frame_size(Some(MAX_FRAME_BYTES))
        .http2_keepalive_interval(Some(config.keepalive_interval))
        .http2_keepalive_timeout(Some(config.keepalive_timeout))
        .tcp_nodelay(true)
        .add_service(InterceptedService::new(
            health_service,
            security.check(security.health_open),
        ))
        .add_service(InterceptedService::new(
            reflection_v1,
            security.check(security.reflection_open),
        ))
        .add_service(InterceptedService::new(
            reflection_v1alpha,
            security.check(security.reflection_open),
        ))
        .add_service(InterceptedService::new(
            model_sync.server(),
            broker_check.clone(),
        ))
        .add_service(InterceptedService::new(
            BrokerRoutes::new(service, message_limit),
            broker_check,
        ))
        .serve_with_incoming_shutdown(
            // tonic applies `tcp_nodelay` only to sockets it binds itself:
            // set it on each accepted socket, or Nagle's algorithm holds
            // small messages (end-of-stream, acks) for a delayed-ACK period.
            futures::StreamExt::map(TcpListenerStream::new(listener), |accepted| {
                if let Ok(socket) = &accepted {
                    let _ = socket.set_nodelay(true);
                }
                accepted
            }),
            server_stop.clone().cancelled_owned(),
        );
    let mut server = tokio::spawn(server);

    tokio::select! {
        _ = shutdown.cancelled() => {}
        result = &mut server => {
            // The server ended on its own (listener failure).
            internal.cancel();
            ticker.abort();
            center_writer.abort();
            stop_metrics(metrics, &metrics_stop).await;
            return match result {
                Ok(outcome) => outcome.map_err(ServeError::from),
                Err(join_error) => {
                    warn!(%join_error, "grpc server task failed");
                    Ok(())
                }
            };
        }
    }

    info!(state = ?shared.run_state(), "shutting down");
    health_reporter
        .set_not_serving::<BrokerServer<BrokerService>>()
        .await;
    health_reporter
        .set_not_serving::<ModelSyncServer<crate::model_sync::ModelSyncService>>()
        .await;
    health_reporter
        .set_service_status("", ServingStatus::NotServing)
        .await;
    internal.cancel();
    shared.end_all_streams();
    server_stop.cancel();
    let deadline = config.shutdown_timeout;
    match tokio::time::timeout(deadline, &mut server).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(error))) => warn!(%error, "grpc server ended with an error"),
        Ok(Err(join_error)) => warn!(%join_error, "grpc server task failed"),
        Err(_) => {
            warn!(timeout = ?deadline, "open connections did not close in time; cutting them");
            server.abort();
        }
    }
    ticker.abort();
    // The writer stops at the cancelled token; a write it started finishes
    // (bounded) before the last one below.
    if tokio::time::timeout(deadline, &mut center_writer)
        .await
        .is_err()
    {
        warn!("the center writer did not stop in time");
        center_writer.abort();
    }
    // The center as it is now, so a restart resumes from it (the final one
    // when the run completed and it was not written yet).
    let final_center = shared.run_state() == crate::queue::RunState::Complete;
    match tokio::time::timeout(deadline, model_sync.save(final_center)).await {
        Ok(Ok(_)) => {}
        Ok(Err(error)) => warn!(%error, "writing the center on shutdown failed"),
        Err(_) => {
            warn!(timeout = ?deadline, "writing the center on shutdown did not finish in time")
        }
    }
    stop_metrics(metrics, &metrics_stop).await;
    let sessions = model_sync.tasks().clone();
    sessions.close();
    if tokio::time::timeout(Duration::from_secs(2), sessions.wait())
        .await
        .is_err()
    {
        warn!("model sync sessions did not stop in time");
    }
    let tasks = shared.tasks().clone();
    tasks.close();
    if tokio::time::timeout(Duration::from_secs(2), tasks.wait())
        .await
        .is_err()
    {
        warn!("stream readers did not stop in time");
    }
    drop::<Arc<Shared>>(shared);
    info!("broker stopped");
    Ok(())
}

/// Stops the metrics endpoint (it serves until the gRPC side has drained, so
/// the final state can still be scraped) and waits for it, bounded.
async fn stop_metrics(metrics: Option<tokio::task::JoinHandle<()>>, stop: &CancellationToken) {
    stop.cancel();
    if let Some(mut metrics) = metrics {
        if tokio::time::timeout(METRICS_STOP_TIMEOUT, &mut metrics)
            .await
            .is_err()
        {
            warn!("metrics endpoint did not stop in time");
            metrics.abort();
        }
    }
}
