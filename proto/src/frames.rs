//! gRPC messages read from and written to HTTP/2 bodies without copying
//! their payloads.
//!
//! tonic reads a stream by appending every HTTP/2 DATA frame to one
//! decode buffer (a copy of every byte) and encodes every message into one
//! buffer (another). Here a received message is a [`Rope`]: the slices of
//! the DATA frames it arrived in, in order, as h2 handed them over (h2 cuts
//! each frame out of its read buffer as a `Bytes`, so the bytes are where
//! the kernel wrote them). [`MessageReader`] turns a body into such
//! messages, checking the 5-byte gRPC prefix of each (compressed flag,
//! length against a limit). prost decodes from a rope as from any `Buf`;
//! a `bytes` field that lies within one frame comes out as a slice of that
//! frame, one that spans frames is copied into one buffer once
//! ([`Rope::copies`] counts both). The broker goes further and keeps a
//! spanning payload as its frames' slices (never copied).
//!
//! On the way out, [`Pieces`] writes a message's prefix and small fields
//! into small buffers and passes each large payload through as its own
//! chunk, so h2 writes the payload from where it already is.

use crate::fields::TENSOR_DATA;
use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use prost::encoding::{self, WireType};
use prost::Message;
use tonic::Status;

use crate::v1 as proto;

/// Bytes of the gRPC prefix of every message: the compressed flag and a
/// big-endian `u32` length.
pub const PREFIX_BYTES: usize = 5;

/// `bytes` fields at least this long travel as their own chunk and are
/// kept as slices of the frames they arrived in; shorter ones are copied
/// (a chunk costs more than a small copy, and a small slice must not keep
/// a whole frame's memory alive).
pub const LARGE_PAYLOAD_BYTES: usize = 16 << 10;

/// How the `bytes` fields prost took from a [`Rope`] came out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Copies {
    /// Fields that lay within one frame: slices of it, not copied.
    pub sliced: u64,
    /// Fields that spanned frames: copied once into one buffer.
    pub assembled: u64,
    /// Bytes of the assembled fields.
    pub assembled_bytes: u64,
}

impl Copies {
    pub fn add(&mut self, other: Copies) {
        self.sliced += other.sliced;
        self.assembled += other.assembled;
        self.assembled_bytes += other.assembled_bytes;
    }
}

/// A sequence of bytes held as the slices it arrived in (no copy). A `Buf`:
/// prost decodes from it, and `copy_to_bytes` (what prost calls for a
/// `Bytes` field) returns a slice when the range lies in one chunk.
#[derive(Debug, Clone, Default)]
pub struct Rope {
    chunks: VecDeque<Bytes>,
    len: usize,
    copies: Copies,
}

impl Rope {
    pub fn new() -> Self {
        Rope::default()
    }

    /// A rope of one chunk.
    pub fn from_bytes(bytes: Bytes) -> Self {
        let mut rope = Rope::new();
        rope.push(bytes);
        rope
    }

