//! # dflash-proto
//!
//! The `dflash.v1` wire contract, generated from `proto/dflash/v1/*.proto`.
//!
//! # Layout
//! - `v1`: the generated messages, `broker_client` and `broker_server`
//!   (`dflash/v1/broker.proto`), `model_sync_client` and `model_sync_server`
//!   (`dflash/v1/model_sync.proto`: the shared draft model).
//! - `chunks`: the run's model's files sent as `ModelFileChunk`s put back
//!   together ([`chunks::FileAssembler`]), for every receiver of the run's
//!   model.
//! - `codec`: the gRPC codec of every generated client and server (prost's,
//!   encoding each message into one exact-size buffer).
//! - `frames`: gRPC messages read from HTTP/2 DATA frames as slices of
//!   those frames ([`frames::MessageReader`], [`frames::Rope`]) and written
//!   with each large payload as its own chunk ([`frames::Pieces`]): no copy
//!   of a payload on either side.
//! - `credentials`: the bearer token and PEM files, read the same way by
//!   the broker and every client.
//! - `fuzzing` (hidden): the fuzz bodies of this crate's decoders of
//!   untrusted bytes (the gRPC prefix reader and prost over its frames, the
//!   sample schema), the received-body input layout the other crates' fuzz
//!   bodies share, and the seeds; run by `tests/fuzz` and, over the
//!   committed corpus, by `tests/fuzz_corpus.rs`.
//! - `fields`: the field numbers the zero-copy encoders and decoders use,
//!   checked against the proto files.
//! - `json`: enum names for the JSON form of status snapshots.
//! - `tensor`: element sizes and checked constructors for `Tensor`/`Sample`.
//! - `sample`: the DFlash sample schema (tensor names, dtypes, shapes): one
//!   encoder and one validating decoder for every role.
//! - `testing` (feature `testing`, for dev-dependencies): the item builder
//!   the hand-written encoders and decoders are tested with.
//! - `transport`: HTTP/2 windows, frame size and message limits, shared by
//!   the broker and every client.
//! - `FILE_DESCRIPTOR_SET`: the encoded descriptors, for server reflection.
//!
//! Depends on nothing of ours; everything else depends on it.

pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    include!(concat!(env!("OUT_DIR"), "/dflash.v1.rs"));
}

pub mod chunks;
pub mod codec;
pub mod credentials;
pub mod fields;
pub mod frames;
#[doc(hidden)]
pub mod fuzzing;
pub mod json;
pub mod sample;
pub mod tensor;
#[cfg(feature = "testing")]
pub mod testing;
pub mod transport;

/// Encoded `FileDescriptorSet` of every dflash proto, for tonic-reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/dflash_descriptor.bin"));
