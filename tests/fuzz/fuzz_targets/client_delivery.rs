//! What the broker sends a client, through the client's decoder
//! (`dflash_client::fuzzing::delivery`).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| dflash_client::fuzzing::delivery(data));
