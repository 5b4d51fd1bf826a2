//! [`ConsumeOut`]: what a Consume stream sends.

use std::sync::Arc;

use dflash_proto::v1 as proto;

use crate::payload::WireItem;
use crate::queue::Delivery;

/// What a Consume stream sends: a delivery (encoded by the route with its
/// payload passed through) or any other message.
#[derive(Debug)]
pub enum ConsumeOut {
    Delivery(Delivery<Arc<WireItem>>),
    Message(proto::ConsumeResponse),
}

impl ConsumeOut {
    /// prost's message (the payload joined into one buffer per tensor: a
    /// copy when it arrived in several frames). For the generated route;
    /// the broker serves Consume through `zero_copy`.
    pub fn into_proto(self) -> proto::ConsumeResponse {
        match self {
            ConsumeOut::Message(message) => message,
            ConsumeOut::Delivery(delivery) => {
                let item = delivery.payload.to_proto();
                proto::ConsumeResponse {
                    kind: Some(proto::consume_response::Kind::Delivery(proto::Delivery {
                        delivery_id: delivery.delivery_id,
                        target_id: delivery.target_id.to_string(),
                        seq: delivery.seq,
                        sample: item.sample,
                        delivery_count: delivery.delivery_count,
                        trace_context: item.trace_context,
                    })),
                }
            }
        }
    }
}
