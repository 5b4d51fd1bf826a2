//! The Consume stream and its reconnects: opening one with backoff for up
//! to `--reconnect-timeout` (a refusal is not retried, a broker that lost
//! the run is not rejoined), the lease-renewal clock, and the bounded wait
//! for the broker to release our leases at the end. What a break means for
//! the work held (it is discarded, the broker requeues it) is the pump's
//! ([`crate::pump`]).

use std::time::{Duration, Instant};

use dflash_client::{Backoff, BrokerClient, Consumer, ConsumerHandle};
use dflash_proto::v1::Credit;
use tokio::time::{interval, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tracing::{error, warn};

use crate::error::DrafterError;
use crate::settings::Connection;

/// One Consume stream (replaced by a new one after a break).
pub(crate) struct ConsumeStream {
    pub(crate) client: BrokerClient,
    pub(crate) consumer: Consumer,
    pub(crate) handle: ConsumerHandle,
    /// False once it ended or broke.
    pub(crate) open: bool,
    /// A third of the broker's lease timeout: leases are renewed on it.
    pub(crate) lease_ticker: tokio::time::Interval,
}

impl ConsumeStream {
    fn new(client: BrokerClient, consumer: Consumer) -> Self {
        let handle = consumer.handle();
        let lease_timeout = Duration::from_millis(consumer.welcome().lease_timeout_ms.max(300));
        let mut lease_ticker = interval(lease_timeout / 3);
        lease_ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        Self {
            client,
            consumer,
            handle,
            open: true,
            lease_ticker,
        }
    }

    /// Opens a Consume stream for `--drafter-id` with `credit`, retrying
    /// with backoff for up to `--reconnect-timeout`; `None` when `shutdown`
    /// fires first. `run_id` is the broker's run id from the first welcome,
    /// updated by every stream opened: a broker that comes back with another
    /// one lost the run, and the client refuses it (not retried), so this
    /// drafter stops instead of training on as if nothing was lost.
    pub(crate) async fn open(
        connection: &Connection,
        credit: Credit,
        run_id: &mut Option<String>,
        shutdown: &CancellationToken,
    ) -> Result<Option<Self>, DrafterError> {
        let deadline = Instant::now() + connection.reconnect_timeout;
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        loop {
            let remembered = run_id.clone();
            let attempt = async {
                let options = connection.security.client_options()?;
                let client = BrokerClient::connect(connection.broker.clone(), options)
                    .await?
                    .remembering_run(remembered);
                let consumer = client.consume(&connection.drafter_id, credit).await?;
                Ok::<_, dflash_client::ClientError>((client, consumer))
            };
            let outcome = tokio::select! {
                _ = shutdown.cancelled() => return Ok(None),
                outcome = attempt => outcome,
            };
            match outcome {
                Ok((client, consumer)) => {
                    *run_id = client.run_id();
                    return Ok(Some(Self::new(client, consumer)));
                }
                Err(error) if !error.is_retryable() => {
                    error!(%error, "the broker refused the Consume stream; not retrying");
                    return Err(DrafterError::BrokerRefused(error.to_string()));
                }
                Err(error) if Instant::now() + backoff.peek() < deadline => {
                    let delay = backoff.next_delay();
                    warn!(%error, retry_in_ms = delay.as_millis() as u64, "cannot open the Consume stream; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => return Ok(None),
                        _ = tokio::time::sleep(delay) => {}
                    }
                }
                Err(error) => {
                    return Err(DrafterError::BrokerUnavailable {
                        address: connection.broker.clone(),
                        seconds: connection.reconnect_timeout.as_secs_f64(),
                        detail: error.to_string(),
                    })
                }
            }
        }
    }

    /// Waits (bounded) until the broker has processed our final acks and
    /// nacks, i.e. holds no lease of `drafter_id`'s, so closing the stream
    /// cannot race them; the broker would requeue the leases anyway, this
    /// only avoids needless redeliveries.
    pub(crate) async fn wait_for_leases_released(&self, drafter_id: &str) {
        self.wait_for_broker(|status| {
            status
                .drafters
                .iter()
                .find(|drafter| drafter.drafter_id == drafter_id && drafter.connected)
                .map_or(0, |drafter| drafter.leased_items)
                == 0
        })
        .await;
    }

    /// Waits (bounded) until the broker shows the final stats this drafter
    /// sent (`steps` of them): after the end of the stream the request
    /// side is still read, but dropping the stream at once could lose them,
    /// and the run's figures (`dflash status`) would miss the last step.
    pub(crate) async fn wait_for_final_stats(&self, drafter_id: &str, steps: u64) {
        self.wait_for_broker(|status| {
            status
                .drafters
                .iter()
                .find(|drafter| drafter.drafter_id == drafter_id)
                .is_none_or(|drafter| {
                    drafter
                        .stats
                        .as_ref()
                        .is_some_and(|stats| stats.steps >= steps)
                })
        })
        .await;
    }

    /// Polls the broker's status until `done` holds, for at most 5 s (a
    /// broker that does not answer ends the wait at once).
    async fn wait_for_broker(&self, done: impl Fn(&dflash_proto::v1::StatusSnapshot) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            let Ok(Ok(status)) =
                tokio::time::timeout(Duration::from_secs(1), self.client.status()).await
            else {
                return;
            };
            if done(&status) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
