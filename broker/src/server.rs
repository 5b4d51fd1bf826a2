//! Serving the broker: the tonic server with health and reflection, the
//! background ticker, and a shutdown bounded in time.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use dflash_proto::v1::lighthouse_server::LighthouseServer;
use dflash_proto::v1::model_sync_server::ModelSyncServer;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::server::Router;
use tonic::transport::Server;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;
use tonic_reflection::server::{v1 as reflection_v1, v1alpha as reflection_v1alpha};
use tracing::{info, warn};

use crate::auth::ServerSecurity;
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
    ModelSync(#[from] crate::run_model::checkpoint::CheckpointError),
    /// Not the error's source: `main` prints the chain (`{:#}`), which
    /// would repeat the whole message.
    #[error("write-ahead log: {0}")]
    StateDir(crate::wal::WalError),
    #[error("cannot listen for metrics on {address}: {source}")]
    MetricsListen {
        address: SocketAddr,
        source: std::io::Error,
    },
}

impl From<crate::wal::WalError> for ServeError {
    fn from(error: crate::wal::WalError) -> Self {
        ServeError::StateDir(error)
    }
}

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
    let metrics_listener = dflash_telemetry::bind_metrics_listener(config.metrics_listen)
        .await
        .map_err(|(address, source)| ServeError::MetricsListen { address, source })?;
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
    warn_if_keepalive_outlasts_grace(&config);
    let security = config.security.load()?;
    let internal = CancellationToken::new();
    let shared = Shared::new(config.clone(), internal.clone())?;
    let service = BrokerService::new(shared.clone());
    let model_sync = crate::run_model::service::ModelSyncShared::start(
        config.model_sync.run_model_settings(),
        config.hello_timeout,
        internal.clone(),
    )?;
    shared.set_model_sync(model_sync.clone());
    let lighthouse = Arc::new(crate::lighthouse::hub::LighthouseHub::new(
        config.lighthouse.settings(),
    ));
    {
        let ledger: Arc<dyn crate::lighthouse::hub::StepLedger> = shared.clone();
        lighthouse.connect(Arc::downgrade(&ledger), shared.commit_record());
    }
    shared.set_lighthouse(lighthouse.clone());

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    report_serving(&health_reporter).await;
    let health_follower = tokio::spawn(follow_log_stalls(
        shared.log_stalled(),
        health_reporter.clone(),
    ));
    let reflection = reflection_services()?;
    let background = Background::spawn(&shared, &model_sync, metrics_listener);
    log_listening(&listener, &config, &security);

    let server_stop = CancellationToken::new();
    let router = grpc_router(
        &config,
        &security,
        health_service,
        reflection,
        &model_sync,
        crate::lighthouse::rpc::LighthouseService::server(lighthouse, internal.clone()),
        service,
    )?;
    let mut server = tokio::spawn(router.serve_with_incoming_shutdown(
        crate::connections::capped_incoming(
            listener,
            config.max_connections,
            config.max_connections_per_peer,
        ),
        server_stop.clone().cancelled_owned(),
    ));

    tokio::select! {
        _ = shutdown.cancelled() => {}
        result = &mut server => {
            // The server ended on its own (listener failure).
            internal.cancel();
            background.abort().await;
            return match result {
                Ok(outcome) => outcome.map_err(ServeError::from),
                Err(join_error) => {
                    warn!(%join_error, "grpc server task failed");
                    Ok(())
                }
            };
        }
    }

    info!(state = ?shared.broker_state(), "shutting down");
    health_follower.abort();
    report_not_serving(&health_reporter).await;
    internal.cancel();
    shared.end_all_streams();
    server_stop.cancel();
    let deadline = config.shutdown_timeout;
    drain_server(server, deadline).await;
    // Every answer still waiting for the write-ahead log is sent, and the
    // log synced, before the process can exit.
    shared.close_log();
    background.ticker.abort();
    stop_model_writer(background.model_writer, deadline).await;
    save_model_on_shutdown(&shared, &model_sync, deadline).await;
    stop_metrics(background.metrics, &background.metrics_stop).await;
    wait_for_tasks(&model_sync, &shared).await;
    drop::<Arc<Shared>>(shared);
    info!("broker stopped");
    Ok(())
}

