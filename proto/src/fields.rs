//! Protobuf field numbers of the messages the zero-copy paths encode or
//! decode by hand (the broker's Produce and Consume routes, the Rust
//! client's producer, the payload scan): written once here, and checked
//! against the compiled descriptors of `proto/dflash/v1/*.proto` by this
//! module's test, so a renumbered field fails the build's tests instead of
//! corrupting the wire.

/// `ProduceRequest.hello`.
pub const PRODUCE_REQUEST_HELLO: u32 = 1;
/// `ProduceRequest.item`.
pub const PRODUCE_REQUEST_ITEM: u32 = 2;
/// `ProduceRequest.stats`.
pub const PRODUCE_REQUEST_STATS: u32 = 3;
/// `Item.seq`.
pub const ITEM_SEQ: u32 = 1;
/// `Item.sample`.
pub const ITEM_SAMPLE: u32 = 2;
/// `Item.trace_context`.
pub const ITEM_TRACE_CONTEXT: u32 = 3;
/// `Sample.tensors`.
pub const SAMPLE_TENSORS: u32 = 1;
/// `Tensor.name`.
pub const TENSOR_NAME: u32 = 1;
/// `Tensor.dtype`.
pub const TENSOR_DTYPE: u32 = 2;
/// `Tensor.shape`.
pub const TENSOR_SHAPE: u32 = 3;
/// `Tensor.data`.
pub const TENSOR_DATA: u32 = 4;
/// `ConsumeResponse.delivery`.
pub const CONSUME_RESPONSE_DELIVERY: u32 = 2;
/// `Delivery.delivery_id`.
pub const DELIVERY_ID: u32 = 1;
/// `Delivery.target_id`.
pub const DELIVERY_TARGET_ID: u32 = 2;
/// `Delivery.seq`.
pub const DELIVERY_SEQ: u32 = 3;
/// `Delivery.sample`.
pub const DELIVERY_SAMPLE: u32 = 4;
/// `Delivery.delivery_count`.
pub const DELIVERY_COUNT: u32 = 5;
/// `Delivery.trace_context`.
pub const DELIVERY_TRACE_CONTEXT: u32 = 6;

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    /// The number of `message.field` in the compiled descriptors.
    fn field_number(
        descriptors: &prost_types::FileDescriptorSet,
        message: &str,
        field: &str,
    ) -> Option<u32> {
        descriptors
            .file
            .iter()
            .filter(|file| file.package() == "dflash.v1")
            .flat_map(|file| file.message_type.iter())
            .find(|candidate| candidate.name() == message)?
            .field
            .iter()
            .find(|candidate| candidate.name() == field)
            .and_then(|candidate| u32::try_from(candidate.number()).ok())
    }

    #[test]
    fn every_hand_written_field_number_matches_the_proto_files() {
        let descriptors = prost_types::FileDescriptorSet::decode(crate::FILE_DESCRIPTOR_SET)
            .expect("the compiled descriptors decode");
        let expected = [
            ("ProduceRequest", "hello", PRODUCE_REQUEST_HELLO),
            ("ProduceRequest", "item", PRODUCE_REQUEST_ITEM),
            ("ProduceRequest", "stats", PRODUCE_REQUEST_STATS),
            ("Item", "seq", ITEM_SEQ),
            ("Item", "sample", ITEM_SAMPLE),
            ("Item", "trace_context", ITEM_TRACE_CONTEXT),
            ("Sample", "tensors", SAMPLE_TENSORS),
            ("Tensor", "name", TENSOR_NAME),
            ("Tensor", "dtype", TENSOR_DTYPE),
            ("Tensor", "shape", TENSOR_SHAPE),
            ("Tensor", "data", TENSOR_DATA),
            ("ConsumeResponse", "delivery", CONSUME_RESPONSE_DELIVERY),
            ("Delivery", "delivery_id", DELIVERY_ID),
            ("Delivery", "target_id", DELIVERY_TARGET_ID),
            ("Delivery", "seq", DELIVERY_SEQ),
            ("Delivery", "sample", DELIVERY_SAMPLE),
            ("Delivery", "delivery_count", DELIVERY_COUNT),
            ("Delivery", "trace_context", DELIVERY_TRACE_CONTEXT),
        ];
        for (message, field, number) in expected {
            assert_eq!(
                field_number(&descriptors, message, field),
                Some(number),
                "{message}.{field}"
            );
        }
    }
}
