//! The gRPC codec every dflash client and server uses: prost's, except that
//! each outgoing message's exact encoded length is reserved before it is
//! encoded.
//!
//! Why: tonic encodes into a growing `BytesMut`. prost writes a message's
//! fields in field-number order, so for a `Delivery` the 16 MiB `sample` is
//! written first and the small `delivery_count` after it; without a
//! reservation the buffer is grown for the sample to exactly its size and
//! then grown again (a reallocation that copies the whole payload) for the
//! few bytes that follow. Reserving `encoded_len` first makes the encode one
//! copy into one allocation. Decoding is prost's unchanged (payload fields
//! are `Bytes` slices of the received buffer, no second copy).

use std::marker::PhantomData;

use prost::Message;
use tonic::codec::{BufferSettings, Codec, EncodeBuf, Encoder};
use tonic::Status;

/// prost encoding with the exact size reserved up front; the generated
/// clients and servers use it through `codec_path` in `build.rs`.
#[derive(Debug, Clone, Copy)]
pub struct ExactCodec<T, U> {
    _types: PhantomData<(T, U)>,
}

impl<T, U> Default for ExactCodec<T, U> {
    fn default() -> Self {
        Self {
            _types: PhantomData,
        }
    }
}

impl<T, U> Codec for ExactCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ExactEncoder<T>;
    type Decoder = tonic_prost::ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ExactEncoder { _type: PhantomData }
    }

    fn decoder(&mut self) -> Self::Decoder {
        tonic_prost::ProstDecoder::new(BufferSettings::default())
    }
}

/// Encodes one message after reserving its encoded length.
#[derive(Debug, Clone, Copy)]
pub struct ExactEncoder<T> {
    _type: PhantomData<T>,
}

impl<T: Message> Encoder for ExactEncoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, buffer: &mut EncodeBuf<'_>) -> Result<(), Status> {
        encode_reserved(&item, buffer)
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}

/// A buffer that can grow by a known amount before it is written.
trait Reserve: bytes::BufMut {
    fn reserve_bytes(&mut self, additional: usize);
}

impl Reserve for EncodeBuf<'_> {
    fn reserve_bytes(&mut self, additional: usize) {
        self.reserve(additional);
    }
}

impl Reserve for bytes::BytesMut {
    fn reserve_bytes(&mut self, additional: usize) {
        self.reserve(additional);
    }
}

fn encode_reserved<T: Message>(item: &T, buffer: &mut impl Reserve) -> Result<(), Status> {
    buffer.reserve_bytes(item.encoded_len());
    item.encode(buffer)
        .map_err(|error| Status::internal(format!("encoding a message: {error}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1;
    use bytes::{Bytes, BytesMut};

    fn delivery(payload_bytes: usize) -> v1::Delivery {
        v1::Delivery {
            delivery_id: 7,
            target_id: "target-0".into(),
            seq: 3,
            sample: Some(v1::Sample {
                tensors: vec![v1::Tensor::from_parts(
                    "hidden_states",
                    v1::Dtype::U8,
                    vec![payload_bytes as u64],
                    Bytes::from(vec![5u8; payload_bytes]),
                )],
            }),
            delivery_count: 2,
            trace_context: Default::default(),
        }
    }

    /// The encoder allocates once: the buffer's capacity after encoding is
    /// the capacity reserved for the message (no growth past it), and the
    /// bytes are prost's own encoding.
    #[test]
    fn encodes_into_one_exact_reservation_with_prost_bytes() {
        let message = delivery(1 << 20);
        let mut buffer = BytesMut::new();
        encode_reserved(&message, &mut buffer).unwrap();
        assert_eq!(buffer.len(), message.encoded_len());
        assert_eq!(buffer.capacity(), message.encoded_len());
        assert_eq!(&buffer[..], &message.encode_to_vec()[..]);
    }
}
