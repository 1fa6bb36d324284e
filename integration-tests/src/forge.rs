//! Packets whose source address the sender does not own, as an attacker
//! who can reach a donor but not receive at that address would send them:
//! real QUIC Initials (quinn's own ClientHello, never continued) and TCP
//! SYNs. A raw IPv4 socket (root, or CAP_NET_RAW) writes any source
//! address and port, a node's own included; without one, Initials go from
//! ordinary sockets bound to the source address (any port), which is all a
//! per-address budget can tell apart, and SYNs cannot be sent.
//!
//! Tests aim these only at loopback addresses or at namespaces they made.

use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// Initials generated per quinn state machine before a fresh one (each
/// keeps its connections' state, never driven).
const PER_ENDPOINT: usize = 64;

/// Real QUIC Initials for server name `d`, from a client that trusts the
/// CA in `ca` and sends no certificate: one datagram each.
#[derive(Debug)]
pub struct Initials {
    config: quinn::ClientConfig,
    endpoint_config: Arc<quinn_proto::EndpointConfig>,
    endpoint: Option<(quinn_proto::Endpoint, usize)>,
}

impl Initials {
    /// A maker whose client trusts `ca` (a PEM file); `None` when no
    /// client configuration can be built.
    pub fn new(ca: &Path) -> Option<Self> {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject;
        let mut store = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(&std::fs::read(ca).unwrap_or_default()).flatten() {
            let _ = store.add(c);
        }
        let builder = rustls::ClientConfig::builder_with_provider(cluster_config::tls::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .ok()?;
        let mut tls = builder.with_root_certificates(store).with_no_client_auth();
        tls.alpn_protocols = vec![cluster_config::tls::ALPN.to_vec()];
        let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(Arc::new(tls)).ok()?;
        Some(Self {
            config: quinn::ClientConfig::new(Arc::new(crypto)),
            endpoint_config: Arc::new(quinn_proto::EndpointConfig::default()),
            endpoint: None,
        })
    }

    /// The next Initial for `to` (a new connection id each time).
    pub fn next(&mut self, to: SocketAddr) -> Option<Vec<u8>> {
        if self
            .endpoint
            .as_ref()
            .is_none_or(|(_, n)| *n >= PER_ENDPOINT)
        {
            let ep =
                quinn_proto::Endpoint::new(Arc::clone(&self.endpoint_config), None, false, None);
            self.endpoint = Some((ep, 0));
        }
        let (endpoint, made) = self.endpoint.as_mut()?;
        *made += 1;
        let now = Instant::now();
        let (_, mut conn) = endpoint.connect(now, self.config.clone(), to, "d").ok()?;
        let mut buf = Vec::with_capacity(1500);
        let t = conn.poll_transmit(now, 1, &mut buf)?;
        buf.truncate(t.size);
        Some(buf)
    }
}

/// Real QUIC Initials at `to` from `sources` loopback addresses `net.1`,
/// `net.2`, ... (addresses a test can bind, looking like many hosts, as
/// spoofed sources would), `per_source` from each, never answered; the
/// client trusts the CA in `ca`. Returns how many were sent.
pub fn quic_initials(
    to: SocketAddr,
    ca: &Path,
    net: [u8; 3],
    sources: u8,
    per_source: usize,
) -> usize {
    let Some(mut initials) = Initials::new(ca) else {
        return 0;
    };
    let mut sent = 0;
    for i in 0..sources {
        let from = Ipv4Addr::new(net[0], net[1], net[2], 1 + i);
        let Ok(sock) = UdpSocket::bind((from, 0)) else {
            continue;
        };
        for _ in 0..per_source {
            if let Some(d) = initials.next(to)
                && sock.send_to(&d, to).is_ok()
            {
                sent += 1;
            }
        }
    }
    sent
}

/// What [`forge_quic_initials`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Forged {
    /// Initials sent.
    pub sent: usize,
    /// Whether they went through a raw socket (with the exact source
    /// port asked for); else from sockets bound to the source address.
    pub raw: bool,
}

