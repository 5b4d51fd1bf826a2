//! A segment file: its header, and its replay with the torn-tail rule.
//!
//! A segment starts with a 32-byte header, then frames (`record.rs`):
//!
//! ```text
//! [8  magic "DFLWAL\r\n"][u32 format version][u32 0]
//! [u64 fingerprint of the run's configuration][u32 CRC-32 of the 24 bytes before][u32 0]
//! ```
//!
//! Little endian. The magic refuses a file that is not a segment (the
//! `\r\n` also catches a text-mode copy), the version a segment of another
//! format, the fingerprint a segment of a run configured otherwise (another
//! set of targets: its resume points would be someone else's).
//!
//! Only a write cut short is cut off, and only at the end of the newest
//! segment: a frame that runs past the end, a last frame whose CRC fails,
//! or a tail of zero bytes (blocks the file system allocated before the
//! crash). Anything else (a bad frame with good records after it, a frame
//! whose CRC holds but whose body does not decode, a bad header, any
//! damage to an older segment) refuses to start, naming the file and the
//! byte offset.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use super::error::{io_error, WalError};
use super::record::DurablePayload;
use super::record::{self, FrameError};
use crate::queue::Recovered;

pub(super) const MAGIC: [u8; 8] = *b"DFLWAL\r\n";
/// The format this broker writes and reads.
pub(super) const FORMAT_VERSION: u32 = 1;
pub const HEADER_BYTES: u64 = 32;

pub(super) fn segment_path(dir: &Path, index: u64) -> PathBuf {
    dir.join(format!("segment-{index:016}.wal"))
}

/// The segment files of `dir`, in index order.
pub(super) fn list_segments(dir: &Path) -> Result<Vec<(u64, PathBuf)>, WalError> {
    let mut segments = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_error(dir))? {
        let entry = entry.map_err(io_error(dir))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(index) = name
            .strip_prefix("segment-")
            .and_then(|rest| rest.strip_suffix(".wal"))
            .and_then(|digits| digits.parse::<u64>().ok())
        {
            segments.push((index, entry.path()));
        }
    }
    segments.sort();
    Ok(segments)
}

