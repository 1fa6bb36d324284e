//! The data plane over QUIC (quinn), ALPN `engram/1`, with the same
//! identities as TLS. Stream use: a node opens one long-lived
//! bidirectional stream per session and speaks the TCP protocol on it
//! unchanged (Hello, Welcome, pipelined Lookups answered by request id), so
//! a lookup costs no stream set-up and the handler is the one every
//! transport uses. A connection may hold a few such streams (each its own
//! session, with its own Hello).
//!
//! Bounds: one connection permit per authenticated QUIC connection (the
//! same `max_connections` as TCP and TLS, taken once the client's
//! certificate is admitted: `busy` in CONNECTION_CLOSE at the bound); at
//! most [`MAX_HANDSHAKES`] handshakes in progress, of which at most
//! [`MAX_HANDSHAKES_PER_SOURCE`] unvalidated and as many validated ones
//! from one address (`budget`): past [`RETRY_ABOVE`] handshakes, or its
//! address's limit, a client whose address is not validated gets a
//! stateless Retry, never a refusal, so Initials with a forged source hold
//! nothing and keep no node out; a client back with the Retry's token is
//! counted against its own address only and gets a place, taking over the
//! oldest unvalidated handshake if it must. Each handshake within the
//! hello timeout; [`MAX_STREAMS`] streams per connection, and the idle
//! timeout as QUIC's own. 0-RTT is not accepted: see PROTOCOL.md.

mod budget;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use engram_protocol::Goodbye;
use tokio::sync::Semaphore;
use tokio::time::Instant;

use self::budget::{Handshakes, Place, Verdict};
use super::ended::Ended;
use super::handler::Handler;
use super::pump::{INITIAL_BUF, Pump, Step};
use super::{CONN_WARN, Shared};

/// QUIC handshakes in progress at once, validated or not.
pub const MAX_HANDSHAKES: usize = 64;
/// Handshakes in progress from one source address at once, in each class
/// (address validated, or not).
pub const MAX_HANDSHAKES_PER_SOURCE: usize = 8;
/// Handshakes in progress past which a client whose address is not yet
/// validated is sent a stateless Retry: a spoofed source never gets past
/// it, and holds nothing on the donor meanwhile.
pub const RETRY_ABOVE: usize = 8;
/// Concurrent bidirectional streams (sessions) per QUIC connection.
pub const MAX_STREAMS: u32 = 4;

/// The quinn server configuration for the donor's TLS state now.
pub fn server_config(shared: &Shared) -> Result<quinn::ServerConfig, String> {
    let tls = shared
        .tls()
        .ok_or("a quic:// address needs the rack's PKI ([rack.tls])")?;
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls.data_config())
        .map_err(|e| e.to_string())?;
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    let cfg = shared.config();
    let mut transport = quinn::TransportConfig::default();
    transport.max_concurrent_bidi_streams(MAX_STREAMS.into());
    transport.max_concurrent_uni_streams(0u32.into());
    if !cfg.idle_timeout.is_zero() {
        transport.max_idle_timeout(quinn::IdleTimeout::try_from(cfg.idle_timeout).ok());
    }
    config.transport_config(Arc::new(transport));
    Ok(config)
}

/// Accept QUIC connections on `endpoint` until `stop` fires.
pub(super) async fn accept_loop(
    endpoint: quinn::Endpoint,
    shared: Arc<Shared>,
    permits: Arc<Semaphore>,
    mut stop: tokio::sync::broadcast::Receiver<()>,
) {
    let handshakes = Handshakes::new(budget::Limits {
        total: MAX_HANDSHAKES,
        per_source: MAX_HANDSHAKES_PER_SOURCE,
        retry_above: RETRY_ABOVE,
    });
    loop {
        let incoming = tokio::select! {
            _ = stop.recv() => break,
            i = endpoint.accept() => match i {
                Some(i) => i,
                None => break,
            },
        };
        let peer = incoming.remote_address();
        let validated = incoming.remote_address_validated();
        if validated {
            shared.stats.quic_validated.fetch_add(1, Ordering::Relaxed);
        }
        match handshakes.admit(peer.ip(), validated) {
            Verdict::Admit(place) => {
                if place.evicted_another {
                    shared.stats.refusal("data", "handshake_evicted");
                }
                let (shared, permits) = (Arc::clone(&shared), Arc::clone(&permits));
                tokio::spawn(async move {
                    serve_connection(incoming, peer, shared, permits, place).await;
                });
            }
            // Stateless: the donor keeps nothing until the client comes
            // back from its address with the token.
            Verdict::Retry => {
                shared.stats.refusal("data", "quic_retry");
                // An unvalidated Initial may always be retried; refused
                // should quinn ever say otherwise.
                if let Err(e) = incoming.retry() {
                    e.into_incoming().refuse();
                }
            }
            Verdict::Refuse => {
                shared.stats.refusal("data", "handshake_limit");
                if let Some(suppressed) = CONN_WARN.allow() {
                    tracing::warn!(%peer, suppressed, "QUIC handshake refused: {MAX_HANDSHAKES} validated handshakes already in progress");
                }
                incoming.refuse();
            }
        }
    }
    // New connections are refused from now on; live ones drain.
    endpoint.set_server_config(None);
}