/// `count` real QUIC Initials at `to`, each with source address `from`
/// (`port`, or a different port for each when `None`), never continued:
/// the donor's answers go to `from`, where nobody reads them. Through a
/// raw socket where the process may open one; else from sockets bound to
/// `from`'s address, 25 Initials from each (the port then is the kernel's).
pub fn forge_quic_initials(
    from: Ipv4Addr,
    port: Option<u16>,
    to: SocketAddr,
    ca: &Path,
    count: usize,
) -> Forged {
    let Some(mut initials) = Initials::new(ca) else {
        return Forged {
            sent: 0,
            raw: false,
        };
    };
    let SocketAddr::V4(to4) = to else {
        return Forged {
            sent: 0,
            raw: false,
        };
    };
    let raw = RawSocket::open().ok();
    let mut sent = 0;
    let mut sock = None;
    for i in 0..count {
        let Some(d) = initials.next(to) else { continue };
        let ok = match &raw {
            Some(r) => {
                let p = port.unwrap_or(20_000 + (i % 40_000) as u16);
                r.udp(SocketAddrV4::new(from, p), to4, &d).is_ok()
            }
            None => {
                if i % 25 == 0 {
                    sock = UdpSocket::bind((from, 0)).ok();
                }
                sock.as_ref().is_some_and(|s| s.send_to(&d, to).is_ok())
            }
        };
        sent += usize::from(ok);
    }
    Forged {
        sent,
        raw: raw.is_some(),
    }
}

/// A raw socket, or `None` where this process may not open one: the
/// caller's test then skips with a note, unless
/// `ENGRAM_REQUIRE_RAW_SOCKETS=1` makes that a failure.
pub fn raw_socket_or_skip() -> Option<RawSocket> {
    match RawSocket::open() {
        Ok(r) => Some(r),
        Err(e) => {
            let required = std::env::var("ENGRAM_REQUIRE_RAW_SOCKETS").as_deref() == Ok("1");
            assert!(
                !required,
                "ENGRAM_REQUIRE_RAW_SOCKETS=1 but no raw socket: {e}"
            );
            eprintln!("skipping: no raw socket (needs root or CAP_NET_RAW): {e}");
            None
        }
    }
}

/// A raw IPv4 socket that writes whole packets, IP header included.
#[derive(Debug)]
pub struct RawSocket(OwnedFd);

