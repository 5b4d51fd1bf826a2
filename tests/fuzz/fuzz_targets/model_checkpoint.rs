//! A model checkpoint's files through the reader a restarted broker resumes
//! with (`dflash_broker::fuzzing::model_checkpoint`).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| dflash_broker::fuzzing::model_checkpoint(data));
