//! Serving the broker: the tonic server with health and reflection, the
//! background ticker, and a shutdown bounded in time.

use std::sync::Arc;
use std::time::Duration;

use dflash_proto::v1::broker_server::BrokerServer;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::Server;
use tonic_health::ServingStatus;
use tracing::{info, warn};

use crate::config::{BrokerConfig, ConfigError};
use crate::service::{BrokerService, Shared};

/// HTTP/2 windows sized for hidden-state payloads of tens of MiB: the
/// defaults (about 1 MB) would stall each stream on round trips.
pub const STREAM_WINDOW_BYTES: u32 = 64 << 20;
pub const CONNECTION_WINDOW_BYTES: u32 = 256 << 20;
/// Room for the proto framing around the largest payload.
pub const MESSAGE_OVERHEAD_BYTES: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("reflection service: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("grpc server: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Serves the broker on `listener` until `shutdown` is cancelled, then ends
/// every open stream (UNAVAILABLE), reports NOT_SERVING, and returns within
/// `config.shutdown_timeout` even if a peer does not go away.
pub async fn serve(
    listener: TcpListener,
    config: BrokerConfig,
    shutdown: CancellationToken,
) -> Result<(), ServeError> {
    config.validate()?;
    let internal = CancellationToken::new();
    let shared = Shared::new(config.clone(), internal.clone());
    let service = BrokerService::new(shared.clone());
    let message_limit =
        usize::try_from(config.max_item_bytes + MESSAGE_OVERHEAD_BYTES).unwrap_or(usize::MAX);

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<BrokerServer<BrokerService>>()
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
    let local_address = listener.local_addr().ok();
    info!(address = ?local_address, expected_targets = config.expected_targets, "broker listening");

    let server_stop = CancellationToken::new();
    let server = Server::builder()
        .initial_stream_window_size(Some(STREAM_WINDOW_BYTES))
        .initial_connection_window_size(Some(CONNECTION_WINDOW_BYTES))
        .max_frame_size(Some(1 << 20))
        .http2_keepalive_interval(Some(config.keepalive_interval))
        .http2_keepalive_timeout(Some(config.keepalive_timeout))
        .tcp_nodelay(true)
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(
            BrokerServer::new(service)
                .max_decoding_message_size(message_limit)
                .max_encoding_message_size(message_limit),
        )
        .serve_with_incoming_shutdown(
            TcpListenerStream::new(listener),
            server_stop.clone().cancelled_owned(),
        );
    let mut server = tokio::spawn(server);

    tokio::select! {
        _ = shutdown.cancelled() => {}
        result = &mut server => {
            // The server ended on its own (listener failure).
            internal.cancel();
            ticker.abort();
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
