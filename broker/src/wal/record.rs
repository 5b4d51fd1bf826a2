//! The one framing of the write-ahead log: how a journal entry becomes a
//! record on disk and back. A frame is `[u32 body length][u32 CRC-32 of
//! body][body]`, little endian; a body is a kind byte and the entry's
//! fields (integers little endian, strings and byte strings as a u64 length
//! and the bytes). Nothing else in the broker knows this layout.

use std::io::{Read, Write};
use std::sync::Arc;

use crate::queue::{CommitRecord, DeadLetter, JournalEntry, Payload, TargetBooks};

/// A payload the log can store.
pub trait DurablePayload: Payload + Sized {
    /// The payload's encoding as pieces written one after another; large
    /// pieces are shared with the payload, not copied.
    fn encode_payload(&self) -> Vec<bytes::Bytes>;
    fn decode_payload(bytes: &[u8]) -> Result<Self, String>;
}

/// Bytes of a frame header: the body length and its CRC-32.
pub(super) const HEADER_BYTES: u64 = 8;
/// A frame body larger than this is corruption, not a record.
const MAX_FRAME_BYTES: u64 = 1 << 34;

const KIND_RESET: u8 = 1;
const KIND_SNAPSHOT_END: u8 = 2;
const KIND_ACCEPTED: u8 = 3;
const KIND_ACKED: u8 = 4;
const KIND_DEAD_LETTERED: u8 = 5;
const KIND_EPOCH: u8 = 6;
const KIND_DONE: u8 = 7;
const KIND_TARGET_FAILED: u8 = 8;
const KIND_ABORTED: u8 = 9;
const KIND_SNAPSHOT_TARGET: u8 = 10;
const KIND_SNAPSHOT_COUNTERS: u8 = 11;
const KIND_SNAPSHOT_DEAD_LETTER: u8 = 12;
const KIND_DELIVERED: u8 = 13;
const KIND_STEP_COMMITTED: u8 = 14;

/// Writes one frame; the bytes written.
pub(super) fn write_frame<P: DurablePayload>(
    out: &mut impl Write,
    entry: &JournalEntry<P>,
) -> std::io::Result<u64> {
    let mut body = Encoder(Vec::with_capacity(64));
    // The payload of an accepted item is written after the small fields,
    // piece by piece, without another copy into `body`.
    let payload = encode_entry(entry, &mut body).unwrap_or_default();
    let payload_length: usize = payload.iter().map(|piece| piece.len()).sum();
    let body_length = body.0.len() + payload_length;
    let body_length_u32 = u32::try_from(body_length).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("a record of {body_length} bytes does not fit a frame"),
        )
    })?;
    let mut crc = crc32fast::Hasher::new();
    crc.update(&body.0);
    for piece in &payload {
        crc.update(piece);
    }
    let mut header = [0u8; HEADER_BYTES as usize];
    header[..4].copy_from_slice(&body_length_u32.to_le_bytes());
    header[4..].copy_from_slice(&crc.finalize().to_le_bytes());
    out.write_all(&header)?;
    out.write_all(&body.0)?;
    for piece in &payload {
        out.write_all(piece)?;
    }
    Ok(HEADER_BYTES + body_length as u64)
}

/// Why a frame could not be read.
#[derive(Debug)]
pub(super) enum FrameError {
    /// The frame runs past the end of the segment: a write cut short.
    PastEnd(String),
    /// The body's CRC does not match; the frame would end at `frame_end`.
    Crc { frame_end: u64 },
    /// The CRC matches but the body does not decode: not a torn write (a
    /// record of another format, or a bug), never cut off.
    Undecodable(String),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::PastEnd(detail) | FrameError::Undecodable(detail) => {
                formatter.write_str(detail)
            }
            FrameError::Crc { .. } => formatter.write_str("CRC mismatch"),
        }
    }
}

/// Reads the frame at `offset` of a segment of `length` bytes and decodes
/// its entry: the entry and the frame's size, or what is wrong with it.
/// The body's length is checked against the bytes left before anything is
/// allocated.
pub(super) fn read_frame<P: DurablePayload>(
    reader: &mut impl Read,
    offset: u64,
    length: u64,
) -> Result<(JournalEntry<P>, u64), FrameError> {
    let mut header = [0u8; HEADER_BYTES as usize];
    if offset + HEADER_BYTES > length {
        return Err(FrameError::PastEnd(format!(
            "frame header at byte {offset} runs past the end ({length})"
        )));
    }
    reader
        .read_exact(&mut header)
        .map_err(|error| FrameError::PastEnd(format!("frame header: {error}")))?;
    let body_length = u64::from(u32::from_le_bytes([
        header[0], header[1], header[2], header[3],
    ]));
    let crc = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
    if body_length > MAX_FRAME_BYTES || offset + HEADER_BYTES + body_length > length {
        return Err(FrameError::PastEnd(format!(
            "frame of {body_length} bytes runs past the end ({length})"
        )));
    }
    let mut body = vec![0u8; body_length as usize];
    reader
        .read_exact(&mut body)
        .map_err(|error| FrameError::PastEnd(format!("frame body: {error}")))?;
    if crc32fast::hash(&body) != crc {
        return Err(FrameError::Crc {
            frame_end: offset + HEADER_BYTES + body_length,
        });
    }
    let entry = decode_entry(&body).map_err(FrameError::Undecodable)?;
    Ok((entry, HEADER_BYTES + body_length))
}

