//! The data side of the pipeline: shard records → encoded samples → sorted
//! windows → `seq` numbers → batches, skipping what the broker already has.
//!
//! Synchronous and free of tch and tokio; it runs on its own thread so that
//! tokenization never holds up the device.

use crate::batching::{sort_window, split_into_batches, NumberedSequence, PlannedBatch};
use crate::settings::SyntheticSpec;
use crate::shard::ShardSpec;
use dflash_model::chat::{parse_line, ChatEncoder, Conversation, LineError, TokenizedSequence};
use std::io::BufRead;
use std::path::{Path, PathBuf};

/// One record of the data set before parsing.
#[derive(Debug, Clone)]
pub enum RecordContent {
    /// A JSONL line (invalid UTF-8 already reported as an error).
    Line(Result<String, LineError>),
    /// A record made in code (synthetic mode without data).
    Generated(Conversation),
}

/// A record of this shard with its 1-based line number (0 if generated).
#[derive(Debug, Clone)]
pub struct Record {
    pub line_number: u64,
    pub content: RecordContent,
}

/// Fatal data errors (a bad line is not fatal until there are too many).
#[derive(Debug, thiserror::Error)]
pub enum ReaderError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: the data file has no records")]
    EmptyDataFile { path: PathBuf },
    #[error("{path}: {count} malformed lines, more than --max-bad-lines {max}; first: {first}")]
    TooManyBadLines {
        path: PathBuf,
        count: u64,
        max: u64,
        first: String,
    },
}

/// A malformed line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadLine {
    pub line_number: u64,
    pub reason: String,
}

/// Counts of what the reader did, for the final report.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReaderSummary {
    /// Records of this shard read (good and bad).
    pub records_in_shard: u64,
    /// Valid samples, each given a seq.
    pub samples: u64,
    /// Samples skipped because the broker already had their seq.
    pub skipped_for_resume: u64,
    pub truncated: u64,
    /// Malformed lines (the first `BAD_LINES_KEPT` are listed).
    pub bad_line_count: u64,
    pub bad_lines: Vec<BadLine>,
}

const BAD_LINES_KEPT: usize = 100;

/// Counts the non-blank lines of a data file (a cheap first pass: the
/// shard's sample total for progress, and the empty-file check).
pub fn count_records(path: &Path) -> Result<u64, ReaderError> {
    let io_error = |source| ReaderError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io_error)?;
    let mut reader = std::io::BufReader::with_capacity(1 << 20, file);
    let mut buffer = Vec::new();
    let mut records = 0;
    loop {
        buffer.clear();
        if reader.read_until(b'\n', &mut buffer).map_err(io_error)? == 0 {
            return Ok(records);
        }
        if !buffer.iter().all(u8::is_ascii_whitespace) {
            records += 1;
        }
    }
}

/// Iterates the records of one shard of a JSONL file.
pub struct ShardLines<R> {
    reader: R,
    path: PathBuf,
    shard: ShardSpec,
    line_number: u64,
    record_index: u64,
    buffer: Vec<u8>,
}

impl ShardLines<std::io::BufReader<std::fs::File>> {
    pub fn open(path: &Path, shard: ShardSpec) -> Result<Self, ReaderError> {
        let file = std::fs::File::open(path).map_err(|source| ReaderError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Self::new(
            std::io::BufReader::with_capacity(1 << 20, file),
            path,
            shard,
        ))
    }
}

impl<R: BufRead> ShardLines<R> {
    pub fn new(reader: R, path: &Path, shard: ShardSpec) -> Self {
        ShardLines {
            reader,
            path: path.to_path_buf(),
            shard,
            line_number: 0,
            record_index: 0,
            buffer: Vec::new(),
        }
    }
}

impl<R: BufRead> Iterator for ShardLines<R> {
    type Item = Result<Record, ReaderError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            self.buffer.clear();
            match self.reader.read_until(b'\n', &mut self.buffer) {
                Ok(0) => return None,
                Ok(_) => {}
                Err(source) => {
                    return Some(Err(ReaderError::Io {
                        path: self.path.clone(),
                        source,
                    }))
                }
            }
            self.line_number += 1;
            if self.buffer.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let record_index = self.record_index;
            self.record_index += 1;
            if !self.shard.contains(record_index) {
                continue;
            }
            let text = String::from_utf8(std::mem::take(&mut self.buffer))
                .map_err(|error| LineError::Invalid(format!("not UTF-8: {error}")));
            return Some(Ok(Record {
                line_number: self.line_number,
                content: RecordContent::Line(text),
            }));
        }
    }
}

