//! The broker's form of a producer's item: prost's `Item`, except that each
//! tensor's data is a [`Rope`], the slices of the HTTP/2 frames it arrived
//! in. A payload that spans frames is never joined: the queue holds the
//! slices and a delivery hands them to the drafter's stream as they are, so
//! no byte of it is copied between the producer's stream and the drafter's.
//!
//! [`decode_produce_request`] reads a `ProduceRequest` from a received
//! message. It follows prost's generated decoding field by field (the
//! same prost functions for every field except `Tensor.data`, the same
//! merge rules for repeated and oneof fields), and the tests check its
//! result against prost's decoding of the same bytes, split at every
//! boundary. [`WireItem::encode`] writes prost's encoding back, the data
//! passed through.

use dflash_proto::fields::{
    ITEM_SAMPLE, ITEM_SEQ, ITEM_TRACE_CONTEXT, PRODUCE_REQUEST_HELLO, PRODUCE_REQUEST_ITEM,
    PRODUCE_REQUEST_STATS, SAMPLE_TENSORS, TENSOR_DATA, TENSOR_DTYPE, TENSOR_NAME, TENSOR_SHAPE,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::{Buf, BytesMut};
use dflash_proto::frames::{self, Pieces, Rope, LARGE_PAYLOAD_BYTES};
use dflash_proto::tensor::TensorError;
use dflash_proto::v1 as proto;
use prost::encoding::{self, DecodeContext, WireType};
use tonic::Status;

/// A producer's item as the broker holds it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WireItem {
    pub seq: u64,
    pub sample: Option<WireSample>,
    pub trace_context: HashMap<String, String>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct WireSample {
    pub tensors: Vec<WireTensor>,
}

/// A tensor: its small fields (`header.data` is always empty) and its data.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WireTensor {
    pub header: proto::Tensor,
    pub data: Rope,
}

/// One message of a Produce stream.
#[derive(Debug, Clone, PartialEq)]
pub enum ProduceIn {
    Hello(proto::ProducerHello),
    Item(WireItem),
    Stats(proto::ProducerStats),
    /// A message with no `kind` set.
    Empty,
}

impl ProduceIn {
    /// From a message tonic decoded (the generated route).
    pub fn from_proto(request: proto::ProduceRequest) -> Self {
        use proto::produce_request::Kind;
        match request.kind {
            Some(Kind::Hello(hello)) => ProduceIn::Hello(hello),
            Some(Kind::Item(item)) => ProduceIn::Item(WireItem::from_proto(item)),
            Some(Kind::Stats(stats)) => ProduceIn::Stats(stats),
            None => ProduceIn::Empty,
        }
    }

    /// prost's message, the data joined (tests and the WAL).
    pub fn to_proto(&self) -> proto::ProduceRequest {
        use proto::produce_request::Kind;
        proto::ProduceRequest {
            kind: match self {
                ProduceIn::Hello(hello) => Some(Kind::Hello(hello.clone())),
                ProduceIn::Item(item) => Some(Kind::Item(item.to_proto())),
                ProduceIn::Stats(stats) => Some(Kind::Stats(stats.clone())),
                ProduceIn::Empty => None,
            },
        }
    }
}

impl WireTensor {
    fn from_proto(mut tensor: proto::Tensor) -> Self {
        let data = Rope::from_bytes(std::mem::take(&mut tensor.data));
        WireTensor {
            header: tensor,
            data,
        }
    }

    fn to_proto(&self) -> proto::Tensor {
        proto::Tensor {
            data: self.data.clone().into_bytes(),
            ..self.header.clone()
        }
    }

    fn encoded_len(&self) -> usize {
        frames::tensor_len(&self.header, self.data.len())
    }
}

