//! What the transport must do after an operation: the queue's outbox.

use std::sync::Arc;

use super::snapshot::RunSummary;
use super::types::{ConnectionId, DeliveryId, RunStatus};

/// One delivery for the transport to send.
#[derive(Debug, Clone)]
pub struct Delivery<P> {
    pub delivery_id: DeliveryId,
    pub target_id: Arc<str>,
    pub seq: u64,
    pub payload: P,
    /// 1 on the first delivery, 2 on the first redelivery, ...
    pub delivery_count: u32,
}

/// What the transport must do after an operation.
#[derive(Debug, Clone)]
pub enum Effect<P> {
    Deliver {
        connection: ConnectionId,
        delivery: Delivery<P>,
    },
    /// Send end-of-stream and close this consumer's stream.
    EndConsumer {
        connection: ConnectionId,
        outcome: RunStatus,
        reason: String,
        summary: RunSummary,
    },
    /// Tell this producer why and close its stream.
    CloseProducer {
        connection: ConnectionId,
        outcome: RunStatus,
        reason: String,
    },
}