struct Encoder(Vec<u8>);

impl Encoder {
    fn u8(&mut self, value: u8) {
        self.0.push(value);
    }
    fn u32(&mut self, value: u32) {
        self.0.extend_from_slice(&value.to_le_bytes());
    }
    fn u64(&mut self, value: u64) {
        self.0.extend_from_slice(&value.to_le_bytes());
    }
    fn bytes(&mut self, value: &[u8]) {
        self.u64(value.len() as u64);
        self.0.extend_from_slice(value);
    }
    fn str(&mut self, value: &str) {
        self.bytes(value.as_bytes());
    }
    /// A kind byte, then the target id and seq most entries start with.
    fn item(&mut self, kind: u8, target_id: &str, seq: u64) {
        self.u8(kind);
        self.str(target_id);
        self.u64(seq);
    }
}

/// Encodes `entry` into `body`; an accepted item's payload is returned
/// instead (as its pieces), to be written after `body` (its length is in
/// `body`).
fn encode_entry<P: DurablePayload>(
    entry: &JournalEntry<P>,
    body: &mut Encoder,
) -> Option<Vec<bytes::Bytes>> {
    match entry {
        JournalEntry::Reset => body.u8(KIND_RESET),
        JournalEntry::SnapshotEnd => body.u8(KIND_SNAPSHOT_END),
        JournalEntry::Accepted {
            target_id,
            seq,
            payload,
        } => {
            body.item(KIND_ACCEPTED, target_id, *seq);
            let encoded = payload.encode_payload();
            let length: usize = encoded.iter().map(|piece| piece.len()).sum();
            body.u64(length as u64);
            return Some(encoded);
        }
        JournalEntry::Acked { target_id, seq } => body.item(KIND_ACKED, target_id, *seq),
        JournalEntry::Delivered {
            target_id,
            seq,
            deliveries,
        } => {
            body.item(KIND_DELIVERED, target_id, *seq);
            body.u32(*deliveries);
        }
        JournalEntry::DeadLettered {
            target_id,
            seq,
            reason,
        } => {
            body.item(KIND_DEAD_LETTERED, target_id, *seq);
            body.str(reason);
        }
        JournalEntry::Epoch { target_id, epoch } => body.item(KIND_EPOCH, target_id, *epoch),
        JournalEntry::Done { target_id } => {
            body.u8(KIND_DONE);
            body.str(target_id);
        }
        JournalEntry::TargetFailed { target_id, reason } => {
            body.u8(KIND_TARGET_FAILED);
            body.str(target_id);
            body.str(reason);
        }
        JournalEntry::Aborted { reason } => {
            body.u8(KIND_ABORTED);
            body.str(reason);
        }
        JournalEntry::SnapshotTarget(books) => encode_target_books(books, body),
        JournalEntry::SnapshotCounters {
            acked_items,
            acked_bytes,
            dead_letter_count,
        } => {
            body.u8(KIND_SNAPSHOT_COUNTERS);
            for value in [acked_items, acked_bytes, dead_letter_count] {
                body.u64(*value);
            }
        }
        JournalEntry::StepCommitted { record, acked } => {
            body.u8(KIND_STEP_COMMITTED);
            for value in [record.step, record.instance, record.quorum_id] {
                body.u64(value);
            }
            body.u64(acked.len() as u64);
            for (target_id, seq) in acked {
                body.str(target_id);
                body.u64(*seq);
            }
        }
        JournalEntry::SnapshotDeadLetter(dead_letter) => {
            body.item(
                KIND_SNAPSHOT_DEAD_LETTER,
                &dead_letter.target_id,
                dead_letter.seq,
            );
            body.u32(dead_letter.deliveries);
            body.str(&dead_letter.reason);
            body.u64(dead_letter.bytes);
        }
    }
    None
}

fn encode_target_books(books: &TargetBooks, body: &mut Encoder) {
    body.u8(KIND_SNAPSHOT_TARGET);
    body.str(&books.target_id);
    for value in [books.epoch, books.accepted_items, books.accepted_bytes] {
        body.u64(value);
    }
    body.u64(books.seq_ranges.len() as u64);
    for (start, end) in &books.seq_ranges {
        body.u64(*start);
        body.u64(*end);
    }
    body.u8(u8::from(books.done));
    match &books.failed {
        Some(reason) => {
            body.u8(1);
            body.str(reason);
        }
        None => body.u8(0),
    }
}

struct Decoder<'a> {
    bytes: &'a [u8],
}

