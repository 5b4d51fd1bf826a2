//! A `Sample`'s bytes through the sample schema's decoder
//! (`dflash_proto::fuzzing::sample`).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| dflash_proto::fuzzing::sample(data));