/// Warns when keepalive would notice a frozen target only after its grace
/// ran out (the flags are legal, but the grace then decides, not keepalive).
fn warn_if_keepalive_outlasts_grace(config: &BrokerConfig) {
    let keepalive_detection = config.keepalive_interval + config.keepalive_timeout;
    if keepalive_detection >= config.target_grace {
        warn!(
            keepalive_seconds = keepalive_detection.as_secs_f64(),
            grace_seconds = config.target_grace.as_secs_f64(),
            "--keepalive-interval + --keepalive-timeout is not below --target-grace: a frozen target is noticed only when keepalive drops its stream, after its grace"
        );
    }
}

/// Reports both broker services SERVING on the health service.
async fn report_serving(health_reporter: &HealthReporter) {
    health_reporter
        .set_serving::<BrokerServer<BrokerService>>()
        .await;
    health_reporter
        .set_serving::<ModelSyncServer<crate::run_model::service::ModelSyncService>>()
        .await;
    health_reporter
        .set_serving::<LighthouseServer<crate::lighthouse::rpc::LighthouseService>>()
        .await;
}

/// The Broker service is NOT_SERVING while the write-ahead log cannot
/// write (no space, EIO: answers are held back until it can), SERVING
/// again when it can: readiness follows the disk, liveness (the server as
/// a whole, `""`) does not, since restarting would not make room.
///
/// Only a change is reported: every report reaches each health Watch
/// stream as a message, even one that repeats the status, so a SERVING
/// repeated at start-up would be a client's next message where it waits
/// for the next change (NOT_SERVING at shutdown).
async fn follow_log_stalls(
    mut stalled: tokio::sync::watch::Receiver<Option<String>>,
    health_reporter: HealthReporter,
) {
    // `report_serving` made the service SERVING before this started.
    let mut serving = true;
    loop {
        let reason = stalled.borrow_and_update().clone();
        match reason {
            Some(reason) => {
                warn!(%reason, "Broker service NOT_SERVING: the write-ahead log cannot write");
                if serving {
                    health_reporter
                        .set_not_serving::<BrokerServer<BrokerService>>()
                        .await;
                    serving = false;
                }
            }
            None if !serving => {
                health_reporter
                    .set_serving::<BrokerServer<BrokerService>>()
                    .await;
                serving = true;
            }
            None => {}
        }
        if stalled.changed().await.is_err() {
            return;
        }
    }
}

/// Reports the broker's services, and the server as a whole (`""`),
/// NOT_SERVING: the first step of a shutdown.
async fn report_not_serving(health_reporter: &HealthReporter) {
    health_reporter
        .set_not_serving::<BrokerServer<BrokerService>>()
        .await;
    health_reporter
        .set_not_serving::<ModelSyncServer<crate::run_model::service::ModelSyncService>>()
        .await;
    health_reporter
        .set_not_serving::<LighthouseServer<crate::lighthouse::rpc::LighthouseService>>()
        .await;
    health_reporter
        .set_service_status("", ServingStatus::NotServing)
        .await;
}

/// The two reflection services (v1 and v1alpha), each describing the
/// broker's and the health service's protos.
type ReflectionServices<V1, V1Alpha> = (
    reflection_v1::ServerReflectionServer<V1>,
    reflection_v1alpha::ServerReflectionServer<V1Alpha>,
);

/// Builds the v1 and v1alpha reflection services.
fn reflection_services() -> Result<
    ReflectionServices<
        impl reflection_v1::ServerReflection,
        impl reflection_v1alpha::ServerReflection,
    >,
    ServeError,
