//! The operator's subcommands: one status snapshot, the live top view, and
//! a gRPC health check.

use std::io::IsTerminal as _;
use std::time::Duration;

use anyhow::Context as _;
use clap::Subcommand;
use dflash_client::{BrokerClient, ClientSecurityArgs};

use crate::top;

/// The broker's address when `--broker` and `DFLASH_BROKER` are not given.
const DEFAULT_BROKER: &str = "http://127.0.0.1:50051";

#[derive(Debug, Subcommand)]
pub enum OpsCommand {
    /// Print one snapshot of the broker's status (`--json` for scripts).
    Status {
        #[arg(long, env = "DFLASH_BROKER", default_value = DEFAULT_BROKER)]
        broker: String,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        security: ClientSecurityArgs,
    },
    /// Live view of every target and drafter, redrawn in place; idle devices stand out.
    Top {
        #[arg(long, env = "DFLASH_BROKER", default_value = DEFAULT_BROKER)]
        broker: String,
        /// Redraw interval (`500ms`, `2s`).
        #[arg(long, default_value = "1s", value_parser = dflash_shell::parse_duration)]
        interval: Duration,
        #[command(flatten)]
        security: ClientSecurityArgs,
    },
    /// gRPC health check of the broker (grpc.health.v1): exits 0 when the
    /// service is SERVING, 1 otherwise (container health checks, probes).
    Health {
        #[arg(long, env = "DFLASH_BROKER", default_value = DEFAULT_BROKER)]
        broker: String,
        /// The service to check; "" is the whole server.
        #[arg(long, default_value = "dflash.v1.Broker")]
        service: String,
        /// Give up after this long (`3s`, `500ms`).
        #[arg(long, default_value = "3s", value_parser = dflash_shell::parse_duration)]
        timeout: Duration,
        #[command(flatten)]
        security: ClientSecurityArgs,
    },
}

/// Runs one operator command to its end.
pub async fn run(command: OpsCommand) -> anyhow::Result<()> {
    match command {
        OpsCommand::Status {
            broker,
            json,
            security,
        } => status(&broker, json, &security).await,
        OpsCommand::Top {
            broker,
            interval,
            security,
        } => watch_top(&broker, interval, &security).await,
        OpsCommand::Health {
            broker,
            service,
            timeout,
            security,
        } => health(&broker, &service, timeout, &security).await,
    }
}

async fn connect(broker: &str, security: &ClientSecurityArgs) -> anyhow::Result<BrokerClient> {
    BrokerClient::connect(broker.to_string(), security.client_options()?)
        .await
        .with_context(|| format!("connecting to the broker at {broker}"))
}

/// `status`: one snapshot, as text or JSON.
async fn status(broker: &str, json: bool, security: &ClientSecurityArgs) -> anyhow::Result<()> {
    let snapshot = connect(broker, security).await?.status().await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&snapshot)?);
    } else {
        print!(
            "{}",
            top::render(&snapshot, broker, top::RenderOptions { color: false })
        );
    }
    Ok(())
}

/// `top`: the status stream, redrawn in place until SIGINT or SIGTERM.
async fn watch_top(
    broker: &str,
    interval: Duration,
    security: &ClientSecurityArgs,
) -> anyhow::Result<()> {
    let client = connect(broker, security).await?;
    let mut stream = client.watch_status(interval).await?;
    let color = std::io::stdout().is_terminal();
    let stop = dflash_shell::shutdown_signal();
    loop {
        tokio::select! {
            () = stop.cancelled() => return Ok(()),
            message = stream.message() => match message {
                Ok(Some(snapshot)) => print!("\x1b[H\x1b[2J{}", top::render(&snapshot, broker, top::RenderOptions { color })),
                Ok(None) => return Ok(()),
                Err(status) => anyhow::bail!("broker status stream ended: {status}"),
            },
        }
    }
}

/// `health`: one grpc.health.v1 Check, bounded in time.
async fn health(
    broker: &str,
    service: &str,
    timeout: Duration,
    security: &ClientSecurityArgs,
) -> anyhow::Result<()> {
    let check = async {
        let mut options = security.client_options()?;
        options.connect_timeout = timeout;
        let channel = dflash_client::connect_channel(broker, &options).await?;
        let response = tonic_health::pb::health_client::HealthClient::new(channel)
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.to_string(),
            })
            .await
            .with_context(|| format!("health check of {service:?} at {broker}"))?;
        anyhow::Ok(response.into_inner().status)
    };
    let status = tokio::time::timeout(timeout, check).await.map_err(|_| {
        anyhow::anyhow!("health check of {service:?} at {broker}: no answer within {timeout:?}")
    })??;
    let serving = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
    anyhow::ensure!(
        status == serving,
        "{service:?} at {broker} is not serving (status {status})"
    );
    println!("{service:?} at {broker}: SERVING");
    Ok(())
}