/// Settings of the reader.
#[derive(Debug, Clone)]
pub struct ReaderSettings {
    pub window_size: usize,
    pub max_batch_tokens: usize,
    /// Skip samples with `seq <= resume_after_seq`.
    pub resume_after_seq: Option<u64>,
    pub max_bad_lines: u64,
    /// For messages.
    pub data_path: PathBuf,
}

/// Records → batches, as an iterator. Errors end the iteration.
pub struct BatchReader<I> {
    records: I,
    encoder: ChatEncoder,
    settings: ReaderSettings,
    next_seq: u64,
    ready: std::collections::VecDeque<PlannedBatch>,
    exhausted: bool,
    summary: ReaderSummary,
}

impl<I: Iterator<Item = Result<Record, ReaderError>>> BatchReader<I> {
    pub fn new(records: I, encoder: ChatEncoder, settings: ReaderSettings) -> Self {
        BatchReader {
            records,
            encoder,
            settings,
            next_seq: 0,
            ready: Default::default(),
            exhausted: false,
            summary: ReaderSummary::default(),
        }
    }

    pub fn summary(&self) -> &ReaderSummary {
        &self.summary
    }

    fn encode(&self, content: RecordContent) -> Result<TokenizedSequence, LineError> {
        let conversation = match content {
            RecordContent::Line(text) => parse_line(&text?)?,
            RecordContent::Generated(conversation) => conversation,
        };
        self.encoder.encode(&conversation)
    }

    fn record_bad_line(&mut self, line_number: u64, error: LineError) -> Result<(), ReaderError> {
        let reason = error.to_string();
        tracing::warn!(line = line_number, %reason, "malformed data line");
        self.summary.bad_line_count += 1;
        if self.summary.bad_lines.len() < BAD_LINES_KEPT {
            self.summary.bad_lines.push(BadLine {
                line_number,
                reason,
            });
        }
        if self.summary.bad_line_count > self.settings.max_bad_lines {
            let first = self
                .summary
                .bad_lines
                .first()
                .map(|bad| format!("line {}: {}", bad.line_number, bad.reason))
                .unwrap_or_default();
            return Err(ReaderError::TooManyBadLines {
                path: self.settings.data_path.clone(),
                count: self.summary.bad_line_count,
                max: self.settings.max_bad_lines,
                first,
            });
        }
        Ok(())
    }

    /// Reads one window, sorts it, numbers it and queues its batches.
    fn fill_window(&mut self) -> Result<(), ReaderError> {
        let mut window: Vec<(u64, TokenizedSequence)> =
            Vec::with_capacity(self.settings.window_size);
        while window.len() < self.settings.window_size.max(1) {
            let Some(record) = self.records.next() else {
                self.exhausted = true;
                break;
            };
            let record = record?;
            self.summary.records_in_shard += 1;
            match self.encode(record.content) {
                Ok(sample) => window.push((record.line_number, sample)),
                Err(error) => self.record_bad_line(record.line_number, error)?,
            }
        }
        sort_window(&mut window);
        let mut sequenced = Vec::with_capacity(window.len());
        for (line_number, sample) in window {
            let seq = self.next_seq;
            self.next_seq += 1;
            self.summary.samples += 1;
            self.summary.truncated += u64::from(sample.truncated);
            if self
                .settings
                .resume_after_seq
                .is_some_and(|resume| seq <= resume)
            {
                self.summary.skipped_for_resume += 1;
                continue;
            }
            sequenced.push(NumberedSequence {
                seq,
                line_number,
                sequence: sample,
            });
        }
        self.ready.extend(split_into_batches(
            sequenced,
            self.settings.max_batch_tokens,
        ));
        Ok(())
    }
}

impl<I: Iterator<Item = Result<Record, ReaderError>>> Iterator for BatchReader<I> {
    type Item = Result<PlannedBatch, ReaderError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(batch) = self.ready.pop_front() {
                return Some(Ok(batch));
            }
            if self.exhausted {
                return None;
            }
            if let Err(error) = self.fill_window() {
                self.exhausted = true;
                return Some(Err(error));
            }
        }
    }
}