    /// Appends a chunk (empty ones are dropped).
    pub fn push(&mut self, bytes: Bytes) {
        if !bytes.is_empty() {
            self.len += bytes.len();
            self.chunks.push_back(bytes);
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The chunks, in order.
    pub fn chunks(&self) -> impl ExactSizeIterator<Item = &Bytes> {
        self.chunks.iter()
    }

    /// Number of chunks.
    pub fn chunk_count(&self) -> usize {
        self.chunks.len()
    }

    /// The first `at` bytes as their own rope, without copying (the chunk
    /// the cut falls in is shared by both).
    ///
    /// # Panics
    /// When `at > self.len()` (a caller checks lengths first).
    pub fn split_to(&mut self, at: usize) -> Rope {
        assert!(
            at <= self.len,
            "split_to({at}) on a rope of {} bytes",
            self.len
        );
        let mut front = Rope::new();
        while front.len < at {
            let Some(mut chunk) = self.chunks.pop_front() else {
                break;
            };
            let wanted = at - front.len;
            if chunk.len() > wanted {
                let head = chunk.split_to(wanted);
                self.chunks.push_front(chunk);
                front.push(head);
            } else {
                front.push(chunk);
            }
        }
        self.len -= front.len;
        front
    }

    /// The bytes as one `Bytes`: the chunk itself when there is one,
    /// otherwise one copy into a buffer of the exact size.
    pub fn into_bytes(mut self) -> Bytes {
        match self.chunks.len() {
            0 => Bytes::new(),
            1 => self.chunks.pop_front().unwrap_or_default(),
            _ => {
                let mut joined = BytesMut::with_capacity(self.len);
                for chunk in &self.chunks {
                    joined.extend_from_slice(chunk);
                }
                joined.freeze()
            }
        }
    }

    /// What `copy_to_bytes` has done so far.
    pub fn copies(&self) -> Copies {
        self.copies
    }
}

impl PartialEq for Rope {
    /// Equal bytes, however they are chunked.
    fn eq(&self, other: &Rope) -> bool {
        self.len == other.len
            && self
                .chunks
                .iter()
                .flat_map(|chunk| chunk.iter())
                .eq(other.chunks.iter().flat_map(|chunk| chunk.iter()))
    }
}

impl Eq for Rope {}

impl Buf for Rope {
    fn remaining(&self) -> usize {
        self.len
    }

    fn chunk(&self) -> &[u8] {
        self.chunks.front().map_or(&[], |chunk| chunk.as_ref())
    }

    fn advance(&mut self, mut count: usize) {
        assert!(
            count <= self.len,
            "advance({count}) on a rope of {} bytes",
            self.len
        );
        self.len -= count;
        while count > 0 {
            let Some(front) = self.chunks.front_mut() else {
                break;
            };
            if front.len() > count {
                front.advance(count);
                return;
            }
            count -= front.len();
            self.chunks.pop_front();
        }
    }

    fn copy_to_bytes(&mut self, len: usize) -> Bytes {
        assert!(
            len <= self.len,
            "copy_to_bytes({len}) on a rope of {} bytes",
            self.len
        );
        if len == 0 {
            return Bytes::new();
        }
        if let Some(front) = self.chunks.front_mut() {
            if front.len() >= len {
                let slice = front.split_to(len);
                if front.is_empty() {
                    self.chunks.pop_front();
                }
                self.len -= len;
                self.copies.sliced += 1;
                return slice;
            }
        }
        let joined = self.split_to(len);
        self.copies.assembled += 1;
        self.copies.assembled_bytes += len as u64;
        joined.into_bytes()
    }
}

/// Which way a body flows, for how its errors read (a client that resets
/// its request stream has simply gone away).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Request,
    Response,
}

/// The gRPC messages of an HTTP body, each a [`Rope`] of slices of the
/// body's DATA frames. Reads no further into the body than the message it
/// returns, so HTTP/2 flow control holds the sender back while the reader
/// is not asking for more.
///
/// Every malformed input ends the stream with a status naming the bad value:
/// a compressed flag (INTERNAL: no `grpc-encoding` is accepted), a flag
/// that is neither 0 nor 1 (INTERNAL), a length over the limit
/// (OUT_OF_RANGE, "too large", before any of the message is read), a body
/// that ends inside a prefix or a message (INTERNAL, with how much came).
pub struct MessageReader<B> {
    body: Pin<Box<B>>,
    direction: Direction,
    buffered: Rope,
    /// Length of the message being read, once its prefix is in.
    expected: Option<usize>,
    limit: usize,
    /// Messages returned so far (errors name the message by its number).
    messages: u64,
    trailers: Option<http::HeaderMap>,
    finished: bool,
}

impl<B> MessageReader<B>
where
    B: http_body::Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    /// Reads messages of at most `limit` bytes from `body`.
    pub fn new(body: B, direction: Direction, limit: usize) -> Self {
        MessageReader {
            body: Box::pin(body),
            direction,
            buffered: Rope::new(),
            expected: None,
            limit,
            messages: 0,
            trailers: None,
            finished: false,
        }
    }

    /// The trailers, once the body sent them.
    pub fn trailers(&self) -> Option<&http::HeaderMap> {
        self.trailers.as_ref()
    }

