//! A whole frame at the front of a buffer: its header checked against the
//! limits, then its payload parsed into the borrowed view of its kind
//! (`messages`). The top of the codec: `frame` and `messages` below it.

use crate::frame::{FrameError, FrameHeader, FrameKind, HEADER_LEN, Limits};
use crate::messages::{
    ErrorFrame, Goodbye, Hello, LookupRef, Region, RegionQuery, RowsRef, WelcomeRef,
};

/// One parsed frame, borrowing the buffer it came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frame<'a> {
    /// See [`Hello`].
    Hello(Hello<'a>),
    /// See [`WelcomeRef`].
    Welcome(WelcomeRef<'a>),
    /// See [`LookupRef`].
    Lookup(LookupRef<'a>),
    /// See [`RowsRef`].
    Rows(RowsRef<'a>),
    /// See [`ErrorFrame`].
    Error(ErrorFrame<'a>),
    /// Liveness probe.
    Ping,
    /// Answer to Ping.
    Pong,
    /// See [`Goodbye`].
    Goodbye(Goodbye),
    /// See [`RegionQuery`].
    RegionQuery(RegionQuery),
    /// See [`Region`].
    Region(Region),
}

impl<'a> Frame<'a> {
    /// Parse a payload of a known kind.
    pub fn parse(kind: FrameKind, payload: &'a [u8], limits: &Limits) -> Result<Self, FrameError> {
        Ok(match kind {
            FrameKind::Hello => Self::Hello(Hello::parse(payload)?),
            FrameKind::Welcome => Self::Welcome(WelcomeRef::parse(payload)?),
            FrameKind::Lookup => Self::Lookup(LookupRef::parse(payload, limits)?),
            FrameKind::Rows => Self::Rows(RowsRef::parse(payload, limits)?),
            FrameKind::Error => Self::Error(ErrorFrame::parse(payload)?),
            FrameKind::Ping | FrameKind::Pong => {
                if !payload.is_empty() {
                    return Err(FrameError::Malformed {
                        kind,
                        reason: "payload must be empty",
                    });
                }
                if kind == FrameKind::Ping {
                    Self::Ping
                } else {
                    Self::Pong
                }
            }
            FrameKind::Goodbye => Self::Goodbye(Goodbye::parse(payload)?),
            FrameKind::RegionQuery => Self::RegionQuery(RegionQuery::parse(payload)?),
            FrameKind::Region => Self::Region(Region::parse(payload)?),
        })
    }
}

/// A whole frame found at the front of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decoded<'a> {
    /// Its header.
    pub header: FrameHeader,
    /// Its parsed payload.
    pub frame: Frame<'a>,
    /// Bytes it occupies (advance the buffer by this much once done with it).
    pub len: usize,
}

/// Decode the frame at the front of `buf`: `Ok(None)` while incomplete.
/// On an error that is not fatal (see [`FrameError::is_fatal`]) the caller
/// may skip `FrameHeader::frame_len` bytes and go on.
pub fn decode<'a>(buf: &'a [u8], limits: &Limits) -> Result<Option<Decoded<'a>>, FrameError> {
    let Some(header) = FrameHeader::peek(buf, limits)? else {
        return Ok(None);
    };
    let Some(payload) = buf.get(HEADER_LEN..header.frame_len()) else {
        return Ok(None);
    };
    let frame = Frame::parse(header.kind, payload, limits)?;
    Ok(Some(Decoded {
        header,
        frame,
        len: header.frame_len(),
    }))
}