pub fn encode_header(fingerprint: u64) -> [u8; HEADER_BYTES as usize] {
    let mut header = [0u8; HEADER_BYTES as usize];
    header[..8].copy_from_slice(&MAGIC);
    header[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    header[16..24].copy_from_slice(&fingerprint.to_le_bytes());
    let crc = crc32fast::hash(&header[..24]);
    header[24..28].copy_from_slice(&crc.to_le_bytes());
    header
}

/// What is wrong with a header, if anything; its fingerprint otherwise.
pub(super) fn decode_header(header: &[u8; HEADER_BYTES as usize]) -> Result<u64, HeaderError> {
    if header[..8] != MAGIC {
        return Err(HeaderError::Magic);
    }
    let crc = u32::from_le_bytes([header[24], header[25], header[26], header[27]]);
    if crc32fast::hash(&header[..24]) != crc {
        return Err(HeaderError::Crc);
    }
    let version = u32::from_le_bytes([header[8], header[9], header[10], header[11]]);
    if version != FORMAT_VERSION {
        return Err(HeaderError::Version(version));
    }
    let mut fingerprint = [0u8; 8];
    fingerprint.copy_from_slice(&header[16..24]);
    Ok(u64::from_le_bytes(fingerprint))
}

#[derive(Debug, PartialEq, Eq)]
pub(super) enum HeaderError {
    Magic,
    Crc,
    Version(u32),
}

/// Creates segment `path` (which must not exist yet) with its header;
/// the file, positioned at its end.
pub(super) fn create_segment(path: &Path, fingerprint: u64) -> Result<File, WalError> {
    let mut file = OpenOptions::new()
        .create_new(true)
        .append(true)
        .open(path)
        .map_err(io_error(path))?;
    file.write_all(&encode_header(fingerprint))
        .map_err(io_error(path))?;
    Ok(file)
}

/// Overwrites the fingerprint in segment `path`'s header (adopting a state
/// dir under a new configuration) and syncs it.
pub(super) fn rewrite_fingerprint(path: &Path, fingerprint: u64) -> Result<(), WalError> {
    let mut file = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(io_error(path))?;
    file.write_all(&encode_header(fingerprint))
        .and_then(|()| file.sync_data())
        .map_err(io_error(path))
}

/// How a replay checks each segment's fingerprint.
#[derive(Debug, Clone, Copy)]
pub(super) enum FingerprintCheck {
    /// Every segment must carry this one.
    Require(u64),
    /// Any (the operator adopts the state dir under a new configuration).
    Any,
}

/// One segment replayed: its records, whether a torn tail was cut, and
/// whether it lacked a whole header (only a newest segment that a crash
/// cut before its header was written; the caller writes it).
pub(super) struct Replayed {
    pub records: u64,
    pub truncated_tail: bool,
    pub needs_header: bool,
}

/// Replays one segment into `recovered`; a torn tail of the newest one is
/// cut off (and the file synced).
pub(super) fn replay_segment<P: DurablePayload>(
    path: &Path,
    is_newest: bool,
    fingerprints: FingerprintCheck,
    recovered: &mut Recovered<P>,
) -> Result<Replayed, WalError> {
    let corrupt = |offset: u64, detail: String| WalError::Corrupt {
        path: path.to_path_buf(),
        offset,
        detail,
    };
    let mut file = OpenOptions::new()
        .read(true)
        .write(is_newest)
        .open(path)
        .map_err(io_error(path))?;
    let length = file.metadata().map_err(io_error(path))?.len();
    let mut reader = std::io::BufReader::with_capacity(1 << 20, &mut file);
    if length < HEADER_BYTES {
        // A crash between creating the file and writing its header.
        let mut start = Vec::new();
        reader.read_to_end(&mut start).map_err(io_error(path))?;
        let cut_short = MAGIC.starts_with(&start[..start.len().min(MAGIC.len())])
            || start.iter().all(|byte| *byte == 0);
        if !is_newest || !cut_short {
            return Err(corrupt(
                0,
                format!("the segment header is cut short ({length} of {HEADER_BYTES} bytes)"),
            ));
        }
        drop(reader);
        cut(&mut file, path, 0, "a segment header cut short")?;
        return Ok(Replayed {
            records: 0,
            truncated_tail: length > 0,
            needs_header: true,
        });
    }
    let mut header = [0u8; HEADER_BYTES as usize];
    reader.read_exact(&mut header).map_err(io_error(path))?;
    match decode_header(&header) {
        Ok(found) => {
            if let FingerprintCheck::Require(expected) = fingerprints {
                if found != expected {
                    return Err(WalError::ForeignSegment {
                        path: path.to_path_buf(),
                        found,
                        expected,
                    });
                }
            }
        }
        Err(HeaderError::Version(found)) => {
            return Err(WalError::Version {
                path: path.to_path_buf(),
                found,
                supported: FORMAT_VERSION,
            })
        }
        Err(HeaderError::Magic) => {
            return Err(corrupt(
                0,
                "not a dflash write-ahead log segment (no DFLWAL magic: written by another program or a broker before the segment header)".to_string(),
            ))
        }
        Err(HeaderError::Crc) => {
            return Err(corrupt(0, "segment header CRC mismatch".to_string()))
        }
    }
    let (records, offset, failure) = replay_frames(&mut reader, HEADER_BYTES, length, recovered);
    drop(reader);
    let Some(error) = failure else {
        return Ok(Replayed {
            records,
            truncated_tail: false,
            needs_header: false,
        });
    };
    let torn = match &error {
        FrameError::PastEnd(_) => true,
        FrameError::Crc { frame_end } if *frame_end == length => true,
        // A zero frame header reads as an empty body whose CRC holds, so
        // a zero-filled tail is recognised whatever the frame error.
        FrameError::Crc { .. } | FrameError::Undecodable(_) => {
            zeros_from(&mut file, path, offset, length)?
        }
    };
    if !is_newest || !torn {
        let hint = if is_newest {
            "good bytes follow it, so this is not a write cut short"
        } else {
            "an older segment is never cut"
        };
        return Err(corrupt(offset, format!("{error} ({hint}): the broker refuses to start rather than lose the records after it; restore the state dir from a copy, or start a new run with a new --state-dir")));
    }
    tracing::warn!(path = %path.display(), offset, %error, "cutting off a torn tail of the write-ahead log");
    cut(&mut file, path, offset, "a torn tail")?;
    Ok(Replayed {
        records,
        truncated_tail: true,
        needs_header: false,
    })
}

/// Replays the frames `reader` holds from `offset` of a segment of
/// `length` bytes: the records applied, where the replay stopped, and why
/// (`None`: at the end).
fn replay_frames<P: DurablePayload>(
    reader: &mut impl Read,
    mut offset: u64,
    length: u64,
    recovered: &mut Recovered<P>,
) -> (u64, u64, Option<FrameError>) {
    let mut records = 0u64;
    while offset < length {
        match record::read_frame::<P>(reader, offset, length) {
            Ok((entry, frame_bytes)) => {
                recovered.apply(entry);
                offset += frame_bytes;
                records += 1;
            }
            Err(error) => return (records, offset, Some(error)),
        }
    }
    (records, offset, None)
}

/// A segment's bytes (header and frames) replayed as the newest segment
/// is, without a file: what was recovered and the records read, or why
/// the header was refused. For the fuzz body (`crate::fuzzing::wal_segment`).
pub fn replay_bytes<P: DurablePayload>(bytes: &[u8]) -> Result<(Recovered<P>, u64), String> {
    let length = bytes.len() as u64;
    if length < HEADER_BYTES {
        return Err(format!("{length} bytes: shorter than a header"));
    }
    let mut header = [0u8; HEADER_BYTES as usize];
    header.copy_from_slice(&bytes[..HEADER_BYTES as usize]);
    decode_header(&header).map_err(|error| format!("{error:?}"))?;
    let mut recovered = Recovered::default();
    let mut reader = &bytes[HEADER_BYTES as usize..];
    let (records, _, _) = replay_frames(&mut reader, HEADER_BYTES, length, &mut recovered);
    if recovered.is_mid_snapshot() {
        // Refused at start (`Wal::open`).
        return Err("the segment ends inside a snapshot".to_string());
    }
    Ok((recovered, records))
}

/// A segment's bytes holding `entries`: the header (with `fingerprint`),
/// then one frame each. For the fuzz seeds; an entry too large for a frame
/// ends the segment early.
pub fn encode_segment<P: DurablePayload>(
    fingerprint: u64,
    entries: &[crate::queue::JournalEntry<P>],
) -> Vec<u8> {
    let mut bytes = encode_header(fingerprint).to_vec();
    for entry in entries {
        if record::write_frame(&mut bytes, entry).is_err() {
            break;
        }
    }
    bytes
}

/// Whether every byte of `file` from `offset` to `length` is zero.
fn zeros_from(file: &mut File, path: &Path, offset: u64, length: u64) -> Result<bool, WalError> {
    file.seek(SeekFrom::Start(offset)).map_err(io_error(path))?;
    let mut left = length - offset;
    let mut buffer = vec![0u8; 1 << 16];
    while left > 0 {
        let chunk = left.min(buffer.len() as u64) as usize;
        file.read_exact(&mut buffer[..chunk])
            .map_err(io_error(path))?;
        if buffer[..chunk].iter().any(|byte| *byte != 0) {
            return Ok(false);
        }
        left -= chunk as u64;
    }
    Ok(true)
}

/// Cuts `file` at `offset`, syncs it, and leaves it positioned at the end.
fn cut(file: &mut File, path: &Path, offset: u64, what: &str) -> Result<(), WalError> {
    tracing::debug!(path = %path.display(), offset, what, "cutting a segment");
    file.set_len(offset).map_err(io_error(path))?;
    file.seek(SeekFrom::End(0)).map_err(io_error(path))?;
    file.sync_all().map_err(io_error(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_round_trips_and_each_kind_of_damage_is_named() {
        let header = encode_header(0xfeed_beef);
        assert_eq!(decode_header(&header), Ok(0xfeed_beef));
        let mut magic = header;
        magic[0] = b'X';
        assert_eq!(decode_header(&magic), Err(HeaderError::Magic));
        let mut flipped = header;
        flipped[17] ^= 1;
        assert_eq!(decode_header(&flipped), Err(HeaderError::Crc));
        let mut version = header;
        version[8..12].copy_from_slice(&7u32.to_le_bytes());
        let crc = crc32fast::hash(&version[..24]);
        version[24..28].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(decode_header(&version), Err(HeaderError::Version(7)));
    }
}