> {
    let described = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(dflash_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    Ok((described().build_v1()?, described().build_v1alpha()?))
}

/// The tasks that run beside the gRPC server: the queue's ticker, the model
/// sync model writer and, when asked for, the metrics endpoint.
struct Background {
    ticker: JoinHandle<()>,
    model_writer: JoinHandle<()>,
    metrics: Option<JoinHandle<()>>,
    metrics_stop: CancellationToken,
}

impl Background {
    /// Spawns the ticker, the model writer and the metrics endpoint (on
    /// `metrics_listener`, when there is one).
    fn spawn(
        shared: &Arc<Shared>,
        model_sync: &Arc<crate::run_model::service::ModelSyncShared>,
        metrics_listener: Option<TcpListener>,
    ) -> Background {
        let ticker = tokio::spawn(shared.clone().run_ticker());
        let model_writer =
            tokio::spawn(model_sync.clone().run_background(shared.watch_run_state()));
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
        Background {
            ticker,
            model_writer,
            metrics,
            metrics_stop,
        }
    }

    /// Stops everything at once, for a server that ended on its own: the
    /// ticker and the model writer are aborted, the metrics endpoint is
    /// stopped (bounded).
    async fn abort(self) {
        self.ticker.abort();
        self.model_writer.abort();
        stop_metrics(self.metrics, &self.metrics_stop).await;
    }
}

/// Logs where the broker listens, for which targets, and with what security.
fn log_listening(listener: &TcpListener, config: &BrokerConfig, security: &ServerSecurity) {
    let local_address = listener.local_addr().ok();
    info!(
        address = ?local_address,
        target_ids = %config.target_ids().join(","),
        target_capture = ?config.target_capture,
        tls = security.tls.is_some(),
        token = security.token.is_some(),
        "broker listening"
    );
}

/// Builds the gRPC router: TLS, the HTTP/2 windows and keepalive, and every
/// service behind its token check.
fn grpc_router<H, V1, V1Alpha>(
    config: &BrokerConfig,
    security: &ServerSecurity,
    health_service: HealthServer<H>,
    (reflection_v1, reflection_v1alpha): ReflectionServices<V1, V1Alpha>,
    model_sync: &Arc<crate::run_model::service::ModelSyncShared>,
    lighthouse: LighthouseServer<crate::lighthouse::rpc::LighthouseService>,
    service: BrokerService,
) -> Result<Router, ServeError>
where
    H: Health,
    V1: reflection_v1::ServerReflection,
    V1Alpha: reflection_v1alpha::ServerReflection,
{
    let message_limit = dflash_proto::transport::message_limit_bytes(config.max_item_bytes);
    let mut builder = Server::builder();
    if let Some(tls) = security.tls.clone() {
        builder = builder.tls_config(tls.timeout(config.tls_handshake_timeout))?;
    }
    // Every service sits behind the token check (a no-op without a token,
    // or for a service the operator exempts).
    let broker_check = security.check(false);
    Ok(builder
        // Bounds what a producer pushes beyond --max-queue-bytes while the
        // broker is not reading its stream (see the constant).
        .initial_stream_window_size(Some(BROKER_RECEIVE_STREAM_WINDOW_BYTES))
        .initial_connection_window_size(Some(CONNECTION_WINDOW_BYTES))
        .max_frame_size(Some(MAX_FRAME_BYTES))
        // Limits one client's share (#25): streams per connection, the
        // resets a peer may cause or send before a GOAWAY (tonic passes
        // `None` on to hyper as "no limit"), and the size of its headers.
        .max_concurrent_streams(Some(config.max_concurrent_streams))
        .http2_max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESET_STREAMS))
        .http2_max_pending_accept_reset_streams(Some(MAX_PENDING_ACCEPT_RESET_STREAMS))
        .http2_max_header_list_size(Some(MAX_HEADER_LIST_BYTES))
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
        .add_service(InterceptedService::new(lighthouse, broker_check.clone()))
        .add_service(InterceptedService::new(
            BrokerRoutes::new(service, message_limit),
            broker_check,
        )))
}

/// Streams a connection may make the server reset (malformed requests)
/// before it is sent a GOAWAY: hyper's own default, which tonic's `None`
/// would turn off.
const MAX_LOCAL_ERROR_RESET_STREAMS: usize = 1024;
/// Streams a client may open and reset before the server accepted them
/// (the "rapid reset" attack) before a GOAWAY: h2's default.
const MAX_PENDING_ACCEPT_RESET_STREAMS: usize = 20;
/// The largest header list a request may carry: the token and the gRPC
/// headers are a few hundred bytes (h2's default is 16 MiB).
const MAX_HEADER_LIST_BYTES: u32 = 64 << 10;

