//! Replays the committed fuzz corpus (`tests/fuzz/corpus/<target>/`: the
//! seeds and every input a fuzzer found a crash with) through this crate's
//! fuzz bodies, on stable Rust without libFuzzer, in every `cargo test`.
//! `cargo test -p dflash-proto --test fuzz_corpus -- --ignored` writes the
//! seeds again from this crate's encoders.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use dflash_proto::fuzzing::{self, replay_corpus};

#[test]
fn the_proto_frames_corpus_replays_without_a_crash() {
    assert!(replay_corpus("proto_frames", fuzzing::frames) >= 10);
}

#[test]
fn the_proto_sample_corpus_replays_without_a_crash() {
    assert!(replay_corpus("proto_sample", fuzzing::sample) >= 5);
}

#[test]
#[ignore = "writes the seed files; run by hand after changing an encoder"]
fn write_seeds() {
    fuzzing::write_seeds(&fuzzing::seeds()).unwrap();
}
