//! A donor's session fed arbitrary bytes in arbitrary chunks.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    engram_protocol::session::toy::fuzz_server(data);
});
