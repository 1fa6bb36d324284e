//! A node's session fed arbitrary donor frames between arbitrary request starts and finishes.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    engram_protocol::session::toy::fuzz_client(data);
});