/// Tensors one item may carry (the sample schema has three): bounds the
/// per-item bookkeeping and keeps the duplicate-name check cheap.
pub const MAX_TENSORS_PER_ITEM: usize = 64;
/// Bytes of trace context (keys and values) one item may carry; a W3C
/// `traceparent` and `tracestate` take well under 1 KiB.
pub const MAX_TRACE_CONTEXT_BYTES: usize = 4096;
/// What the broker keeps for an item beyond its bytes (queue entry, `Arc`,
/// maps), for each of its tensors (header, slice list), and for each trace
/// context entry: charged to `--max-queue-bytes` with the bytes, so items of
/// any shape (empty tensors, many of them, a large trace context) count.
pub const ITEM_OVERHEAD_BYTES: u64 = 256;
pub const TENSOR_OVERHEAD_BYTES: u64 = 128;
pub const SLICE_OVERHEAD_BYTES: u64 = 32;
pub const TRACE_ENTRY_OVERHEAD_BYTES: u64 = 64;

impl WireSample {
    /// [`proto::Sample::validate`]'s checks: tensors present (at most
    /// [`MAX_TENSORS_PER_ITEM`]), each valid, names unique.
    pub fn validate(&self) -> Result<(), TensorError> {
        if self.tensors.is_empty() {
            return Err(TensorError::EmptySample);
        }
        if self.tensors.len() > MAX_TENSORS_PER_ITEM {
            return Err(TensorError::TooManyTensors {
                count: self.tensors.len(),
                limit: MAX_TENSORS_PER_ITEM,
            });
        }
        for (index, tensor) in self.tensors.iter().enumerate() {
            tensor.header.validate_length(tensor.data.len() as u64)?;
            if self.tensors[..index]
                .iter()
                .any(|earlier| earlier.header.name == tensor.header.name)
            {
                return Err(TensorError::DuplicateName {
                    name: tensor.header.name.clone(),
                });
            }
        }
        Ok(())
    }

    /// Everything the broker keeps for these tensors: their data, names
    /// and shapes, and the bookkeeping of each tensor and each slice.
    pub fn held_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .map(|tensor| {
                tensor.data.len() as u64
                    + tensor.header.name.len() as u64
                    + 8 * tensor.header.shape.len() as u64
                    + TENSOR_OVERHEAD_BYTES
                    + SLICE_OVERHEAD_BYTES * tensor.data.chunk_count() as u64
            })
            .sum()
    }

    /// Payload bytes of all tensors.
    pub fn payload_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .map(|tensor| tensor.data.len() as u64)
            .sum()
    }

    /// Tensors whose data arrived in more than one frame (kept as slices).
    pub fn spanning_tensors(&self) -> usize {
        self.tensors
            .iter()
            .filter(|tensor| tensor.data.chunk_count() > 1)
            .count()
    }

    pub fn encoded_len(&self) -> usize {
        self.tensors
            .iter()
            .map(|tensor| frames::delimited_len(SAMPLE_TENSORS, tensor.encoded_len()))
            .sum()
    }

    /// The sample as field `tag` of its message, the data passed through.
    pub fn encode(&self, tag: u32, pieces: &mut Pieces) -> Result<(), Status> {
        let buffer = pieces.buffer();
        encoding::encode_key(tag, WireType::LengthDelimited, buffer);
        encoding::encode_varint(self.encoded_len() as u64, buffer);
        for tensor in &self.tensors {
            frames::encode_tensor(
                SAMPLE_TENSORS,
                &tensor.header,
                tensor.data.chunks(),
                tensor.data.len(),
                pieces,
            )?;
        }
        Ok(())
    }

    fn to_proto(&self) -> proto::Sample {
        proto::Sample {
            tensors: self.tensors.iter().map(WireTensor::to_proto).collect(),
        }
    }
}

impl WireItem {
    /// Everything the broker keeps for this item, as `--max-queue-bytes`
    /// counts it: the sample's [`WireSample::held_bytes`], the trace
    /// context's keys and values with their bookkeeping, and the item's own.
    pub fn held_bytes(&self) -> u64 {
        let trace: u64 = self
            .trace_context
            .iter()
            .map(|(key, value)| (key.len() + value.len()) as u64 + TRACE_ENTRY_OVERHEAD_BYTES)
            .sum();
        ITEM_OVERHEAD_BYTES + trace + self.sample.as_ref().map_or(0, WireSample::held_bytes)
    }