/// Hand a connection's handshake to quinn, bounded by the hello timeout,
/// and check the client's identity.
async fn admit(
    incoming: quinn::Incoming,
    peer: SocketAddr,
    shared: &Shared,
    place: &Place,
) -> Option<(quinn::Connection, String, super::Chain)> {
    let stats = &shared.stats;
    let timeout = shared.config().hello_timeout.max(Duration::from_millis(1));
    let connecting = match incoming.accept() {
        Ok(c) => c,
        Err(e) => {
            stats.refusal("data", "handshake_failed");
            tracing::debug!(%peer, error = %e, "QUIC connection not accepted");
            return None;
        }
    };
    let finished = tokio::select! {
        r = tokio::time::timeout(timeout, connecting) => r,
        // Dropping the handshake closes it: a validated newcomer took its place.
        () = place.evicted() => {
            tracing::debug!(%peer, "QUIC handshake evicted by a validated one");
            return None;
        }
    };
    let conn = match finished {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            stats.refusal("data", "handshake_failed");
            if let Some(suppressed) = CONN_WARN.allow() {
                tracing::warn!(%peer, error = %e, suppressed, "QUIC handshake failed");
            }
            return None;
        }
        Err(_) => {
            stats.refusal("data", "handshake_timeout");
            if let Some(suppressed) = CONN_WARN.allow() {
                tracing::warn!(%peer, suppressed, "QUIC handshake timed out");
            }
            return None;
        }
    };
    let chain: super::Chain = conn
        .peer_identity()
        .and_then(|any| {
            any.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
                .ok()
        })
        .map(|chain| chain.into_iter().collect())
        .unwrap_or_default();
    let identity = cluster_config::tls::peer_identity(Some(&chain[..]));
    let who = identity.clone().unwrap_or_else(|| "(no name)".into());
    match identity {
        Some(id) if shared.tls().is_some_and(|t| t.data_allowed(&id)) => Some((conn, id, chain)),
        _ => {
            stats.refusal("data", "client_not_allowed");
            if let Some(suppressed) = CONN_WARN.allow() {
                tracing::warn!(%peer, identity = %who, suppressed, "QUIC client not allowed on this donor: refused");
            }
            let why = format!(
                "{who} is not allowed on donor {} (the donor's `clients` in the rack config)",
                shared.config().name
            );
            conn.close(quinn::VarInt::from_u32(1), why.as_bytes());
            None
        }
    }
}

async fn serve_connection(
    incoming: quinn::Incoming,
    peer: SocketAddr,
    shared: Arc<Shared>,
    permits: Arc<Semaphore>,
    place: Place,
) {
    let admitted = admit(incoming, peer, &shared, &place).await;
    drop(place);
    let Some((conn, identity, chain)) = admitted else {
        return;
    };
    // Authenticated: a served slot now, or `busy` in CONNECTION_CLOSE.
    let Ok(permit) = permits.try_acquire_owned() else {
        shared.stats.refused.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(%peer, "QUIC connection refused: at the bound");
        let max = shared.max_connections();
        conn.close(
            quinn::VarInt::from_u32(u32::from(engram_protocol::ErrorCode::Busy.to_u16())),
            format!("donor is at its bound of {max} connections").as_bytes(),
        );
        return;
    };
    let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    shared.stats.connections.fetch_add(1, Ordering::Relaxed);
    shared.stats.open.fetch_add(1, Ordering::Relaxed);
    shared.quic_open.fetch_add(1, Ordering::Relaxed);
    shared.quic_conns.lock().insert(id, conn.clone());
    let mut streams = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            s = conn.accept_bi() => s,
            // Finished sessions are reaped as they end.
            Some(_) = streams.join_next(), if !streams.is_empty() => continue,
        };
        match accepted {
            Ok((send, recv)) => {
                let (shared, identity) = (Arc::clone(&shared), identity.clone());
                let chain = Arc::clone(&chain);
                streams.spawn(async move {
                    serve_stream(send, recv, &shared, (identity, chain), id, peer).await;
                });
            }
            Err(e) => {
                tracing::debug!(conn = id, %peer, error = %e, "QUIC connection closed");
                if let Some(ended) = connection_lost(&e) {
                    ended.report(&shared, id, peer, "");
                }
                break;
            }
        }
    }
    streams.abort_all();
    while streams.join_next().await.is_some() {}
    shared.quic_open.fetch_sub(1, Ordering::Relaxed);
    shared.quic_conns.lock().remove(&id);
    shared.stats.open.fetch_sub(1, Ordering::Relaxed);
    drop(permit);
}

