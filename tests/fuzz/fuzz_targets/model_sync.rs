//! ModelSync sessions' messages against one model
//! (`dflash_broker::fuzzing::model_sync`).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| dflash_broker::fuzzing::model_sync(data));