/// Generated records for synthetic mode without `--data`.
pub fn generated_records(
    spec: &SyntheticSpec,
    shard: ShardSpec,
) -> impl Iterator<Item = Result<Record, ReaderError>> {
    let spec = spec.clone();
    (0..spec.samples)
        .filter(move |&index| shard.contains(index))
        .map(move |index| {
            let mut state =
                spec.seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
            let input_ids = (0..spec.seq_len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state % spec.vocab as u64) as i64
                })
                .collect();
            // A prompt quarter without loss, like a chat sample.
            let loss_mask = (0..spec.seq_len)
                .map(|position| u8::from(position >= spec.seq_len / 4))
                .collect();
            Ok(Record {
                line_number: 0,
                content: RecordContent::Generated(Conversation::PreTokenized {
                    input_ids,
                    loss_mask,
                }),
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(resume_after_seq: Option<u64>, max_bad_lines: u64) -> ReaderSettings {
        ReaderSettings {
            window_size: 4,
            max_batch_tokens: 64,
            resume_after_seq,
            max_bad_lines,
            data_path: "data.jsonl".into(),
        }
    }

    fn lines(text: &str, shard: ShardSpec) -> ShardLines<std::io::Cursor<Vec<u8>>> {
        ShardLines::new(
            std::io::Cursor::new(text.as_bytes().to_vec()),
            Path::new("data.jsonl"),
            shard,
        )
    }

    fn data(count: usize) -> String {
        (0..count)
            .map(|index| {
                format!(
                    "{{\"input_ids\": {:?}}}\n",
                    vec![index as i64; 1 + index % 5]
                )
            })
            .collect()
    }

    fn collect(
        reader: &mut BatchReader<ShardLines<std::io::Cursor<Vec<u8>>>>,
    ) -> Result<Vec<NumberedSequence>, ReaderError> {
        let mut samples = Vec::new();
        for batch in reader.by_ref() {
            samples.extend(batch?.samples);
        }
        Ok(samples)
    }

    #[test]
    fn seqs_follow_the_sorted_order_and_resume_skips_exactly_the_prefix() -> Result<(), ReaderError>
    {
        let text = data(11);
        let shard = ShardSpec { index: 0, count: 1 };
        let encoder = || ChatEncoder::pre_tokenized_only(100, None);
        let mut full = BatchReader::new(lines(&text, shard), encoder(), settings(None, 0));
        let all = collect(&mut full)?;
        let seqs: Vec<u64> = all.iter().map(|sample| sample.seq).collect();
        assert_eq!(seqs, (0..11).collect::<Vec<u64>>());
        // Within the first window (lines 1-4, lengths 1..4) longest first.
        let first_window_lines: Vec<u64> =
            all[..4].iter().map(|sample| sample.line_number).collect();
        assert_eq!(first_window_lines, vec![4, 3, 2, 1]);

        let mut resumed = BatchReader::new(lines(&text, shard), encoder(), settings(Some(6), 0));
        let rest = collect(&mut resumed)?;
        assert_eq!(
            rest.as_slice(),
            &all[7..],
            "resume skips seqs 0..=6 and nothing else"
        );
        assert_eq!(resumed.summary().skipped_for_resume, 7);
        assert_eq!(resumed.summary().samples, 11);
        Ok(())
    }

    #[test]
    fn blank_lines_are_not_records_and_shards_split_records() -> Result<(), ReaderError> {
        let text = format!("\n{}   \n{}", data(3), data(2));
        let mut seen = Vec::new();
        for index in 0..2 {
            let shard = ShardSpec { index, count: 2 };
            let lines: Vec<u64> = lines(&text, shard)
                .map(|record| record.map(|record| record.line_number))
                .collect::<Result<_, _>>()?;
            seen.extend(lines);
        }
        seen.sort_unstable();
        assert_eq!(seen, vec![2, 3, 4, 6, 7]);
        Ok(())
    }

    #[test]
    fn bad_lines_are_counted_and_stop_the_run_past_the_limit() -> Result<(), ReaderError> {
        let text = "{\"input_ids\": [1]}\nnot json\n{\"input_ids\": [2, 3]}\n{\"messages\": 5}\n";
        let shard = ShardSpec { index: 0, count: 1 };
        let mut tolerant = BatchReader::new(
            lines(text, shard),
            ChatEncoder::pre_tokenized_only(10, None),
            settings(None, 2),
        );
        let samples = collect(&mut tolerant)?;
        assert_eq!(samples.len(), 2);
        let bad: Vec<u64> = tolerant
            .summary()
            .bad_lines
            .iter()
            .map(|bad| bad.line_number)
            .collect();
        assert_eq!(bad, vec![2, 4]);

        let mut strict = BatchReader::new(
            lines(text, shard),
            ChatEncoder::pre_tokenized_only(10, None),
            settings(None, 1),
        );
        let error = collect(&mut strict).err();
        let message = error.map(|error| error.to_string()).unwrap_or_default();
        assert!(
            message.contains("2 malformed lines") && message.contains("line 2: not valid JSON"),
            "{message}"
        );
        Ok(())
    }
}
