//! The donor's watchdog probe: before each `WATCHDOG=1`, the serving loop
//! asks the donor itself for one row of every table, over TCP, through its
//! own listener, connection thread and handler. A ping therefore means a
//! client would have been answered just now; a timer thread could not say
//! that. What it catches: a wedged runtime (the accept loop and this probe
//! share it), connection threads that cannot be started, and a handler
//! stuck on the tables' lock (a swap that never finishes). What it does not
//! catch: one client's connection thread stuck while others are fine (the
//! threads are independent by design; that client's own timeouts act).
//!
//! The probe keeps one connection (one of `max_connections`), reconnecting
//! when it is dropped; its lookups count in the donor's statistics like
//! any other (one per watchdog period, half of `WatchdogSec=`). When it
//! must reconnect while the donor is at its connection bound, the `Busy`
//! answer from the accept loop counts as alive: a full donor is not a
//! wedged one.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use crate::tls::DonorTls;

use engram_protocol::messages::{LookupSection, encode_lookup};
use engram_protocol::{ErrorCode, Frame, Hello, Limits, PROTOCOL_VERSION, TableInfo, decode};
use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Why a probe failed.
#[derive(Debug, Error)]
pub enum ProbeError {
    /// No answer in time.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The socket failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The donor answered with something other than what was asked.
    #[error("unexpected answer: {0}")]
    Answer(String),
    /// The donor is at its connection bound (its accept loop said so).
    #[error("the donor is at its connection bound")]
    Busy,
}

/// One row of every table, asked of the donor itself.
#[derive(Debug)]
pub struct SelfProbe {
    tls: Option<Arc<DonorTls>>,
    donor: String,
    addr: SocketAddr,
    name: String,
    credential: Option<Vec<u8>>,
    conn: Option<ProbeConn>,
    next_row: u64,
}

/// The probe's stream: plain TCP or TLS.
trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + std::fmt::Debug {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + std::fmt::Debug> Io for T {}

#[derive(Debug)]
struct ProbeConn {
    stream: Box<dyn Io>,
    buf: Vec<u8>,
    tables: Vec<TableInfo>,
    next_id: u64,
}

/// Largest answer the probe reads (Welcome or one row per table).
const MAX_ANSWER: usize = 1 << 20;

/// Where to reach a listener bound to `bound` from this machine.
pub fn reachable(bound: SocketAddr) -> SocketAddr {
    match bound.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => {
            SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), bound.port())
        }
        IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), bound.port())
        }
        _ => bound,
    }
}

impl SelfProbe {
    /// A probe of the listener at `addr` (as bound), saying `name` and
    /// `credential` in its Hello; over TLS with the donor's own
    /// certificate when `tls` is given (a TLS listener).
    pub fn new(
        addr: SocketAddr,
        name: &str,
        credential: Option<Vec<u8>>,
        tls: Option<Arc<DonorTls>>,
    ) -> Self {
        Self {
            tls,
            donor: name.to_string(),
            addr: reachable(addr),
            name: format!("{name}-watchdog"),
            credential,
            conn: None,
            next_row: 0,
        }
    }

    /// A new credential for later connections (a reload).
    pub fn set_credential(&mut self, credential: Option<Vec<u8>>) {
        self.credential = credential;
    }

    /// Ask for one row of every table, within `timeout`; a dropped
    /// connection is replaced once.
    pub async fn check(&mut self, timeout: Duration) -> Result<(), ProbeError> {
        let r = tokio::time::timeout(timeout, async {
            if self.conn.is_some() {
                match self.lookup().await {
                    Ok(()) => return Ok(()),
                    // The donor may have closed it (idle timeout, a swap):
                    // one fresh try, below.
                    Err(_) => self.conn = None,
                }
            }
            match self.connect().await {
                Err(ProbeError::Busy) => return Ok(()),
                Err(e) => return Err(e),
                Ok(()) => {}
            }
            self.lookup().await
        })
        .await;
        let r = r.unwrap_or(Err(ProbeError::Timeout(timeout)));
        if r.is_err() {
            self.conn = None;
        }
        r
    }

