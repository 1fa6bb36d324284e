//! Frames in, answers out, for one client session whatever carries it
//! (a TCP or TLS connection's thread, a QUIC stream's task). The protocol
//! is the shared [`ServerSession`] (engram-protocol, no IO); this adds the
//! donor's answers ([`Handler`]), its counters and its logs. The driver
//! reads into `session.rb`, calls [`Pump::step`] until it needs input, and
//! does what each step says.

use std::net::SocketAddr;

use engram_protocol::Limits;
use engram_protocol::session::server::{self, Closed, ServerSession};
pub(super) use engram_protocol::session::{INITIAL_BUF, ReadBuf};

use super::Shared;
use super::handler::Handler;

/// What the driver does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    /// Every whole frame is answered: write `out`, then read more.
    NeedInput,
    /// `out` is large: write it, then step again.
    Flush,
    /// The client completed the handshake: switch to the idle timeout, then step again.
    Ready,
    /// Write `out` and close the session.
    Close,
}

/// One session's frame processing.
#[derive(Debug)]
pub(super) struct Pump<'a> {
    pub(super) session: ServerSession,
    pub(super) handler: Handler<'a>,
    conn: u64,
    peer: SocketAddr,
}

impl<'a> Pump<'a> {
    /// A session under `limits` (before Hello only a Hello fits); `plaintext`
    /// when it is not encrypted (a TLS ClientHello there is recognised).
    pub(super) fn new(
        handler: Handler<'a>,
        limits: Limits,
        conn: u64,
        peer: SocketAddr,
        plaintext: bool,
    ) -> Self {
        Self {
            session: ServerSession::new(limits, plaintext),
            handler,
            conn,
            peer,
        }
    }

    /// Answer whole frames in the buffer into `out` until something needs the driver.
    pub(super) fn step(&mut self, shared: &Shared, out: &mut Vec<u8>) -> Step {
        let (conn, peer) = (self.conn, self.peer);
        match self.session.step(&mut self.handler, out) {
            server::Step::NeedInput => Step::NeedInput,
            server::Step::Flush => Step::Flush,
            server::Step::Ready => {
                tracing::debug!(conn, %peer, node = self.handler.peer_name(), "client ready");
                Step::Ready
            }
            server::Step::Close(why) => {
                if why == Closed::TlsOnPlaintext {
                    shared.stats.refusal("data", "tls_on_plaintext_port");
                    if let Some(suppressed) = super::CONN_WARN.allow() {
                        tracing::warn!(conn, %peer, suppressed, "a TLS client on a plaintext port: refused (it must dial tcp://)");
                    }
                }
                let error = self.session.last_error().map(|c| c.name());
                tracing::debug!(conn, %peer, ?why, error, "closing");
                Step::Close
            }
        }
    }
}