/// Why a QUIC connection ended, when the donor counts it as an error:
/// not a close by either side.
fn connection_lost(e: &quinn::ConnectionError) -> Option<Ended> {
    use quinn::ConnectionError as E;
    let reason = match e {
        E::ApplicationClosed(_) | E::ConnectionClosed(_) | E::LocallyClosed => return None,
        E::TimedOut => "peer_timeout",
        E::Reset => "peer_reset",
        E::TransportError(_) | E::VersionMismatch | E::CidsExhausted => "quic_error",
    };
    Some(Ended::new(reason, e.to_string()))
}

/// Write `out` within the write timeout.
async fn write(
    send: &mut quinn::SendStream,
    out: &mut Vec<u8>,
    limit: Duration,
) -> Result<(), Ended> {
    if out.is_empty() {
        return Ok(());
    }
    let failed = |e: quinn::WriteError| match e {
        quinn::WriteError::ConnectionLost(c) => {
            connection_lost(&c).unwrap_or_else(|| Ended::new("peer_reset", c.to_string()))
        }
        quinn::WriteError::Stopped(_) => Ended::new("peer_reset", e.to_string()),
        _ => Ended::new("write_error", e.to_string()),
    };
    let w = send.write_all(out);
    let r = if limit.is_zero() {
        w.await.map_err(failed)
    } else {
        tokio::time::timeout(limit, w)
            .await
            .map_err(|_| Ended::new("write_timeout", "write timed out"))?
            .map_err(failed)
    };
    out.clear();
    r
}

/// One session on one stream: the same frames as over TCP. An end on an
/// error is counted and logged by its reason.
async fn serve_stream(
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    shared: &Arc<Shared>,
    (identity, chain): (String, super::Chain),
    id: u64,
    peer: SocketAddr,
) {
    let cfg = shared.config();
    let mut handler = Handler::new(shared, Arc::clone(&cfg));
    handler.set_identity(identity, chain);
    let mut pump = Pump::new(handler, cfg.limits, id, peer, false);
    if let Err(ended) = stream_session(send, recv, shared, &mut pump).await {
        ended.report(shared, id, peer, pump.handler.peer_name());
    }
}

/// Read frames, answer them and write the answers until the session ends:
/// `Ok` when the peer finished its stream, else why it ended.
async fn stream_session(
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    shared: &Arc<Shared>,
    pump: &mut Pump<'_>,
) -> Result<(), Ended> {
    let cfg = shared.config();
    let mut out = Vec::with_capacity(INITIAL_BUF);
    let hello_deadline = Instant::now() + cfg.hello_timeout.max(Duration::from_millis(1));
    let mut draining = shared.drain_signal();
    let mut said_goodbye = false;
    loop {
        loop {
            match pump.step(shared, &mut out) {
                Step::NeedInput => break,
                Step::Flush | Step::Ready => write(&mut send, &mut out, cfg.write_timeout).await?,
                Step::Close => {
                    write(&mut send, &mut out, cfg.write_timeout).await?;
                    let _ = send.finish();
                    // Let the peer read the last answer before the stream goes.
                    let _ = tokio::time::timeout(Duration::from_millis(200), send.stopped()).await;
                    return Err(Ended::closed_on(pump.session.last_error()));
                }
            }
        }
        write(&mut send, &mut out, cfg.write_timeout).await?;
        let wait = if pump.session.is_ready() {
            (!cfg.idle_timeout.is_zero()).then(|| Instant::now() + cfg.idle_timeout)
        } else {
            Some(hello_deadline)
        };
        let rb = &mut pump.session.rb;
        if rb.end == rb.buf.len() {
            rb.reserve_frame(rb.end - rb.start + engram_protocol::HEADER_LEN);
        }
        let end = rb.end;
        tokio::select! {
            r = recv.read(&mut rb.buf[end..]) => match r {
                Ok(Some(n)) => rb.end += n,
                Ok(None) => {
                    let _ = send.finish();
                    return Ok(());
                }
                // The peer closed its connection: its own close, not an error.
                Err(quinn::ReadError::ConnectionLost(e)) => {
                    return connection_lost(&e).map_or(Ok(()), Err);
                }
                Err(e) => {
                    let reason = match e {
                        quinn::ReadError::Reset(_) => "peer_reset",
                        _ => "read_error",
                    };
                    return Err(Ended::new(reason, e.to_string()));
                }
            },
            _ = draining.wait_for(|d| *d), if !said_goodbye => {
                said_goodbye = true;
                let grace = cfg.drain_timeout;
                Goodbye {
                    grace_ms: u32::try_from(grace.as_millis()).unwrap_or(u32::MAX),
                }
                .encode(&mut out);
            }
            _ = sleep_until(wait) => {
                return Err(if pump.session.is_ready() {
                    Ended::new("idle_timeout", "idle timeout")
                } else {
                    Ended::new("hello_timeout", "no Hello in time")
                });
            }
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
