//! The broker side: one Produce stream that survives broken connections.
//!
//! The client library's `Producer` keeps at most a window of items
//! unanswered; when its stream breaks, those items may or may not have
//! reached the broker. This wrapper remembers the last window's worth of
//! items plus the one being sent, reopens the stream (the broker's welcome
//! says which seq it has up to), and re-sends only what came after that.
//! Everything before the remembered items was answered: a send takes a
//! window slot before it goes out, so when item n is sent at most `window`
//! items (n among them) are unanswered, and when the send of n fails, the
//! `window` items before it may still be.

use crate::capture::{Capture, CaptureError};
use crate::error::TargetServerError;
use dflash_client::{Backoff, BrokerClient, ClientError, ProduceReport, Producer};
use dflash_proto::v1::{Item, ProducerStats};
use std::collections::VecDeque;
use std::time::Duration;

/// The first wait before reopening a broken Produce stream.
const FIRST_RECONNECT_DELAY: Duration = Duration::from_millis(400);
/// The longest wait between reopening attempts.
const MAX_RECONNECT_DELAY: Duration = Duration::from_millis(6400);

/// A Produce stream with reconnect-and-resume.
pub struct ResilientProducer {
    client: BrokerClient,
    target_id: String,
    producer: Producer,
    /// The last `window + 1` items sent (the unanswered window and the
    /// one being sent), for re-sending after a reconnect (clones share the
    /// payload bytes).
    recent: VecDeque<Item>,
    /// The stream's window ([`Producer::window_items`]).
    window: usize,
    /// Reopening attempts allowed in one outage.
    max_reconnects: u32,
    /// Attempts in the current outage: back to 0 once a reopened stream
    /// shows that the stream before it had items accepted, so routine
    /// broker restarts over a long run never add up to the budget.
    outage_attempts: u32,
    /// The wait before each reopening attempt (0.4 s doubling to 6.4 s),
    /// reset with `outage_attempts`.
    backoff: Backoff,
    /// What the broker had accepted from this target when the current
    /// stream opened (its welcome).
    accepted_at_open: u64,
    /// What the run asked this target to capture in the first welcome;
    /// every later welcome must ask the same.
    capture: Capture,
    /// Every reopening over the process's life (reported, not limited).
    pub reconnects: u32,
}

impl ResilientProducer {
    /// Opens the stream; its window is the client's
    /// (`ClientOptions::producer_window_items`). Fails when the welcome asks
    /// for a tensor this build does not know ([`Capture::from_welcome`]).
    pub async fn open(
        client: BrokerClient,
        target_id: &str,
        max_reconnects: u32,
    ) -> Result<Self, TargetServerError> {
        let producer = client.produce(target_id).await?;
        let capture = Capture::from_welcome(producer.capture())?;
        let accepted_at_open = producer.accepted_before();
        let window = producer.window_items();
        Ok(ResilientProducer {
            client,
            target_id: target_id.to_string(),
            producer,
            recent: VecDeque::with_capacity(window + 1),
            window,
            max_reconnects,
            outage_attempts: 0,
            backoff: Backoff::new(FIRST_RECONNECT_DELAY, MAX_RECONNECT_DELAY),
            accepted_at_open,
            capture,
            reconnects: 0,
        })
    }

    /// What the run asks each sample to carry (the first welcome's).
    pub fn capture(&self) -> Capture {
        self.capture
    }

    /// Highest seq the broker had when the current stream opened.
    pub fn resume_after_seq(&self) -> Option<u64> {
        self.producer.resume_after_seq()
    }

    /// Items the broker had accepted from this target before the current
    /// stream opened.
    pub fn accepted_before(&self) -> u64 {
        self.producer.accepted_before()
    }

    /// Sends one item (its `trace_context` is the W3C context of the span
    /// that made it).
    pub async fn send_item(&mut self, item: Item) -> Result<(), TargetServerError> {
        self.recent.push_back(item.clone());
        while self.recent.len() > self.window + 1 {
            self.recent.pop_front();
        }
        let mut pending = vec![item];
        loop {
            let mut failure = None;
            for item in pending.drain(..) {
                if let Err(error) = self.producer.send_item(item).await {
                    failure = Some(error);
                    break;
                }
            }
            let Some(error) = failure else {
                return Ok(());
            };
            self.reconnect(error).await?;
            let resume = self.producer.resume_after_seq();
            pending = self
                .recent
                .iter()
                .filter(|item| resume.is_none_or(|resume| item.seq > resume))
                .cloned()
                .collect();
        }
    }

    /// Reopens the stream after `error`, unless the broker refused or closed
    /// it on purpose (a non-retryable status: the run ended or was lost, an
    /// item over the limit, a fenced stream) or this outage has spent the
    /// reconnect budget. The budget is per outage: a reopened stream whose
    /// welcome shows more items accepted than when the broken stream opened
    /// ends the outage, and the next break starts counting from zero. A
    /// welcome that asks for another capture than the first ends the run
    /// before anything is re-sent: the items made so far do not match it.
    async fn reconnect(&mut self, error: ClientError) -> Result<(), TargetServerError> {
        if !error.is_retryable() || self.outage_attempts >= self.max_reconnects {
            tracing::error!(target_id = %self.target_id, %error, attempts = self.outage_attempts, "produce stream ended; not retrying");
            return Err(error.into());
        }
        let mut last_error = error;
        while self.outage_attempts < self.max_reconnects {
            self.outage_attempts += 1;
            self.reconnects += 1;
            let backoff = self.backoff.next_delay();
            tracing::warn!(target_id = %self.target_id, attempt = self.outage_attempts, error = %last_error, ?backoff, "produce stream broke; reopening");
            tokio::time::sleep(backoff).await;
            match self.client.produce(&self.target_id).await {
                Ok(producer) => {
                    tracing::info!(target_id = %self.target_id, resume_after_seq = ?producer.resume_after_seq(), "produce stream reopened");
                    let capture = Capture::from_welcome(producer.capture())?;
                    if capture != self.capture {
                        return Err(CaptureError::Changed {
                            before: self.capture,
                            after: capture,
                        }
                        .into());
                    }
                    if producer.accepted_before() > self.accepted_at_open {
                        self.outage_attempts = 0;
                        self.backoff.reset();
                    }
                    self.accepted_at_open = producer.accepted_before();
                    self.window = producer.window_items();
                    self.producer = producer;
                    return Ok(());
                }
                Err(error) if !error.is_retryable() => return Err(error.into()),
                Err(error) => last_error = error,
            }
        }
        Err(last_error.into())
    }

    /// Stats are best effort: a failure shows up on the next send.
    pub async fn send_stats(&mut self, stats: ProducerStats) {
        if let Err(error) = self.producer.send_stats(stats).await {
            tracing::debug!(%error, "stats not sent");
        }
    }

    /// Closes the stream and waits for every answer.
    pub async fn finish(self) -> Result<ProduceReport, ClientError> {
        self.producer.finish().await
    }
}
