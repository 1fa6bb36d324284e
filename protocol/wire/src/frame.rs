//! Data-plane framing: a 16-byte little-endian header (payload length, kind,
//! flags, reserved, request id) followed by the payload. The codec is
//! incremental: `FrameHeader::peek` says "incomplete" until 16 bytes are there
//! and checks the payload length against the configured maximum before the
//! caller buffers or allocates anything; `decode` parses one whole frame into
//! a borrowed view, and the caller advances its buffer only afterwards.
//!
//! Message payloads and their encoders live in `messages`; a whole frame
//! parsed (header and payload) in `decode`. The payload bounds the limits
//! need are here, below both.

use thiserror::Error;

use crate::row::ROW_BYTES;

/// Longest node or donor name, in bytes.
pub const MAX_NAME: usize = 255;
/// Longest Hello credential, in bytes.
pub const MAX_CREDENTIAL: usize = 1024;
/// Most tables one Welcome may list.
pub const MAX_WELCOME_TABLES: usize = 1024;
/// Bytes per table entry in a version-1 Welcome.
pub const TABLE_INFO_LEN: usize = 48;
/// Bytes per table entry in a version-2 Welcome (the encoding added).
pub const TABLE_INFO_LEN_V2: usize = 64;
/// Most tables a version-2 Welcome may list: its entries take the bytes
/// 1,024 version-1 entries take, so the largest Welcome is the same.
pub const MAX_WELCOME_TABLES_V2: usize = MAX_WELCOME_TABLES * TABLE_INFO_LEN / TABLE_INFO_LEN_V2;
pub(crate) const WELCOME_HEAD_LEN: usize = 16;
/// Largest Hello payload.
pub const MAX_HELLO_PAYLOAD: usize = 12 + MAX_NAME + MAX_CREDENTIAL;
/// Largest payload of the frames whose size does not depend on row caps.
pub(crate) const MAX_FIXED_PAYLOAD: usize =
    WELCOME_HEAD_LEN + MAX_NAME + TABLE_INFO_LEN * MAX_WELCOME_TABLES;
/// Bytes in every frame header.
pub const HEADER_LEN: usize = 16;
/// Data-plane protocol version spoken by this build: its clients say 2
/// (tables of any row encoding); its donors answer versions 1 and 2.
pub const PROTOCOL_VERSION: u16 = 2;
/// The first version, V4.1's 264-byte rows only: what older clients say,
/// and still answered.
pub const PROTOCOL_VERSION_V1: u16 = 1;

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// Client -> donor, first frame on a connection.
    Hello = 1,
    /// Donor -> client, answer to Hello: donor name, tables, limits.
    Welcome = 2,
    /// Client -> donor: one or more sections of row ids.
    Lookup = 3,
    /// Donor -> client: per-section statuses and the rows.
    Rows = 4,
    /// Donor -> client: a request-level typed error.
    Error = 5,
    /// Client -> donor: liveness probe.
    Ping = 6,
    /// Answer to Ping, same request id.
    Pong = 7,
    /// Donor -> client: the donor is draining; send no new requests.
    Goodbye = 8,
    /// Client -> donor: where a table's RDMA region is (TLS and QUIC only).
    RegionQuery = 9,
    /// Donor -> client, answer to RegionQuery: the region and a queue-pair token.
    Region = 10,
}

impl FrameKind {
    /// The kind of a wire byte, if known.
    pub const fn from_u8(b: u8) -> Option<Self> {
        Some(match b {
            1 => Self::Hello,
            2 => Self::Welcome,
            3 => Self::Lookup,
            4 => Self::Rows,
            5 => Self::Error,
            6 => Self::Ping,
            7 => Self::Pong,
            8 => Self::Goodbye,
            9 => Self::RegionQuery,
            10 => Self::Region,
            _ => return None,
        })
    }
}

