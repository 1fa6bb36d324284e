//! The QUIC floor: quinn itself moving the same bytes as a lookup, with
//! the project's QUIC settings (quinn's defaults, one bidirectional stream
//! per session, a current-thread runtime on the server as on the donor) and
//! nothing else: no frames, no rows, no access checks. What a donor over
//! QUIC costs above this is the donor's; what this costs above TCP's
//! floor is quinn's, which no donor built on it can undercut.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// What QUIC's UDP layer (quinn-udp) uses on this kernel.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub(crate) struct UdpOffloads {
    /// Segments one send may carry (GSO; 1: none).
    pub gso_segments: usize,
    /// Segments one receive may return (GRO; 1: none).
    pub gro_segments: usize,
    /// Datagrams one receive call may take (`recvmmsg`).
    pub recv_batch: usize,
}

/// Ask quinn-udp what it uses on a UDP socket of this host.
pub(super) fn offloads() -> Result<UdpOffloads> {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0")?;
    let state = quinn::udp::UdpSocketState::new((&socket).into())?;
    Ok(UdpOffloads {
        gso_segments: state.max_gso_segments(),
        gro_segments: state.gro_segments(),
        recv_batch: quinn::udp::BATCH_SIZE,
    })
}

/// The name in the floor's certificate.
const NAME: &str = "floor";

/// A certificate and key for the floor, made for the run, written as DER
/// to `dir` (`quic-floor.crt`, `quic-floor.key`); their paths.
pub(super) fn make_cert(dir: &Path) -> Result<(std::path::PathBuf, std::path::PathBuf)> {
    let key = rcgen::KeyPair::generate()?;
    let cert = rcgen::CertificateParams::new(vec![NAME.to_string()])?.self_signed(&key)?;
    let (c, k) = (dir.join("quic-floor.crt"), dir.join("quic-floor.key"));
    std::fs::write(&c, cert.der())?;
    std::fs::write(&k, key.serialize_der())?;
    Ok((c, k))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The project's QUIC transport settings that bear on a lookup's time.
fn transport() -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    t.max_concurrent_uni_streams(0u32.into());
    t
}

fn endpoint_config() -> quinn::EndpointConfig {
    quinn::EndpointConfig::default()
}

/// Serve the QUIC floor on 127.0.0.1 from a thread of its own (a
/// current-thread runtime); its address. Each stream: read a request (its
/// first 8 bytes give the request and answer sizes), write the answer.
pub(super) fn serve(cert: &Path, key: &Path) -> Result<SocketAddr> {
    let cert = CertificateDer::from(std::fs::read(cert).context("the QUIC floor's certificate")?);
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(
        std::fs::read(key).context("the QUIC floor's key")?,
    ));
    let tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_no_client_auth()
        .with_single_cert(vec![cert], key)?;
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(Arc::new(tls))?;
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    config.transport_config(Arc::new(transport()));
    let socket = std::net::UdpSocket::bind("127.0.0.1:0")?;
    let addr = socket.local_addr()?;
    let ec = endpoint_config();
    std::thread::spawn(move || {
        let rt = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                eprintln!("the QUIC floor cannot start a runtime: {e}");
                return;
            }
        };
        rt.block_on(async move {
            let endpoint =
                match quinn::Endpoint::new(ec, Some(config), socket, Arc::new(quinn::TokioRuntime))
                {
                    Ok(e) => e,
                    Err(e) => {
                        eprintln!("the QUIC floor cannot listen: {e}");
                        return;
                    }
                };
            while let Some(incoming) = endpoint.accept().await {
                tokio::spawn(async move {
                    let Ok(conn) = incoming.await else { return };
                    while let Ok((send, recv)) = conn.accept_bi().await {
                        tokio::spawn(answer(send, recv));
                    }
                });
            }
        });
    });
    Ok(addr)
}

/// Answer one stream's requests until it ends.
async fn answer(mut send: quinn::SendStream, mut recv: quinn::RecvStream) {
    // Large enough for a lookup's request and answer (the floor's sizes
    // are those of 24- and 48-row lookups).
    let mut buf = vec![0u8; 64 << 10];
    let answer = vec![0x5Au8; 64 << 10];
    loop {
        if recv.read_exact(&mut buf[..8]).await.is_err() {
            return;
        }
        let want = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        let len = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]) as usize;
        if want < 8 || want > buf.len() || len > answer.len() {
            return;
        }
        if recv.read_exact(&mut buf[8..want]).await.is_err()
            || send.write_all(&answer[..len]).await.is_err()
        {
            return;
        }
    }
}

/// A client of the QUIC floor: one stream, one request at a time.
pub(super) struct QuicFloorConn {
    _endpoint: quinn::Endpoint,
    _conn: quinn::Connection,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    req: Vec<u8>,
    resp: Vec<u8>,
}

impl QuicFloorConn {
    /// Connect to the floor at `addr`, trusting `cert`, for requests of
    /// `req_len` bytes answered with `resp_len`.
    pub(super) async fn connect(
        addr: SocketAddr,
        cert: &Path,
        req_len: usize,
        resp_len: usize,
    ) -> Result<Self> {
        if !(8..=64 << 10).contains(&req_len) || resp_len > 64 << 10 {
            bail!("QUIC floor sizes out of range: {req_len}, {resp_len}");
        }
        let mut roots = rustls::RootCertStore::empty();
        roots.add(CertificateDer::from(std::fs::read(cert)?))?;
        let tls = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(Arc::new(tls))?;
        let mut config = quinn::ClientConfig::new(Arc::new(crypto));
        config.transport_config(Arc::new(transport()));
        let socket = std::net::UdpSocket::bind("127.0.0.1:0")?;
        let endpoint = quinn::Endpoint::new(
            endpoint_config(),
            None,
            socket,
            Arc::new(quinn::TokioRuntime),
        )?;
        let conn = endpoint.connect_with(config, addr, NAME)?.await?;
        let (send, recv) = conn.open_bi().await?;
        let mut req = vec![0xA5u8; req_len];
        req[..4].copy_from_slice(&(req_len as u32).to_le_bytes());
        req[4..8].copy_from_slice(&(resp_len as u32).to_le_bytes());
        Ok(Self {
            _endpoint: endpoint,
            _conn: conn,
            send,
            recv,
            req,
            resp: vec![0; resp_len],
        })
    }

    /// One request and its answer, polling for it for up to `poll` (the
    /// stream once after each yield, as the project's client polls a
    /// QUIC stream), then waiting.
    pub(super) async fn one(
        &mut self,
        poll: Duration,
        pace: &mut super::pace::Pacer,
    ) -> Result<Duration> {
        use futures_util::FutureExt;
        let t = pace.start();
        self.send.write_all(&self.req).await?;
        let mut have = 0;
        while have < self.resp.len() {
            let rest = &mut self.resp[have..];
            if t.elapsed() >= poll {
                self.recv.read_exact(rest).await?;
                break;
            }
            match self.recv.read(rest).now_or_never() {
                Some(Ok(Some(n))) => have += n,
                Some(Ok(None)) => bail!("the QUIC floor closed its stream"),
                Some(Err(e)) => return Err(e.into()),
                None => tokio::task::yield_now().await,
            }
        }
        Ok(pace.took(t))
    }
}