impl<'a> Decoder<'a> {
    fn take(&mut self, count: usize) -> Result<&'a [u8], String> {
        if self.bytes.len() < count {
            return Err(format!(
                "record ends early ({} of {count} bytes)",
                self.bytes.len()
            ));
        }
        let (head, rest) = self.bytes.split_at(count);
        self.bytes = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, String> {
        let bytes = self.take(4)?;
        Ok(u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
    }
    fn u64(&mut self) -> Result<u64, String> {
        let bytes = self.take(8)?;
        let mut array = [0u8; 8];
        array.copy_from_slice(bytes);
        Ok(u64::from_le_bytes(array))
    }
    fn bytes(&mut self) -> Result<&'a [u8], String> {
        let length = self.u64()?;
        let length = usize::try_from(length).map_err(|_| format!("length {length} too large"))?;
        self.take(length)
    }
    fn string(&mut self) -> Result<String, String> {
        String::from_utf8(self.bytes()?.to_vec()).map_err(|error| format!("text: {error}"))
    }
    fn target(&mut self) -> Result<Arc<str>, String> {
        Ok(Arc::from(self.string()?.as_str()))
    }
}

fn decode_entry<P: DurablePayload>(body: &[u8]) -> Result<JournalEntry<P>, String> {
    let mut decoder = Decoder { bytes: body };
    let entry = match decoder.u8()? {
        KIND_RESET => JournalEntry::Reset,
        KIND_SNAPSHOT_END => JournalEntry::SnapshotEnd,
        KIND_ACCEPTED => {
            let target_id = decoder.target()?;
            let seq = decoder.u64()?;
            let payload = P::decode_payload(decoder.bytes()?)
                .map_err(|error| format!("payload of {target_id} seq {seq}: {error}"))?;
            JournalEntry::Accepted {
                target_id,
                seq,
                payload,
            }
        }
        KIND_ACKED => JournalEntry::Acked {
            target_id: decoder.target()?,
            seq: decoder.u64()?,
        },
        KIND_DELIVERED => JournalEntry::Delivered {
            target_id: decoder.target()?,
            seq: decoder.u64()?,
            deliveries: decoder.u32()?,
        },
        KIND_DEAD_LETTERED => JournalEntry::DeadLettered {
            target_id: decoder.target()?,
            seq: decoder.u64()?,
            reason: decoder.string()?,
        },
        KIND_EPOCH => JournalEntry::Epoch {
            target_id: decoder.target()?,
            epoch: decoder.u64()?,
        },
        KIND_DONE => JournalEntry::Done {
            target_id: decoder.target()?,
        },
        KIND_TARGET_FAILED => JournalEntry::TargetFailed {
            target_id: decoder.target()?,
            reason: decoder.string()?,
        },
        KIND_ABORTED => JournalEntry::Aborted {
            reason: decoder.string()?,
        },
        KIND_SNAPSHOT_TARGET => JournalEntry::SnapshotTarget(decode_target_books(&mut decoder)?),
        KIND_SNAPSHOT_COUNTERS => JournalEntry::SnapshotCounters {
            acked_items: decoder.u64()?,
            acked_bytes: decoder.u64()?,
            dead_letter_count: decoder.u64()?,
        },
        KIND_SNAPSHOT_DEAD_LETTER => JournalEntry::SnapshotDeadLetter(DeadLetter {
            target_id: decoder.target()?,
            seq: decoder.u64()?,
            deliveries: decoder.u32()?,
            reason: decoder.string()?,
            bytes: decoder.u64()?,
        }),
        KIND_STEP_COMMITTED => {
            let record = CommitRecord {
                step: decoder.u64()?,
                instance: decoder.u64()?,
                quorum_id: decoder.u64()?,
            };
            let count = decoder.u64()?;
            // Each sample takes at least 16 bytes: a count beyond that is
            // corruption, refused before anything is allocated.
            if count > (decoder.bytes.len() / 16) as u64 {
                return Err(format!(
                    "step record lists {count} samples in {} bytes",
                    decoder.bytes.len()
                ));
            }
            let mut acked = Vec::with_capacity(count as usize);
            for _ in 0..count {
                acked.push((decoder.target()?, decoder.u64()?));
            }
            JournalEntry::StepCommitted { record, acked }
        }
        kind => return Err(format!("unknown record kind {kind}")),
    };
    if !decoder.bytes.is_empty() {
        return Err(format!(
            "{} bytes left after the record",
            decoder.bytes.len()
        ));
    }
    Ok(entry)
}

fn decode_target_books(decoder: &mut Decoder<'_>) -> Result<TargetBooks, String> {
    let target_id = decoder.target()?;
    let epoch = decoder.u64()?;
    let accepted_items = decoder.u64()?;
    let accepted_bytes = decoder.u64()?;
    let ranges = decoder.u64()?;
    let mut seq_ranges = Vec::new();
    for _ in 0..ranges {
        seq_ranges.push((decoder.u64()?, decoder.u64()?));
    }
    let done = decoder.u8()? != 0;
    let failed = match decoder.u8()? {
        0 => None,
        _ => Some(decoder.string()?),
    };
    Ok(TargetBooks {
        target_id,
        epoch,
        accepted_items,
        accepted_bytes,
        seq_ranges,
        done,
        failed,
    })
}