impl RawSocket {
    /// Open one: needs root or CAP_NET_RAW.
    pub fn open() -> io::Result<Self> {
        // SAFETY: a plain socket call; the descriptor is owned from here on.
        let fd = unsafe {
            libc::socket(
                libc::AF_INET,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::IPPROTO_RAW,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor nobody else owns.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// A UDP datagram from `from` to `to`.
    pub fn udp(&self, from: SocketAddrV4, to: SocketAddrV4, payload: &[u8]) -> io::Result<()> {
        let len = u16::try_from(8 + payload.len()).map_err(|_| io::ErrorKind::InvalidInput)?;
        let mut seg = Vec::with_capacity(usize::from(len));
        seg.extend_from_slice(&from.port().to_be_bytes());
        seg.extend_from_slice(&to.port().to_be_bytes());
        seg.extend_from_slice(&len.to_be_bytes());
        seg.extend_from_slice(&[0, 0]);
        seg.extend_from_slice(payload);
        let sum = match transport_checksum(*from.ip(), *to.ip(), libc::IPPROTO_UDP as u8, &seg) {
            // An all-zero UDP checksum means "none": sent as all ones.
            0 => 0xFFFF,
            s => s,
        };
        seg[6..8].copy_from_slice(&sum.to_be_bytes());
        self.send(*from.ip(), *to.ip(), libc::IPPROTO_UDP as u8, &seg, to)
    }

    /// A TCP SYN from `from` to `to` with sequence number `seq`.
    pub fn syn(&self, from: SocketAddrV4, to: SocketAddrV4, seq: u32) -> io::Result<()> {
        let mut seg = [0u8; 20];
        seg[0..2].copy_from_slice(&from.port().to_be_bytes());
        seg[2..4].copy_from_slice(&to.port().to_be_bytes());
        seg[4..8].copy_from_slice(&seq.to_be_bytes());
        // Data offset 5 words; flags: SYN; a 64 KiB window.
        seg[12] = 5 << 4;
        seg[13] = 0x02;
        seg[14..16].copy_from_slice(&u16::MAX.to_be_bytes());
        let sum = transport_checksum(*from.ip(), *to.ip(), libc::IPPROTO_TCP as u8, &seg);
        seg[16..18].copy_from_slice(&sum.to_be_bytes());
        self.send(*from.ip(), *to.ip(), libc::IPPROTO_TCP as u8, &seg, to)
    }

    fn send(
        &self,
        src: Ipv4Addr,
        dst: Ipv4Addr,
        protocol: u8,
        segment: &[u8],
        to: SocketAddrV4,
    ) -> io::Result<()> {
        let total = u16::try_from(20 + segment.len()).map_err(|_| io::ErrorKind::InvalidInput)?;
        let mut packet = Vec::with_capacity(usize::from(total));
        // Version 4, 5 words of header; no options. The kernel fills in
        // the identification and the header checksum.
        packet.extend_from_slice(&[0x45, 0]);
        packet.extend_from_slice(&total.to_be_bytes());
        packet.extend_from_slice(&[0, 0, 0x40, 0, 64, protocol, 0, 0]);
        packet.extend_from_slice(&src.octets());
        packet.extend_from_slice(&dst.octets());
        packet.extend_from_slice(segment);
        let sin = sockaddr_in(*to.ip(), 0);
        // SAFETY: `packet` and `sin` outlive the call, which reads
        // `packet.len()` bytes and a sockaddr_in.
        let n = unsafe {
            libc::sendto(
                self.0.as_raw_fd(),
                packet.as_ptr().cast(),
                packet.len(),
                0,
                (&raw const sin).cast(),
                size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// `ip:port` as the C socket calls take it.
pub(crate) fn sockaddr_in(ip: Ipv4Addr, port: u16) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    }
}

/// The Internet checksum (RFC 1071) of a UDP or TCP segment with its IPv4
/// pseudo-header.
fn transport_checksum(src: Ipv4Addr, dst: Ipv4Addr, protocol: u8, segment: &[u8]) -> u16 {
    let len = segment.len() as u32;
    let mut pseudo = [0u8; 12];
    pseudo[0..4].copy_from_slice(&src.octets());
    pseudo[4..8].copy_from_slice(&dst.octets());
    pseudo[9] = protocol;
    pseudo[10..12].copy_from_slice(&(len as u16).to_be_bytes());
    let mut sum: u32 = 0;
    for chunk in pseudo.chunks(2).chain(segment.chunks(2)) {
        let hi = u32::from(chunk[0]) << 8;
        sum += hi | chunk.get(1).map_or(0, |&b| u32::from(b));
    }
    while sum > 0xFFFF {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    !(sum as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_checksum_of_a_segment_with_its_own_checksum_is_zero() {
        let (a, b) = (Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2));
        let mut seg = vec![0x30, 0x39, 0x00, 0x35, 0x00, 0x0B, 0, 0, b'h', b'e', b'y'];
        let sum = transport_checksum(a, b, 17, &seg);
        seg[6..8].copy_from_slice(&sum.to_be_bytes());
        assert_eq!(transport_checksum(a, b, 17, &seg), 0);
    }

    #[test]
    fn a_forged_datagram_arrives_with_the_source_it_claims() {
        let Some(raw) = raw_socket_or_skip() else {
            return;
        };
        let rx = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let SocketAddr::V4(to) = rx.local_addr().expect("addr") else {
            panic!("not IPv4")
        };
        let from = SocketAddrV4::new(Ipv4Addr::new(127, 0, 0, 1), 4321);
        raw.udp(from, to, b"forged").expect("send");
        let mut buf = [0u8; 16];
        rx.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .expect("timeout");
        let (n, src) = rx.recv_from(&mut buf).expect("the datagram");
        assert_eq!((&buf[..n], src), (&b"forged"[..], SocketAddr::V4(from)));
    }
}
