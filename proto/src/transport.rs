//! HTTP/2 and gRPC transport settings shared by the broker and every client,
//! defined once so both ends of a connection agree.

/// Per-stream HTTP/2 flow-control window of the clients (what the broker
/// may send a drafter ahead of its reading). Hidden-state payloads are tens
/// of MiB; hyper's default (about 1 MB) would stall each stream on round
/// trips.
pub const STREAM_WINDOW_BYTES: u32 = 64 << 20;

/// The broker's own receive window per stream. While the queue is full the
/// broker stops reading a Produce stream, and what the producer already sent
/// waits in HTTP/2 buffers, outside `--max-queue-bytes`: each producer adds
/// at most this window plus the one item the broker decoded and holds until
/// there is room for it. So the broker's memory stays within cap +
/// producers x (this + one item) + a baseline (measured in
/// `tests/tests/memory_bound.rs`; the README states the figure). 16 MiB keeps
/// that small and still moves an item in a few window updates on loopback.
pub const BROKER_RECEIVE_STREAM_WINDOW_BYTES: u32 = 16 << 20;

/// Per-connection HTTP/2 flow-control window (several streams' worth).
pub const CONNECTION_WINDOW_BYTES: u32 = 256 << 20;

/// Largest HTTP/2 DATA frame each end accepts (the protocol's default is
/// 16 KiB: a 16 MiB item would take 1,024 frames, each with its own header
/// and poll). Both the broker and the clients advertise this.
pub const MAX_FRAME_BYTES: u32 = 1 << 20;

/// Room for the proto framing around the largest payload of a message.
pub const MESSAGE_OVERHEAD_BYTES: u64 = 1 << 20;

/// Largest item the broker accepts by default (its `--max-item-bytes`).
pub const DEFAULT_MAX_ITEM_BYTES: u64 = 256 << 20;

/// The gRPC message limit for items of up to `max_item_bytes`.
pub fn message_limit_bytes(max_item_bytes: u64) -> usize {
    usize::try_from(max_item_bytes.saturating_add(MESSAGE_OVERHEAD_BYTES)).unwrap_or(usize::MAX)
}

/// The model-sync stream's message limit: weights travel in chunks well
/// below it.
pub const MODEL_SYNC_MESSAGE_BYTES: usize = 8 << 20;

/// The largest message a client may send on anything but Produce and model
/// sync: a Consume stream's hello, acks, nacks, credit and stats, and every
/// unary call. 1 MiB holds an ack of about 200,000 delivery ids, far beyond
/// any credit window, and is far below `--max-item-bytes`.
pub const CONTROL_MESSAGE_BYTES: usize = 1 << 20;

/// The most delivery ids one Ack, Nack or ExtendLeases may name: far
/// beyond any credit window (a drafter acks what it holds), and a bound on
/// the work one message does under the broker's queue lock. A message
/// naming more ends its Consume stream (INVALID_ARGUMENT, naming both
/// counts); its leases go back to the queue.
pub const MAX_IDS_PER_MESSAGE: usize = 65_536;

/// The longest nack reason or stats string the broker keeps; longer ones
/// are cut (at a character boundary) and marked.
pub const MAX_CONTROL_STRING_BYTES: usize = 1024;

/// `text` cut to [`MAX_CONTROL_STRING_BYTES`] at a character boundary, with
/// a mark saying how long it was.
pub fn bounded_control_string(text: &str) -> std::borrow::Cow<'_, str> {
    if text.len() <= MAX_CONTROL_STRING_BYTES {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut end = MAX_CONTROL_STRING_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    std::borrow::Cow::Owned(format!("{}... ({} bytes, cut)", &text[..end], text.len()))
}

/// Largest file chunk of a model-sync stream, either way (the model's
/// files are split into chunks of this size).
pub const MODEL_SYNC_CHUNK_BYTES: usize = 1 << 20;
