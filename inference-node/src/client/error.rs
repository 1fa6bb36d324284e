//! The client's error type.

use std::net::SocketAddr;
use std::time::Duration;

use engram_protocol::{ErrorCode, TableDigest};
use thiserror::Error;

/// Why a donor could not serve a request. Each variant says whether another
/// source may succeed ([`ClientError::retry_elsewhere`]), so failover is
/// decided from types, not strings.
#[derive(Debug, Clone, Error)]
pub enum ClientError {
    /// The TCP connection could not be made.
    #[error("connecting to {addr}: {message}")]
    Connect {
        /// The donor's address.
        addr: SocketAddr,
        /// Why the connection (or its TLS or QUIC handshake) failed.
        message: String,
    },
    /// No answer in time.
    #[error("timed out after {0:?} waiting for the donor")]
    Timeout(Duration),
    /// The donor refused the handshake (busy, unauthorized, version, draining).
    #[error("donor refused the connection: {code}: {message}")]
    Refused {
        /// The donor's error code.
        code: ErrorCode,
        /// The donor's explanation.
        message: String,
    },
    /// The donor serves this table at another version than the one pinned.
    #[error("donor {donor} serves table {table} at digest {advertised}, not the pinned {pinned}")]
    DigestMismatch {
        /// The donor's name, as its Welcome gives it.
        donor: String,
        /// The table id.
        table: u32,
        /// The version the client pinned.
        pinned: TableDigest,
        /// The version the donor serves.
        advertised: TableDigest,
    },
    /// The donor does not serve a pinned table.
    #[error("donor {donor} does not serve table {table}")]
    TableMissing {
        /// The donor's name, as its Welcome gives it.
        donor: String,
        /// The pinned table id it does not serve.
        table: u32,
    },
    /// The caller asked for a table it did not pin (a caller bug).
    #[error("table {0} was not pinned when connecting")]
    NotPinned(u32),
    /// One section of an answer failed.
    #[error("donor answered table {table} with {code}")]
    Section {
        /// The table id of the failed section.
        table: u32,
        /// The donor's error code for it.
        code: ErrorCode,
    },
    /// The donor answered the request with a typed error.
    #[error("donor error {code}: {message}")]
    Donor {
        /// The donor's error code.
        code: ErrorCode,
        /// The donor's explanation.
        message: String,
    },
    /// The answer's checksum did not match: its rows were discarded.
    #[error("corrupt answer: {0}")]
    Corrupt(String),
    /// The donor broke the protocol; the connection was closed.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// The connection is gone.
    #[error("connection lost: {0}")]
    Disconnected(String),
    /// The donor said Goodbye: it takes no new requests.
    #[error("donor is draining")]
    Draining,
    /// The request itself is wrong (a caller bug): buffer size, row count.
    #[error("bad request: {0}")]
    BadRequest(String),
}

impl ClientError {
    /// True when another source (a replica, the SSD copy) may well succeed.
    pub fn retry_elsewhere(&self) -> bool {
        match self {
            Self::NotPinned(_) | Self::BadRequest(_) => false,
            // Out of range at the pinned version is out of range everywhere.
            Self::Section { code, .. } | Self::Donor { code, .. } => {
                !matches!(code, ErrorCode::RowOutOfRange | ErrorCode::RequestTooLarge)
            }
            _ => true,
        }
    }
}
