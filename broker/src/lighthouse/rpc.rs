//! The `dflash.v1.Lighthouse` service (`Quorum`, `Commit`): proto ↔
//! lighthouse types, the caller's role, and bad input refused naming the
//! value.

use std::sync::Arc;
use std::time::Duration;

use dflash_proto::v1 as proto;
use dflash_proto::v1::lighthouse_server::{Lighthouse, LighthouseServer};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use super::hub::{LighthouseHub, StepSample, StepSamples};
use super::{CommitRecord, Outcome, QuorumAnswer, QuorumAsk, Vote};
use crate::rpc_error::RpcError;

/// The `dflash.v1.Lighthouse` service: the hub's two RPCs.
#[derive(Clone)]
pub struct LighthouseService {
    hub: Arc<LighthouseHub>,
    /// Cancelled on broker shutdown: waiting calls end with UNAVAILABLE.
    shutdown: CancellationToken,
}

impl LighthouseService {
    /// The tonic service over `hub`.
    pub fn server(hub: Arc<LighthouseHub>, shutdown: CancellationToken) -> LighthouseServer<Self> {
        LighthouseServer::new(LighthouseService { hub, shutdown })
    }
}

#[tonic::async_trait]
impl Lighthouse for LighthouseService {
    async fn quorum(
        &self,
        request: Request<proto::QuorumRequest>,
    ) -> Result<Response<proto::QuorumResponse>, Status> {
        quorum(&self.hub, &self.shutdown, request).await
    }

    async fn commit(
        &self,
        request: Request<proto::CommitVote>,
    ) -> Result<Response<proto::CommitDecision>, Status> {
        commit(&self.hub, &self.shutdown, request).await
    }
}

/// Longest `collective_timeout_ms` an ask may carry (a day): beyond it a
/// dead member would hold a quorum for ever.
const MAX_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

fn checked_drafter(
    principal: &crate::roles::Principal,
    drafter_id: &str,
    action: &'static str,
) -> Result<(), RpcError> {
    if drafter_id.is_empty() {
        return Err(RpcError::EmptyId {
            field: "drafter_id",
        });
    }
    crate::roles::validate_id("drafter_id", drafter_id)?;
    principal.authorize(crate::roles::Role::Drafter, drafter_id, action)
}

fn record_from_proto(record: Option<proto::CommitRecord>) -> CommitRecord {
    record.map_or(CommitRecord::GENESIS, |record| CommitRecord {
        step: record.step,
        instance: record.instance,
        quorum_id: record.quorum_id,
    })
}

fn record_to_proto(record: CommitRecord) -> proto::CommitRecord {
    proto::CommitRecord {
        step: record.step,
        instance: record.instance,
        quorum_id: record.quorum_id,
    }
}

/// The ask a request makes, or why it is refused.
fn ask_from_proto(request: proto::QuorumRequest) -> Result<QuorumAsk, RpcError> {
    if !request.leaving {
        check_store_address(&request.store_address)?;
    }
    let committed = record_from_proto(request.committed);
    if committed.step != request.step {
        return Err(RpcError::CommittedStepDiffers {
            committed: committed.step,
            step: request.step,
        });
    }
    let collective_timeout = Duration::from_millis(request.collective_timeout_ms);
    if !request.leaving
        && (collective_timeout.is_zero() || collective_timeout > MAX_COLLECTIVE_TIMEOUT)
    {
        return Err(RpcError::CollectiveTimeoutOutOfRange {
            collective_timeout_ms: request.collective_timeout_ms,
            limit_ms: MAX_COLLECTIVE_TIMEOUT.as_millis(),
        });
    }
    Ok(QuorumAsk {
        drafter_id: request.drafter_id,
        store_address: request.store_address,
        committed,
        state_checksum: request.state_checksum,
        samples_ready: request.samples_ready,
        leaving: request.leaving,
        collective_timeout,
    })
}

/// `Lighthouse.Quorum`.
async fn quorum(
    hub: &Arc<LighthouseHub>,
    shutdown: &CancellationToken,
    request: Request<proto::QuorumRequest>,
) -> Result<Response<proto::QuorumResponse>, Status> {
    let principal = crate::roles::Principal::of(request.extensions());
    let request = request.into_inner();
    checked_drafter(&principal, &request.drafter_id, "Lighthouse.Quorum")?;
    let drafter_id = request.drafter_id.clone();
    let ask = ask_from_proto(request)?;
    let answer = hub.ask(ask, shutdown).await?;
    let response = match answer {
        QuorumAnswer::Formed(formed) => {
            let rank =
                formed
                    .rank_of(&drafter_id)
                    .ok_or_else(|| RpcError::AnsweredToNonMember {
                        quorum_id: formed.quorum_id,
                        drafter_id: drafter_id.clone(),
                    })?;
            proto::QuorumResponse {
                quorum_id: formed.quorum_id,
                rank: rank as u32,
                world_size: formed.members.len() as u32,
                members: formed.members.clone(),
                store_address: formed.store_address.clone(),
                store_prefix: formed.store_prefix(),
                step: formed.step,
                heal: formed.heal,
                heal_reason: formed.heal_reason.clone(),
                instance: formed.instance,
                nonce: formed.nonce,
                record: Some(record_to_proto(formed.record)),
            }
        }
        QuorumAnswer::Idle | QuorumAnswer::Left => proto::QuorumResponse::default(),
    };
    Ok(Response::new(response))
}