    /// The next message, `None` at the end of the body, or the error that
    /// ended it (after which it yields `None`).
    pub fn poll_message(
        &mut self,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<Rope, Status>>> {
        loop {
            if self.finished {
                return Poll::Ready(None);
            }
            match self.take_message() {
                Ok(Some(message)) => return Poll::Ready(Some(Ok(message))),
                Ok(None) => {}
                Err(status) => return Poll::Ready(Some(Err(self.fail(status)))),
            }
            match self.body.as_mut().poll_frame(context) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(mut data) => {
                        let bytes = data.copy_to_bytes(data.remaining());
                        self.buffered.push(bytes);
                    }
                    Err(frame) => {
                        if let Ok(trailers) = frame.into_trailers() {
                            match &mut self.trailers {
                                Some(earlier) => earlier.extend(trailers),
                                None => self.trailers = Some(trailers),
                            }
                        }
                    }
                },
                Poll::Ready(Some(Err(error))) => {
                    let status = Status::from_error(error.into());
                    if self.direction == Direction::Request
                        && status.code() == tonic::Code::Cancelled
                    {
                        // The client reset its stream: it went away.
                        self.finished = true;
                        return Poll::Ready(None);
                    }
                    return Poll::Ready(Some(Err(self.fail(status))));
                }
                Poll::Ready(None) => {
                    self.finished = true;
                    let number = self.messages + 1;
                    let status = match self.expected {
                        Some(length) => Status::internal(format!(
                            "the stream ended inside gRPC message {number}: {} of its {length} bytes arrived",
                            self.buffered.len()
                        )),
                        None if !self.buffered.is_empty() => Status::internal(format!(
                            "the stream ended inside the {PREFIX_BYTES}-byte prefix of gRPC message {number}: {} bytes arrived",
                            self.buffered.len()
                        )),
                        None => return Poll::Ready(None),
                    };
                    return Poll::Ready(Some(Err(status)));
                }
            }
        }
    }

    /// Ends the stream with `status`.
    fn fail(&mut self, status: Status) -> Status {
        self.finished = true;
        self.buffered = Rope::new();
        status
    }

    /// The next whole message from what is buffered, if it is all there.
    fn take_message(&mut self) -> Result<Option<Rope>, Status> {
        if self.expected.is_none() {
            if self.buffered.len() < PREFIX_BYTES {
                return Ok(None);
            }
            let number = self.messages + 1;
            let flag = self.buffered.get_u8();
            let length = self.buffered.get_u32() as usize;
            match flag {
                0 => {}
                1 => {
                    return Err(Status::internal(format!(
                        "gRPC message {number} has its compressed flag set (1), but the stream declared no grpc-encoding: only uncompressed messages are accepted"
                    )))
                }
                other => {
                    return Err(Status::internal(format!(
                        "gRPC message {number} has compressed flag {other}; valid flags are 0 and 1"
                    )))
                }
            }
            if length > self.limit {
                return Err(Status::out_of_range(format!(
                    "gRPC message {number} too large: its prefix declares {length} bytes, the limit is {} bytes",
                    self.limit
                )));
            }
            self.expected = Some(length);
        }
        match self.expected {
            Some(length) if self.buffered.len() >= length => {
                self.expected = None;
                self.messages += 1;
                Ok(Some(self.buffered.split_to(length)))
            }
            _ => Ok(None),
        }
    }
}

impl<B> futures::Stream for MessageReader<B>
where
    B: http_body::Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Item = Result<Rope, Status>;

    fn poll_next(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().poll_message(context)
    }
}

/// One outgoing gRPC message in pieces: the prefix and small fields in
/// small buffers, every large payload as its own chunk (shared, not
/// copied). Concatenated, the pieces are the prefix and prost's encoding.
#[derive(Debug, Default)]
pub struct Pieces {
    finished: Vec<Bytes>,
    current: BytesMut,
}

impl Pieces {
    /// Starts a message of `length` encoded bytes with its gRPC prefix.
    pub fn message(length: usize) -> Result<Pieces, Status> {
        let length = u32::try_from(length).map_err(|_| {
            Status::resource_exhausted(format!(
                "a message of {length} bytes does not fit one gRPC frame"
            ))
        })?;
        let mut pieces = Pieces::default();
        pieces.current.put_u8(0);
        pieces.current.put_u32(length);
        Ok(pieces)
    }

    /// The small buffer being filled.
    pub fn buffer(&mut self) -> &mut BytesMut {
        &mut self.current
    }

    /// Appends payload bytes: their own chunk when large, copied otherwise.
    pub fn payload(&mut self, bytes: &Bytes) {
        if bytes.len() < LARGE_PAYLOAD_BYTES {
            self.current.extend_from_slice(bytes);
            return;
        }
        if !self.current.is_empty() {
            self.finished.push(self.current.split().freeze());
        }
        self.finished.push(bytes.clone());
    }

    /// Appends a message encoded by prost into the small buffer.
    pub fn encode(&mut self, message: &impl Message) -> Result<(), Status> {
        message
            .encode(&mut self.current)
            .map_err(|error| Status::internal(format!("encoding a message: {error}")))
    }

    /// The pieces, in order.
    pub fn finish(mut self) -> Vec<Bytes> {
        if !self.current.is_empty() {
            self.finished.push(self.current.split().freeze());
        }
        self.finished
    }

