//! The drafter's link to the broker's lighthouse (`Lighthouse.Quorum`,
//! `Lighthouse.Commit`), called from the training thread: one call at a
//! time, each bounded, the decision fetched again until the broker answers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dflash_proto::v1 as proto;
use dflash_proto::v1::lighthouse_client::LighthouseClient;
use tracing::warn;

use super::error::DataParallelError;
use super::settings::DataParallelConfig;
use crate::broker_link::BrokerLink;

/// Bound on a Quorum or Commit call beyond the broker's own waits.
pub(super) const CALL_MARGIN: Duration = Duration::from_secs(30);
/// The first pause between two tries of a decision fetch (doubling, at
/// most [`MAX_RETRY_PAUSE`]).
const FIRST_RETRY_PAUSE: Duration = Duration::from_millis(100);
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(5);

pub(super) struct LighthouseLink {
    runtime: tokio::runtime::Handle,
    /// The member's one connection to the broker, shared with its
    /// run-model link.
    link: Arc<BrokerLink>,
    client: Option<LighthouseClient<dflash_client::AuthChannel>>,
    /// Bound on one call: the collective timeout plus [`CALL_MARGIN`].
    call_limit: Duration,
    /// Test hook: the first this many tries of each decision fetch lose
    /// the answer (always 0 without the feature `test-hooks`).
    lose_decisions: u32,
}

impl LighthouseLink {
    pub(super) fn new(
        runtime: tokio::runtime::Handle,
        link: Arc<BrokerLink>,
        config: &DataParallelConfig,
    ) -> Self {
        #[cfg(feature = "test-hooks")]
        let lose_decisions = config.lose_decisions;
        #[cfg(not(feature = "test-hooks"))]
        let lose_decisions = 0;
        LighthouseLink {
            runtime,
            link,
            client: None,
            call_limit: config.collective_timeout + CALL_MARGIN,
            lose_decisions,
        }
    }

    pub(super) fn quorum(
        &mut self,
        request: proto::QuorumRequest,
    ) -> Result<proto::QuorumResponse, DataParallelError> {
        let mut client = self.client()?;
        let response = self.block_on("a quorum call", self.call_limit, async move {
            Ok(client.quorum(request).await?.into_inner())
        });
        if response.is_err() {
            self.client = None;
        }
        response
    }

    /// Sends the vote, and sends it again (the broker's decision fetch is
    /// idempotent) until the broker answers or `patience` is spent: a
    /// member that cannot learn the decision must not guess it.
    pub(super) fn decide(
        &mut self,
        vote: proto::CommitVote,
        patience: Duration,
    ) -> Result<proto::CommitDecision, DataParallelError> {
        let started = Instant::now();
        let mut pause = FIRST_RETRY_PAUSE;
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            let error = match self.vote_once(vote.clone(), attempt) {
                Ok(decision) => return Ok(decision),
                Err(error) => error,
            };
            self.client = None;
            if started.elapsed() + pause > patience {
                return Err(error);
            }
            warn!(%error, attempt, quorum_id = vote.quorum_id, step = vote.step, "data parallelism: the decision did not arrive; fetching it again");
            std::thread::sleep(pause);
            pause = (pause * 2).min(MAX_RETRY_PAUSE);
        }
    }

    fn vote_once(
        &mut self,
        vote: proto::CommitVote,
        attempt: u32,
    ) -> Result<proto::CommitDecision, DataParallelError> {
        let mut client = self.client()?;
        let decision = self.block_on("a commit vote", self.call_limit, async move {
            Ok(client.commit(vote).await?.into_inner())
        })?;
        if attempt <= self.lose_decisions {
            return Err(DataParallelError::Lost {
                what: "the commit decision (test hook)",
            });
        }
        Ok(decision)
    }

    fn client(
        &mut self,
    ) -> Result<LighthouseClient<dflash_client::AuthChannel>, DataParallelError> {
        if let Some(client) = &self.client {
            return Ok(client.clone());
        }
        let link = self.link.clone();
        let client = self.block_on("connecting to the broker", CALL_MARGIN, async move {
            let channel = link
                .channel()
                .await
                .map_err(|error| DataParallelError::Connect {
                    address: error.address,
                    detail: error.detail,
                })?;
            Ok(LighthouseClient::new(channel))
        })?;
        self.client = Some(client.clone());
        Ok(client)
    }

    /// Runs `future` on the server's runtime from the training thread.
    fn block_on<T>(
        &self,
        what: &'static str,
        limit: Duration,
        future: impl std::future::Future<Output = Result<T, DataParallelError>>,
    ) -> Result<T, DataParallelError> {
        self.runtime.block_on(async move {
            tokio::time::timeout(limit, future)
                .await
                .map_err(|_| DataParallelError::Timeout { what, limit })?
        })
    }
}