    /// The trace context's size within [`MAX_TRACE_CONTEXT_BYTES`].
    pub fn check_trace_context(&self) -> Result<(), String> {
        let bytes: usize = self
            .trace_context
            .iter()
            .map(|(key, value)| key.len() + value.len())
            .sum();
        if bytes > MAX_TRACE_CONTEXT_BYTES {
            return Err(format!(
                "trace context of {bytes} bytes ({} entries), at most {MAX_TRACE_CONTEXT_BYTES} are accepted",
                self.trace_context.len()
            ));
        }
        Ok(())
    }

    pub fn from_proto(item: proto::Item) -> Self {
        WireItem {
            seq: item.seq,
            sample: item.sample.map(|sample| WireSample {
                tensors: sample
                    .tensors
                    .into_iter()
                    .map(WireTensor::from_proto)
                    .collect(),
            }),
            trace_context: item.trace_context,
        }
    }

    /// prost's `Item`, each tensor's data joined into one buffer (a copy
    /// when it arrived in several frames).
    pub fn to_proto(&self) -> proto::Item {
        proto::Item {
            seq: self.seq,
            sample: self.sample.as_ref().map(WireSample::to_proto),
            trace_context: self.trace_context.clone(),
        }
    }

    /// Length of prost's encoding of the `Item`.
    pub fn encoded_len(&self) -> usize {
        let seq = if self.seq == 0 {
            0
        } else {
            encoding::uint64::encoded_len(ITEM_SEQ, &self.seq)
        };
        let sample = self.sample.as_ref().map_or(0, |sample| {
            frames::delimited_len(ITEM_SAMPLE, sample.encoded_len())
        });
        seq + sample + trace_context_len(ITEM_TRACE_CONTEXT, &self.trace_context)
    }

    /// prost's encoding of the `Item` (its fields, no length), the data
    /// passed through.
    pub fn encode(&self, pieces: &mut Pieces) -> Result<(), Status> {
        if self.seq != 0 {
            encoding::uint64::encode(ITEM_SEQ, &self.seq, pieces.buffer());
        }
        if let Some(sample) = &self.sample {
            sample.encode(ITEM_SAMPLE, pieces)?;
        }
        encode_trace_context(ITEM_TRACE_CONTEXT, &self.trace_context, pieces.buffer());
        Ok(())
    }

    /// prost's encoding as pieces (the write-ahead log's record): small
    /// fields in buffers, each large tensor slice shared, not copied.
    pub fn encode_pieces(&self) -> Result<Vec<bytes::Bytes>, Status> {
        let mut pieces = Pieces::default();
        pieces
            .buffer()
            .reserve(self.encoded_len().min(LARGE_PAYLOAD_BYTES));
        self.encode(&mut pieces)?;
        Ok(pieces.finish())
    }

    /// prost's encoding in one buffer.
    pub fn encode_to_vec(&self) -> Result<Vec<u8>, Status> {
        let mut out = Vec::with_capacity(self.encoded_len());
        for piece in self.encode_pieces()? {
            out.extend_from_slice(&piece);
        }
        Ok(out)
    }
}

/// How the large payloads (at least [`LARGE_PAYLOAD_BYTES`]) of valid
/// items arrived: within one HTTP/2 frame, or across several (then kept as
/// that many slices; neither is copied). In `/metrics`.
#[derive(Debug, Default)]
pub struct ReceivedPayloads {
    one_frame: AtomicU64,
    several_frames: AtomicU64,
    slices: AtomicU64,
    /// Decoded items whose producer's reader waits for room in a full
    /// queue: held outside `--max-queue-bytes` (one per producer stream at
    /// most), and let go as soon as that stream ends or is fenced.
    waiting_items: AtomicU64,
    waiting_bytes: AtomicU64,
}

/// A reading of [`ReceivedPayloads`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReceivedCounts {
    pub one_frame: u64,
    pub several_frames: u64,
    /// Slices of the payloads that came in several frames.
    pub slices: u64,
    /// Items (and their payload bytes) decoded and waiting for room.
    pub waiting_items: u64,
    pub waiting_bytes: u64,
}

/// Counts one decoded item as waiting for room while it lives.
pub struct WaitingForRoom<'a> {
    payloads: &'a ReceivedPayloads,
    bytes: u64,
}