/// Typed error codes, shared by `Error` frames and Rows section statuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// The table id is not served by this donor.
    UnknownTable,
    /// The digest prefix does not match the donor's table version.
    VersionMismatch,
    /// A row id is at or beyond the table's row count.
    RowOutOfRange,
    /// More rows or sections than the donor's configured cap.
    RequestTooLarge,
    /// The frame could not be parsed.
    Malformed,
    /// The donor is at its connection or request bound.
    Busy,
    /// The donor is shutting down.
    Draining,
    /// Missing or wrong credentials.
    Unauthorized,
    /// The client's protocol version is not spoken here.
    UnsupportedVersion,
    /// The donor failed internally.
    Internal,
    /// A frame's declared payload is larger than the receiver accepts (and
    /// is not a Lookup after the handshake): the connection closes.
    FrameTooLarge,
    /// The donor does not offer what was asked (RDMA, on a donor without
    /// a device or built without it).
    Unavailable,
    /// A code this build does not know (from a newer peer).
    Other(u16),
}

impl ErrorCode {
    /// Wire value (never 0: 0 is "OK" in section statuses).
    pub const fn to_u16(self) -> u16 {
        match self {
            Self::UnknownTable => 1,
            Self::VersionMismatch => 2,
            Self::RowOutOfRange => 3,
            Self::RequestTooLarge => 4,
            Self::Malformed => 5,
            Self::Busy => 6,
            Self::Draining => 7,
            Self::Unauthorized => 8,
            Self::UnsupportedVersion => 9,
            Self::Internal => 10,
            Self::FrameTooLarge => 11,
            Self::Unavailable => 12,
            Self::Other(c) => c,
        }
    }

    /// The code of a wire value; `None` for 0 (OK).
    pub const fn from_u16(v: u16) -> Option<Self> {
        Some(match v {
            0 => return None,
            1 => Self::UnknownTable,
            2 => Self::VersionMismatch,
            3 => Self::RowOutOfRange,
            4 => Self::RequestTooLarge,
            5 => Self::Malformed,
            6 => Self::Busy,
            7 => Self::Draining,
            8 => Self::Unauthorized,
            9 => Self::UnsupportedVersion,
            10 => Self::Internal,
            11 => Self::FrameTooLarge,
            12 => Self::Unavailable,
            c => Self::Other(c),
        })
    }

    /// Stable lower-case name, for logs and metrics labels.
    pub const fn name(self) -> &'static str {
        match self {
            Self::UnknownTable => "unknown_table",
            Self::VersionMismatch => "version_mismatch",
            Self::RowOutOfRange => "row_out_of_range",
            Self::RequestTooLarge => "request_too_large",
            Self::Malformed => "malformed",
            Self::Busy => "busy",
            Self::Draining => "draining",
            Self::Unauthorized => "unauthorized",
            Self::UnsupportedVersion => "unsupported_version",
            Self::Internal => "internal",
            Self::FrameTooLarge => "frame_too_large",
            Self::Unavailable => "unavailable",
            Self::Other(_) => "other",
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Other(c) => write!(f, "error code {c}"),
            c => f.write_str(c.name()),
        }
    }
}

/// Configured bounds, checked before anything is allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest payload of any frame, in bytes.
    pub max_payload: u32,
    /// Most sections in one Lookup or Rows.
    pub max_sections: u32,
    /// Most rows in one Lookup or Rows, all sections together.
    pub max_rows: u32,
}

/// Default cap on rows per lookup: a wide prefill sweep, still a bounded answer (4.3 MB).
pub const DEFAULT_MAX_ROWS: u32 = 16_384;
/// Default cap on sections per lookup.
pub const DEFAULT_MAX_SECTIONS: u32 = 64;
/// Hard ceiling on any configured row cap (a 1 GiB answer).
pub const MAX_ROWS_CEILING: u32 = (1 << 30) / ROW_BYTES as u32;

impl Limits {
    /// Limits that fit the largest Lookup and Rows frames for these caps, and every fixed-size frame.
    pub const fn for_caps(max_rows: u32, max_sections: u32) -> Self {
        let rows = max_rows as u64;
        let sections = max_sections as u64;
        let lookup = 8 + 16 * sections + 8 * rows;
        let answer = 16 + 12 * sections + ROW_BYTES as u64 * rows;
        let fixed = MAX_FIXED_PAYLOAD as u64;
        let mut max = if lookup > answer { lookup } else { answer };
        if fixed > max {
            max = fixed;
        }
        let max_payload = if max > u32::MAX as u64 {
            u32::MAX
        } else {
            max as u32
        };
        Self {
            max_payload,
            max_sections,
            max_rows,
        }
    }
}