    async fn connect(&mut self) -> Result<(), ProbeError> {
        let tcp = TcpStream::connect(self.addr).await?;
        tcp.set_nodelay(true)?;
        let mut stream: Box<dyn Io> = match &self.tls {
            None => Box::new(tcp),
            Some(tls) => {
                let config = tls
                    .material()
                    .client_config(&[cluster_config::tls::ALPN])
                    .map_err(|e| ProbeError::Answer(e.to_string()))?;
                let name = cluster_config::tls::server_name(&self.donor)
                    .map_err(|e| ProbeError::Answer(e.to_string()))?;
                let s = tokio_rustls::TlsConnector::from(config)
                    .connect(name, tcp)
                    .await?;
                Box::new(s)
            }
        };
        let mut out = Vec::new();
        Hello {
            version: PROTOCOL_VERSION,
            node: &self.name,
            credential: self.credential.as_deref().unwrap_or_default(),
        }
        .encode(&mut out, 0)
        .map_err(|e| ProbeError::Answer(e.to_string()))?;
        stream.write_all(&out).await?;
        let mut conn = ProbeConn {
            stream,
            buf: Vec::with_capacity(4096),
            tables: Vec::new(),
            next_id: 1,
        };
        let tables = conn
            .answer(|f| match f {
                Frame::Welcome(w) => Ok(Some(w.tables().collect::<Vec<_>>())),
                Frame::Error(e) if e.code == ErrorCode::Busy => Ok(None),
                other => Err(describe(&other)),
            })
            .await?
            .ok_or(ProbeError::Busy)?;
        conn.tables = tables;
        self.conn = Some(conn);
        Ok(())
    }

    async fn lookup(&mut self) -> Result<(), ProbeError> {
        let row = self.next_row;
        self.next_row = self.next_row.wrapping_add(7919);
        let conn = self
            .conn
            .as_mut()
            .ok_or_else(|| ProbeError::Answer("not connected".into()))?;
        if conn.tables.is_empty() {
            return Ok(());
        }
        let rows: Vec<[u64; 1]> = conn.tables.iter().map(|t| [row % t.rows.max(1)]).collect();
        let sections: Vec<LookupSection<'_>> = conn
            .tables
            .iter()
            .zip(&rows)
            .map(|(t, r)| LookupSection {
                table_id: t.table_id,
                digest_prefix: t.digest.prefix(),
                rows: r,
            })
            .collect();
        let id = conn.next_id;
        conn.next_id += 1;
        let mut out = Vec::new();
        encode_lookup(&mut out, id, &sections).map_err(|e| ProbeError::Answer(e.to_string()))?;
        conn.stream.write_all(&out).await?;
        conn.answer(|f| match f {
            // Any section status is an answer from the serving path; a
            // mismatch (the table was swapped) only means: reconnect and
            // learn the new versions.
            Frame::Rows(r) if r.sections().all(|(s, _)| s.status.is_none()) => Ok(()),
            Frame::Rows(_) => Err("a section failed (a table was swapped)".into()),
            other => Err(describe(&other)),
        })
        .await
    }
}

fn describe(f: &Frame<'_>) -> String {
    match f {
        Frame::Error(e) => format!("error {}: {}", e.code, e.message),
        Frame::Goodbye(_) => "Goodbye (the donor drains)".into(),
        other => format!("{other:?}").chars().take(80).collect(),
    }
}

impl ProbeConn {
    /// Read one whole frame and hand it to `f`.
    async fn answer<T>(
        &mut self,
        f: impl FnOnce(Frame<'_>) -> Result<T, String>,
    ) -> Result<T, ProbeError> {
        let limits = Limits::default();
        loop {
            let decoded =
                decode(&self.buf, &limits).map_err(|e| ProbeError::Answer(e.to_string()))?;
            if let Some(d) = decoded {
                let len = d.len;
                let r = f(d.frame).map_err(ProbeError::Answer);
                self.buf.drain(..len);
                return r;
            }
            if self.buf.len() >= MAX_ANSWER {
                return Err(ProbeError::Answer("answer too large".into()));
            }
            let mut chunk = [0u8; 8192];
            let n = self.stream.read(&mut chunk).await?;
            if n == 0 {
                return Err(ProbeError::Answer("the donor closed the connection".into()));
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}