impl Drop for WaitingForRoom<'_> {
    fn drop(&mut self) {
        self.payloads.waiting_items.fetch_sub(1, Ordering::Relaxed);
        self.payloads
            .waiting_bytes
            .fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

impl ReceivedPayloads {
    pub fn record(&self, item: &WireItem) {
        let Some(sample) = &item.sample else {
            return;
        };
        for tensor in &sample.tensors {
            if tensor.data.len() < LARGE_PAYLOAD_BYTES {
                continue;
            }
            match tensor.data.chunk_count() {
                1 => self.one_frame.fetch_add(1, Ordering::Relaxed),
                slices => {
                    self.slices.fetch_add(slices as u64, Ordering::Relaxed);
                    self.several_frames.fetch_add(1, Ordering::Relaxed)
                }
            };
        }
    }

    /// Counts an item of `bytes` as waiting for room until the guard drops.
    pub fn wait_for_room(&self, bytes: u64) -> WaitingForRoom<'_> {
        self.waiting_items.fetch_add(1, Ordering::Relaxed);
        self.waiting_bytes.fetch_add(bytes, Ordering::Relaxed);
        WaitingForRoom {
            payloads: self,
            bytes,
        }
    }

    pub fn counts(&self) -> ReceivedCounts {
        ReceivedCounts {
            one_frame: self.one_frame.load(Ordering::Relaxed),
            several_frames: self.several_frames.load(Ordering::Relaxed),
            slices: self.slices.load(Ordering::Relaxed),
            waiting_items: self.waiting_items.load(Ordering::Relaxed),
            waiting_bytes: self.waiting_bytes.load(Ordering::Relaxed),
        }
    }
}

/// prost's encoded length of a `map<string, string>` field.
pub fn trace_context_len(tag: u32, map: &HashMap<String, String>) -> usize {
    encoding::hash_map::encoded_len(
        encoding::string::encoded_len,
        encoding::string::encoded_len,
        tag,
        map,
    )
}

/// prost's encoding of a `map<string, string>` field.
pub fn encode_trace_context(tag: u32, map: &HashMap<String, String>, buffer: &mut BytesMut) {
    encoding::hash_map::encode(
        encoding::string::encode,
        encoding::string::encoded_len,
        encoding::string::encode,
        encoding::string::encoded_len,
        tag,
        map,
        buffer,
    );
}

