//! A gRPC body cut into HTTP/2 frames through the prefix reader and prost
//! (`dflash_proto::fuzzing::frames`).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| dflash_proto::fuzzing::frames(data));
