//! Replays the committed fuzz corpus of the client's decoder
//! (`tests/fuzz/corpus/client_delivery/`: the seeds and every input a
//! fuzzer found a crash with), on stable Rust without libFuzzer, in every
//! `cargo test`. `cargo test -p dflash-client --test fuzz_corpus --
//! --ignored` writes the seeds again.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use dflash_proto::fuzzing::replay_corpus;

#[test]
fn the_client_delivery_corpus_replays_without_a_crash() {
    assert!(replay_corpus("client_delivery", dflash_client::fuzzing::delivery) >= 6);
}

#[test]
#[ignore = "writes the seed files; run by hand after changing an encoder"]
fn write_seeds() {
    dflash_proto::fuzzing::write_seeds(&dflash_client::fuzzing::seeds()).unwrap();
}
