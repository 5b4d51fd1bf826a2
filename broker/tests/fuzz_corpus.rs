//! Replays the committed fuzz corpus of the broker's decoders
//! (`tests/fuzz/corpus/<target>/`: the seeds and every input a fuzzer
//! found a crash with), on stable Rust without libFuzzer, in every
//! `cargo test`. `cargo test -p dflash-broker --test fuzz_corpus --
//! --ignored` writes the seeds again from the broker's encoders.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use dflash_broker::fuzzing;
use dflash_proto::fuzzing::replay_corpus;

#[test]
fn the_broker_produce_corpus_replays_without_a_crash() {
    assert!(replay_corpus("broker_produce", fuzzing::produce) >= 5);
}

#[test]
fn the_model_sync_corpus_replays_without_a_crash() {
    assert!(replay_corpus("model_sync", fuzzing::model_sync) >= 5);
}

#[test]
fn the_model_checkpoint_corpus_replays_without_a_crash() {
    assert!(replay_corpus("model_checkpoint", fuzzing::model_checkpoint) >= 3);
}

#[test]
fn the_wal_segment_corpus_replays_without_a_crash() {
    assert!(replay_corpus("wal_segment", fuzzing::wal_segment) >= 3);
}

#[test]
#[ignore = "writes the seed files; run by hand after changing an encoder"]
fn write_seeds() {
    dflash_proto::fuzzing::write_seeds(&fuzzing::seeds()).unwrap();
}
