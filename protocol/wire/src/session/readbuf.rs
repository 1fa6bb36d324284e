//! The bytes a session has read and not yet consumed.

use std::io::{self, Read};

use crate::HEADER_LEN;

/// Initial size of a session's read buffer (and of a donor's write buffer).
pub const INITIAL_BUF: usize = 64 << 10;

/// A read buffer with explicit start and end, zero-filled once when it grows
/// (not on every read) and bounded by the largest frame allowed: it grows
/// only to hold one whole frame whose length the session's limits passed.
#[derive(Debug)]
pub struct ReadBuf {
    /// The storage; `buf[start..end]` is unread.
    pub buf: Vec<u8>,
    /// Where the unread bytes begin.
    pub start: usize,
    /// Where they end: new bytes go to `buf[end..]`.
    pub end: usize,
}

impl Default for ReadBuf {
    fn default() -> Self {
        Self::new(INITIAL_BUF)
    }
}

impl ReadBuf {
    /// An empty buffer of `size` bytes.
    pub fn new(size: usize) -> Self {
        Self {
            buf: vec![0; size],
            start: 0,
            end: 0,
        }
    }

    /// The unread bytes.
    pub fn data(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// Mark `n` unread bytes as read (at most what is there).
    pub fn consume(&mut self, n: usize) {
        self.start = (self.start + n).min(self.end);
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
            // Give back what one large request needed.
            if self.buf.len() > 4 * INITIAL_BUF {
                self.buf.truncate(INITIAL_BUF);
                self.buf.shrink_to_fit();
            }
        }
    }

    /// Make room for a frame of `frame_len` bytes (already bounded by the
    /// codec's maximum) to be fully buffered.
    pub fn reserve_frame(&mut self, frame_len: usize) {
        if self.start + frame_len > self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if frame_len > self.buf.len() {
            self.buf.resize(frame_len, 0);
        }
    }

    /// Append `bytes` (a test's or a fuzzer's input, early data that came
    /// with a handshake).
    pub fn push(&mut self, bytes: &[u8]) {
        self.reserve_frame(self.end - self.start + bytes.len());
        self.buf[self.end..self.end + bytes.len()].copy_from_slice(bytes);
        self.end += bytes.len();
    }

    /// One read from `r` into the free space (made when there is none).
    pub fn read_from(&mut self, r: &mut impl Read) -> io::Result<usize> {
        if self.end == self.buf.len() {
            self.reserve_frame(self.end - self.start + HEADER_LEN);
        }
        let n = r.read(&mut self.buf[self.end..])?;
        self.end += n;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pushed_bytes_are_read_back_in_order_and_the_buffer_shrinks_when_drained() {
        let mut rb = ReadBuf::new(8);
        rb.push(b"abcdef");
        rb.consume(4);
        rb.push(b"ghijklmnop");
        assert_eq!(rb.data(), b"efghijklmnop");
        rb.consume(100);
        assert!(rb.data().is_empty());
        let mut big = ReadBuf::new(8);
        big.push(&vec![1u8; 5 * INITIAL_BUF]);
        big.consume(5 * INITIAL_BUF);
        assert_eq!(big.buf.len(), INITIAL_BUF);
    }
}
