//! The QUIC side of the handshake storm: junk datagrams at the port,
//! half-open handshakes (a real Initial from quinn's state machine, never
//! answered) and handshakes without a client certificate.

use std::collections::HashMap;
use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::{Counters, PAUSE, TIMEOUT, add, micros};

/// Half-open Initials sent per round, a round every [`ROUND`]: about 400 a
/// second, so more than the donor's 64 handshakes are in progress within
/// its hello timeout.
const BURST: usize = 4;
const ROUND: Duration = Duration::from_millis(10);
/// How long an intruder waits for the donor's verdict.
const VERDICT: Duration = Duration::from_secs(1);
/// How long a QUIC intruder waits for its handshake to end either way.
const HANDSHAKE_WAIT: Duration = Duration::from_secs(3);

/// Random datagrams of an Initial's size at the QUIC port, every other
/// one dressed as a QUIC v1 Initial (long header, version 1).
pub(super) fn quic_junk(addr: SocketAddr, st: &AtomicBool, c: &Counters) {
    let Ok(sock) = UdpSocket::bind(unspecified(addr)) else {
        return;
    };
    let mut x: u64 = 0xD1B5_4A32_D192_ED03;
    let mut buf = [0u8; 1200];
    while !st.load(Ordering::Relaxed) {
        for b in buf.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        if x & 1 == 0 {
            buf[..6].copy_from_slice(&[0xC3, 0, 0, 0, 1, 8]);
        }
        if sock.send_to(&buf, addr).is_ok() {
            add(&c.quic_junk);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn unspecified(addr: SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V4(_) => (std::net::Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    }
}

/// The destination and source connection ids of a QUIC long-header packet.
fn long_header_cids(p: &[u8]) -> Option<(&[u8], &[u8])> {
    if p.first()? & 0x80 == 0 {
        return None;
    }
    let dl = usize::from(*p.get(5)?);
    let dcid = p.get(6..6 + dl)?;
    let sl = usize::from(*p.get(6 + dl)?);
    let scid = p.get(7 + dl..7 + dl + sl)?;
    Some((dcid, scid))
}

/// One half-open QUIC handshake: when its Initial went, when the donor's
/// first and last datagrams for it came.
struct Attempt {
    sent: Instant,
    first: Option<Instant>,
    last: Option<Instant>,
}

/// Real QUIC Initials (a ClientHello, from quinn's state machine) from one
/// socket, never answered; the donor's datagrams for each (by our
/// connection id) say whether it held the handshake and when it closed it.
pub(super) fn quic_half_open(
    addr: SocketAddr,
    config: &quinn::ClientConfig,
    donor: &str,
    hello: Duration,
    retire: Duration,
    st: &AtomicBool,
    c: &Counters,
) {
    let Ok(sock) = UdpSocket::bind(unspecified(addr)) else {
        return;
    };
    if sock.set_nonblocking(true).is_err() {
        return;
    }
    let config_ep = Arc::new(quinn_proto::EndpointConfig::default());
    let mut open: HashMap<Vec<u8>, Attempt> = HashMap::new();
    let (mut out, mut inb) = (Vec::with_capacity(1500), vec![0u8; 2048]);
    let classify = |a: &Attempt| match (a.first, a.last) {
        (Some(first), Some(last)) if last - first >= hello / 2 => {
            add(&c.quic_held);
            let close = micros(last - a.sent);
            c.quic_close_max_us.fetch_max(close, Ordering::Relaxed);
        }
        (Some(_), _) => add(&c.quic_refused_at_once),
        (None, _) => add(&c.quic_unanswered),
    };
    while !st.load(Ordering::Relaxed) {
        // A fresh state machine per round: those it holds are never driven.
        let mut endpoint = quinn_proto::Endpoint::new(config_ep.clone(), None, false, None);
        for _ in 0..BURST {
            let now = Instant::now();
            let Ok((_, mut conn)) = endpoint.connect(now, config.clone(), addr, donor) else {
                continue;
            };
            out.clear();
            let Some(t) = conn.poll_transmit(now, 1, &mut out) else {
                continue;
            };
            let datagram = &out[..t.size];
            let Some((_, ours)) = long_header_cids(datagram) else {
                continue;
            };
            if sock.send_to(datagram, addr).is_ok() {
                add(&c.quic_initials);
                let a = Attempt {
                    sent: now,
                    first: None,
                    last: None,
                };
                open.insert(ours.to_vec(), a);
            }
        }
        let until = Instant::now() + ROUND;
        while Instant::now() < until {
            while let Ok((n, _)) = sock.recv_from(&mut inb) {
                let now = Instant::now();
                if let Some(a) = long_header_cids(&inb[..n]).and_then(|(d, _)| open.get_mut(d)) {
                    a.first.get_or_insert(now);
                    a.last = Some(now);
                }
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        open.retain(|_, a| {
            let done = a.sent.elapsed() >= retire;
            if done {
                classify(a);
            }
            !done
        });
    }
}

/// QUIC handshakes without a client certificate, one after the other.
pub(super) fn quic_intruders(
    addr: SocketAddr,
    config: quinn::ClientConfig,
    donor: &str,
    st: &AtomicBool,
    c: &Counters,
) {
    let Ok(rt) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return;
    };
    rt.block_on(async {
        let Ok(mut endpoint) = quinn::Endpoint::client(unspecified(addr)) else {
            return;
        };
        endpoint.set_default_client_config(config);
        while !st.load(Ordering::Relaxed) {
            add(&c.quic_intruders);
            let Ok(connecting) = endpoint.connect(addr, donor) else {
                return;
            };
            match tokio::time::timeout(HANDSHAKE_WAIT, connecting).await {
                // A handshake lost in the storm (its packets dropped, a
                // Retry's round trip): no verdict, and not let in.
                Err(_) => add(&c.quic_no_verdict),
                Ok(Err(_)) => add(&c.quic_refused),
                // Our side may be done; the donor's verdict follows our Finished.
                Ok(Ok(conn)) => match tokio::time::timeout(VERDICT, conn.closed()).await {
                    Ok(_) => add(&c.quic_refused),
                    Err(_) => add(&c.quic_admitted),
                },
            }
            tokio::time::sleep(PAUSE).await;
        }
        endpoint.close(0u32.into(), b"");
        let _ = tokio::time::timeout(TIMEOUT, endpoint.wait_idle()).await;
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_header_ids_are_read_and_short_or_cut_packets_are_not() {
        let p = [0xC3, 0, 0, 0, 1, 2, 0xAA, 0xBB, 1, 0xCC, 0xFF];
        assert_eq!(long_header_cids(&p), Some((&[0xAA, 0xBB][..], &[0xCC][..])));
        assert_eq!(long_header_cids(&[0x43, 1, 2, 3]), None);
        assert_eq!(long_header_cids(&p[..8]), None);
        assert_eq!(long_header_cids(&[]), None);
    }
}
