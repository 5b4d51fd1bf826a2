//! A center checkpoint's files through the reader a restarted broker resumes
//! with (`dflash_broker::fuzzing::center_checkpoint`).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| dflash_broker::fuzzing::center_checkpoint(data));