    /// The whole message as one gRPC frame of prost's bytes (prefix
    /// included): for small messages.
    pub fn whole(message: &impl Message) -> Result<Bytes, Status> {
        let length = message.encoded_len();
        let mut pieces = Pieces::message(length)?;
        pieces.current.reserve(length);
        pieces.encode(message)?;
        Ok(pieces.current.freeze())
    }
}

/// Encoded length of a length-delimited field of `length` bytes.
pub fn delimited_len(tag: u32, length: usize) -> usize {
    encoding::key_len(tag) + encoding::encoded_len_varint(length as u64) + length
}

/// Encoded length of `Tensor` fields: `header`'s (its `data` must be
/// empty) and a `data` field of `data_bytes`.
pub fn tensor_len(header: &proto::Tensor, data_bytes: usize) -> usize {
    header.encoded_len()
        + if data_bytes == 0 {
            0
        } else {
            delimited_len(TENSOR_DATA, data_bytes)
        }
}

/// Writes one tensor as field `tag` of the enclosing message: its header
/// fields (`header.data` must be empty) through prost, then its data from
/// `data` (chunks of `data_bytes` in all), each large chunk passed through.
pub fn encode_tensor<'a>(
    tag: u32,
    header: &proto::Tensor,
    data: impl IntoIterator<Item = &'a Bytes>,
    data_bytes: usize,
    pieces: &mut Pieces,
) -> Result<(), Status> {
    debug_assert!(header.data.is_empty(), "the header carries no data");
    let buffer = pieces.buffer();
    encoding::encode_key(tag, WireType::LengthDelimited, buffer);
    encoding::encode_varint(tensor_len(header, data_bytes) as u64, buffer);
    pieces.encode(header)?;
    if data_bytes == 0 {
        return Ok(());
    }
    let buffer = pieces.buffer();
    encoding::encode_key(TENSOR_DATA, WireType::LengthDelimited, buffer);
    encoding::encode_varint(data_bytes as u64, buffer);
    for chunk in data {
        pieces.payload(chunk);
    }
    Ok(())
}

/// An HTTP body of gRPC messages, each written as its pieces, then the
/// status in trailers: the stream's messages as [`Pieces`] (through
/// `encode`) until it ends (status OK) or yields an error (that status).
pub struct PieceBody<S, F> {
    messages: Pin<Box<S>>,
    encode: F,
    pending: VecDeque<Bytes>,
    finished: bool,
    /// A client body ends without trailers; a server body sends the status.
    trailers: bool,
}

impl<S, F> PieceBody<S, F> {
    /// A server's response body: messages, then the status in trailers.
    pub fn response(messages: S, encode: F) -> Self {
        PieceBody {
            messages: Box::pin(messages),
            encode,
            pending: VecDeque::new(),
            finished: false,
            trailers: true,
        }
    }

    /// A client's request body: messages, then the end of the stream (a
    /// request carries no status).
    pub fn request(messages: S, encode: F) -> Self {
        PieceBody {
            messages: Box::pin(messages),
            encode,
            pending: VecDeque::new(),
            finished: false,
            trailers: false,
        }
    }
}

impl<S, F, T> http_body::Body for PieceBody<S, F>
where
    S: futures::Stream<Item = Result<T, Status>>,
    F: FnMut(T) -> Result<Vec<Bytes>, Status> + Unpin,
{
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Status>>> {
        let this = &mut *self;
        loop {
            if let Some(piece) = this.pending.pop_front() {
                return Poll::Ready(Some(Ok(http_body::Frame::data(piece))));
            }
            if this.finished {
                return Poll::Ready(None);
            }
            let status = match this.messages.as_mut().poll_next(context) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(message))) => match (this.encode)(message) {
                    Ok(pieces) => {
                        this.pending.extend(pieces);
                        continue;
                    }
                    Err(status) => status,
                },
                Poll::Ready(Some(Err(status))) => status,
                Poll::Ready(None) => Status::ok(""),
            };
            this.finished = true;
            if !this.trailers {
                return if status.code() == tonic::Code::Ok {
                    Poll::Ready(None)
                } else {
                    Poll::Ready(Some(Err(status)))
                };
            }
            let mut trailers = http::HeaderMap::new();
            if status.add_header(&mut trailers).is_err() {
                // A message that cannot be a header (tonic percent-encodes
                // it, so this is not expected): the code alone.
                let _ = Status::new(status.code(), "").add_header(&mut trailers);
            }
            return Poll::Ready(Some(Ok(http_body::Frame::trailers(trailers))));
        }
    }

    fn is_end_stream(&self) -> bool {
        self.finished && self.pending.is_empty()
    }
}

#[cfg(test)]
mod tests;