impl Limits {
    /// `for_caps` with the default section cap.
    pub const fn for_rows(max_rows: u32) -> Self {
        Self::for_caps(max_rows, DEFAULT_MAX_SECTIONS)
    }

    /// The same caps, with `max_payload` lowered to the largest frame a
    /// client sends: a Lookup at the caps (or a Hello, if larger). What a
    /// donor accepts once the handshake is done.
    pub const fn for_requests(&self) -> Self {
        let lookup = 8 + 16 * self.max_sections as u64 + 8 * self.max_rows as u64;
        let hello = MAX_HELLO_PAYLOAD as u64;
        let max = if lookup > hello { lookup } else { hello };
        let max = if max < self.max_payload as u64 {
            max as u32
        } else {
            self.max_payload
        };
        Self {
            max_payload: max,
            ..*self
        }
    }

    /// Only a Hello fits: what a donor accepts before the handshake.
    pub const fn before_hello(&self) -> Self {
        Self {
            max_payload: MAX_HELLO_PAYLOAD as u32,
            ..*self
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self::for_caps(DEFAULT_MAX_ROWS, DEFAULT_MAX_SECTIONS)
    }
}

/// Why bytes are not a valid frame.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum FrameError {
    /// Unknown frame kind byte.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// Flags or reserved header bits are set.
    #[error("frame header has non-zero flags or reserved bits")]
    BadHeader,
    /// Payload length above the configured maximum.
    #[error("frame payload of {len} bytes exceeds the maximum of {max}")]
    TooLarge {
        /// Payload length in bytes from the frame header.
        len: u32,
        /// Largest payload length accepted, in bytes.
        max: u32,
    },
    /// The payload does not parse as its kind.
    #[error("malformed {kind:?} frame: {reason}")]
    Malformed {
        /// Kind of the frame whose payload is malformed.
        kind: FrameKind,
        /// What is wrong with the payload.
        reason: &'static str,
    },
    /// More rows than the configured cap (framing is intact).
    #[error("{rows} rows exceed the cap of {max}")]
    TooManyRows {
        /// Rows counted, all sections together, up to the section that passed the cap.
        rows: u64,
        /// Configured cap on rows in one frame, all sections together.
        max: u32,
    },
    /// More sections than the configured cap (framing is intact).
    #[error("{sections} sections exceed the cap of {max}")]
    TooManySections {
        /// Sections the frame declares.
        sections: u32,
        /// Configured cap on sections in one frame.
        max: u32,
    },
    /// A Rows payload whose checksum does not match (framing is intact).
    #[error(
        "rows checksum mismatch: frame says {expected:#018x}, payload hashes to {actual:#018x}"
    )]
    Checksum {
        /// Checksum the frame carries.
        expected: u64,
        /// Checksum the payload hashes to.
        actual: u64,
    },
}

impl FrameError {
    /// True when the byte stream cannot be trusted any more and the
    /// connection must close; false when only this frame is bad.
    pub const fn is_fatal(&self) -> bool {
        !matches!(
            self,
            Self::TooManyRows { .. } | Self::TooManySections { .. } | Self::Checksum { .. }
        )
    }

    /// The code to answer a peer with.
    pub const fn code(&self) -> ErrorCode {
        match self {
            Self::TooManyRows { .. } | Self::TooManySections { .. } => ErrorCode::RequestTooLarge,
            Self::TooLarge { .. } => ErrorCode::FrameTooLarge,
            _ => ErrorCode::Malformed,
        }
    }
}

/// A frame's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// What the payload is.
    pub kind: FrameKind,
    /// Chosen by the client, echoed by the donor; 0 for unsolicited frames.
    pub request_id: u64,
    /// Payload bytes after the header.
    pub payload_len: u32,
}

