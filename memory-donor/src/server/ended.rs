//! Why a client session ended other than by the client's own close: a
//! timeout, a failed read or write, a TLS or QUIC fault, or a frame the
//! donor answered with an error and closed on. Every such end is counted
//! by reason (`engram_donor_connection_errors_total{reason}`) and logged
//! (at WARN, rate-limited; an idle connection closed by `idle_timeout_ms`
//! at INFO, since that is the configured policy, not a fault).

use std::io;
use std::net::SocketAddr;

use engram_protocol::ErrorCode;

use super::Shared;

/// A session's end, with a short snake_case reason and what happened.
#[derive(Debug)]
pub(super) struct Ended {
    pub reason: &'static str,
    pub detail: String,
}

impl Ended {
    pub fn new(reason: &'static str, detail: impl Into<String>) -> Self {
        Self {
            reason,
            detail: detail.into(),
        }
    }

    /// A read failed; `ready` once the client completed its Hello.
    pub fn reading(e: &io::Error, ready: bool) -> Self {
        let reason = match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut if ready => "idle_timeout",
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => "hello_timeout",
            io::ErrorKind::InvalidData => "tls_error",
            k if peer_gone(k) => "peer_reset",
            _ => "read_error",
        };
        Self::new(reason, e.to_string())
    }

    /// A write failed: the client stopped reading (the write timeout),
    /// went away, or the socket failed.
    pub fn writing(e: &io::Error) -> Self {
        let reason = match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => "write_timeout",
            k if peer_gone(k) => "peer_reset",
            _ => "write_error",
        };
        Self::new(reason, e.to_string())
    }

    /// The donor answered a frame with `code` and closed (a malformed or
    /// oversized frame, a refused Hello).
    pub fn closed_on(code: Option<ErrorCode>) -> Self {
        let reason = code.map_or("protocol_error", ErrorCode::name);
        Self::new(reason, "answered with an error frame and closed")
    }

    /// Count it and log it, for connection `conn` from `peer` (client
    /// `node`, empty before its Hello). Once a drain has begun, the ends
    /// it forces are counted as `drain`.
    pub fn report(&self, shared: &Shared, conn: u64, peer: SocketAddr, node: &str) {
        let reason = if shared.is_draining() && matches!(self.reason, "peer_reset" | "write_error")
        {
            "drain"
        } else {
            self.reason
        };
        shared.stats.connection_error(reason);
        let Some(suppressed) = super::CONN_WARN.allow() else {
            return;
        };
        let error = &self.detail;
        if reason == "idle_timeout" {
            tracing::info!(conn, %peer, node, reason, suppressed, "idle connection closed");
        } else {
            tracing::warn!(conn, %peer, node, reason, error, suppressed, "connection closed on an error");
        }
    }
}

fn peer_gone(k: io::ErrorKind) -> bool {
    matches!(
        k,
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::UnexpectedEof
            | io::ErrorKind::NotConnected
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_name_what_failed() {
        let e = |k| io::Error::from(k);
        assert_eq!(
            Ended::writing(&e(io::ErrorKind::WouldBlock)).reason,
            "write_timeout"
        );
        assert_eq!(
            Ended::writing(&e(io::ErrorKind::BrokenPipe)).reason,
            "peer_reset"
        );
        assert_eq!(
            Ended::writing(&e(io::ErrorKind::WriteZero)).reason,
            "write_error"
        );
        assert_eq!(
            Ended::reading(&e(io::ErrorKind::WouldBlock), true).reason,
            "idle_timeout"
        );
        assert_eq!(
            Ended::reading(&e(io::ErrorKind::TimedOut), false).reason,
            "hello_timeout"
        );
        assert_eq!(
            Ended::reading(&e(io::ErrorKind::InvalidData), true).reason,
            "tls_error"
        );
        assert_eq!(
            Ended::reading(&e(io::ErrorKind::ConnectionReset), true).reason,
            "peer_reset"
        );
        assert_eq!(
            Ended::reading(&e(io::ErrorKind::Other), true).reason,
            "read_error"
        );
        assert_eq!(
            Ended::closed_on(Some(ErrorCode::Malformed)).reason,
            "malformed"
        );
        assert_eq!(Ended::closed_on(None).reason, "protocol_error");
    }
}
