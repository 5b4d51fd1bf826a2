//! A Produce request body through the broker's Produce route: prefix reader,
//! item decoder, delivery (`dflash_broker::fuzzing::produce`).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| dflash_broker::fuzzing::produce(data));