impl FrameHeader {
    /// Parse the header at the front of `buf`: `Ok(None)` when fewer than 16
    /// bytes are buffered; an error for an unknown kind, set reserved bits or
    /// a payload length above `limits.max_payload`.
    pub fn peek(buf: &[u8], limits: &Limits) -> Result<Option<Self>, FrameError> {
        let Some(h) = Self::peek_unbounded(buf)? else {
            return Ok(None);
        };
        if h.payload_len > limits.max_payload {
            return Err(FrameError::TooLarge {
                len: h.payload_len,
                max: limits.max_payload,
            });
        }
        Ok(Some(h))
    }

    /// Like [`peek`](Self::peek), but the payload length is left for the
    /// caller to check (a donor skips an oversized Lookup's payload instead
    /// of closing, so it needs the header's kind and request id first).
    pub fn peek_unbounded(buf: &[u8]) -> Result<Option<Self>, FrameError> {
        let Some(h) = buf.get(..HEADER_LEN) else {
            return Ok(None);
        };
        let payload_len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
        let kind = FrameKind::from_u8(h[4]).ok_or(FrameError::UnknownKind(h[4]))?;
        if h[5] != 0 || h[6] != 0 || h[7] != 0 {
            return Err(FrameError::BadHeader);
        }
        let request_id = u64::from_le_bytes([h[8], h[9], h[10], h[11], h[12], h[13], h[14], h[15]]);
        Ok(Some(Self {
            kind,
            request_id,
            payload_len,
        }))
    }

    /// Header plus payload.
    pub const fn frame_len(&self) -> usize {
        HEADER_LEN + self.payload_len as usize
    }

    /// Append a header.
    pub fn write(out: &mut Vec<u8>, kind: FrameKind, request_id: u64, payload_len: u32) {
        out.extend_from_slice(&payload_len.to_le_bytes());
        out.extend_from_slice(&[kind as u8, 0, 0, 0]);
        out.extend_from_slice(&request_id.to_le_bytes());
    }
}

/// A bounds-checked little-endian reader over one payload.
#[derive(Debug)]
pub(crate) struct Cursor<'a> {
    buf: &'a [u8],
    kind: FrameKind,
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(buf: &'a [u8], kind: FrameKind) -> Self {
        Self { buf, kind }
    }

    pub(crate) fn malformed(&self, reason: &'static str) -> FrameError {
        FrameError::Malformed {
            kind: self.kind,
            reason,
        }
    }

    pub(crate) fn bytes(&mut self, n: usize) -> Result<&'a [u8], FrameError> {
        if n > self.buf.len() {
            return Err(self.malformed("payload shorter than its fields"));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    pub(crate) fn array<const N: usize>(&mut self) -> Result<[u8; N], FrameError> {
        let b = self.bytes(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(b);
        Ok(a)
    }

    pub(crate) fn u16(&mut self) -> Result<u16, FrameError> {
        self.array().map(u16::from_le_bytes)
    }

    pub(crate) fn u32(&mut self) -> Result<u32, FrameError> {
        self.array().map(u32::from_le_bytes)
    }

    pub(crate) fn u64(&mut self) -> Result<u64, FrameError> {
        self.array().map(u64::from_le_bytes)
    }

    pub(crate) fn zero_u16(&mut self) -> Result<(), FrameError> {
        if self.u16()? != 0 {
            return Err(self.malformed("reserved field is not zero"));
        }
        Ok(())
    }

    pub(crate) fn zero_u32(&mut self) -> Result<(), FrameError> {
        if self.u32()? != 0 {
            return Err(self.malformed("reserved field is not zero"));
        }
        Ok(())
    }

    pub(crate) fn utf8(&mut self, n: usize) -> Result<&'a str, FrameError> {
        let b = self.bytes(n)?;
        std::str::from_utf8(b).map_err(|_| self.malformed("text is not UTF-8"))
    }

    pub(crate) fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.buf)
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len()
    }

    pub(crate) fn end(&self) -> Result<(), FrameError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(self.malformed("trailing bytes after the fields"))
        }
    }
}
