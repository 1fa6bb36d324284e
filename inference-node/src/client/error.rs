//! The client's error type.

use std::net::SocketAddr;
use std::time::Duration;

use engram_protocol::session::client::SessionError;
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
    /// True when another source (a replica, the SSD copy) may well succeed:
    /// the session's rule ([`SessionError::retry_elsewhere`]); a failed
    /// connect or a time-out is this donor's trouble only.
    pub fn retry_elsewhere(&self) -> bool {
        self.to_session().retry_elsewhere()
    }
}

impl From<SessionError> for ClientError {
    /// The session's verdicts keep their kind (and so their retry-ability).
    fn from(e: SessionError) -> Self {
        match e {
            SessionError::Refused { code, message } => Self::Refused { code, message },
            SessionError::DigestMismatch {
                donor,
                table,
                pinned,
                advertised,
            } => Self::DigestMismatch {
                donor,
                table,
                pinned,
                advertised,
            },
            SessionError::TableMissing { donor, table } => Self::TableMissing { donor, table },
            SessionError::NotPinned(t) => Self::NotPinned(t),
            SessionError::Section { table, code } => Self::Section { table, code },
            SessionError::Donor { code, message } => Self::Donor { code, message },
            SessionError::Corrupt(m) => Self::Corrupt(m),
            SessionError::Protocol(m) => Self::Protocol(m),
            SessionError::Disconnected(m) => Self::Disconnected(m),
            SessionError::Draining => Self::Draining,
            SessionError::BadRequest(m) => Self::BadRequest(m),
        }
    }
}

impl ClientError {
    /// The same verdict as the session keeps it: what ends a connection
    /// (IO failures and time-outs are a lost connection to the session).
    pub(super) fn to_session(&self) -> SessionError {
        match self.clone() {
            Self::Connect { .. } | Self::Timeout(_) => SessionError::Disconnected(self.to_string()),
            Self::Refused { code, message } => SessionError::Refused { code, message },
            Self::DigestMismatch {
                donor,
                table,
                pinned,
                advertised,
            } => SessionError::DigestMismatch {
                donor,
                table,
                pinned,
                advertised,
            },
            Self::TableMissing { donor, table } => SessionError::TableMissing { donor, table },
            Self::NotPinned(t) => SessionError::NotPinned(t),
            Self::Section { table, code } => SessionError::Section { table, code },
            Self::Donor { code, message } => SessionError::Donor { code, message },
            Self::Corrupt(m) => SessionError::Corrupt(m),
            Self::Protocol(m) => SessionError::Protocol(m),
            Self::Disconnected(m) => SessionError::Disconnected(m),
            Self::Draining => SessionError::Draining,
            Self::BadRequest(m) => SessionError::BadRequest(m),
        }
    }
}