/// Why a Produce message is not valid protobuf.
#[derive(Debug, thiserror::Error)]
pub enum DecodeFailure {
    #[error("{0}")]
    Prost(#[from] prost::DecodeError),
    #[error("{field} has wire type {actual:?}, expected length-delimited")]
    WireType {
        field: &'static str,
        actual: WireType,
    },
    #[error("{field} declares {declared} bytes, but only {remaining} remain in its message")]
    Underflow {
        field: &'static str,
        declared: u64,
        remaining: usize,
    },
}

/// A length-delimited field's body: its declared length checked against
/// what remains, then cut out (no copy).
fn delimited(
    field: &'static str,
    wire_type: WireType,
    buf: &mut Rope,
) -> Result<Rope, DecodeFailure> {
    if wire_type != WireType::LengthDelimited {
        return Err(DecodeFailure::WireType {
            field,
            actual: wire_type,
        });
    }
    let declared = encoding::decode_varint(buf)?;
    let remaining = buf.remaining();
    if declared > remaining as u64 {
        return Err(DecodeFailure::Underflow {
            field,
            declared,
            remaining,
        });
    }
    Ok(buf.split_to(declared as usize))
}

/// Decodes one Produce message. prost's rules: a oneof field replaces a
/// different variant and merges into the same one; a repeated message
/// field appends; a scalar field's last value wins; unknown fields are
/// skipped.
pub fn decode_produce_request(mut buf: Rope) -> Result<ProduceIn, DecodeFailure> {
    let context = DecodeContext::default();
    let mut kind = ProduceIn::Empty;
    while buf.has_remaining() {
        let (tag, wire_type) = encoding::decode_key(&mut buf)?;
        kind = match (tag, std::mem::replace(&mut kind, ProduceIn::Empty)) {
            (PRODUCE_REQUEST_HELLO, earlier) => {
                let mut hello = match earlier {
                    ProduceIn::Hello(hello) => hello,
                    _ => proto::ProducerHello::default(),
                };
                encoding::message::merge(wire_type, &mut hello, &mut buf, context.clone())?;
                ProduceIn::Hello(hello)
            }
            (PRODUCE_REQUEST_ITEM, earlier) => {
                let mut item = match earlier {
                    ProduceIn::Item(item) => item,
                    _ => WireItem::default(),
                };
                merge_item(
                    delimited("ProduceRequest.item", wire_type, &mut buf)?,
                    &mut item,
                )?;
                ProduceIn::Item(item)
            }
            (PRODUCE_REQUEST_STATS, earlier) => {
                let mut stats = match earlier {
                    ProduceIn::Stats(stats) => stats,
                    _ => proto::ProducerStats::default(),
                };
                encoding::message::merge(wire_type, &mut stats, &mut buf, context.clone())?;
                ProduceIn::Stats(stats)
            }
            (_, earlier) => {
                encoding::skip_field(wire_type, tag, &mut buf, context.clone())?;
                earlier
            }
        };
    }
    Ok(kind)
}

fn merge_item(mut buf: Rope, item: &mut WireItem) -> Result<(), DecodeFailure> {
    let context = DecodeContext::default();
    while buf.has_remaining() {
        let (tag, wire_type) = encoding::decode_key(&mut buf)?;
        match tag {
            ITEM_SEQ => {
                encoding::uint64::merge(wire_type, &mut item.seq, &mut buf, context.clone())?
            }
            ITEM_SAMPLE => merge_sample(
                delimited("Item.sample", wire_type, &mut buf)?,
                item.sample.get_or_insert_with(WireSample::default),
            )?,
            ITEM_TRACE_CONTEXT => {
                // prost's generated code checks a map field's wire type
                // before merging an entry; `hash_map::merge` does not.
                encoding::check_wire_type(WireType::LengthDelimited, wire_type)?;
                encoding::hash_map::merge(
                    encoding::string::merge,
                    encoding::string::merge,
                    &mut item.trace_context,
                    &mut buf,
                    context.clone(),
                )?
            }
            _ => encoding::skip_field(wire_type, tag, &mut buf, context.clone())?,
        }
    }
    Ok(())
}

fn merge_sample(mut buf: Rope, sample: &mut WireSample) -> Result<(), DecodeFailure> {
    let context = DecodeContext::default();
    while buf.has_remaining() {
        let (tag, wire_type) = encoding::decode_key(&mut buf)?;
        match tag {
            SAMPLE_TENSORS => {
                let mut tensor = WireTensor::default();
                merge_tensor(
                    delimited("Sample.tensors", wire_type, &mut buf)?,
                    &mut tensor,
                )?;
                sample.tensors.push(tensor);
            }
            _ => encoding::skip_field(wire_type, tag, &mut buf, context.clone())?,
        }
    }
    Ok(())
}

fn merge_tensor(mut buf: Rope, tensor: &mut WireTensor) -> Result<(), DecodeFailure> {
    let context = DecodeContext::default();
    let header = &mut tensor.header;
    while buf.has_remaining() {
        let (tag, wire_type) = encoding::decode_key(&mut buf)?;
        match tag {
            TENSOR_NAME => {
                encoding::string::merge(wire_type, &mut header.name, &mut buf, context.clone())?
            }
            TENSOR_DTYPE => {
                encoding::int32::merge(wire_type, &mut header.dtype, &mut buf, context.clone())?
            }
            TENSOR_SHAPE => encoding::uint64::merge_repeated(
                wire_type,
                &mut header.shape,
                &mut buf,
                context.clone(),
            )?,
            TENSOR_DATA => {
                let data = delimited("Tensor.data", wire_type, &mut buf)?;
                tensor.data = if data.len() < LARGE_PAYLOAD_BYTES && data.chunk_count() > 0 {
                    // A small payload is copied: its slice must not keep a
                    // whole frame's memory alive in the queue.
                    let mut copy = BytesMut::with_capacity(data.len());
                    for chunk in data.chunks() {
                        copy.extend_from_slice(chunk);
                    }
                    Rope::from_bytes(copy.freeze())
                } else {
                    data
                };
            }
            _ => encoding::skip_field(wire_type, tag, &mut buf, context.clone())?,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
