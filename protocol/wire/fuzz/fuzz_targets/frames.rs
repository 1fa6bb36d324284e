//! The frame decoder on arbitrary bytes.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    engram_protocol::session::toy::fuzz_frames(data);
});