/// Waits up to `deadline` for the stopped gRPC server to finish; past it,
/// cuts the connections still open.
async fn drain_server(
    mut server: JoinHandle<Result<(), tonic::transport::Error>>,
    deadline: Duration,
) {
    match tokio::time::timeout(deadline, &mut server).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(error))) => warn!(%error, "grpc server ended with an error"),
        Ok(Err(join_error)) => warn!(%join_error, "grpc server task failed"),
        Err(_) => {
            warn!(timeout = ?deadline, "open connections did not close in time; cutting them");
            server.abort();
        }
    }
}

/// Waits up to `deadline` for the model writer: it stops at the cancelled
/// token, and a write it started finishes (bounded) before the last one
/// [`save_model_on_shutdown`] makes.
async fn stop_model_writer(mut model_writer: JoinHandle<()>, deadline: Duration) {
    if tokio::time::timeout(deadline, &mut model_writer)
        .await
        .is_err()
    {
        warn!("the model writer did not stop in time");
        model_writer.abort();
    }
}

/// Writes the model as it is now, so a restart resumes from it (the final
/// one when the run completed and it was not written yet), bounded by
/// `deadline`.
async fn save_model_on_shutdown(
    shared: &Shared,
    model_sync: &crate::run_model::service::ModelSyncShared,
    deadline: Duration,
) {
    let final_model = shared.broker_state() == crate::queue::BrokerState::Complete;
    match tokio::time::timeout(deadline, model_sync.save(final_model)).await {
        Ok(Ok(_)) => {}
        Ok(Err(error)) => warn!(%error, "writing the model on shutdown failed"),
        Err(_) => {
            warn!(timeout = ?deadline, "writing the model on shutdown did not finish in time")
        }
    }
}

/// Closes the model sync sessions' and the stream readers' task trackers and
/// waits for each, two seconds at the most.
async fn wait_for_tasks(model_sync: &crate::run_model::service::ModelSyncShared, shared: &Shared) {
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
}

/// Stops the metrics endpoint (it serves until the gRPC side has drained, so
/// the final state can still be scraped) and waits for it, bounded.
async fn stop_metrics(metrics: Option<JoinHandle<()>>, stop: &CancellationToken) {
    stop.cancel();
    if let Some(mut metrics) = metrics {
        if tokio::time::timeout(dflash_telemetry::METRICS_STOP_TIMEOUT, &mut metrics)
            .await
            .is_err()
        {
            warn!("metrics endpoint did not stop in time");
            metrics.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use futures::StreamExt as _;
    use tonic_health::pb::health_check_response::ServingStatus as WireStatus;
    use tonic_health::pb::health_server::Health as _;
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::server::{HealthService, WatchStream};

    use super::*;

    async fn next(watch: &mut WatchStream) -> WireStatus {
        watch
            .next()
            .await
            .expect("a message")
            .expect("a health response")
            .status()
    }

    /// The log follower reports changes only: started on a writable log it
    /// sends nothing, so a Watch stream's next message after SERVING is the
    /// stall's NOT_SERVING (a repeated SERVING made the shutdown test's
    /// NOT_SERVING the second message, once, under load).
    #[tokio::test(flavor = "current_thread")]
    async fn the_log_follower_reports_only_changes() {
        let reporter = HealthReporter::new();
        report_serving(&reporter).await;
        let service = HealthService::from_health_reporter(reporter.clone());
        let mut watch = service
            .watch(tonic::Request::new(HealthCheckRequest {
                service: "dflash.v1.Broker".into(),
            }))
            .await
            .expect("the broker service is registered")
            .into_inner();
        assert_eq!(next(&mut watch).await, WireStatus::Serving);
        let (stalls, stalled) = tokio::sync::watch::channel(None);
        let follower = tokio::spawn(follow_log_stalls(stalled, reporter));
        // The follower reads the writable log and waits for a change (on
        // this one thread, it runs to its first wait within these yields).
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        stalls
            .send(Some("no space left".into()))
            .expect("the follower listens");
        assert_eq!(next(&mut watch).await, WireStatus::NotServing);
        stalls.send(None).expect("the follower listens");
        assert_eq!(next(&mut watch).await, WireStatus::Serving);
        follower.abort();
    }
}
