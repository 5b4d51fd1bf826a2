//! A write-ahead log segment replayed as a restarted broker replays its
//! newest one, and the queue rebuilt from it
//! (`dflash_broker::fuzzing::wal_segment`).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| dflash_broker::fuzzing::wal_segment(data));