/// `Lighthouse.Commit`. a vote, or its retry to fetch the decision.
async fn commit(
    hub: &Arc<LighthouseHub>,
    shutdown: &CancellationToken,
    request: Request<proto::CommitVote>,
) -> Result<Response<proto::CommitDecision>, Status> {
    let principal = crate::roles::Principal::of(request.extensions());
    let request = request.into_inner();
    checked_drafter(&principal, &request.drafter_id, "Lighthouse.Commit")?;
    let samples = step_samples(request.samples)?;
    let vote = Vote {
        drafter_id: request.drafter_id,
        instance: request.instance,
        quorum_id: request.quorum_id,
        step: request.step,
        nonce: request.nonce,
        ok: request.ok,
        reason: request.reason,
    };
    let samples = StepSamples {
        samples,
        charge_on_abort: request.charge_on_abort && !request.ok,
    };
    let decision = hub.vote(vote, samples, shutdown).await?;
    let outcome = match decision.outcome {
        Outcome::Commit => proto::StepOutcome::Commit,
        Outcome::Abort => proto::StepOutcome::Abort,
        Outcome::Unknown => proto::StepOutcome::Unknown,
    };
    Ok(Response::new(proto::CommitDecision {
        commit: decision.outcome == Outcome::Commit,
        reason: decision.reason,
        outcome: outcome as i32,
        record: decision.record.map(record_to_proto),
    }))
}

/// A vote's samples, each delivery named once and with a target id.
fn step_samples(samples: Vec<proto::StepSample>) -> Result<Vec<StepSample>, RpcError> {
    let mut seen = std::collections::BTreeSet::new();
    samples
        .into_iter()
        .map(|sample| {
            if !seen.insert(sample.delivery_id) {
                return Err(RpcError::DeliveryListedTwice(sample.delivery_id));
            }
            crate::roles::validate_id("samples.target_id", &sample.target_id)?;
            Ok(StepSample {
                delivery_id: sample.delivery_id,
                target_id: sample.target_id,
                seq: sample.seq,
            })
        })
        .collect()
}

/// A store address is `host:port` with a port in 1..=65535.
fn check_store_address(address: &str) -> Result<(), RpcError> {
    let bad = || RpcError::BadStoreAddress(address.to_string());
    let (host, port) = address.rsplit_once(':').ok_or_else(bad)?;
    if host.is_empty() || host.len() > 253 {
        return Err(bad());
    }
    match port.parse::<u16>() {
        Ok(port) if port > 0 => Ok(()),
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_addresses_are_host_and_port() {
        assert!(check_store_address("10.0.0.7:29500").is_ok());
        assert!(check_store_address("drafter-3.dflash:1").is_ok());
        for bad in ["", "host", ":80", "host:0", "host:65536", "host:x"] {
            let status = Status::from(check_store_address(bad).unwrap_err());
            assert!(status.message().contains(&format!("{bad:?}")), "{status:?}");
        }
    }

    fn request() -> proto::QuorumRequest {
        proto::QuorumRequest {
            drafter_id: "d0".to_string(),
            store_address: "127.0.0.1:29500".to_string(),
            step: 3,
            committed: Some(proto::CommitRecord {
                step: 3,
                instance: 9,
                quorum_id: 2,
            }),
            collective_timeout_ms: 60_000,
            ..Default::default()
        }
    }

    #[test]
    fn asks_with_bad_values_are_refused_naming_them() {
        assert!(ask_from_proto(request()).is_ok());
        let mismatched = proto::QuorumRequest {
            step: 4,
            ..request()
        };
        let status = Status::from(ask_from_proto(mismatched).unwrap_err());
        assert!(
            status
                .message()
                .contains("committed.step 3 differs from step 4"),
            "{status:?}"
        );
        let no_timeout = proto::QuorumRequest {
            collective_timeout_ms: 0,
            ..request()
        };
        let status = Status::from(ask_from_proto(no_timeout).unwrap_err());
        assert!(
            status.message().contains("collective_timeout_ms 0"),
            "{status:?}"
        );
    }
}
