//! The floor benchmark's transports: the rack (a config and its PKI) that
//! lets the donor listen on TCP, TLS and QUIC at once, client options per
//! transport, connection set-up times, and the time from a restarted
//! donor's ready line to its first served lookup over each transport.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use cluster_config::{Config, Transport};
use engram_protocol::{ROW_BYTES, TableDigest};
use inference_node::client::TlsClient;
use inference_node::tls::NodeTls;
use inference_node::{ClientOptions, DonorClient, Request};
use rack_harness::rack_toml::{
    DonorEntry, NodeEntry, RackToml, RouteEntry, TableEntry, TlsSection,
};
use rack_harness::{DonorProcess, rack_pki};
use serde::Serialize;

use super::{TABLES, Tables};
use crate::stats::{Latency, Summary};

/// The donor's name (its certificate's).
pub(super) const DONOR: &str = "bench-donor";
/// The bench's identity as a node.
const NODE: &str = "engram-bench";

/// A rack config for the run: the donor on loopback over TCP and every
/// secure transport asked for, and the bench as its node, with a PKI.
#[derive(Debug)]
pub(super) struct Rack {
    /// The config file.
    pub(super) config: PathBuf,
    parsed: Config,
}

impl Rack {
    /// Write the config and its PKI (for TLS and QUIC) in `dir`, the donor
    /// listening on `extra` addresses too (`rdma://IP:PORT`,
    /// `unix://PATH`); none when only plain TCP is measured.
    pub(super) fn write_with(
        dir: &Path,
        tables: &Tables,
        secure: &[Transport],
        extra: &[String],
    ) -> Result<Option<Self>> {
        if secure.is_empty() && extra.is_empty() {
            return Ok(None);
        }
        let mut rack = RackToml::new("bench");
        if !secure.is_empty() {
            rack.rack.tls = Some(TlsSection::default());
        }
        for (((id, _), (_, digest)), path) in TABLES.iter().zip(&tables.digests).zip(&tables.paths)
        {
            rack.table
                .push(TableEntry::new(*id, path, tables.rows, digest));
        }
        let listen = std::iter::once("tcp://127.0.0.1:0".to_string())
            .chain(secure.iter().map(|s| format!("{s}://127.0.0.1:0")))
            .chain(extra.iter().cloned());
        rack.donor.push(DonorEntry {
            ram_gib: 1024.0,
            ..DonorEntry::new(DONOR, listen, [1, 14])
        });
        let routes = TABLES.iter().map(|(id, _)| RouteEntry::new(*id, [DONOR]));
        rack.node.push(NodeEntry::new(NODE, routes.collect()));
        let config = dir.join("bench-rack.toml");
        rack.write(&config)?;
        let parsed = Config::load(&config).map_err(|e| anyhow::anyhow!("{e}"))?;
        if !secure.is_empty() {
            rack_pki(&config).context("making the run's rack PKI")?;
        }
        Ok(Some(Self { config, parsed }))
    }
}

/// The bench's client options over `transport` (for TLS and QUIC: its
/// certificate, freshly loaded, so no session is resumed from earlier).
pub(super) fn options(
    rack: Option<&Rack>,
    digests: &[(u32, TableDigest)],
    transport: Transport,
) -> Result<ClientOptions> {
    let mut opts = ClientOptions::new(NODE, digests.to_vec());
    opts.transport = transport;
    opts.lookup_timeout = crate::LOOKUP_TIMEOUT;
    if transport.is_secure() {
        let rack = rack.context("TLS and QUIC need the run's rack")?;
        let files = rack
            .parsed
            .tls_files(NODE)
            .context("the bench's certificate")?;
        opts.tls = Some(TlsClient {
            tls: NodeTls::load(&files)?,
            server_name: cluster_config::tls::server_name(DONOR)?,
        });
    }
    Ok(opts)
}

/// Connection set-up times over one transport.
#[derive(Debug, Serialize)]
pub(super) struct SetupResult {
    /// `tcp`, `tls` or `quic`.
    pub(super) transport: String,
    /// What a connection's set-up includes.
    pub(super) what: &'static str,
    /// Connections timed.
    pub(super) connects: usize,
    /// Their times.
    pub(super) summary: Summary,
}

/// Time `n` connections over each transport (connect, handshake, Hello,
/// Welcome): full handshakes (fresh client state each time), and for TLS
/// and QUIC also with the client's state reused (session resumption).
pub(super) fn setup_times(
    rt: &tokio::runtime::Runtime,
    donor: &DonorProcess,
    rack: Option<&Rack>,
    digests: &[(u32, TableDigest)],
    transports: &[Transport],
    n: usize,
) -> Result<Vec<SetupResult>> {
    let mut out = Vec::new();
    for &t in transports {
        let Some(addr) = donor.endpoint(t) else {
            continue;
        };
        let what = match t {
            Transport::Tcp => "TCP connect + Hello/Welcome",
            Transport::Tls => "TCP connect + TLS 1.3 full handshake + Hello/Welcome",
            Transport::Quic => "QUIC 1-RTT handshake + stream + Hello/Welcome",
            Transport::Rdma => continue,
        };
        // Fresh client state for every connection: full handshakes.
        let summary = time_connects(rt, addr, n, || options(rack, digests, t))?;
        out.push(SetupResult {
            transport: t.to_string(),
            what,
            connects: n,
            summary,
        });
        if t.is_secure() {
            // One client state throughout: resumed after the first.
            let opts = options(rack, digests, t)?;
            drop(rt.block_on(DonorClient::connect(addr, &opts))?);
            let summary = time_connects(rt, addr, n, || Ok(opts.clone()))?;
            out.push(SetupResult {
                transport: t.to_string(),
                what: match t {
                    Transport::Tls => "TLS 1.3 resumed (PSK) + Hello/Welcome",
                    _ => "QUIC 1-RTT, session resumed + stream + Hello/Welcome",
                },
                connects: n,
                summary,
            });
        }
    }
    Ok(out)
}

/// Time `n` connections to `addr` (connect to Welcome), each with the
/// options `opts` makes (made before its timing starts).
fn time_connects(
    rt: &tokio::runtime::Runtime,
    addr: std::net::SocketAddr,
    n: usize,
    mut opts: impl FnMut() -> Result<ClientOptions>,
) -> Result<Summary> {
    let mut lat = Latency::default();
    for _ in 0..n {
        let o = opts()?;
        let start = Instant::now();
        let c = rt.block_on(DonorClient::connect(addr, &o))?;
        lat.record(start.elapsed());
        drop(c);
    }
    Ok(lat.summary())
}

/// From a restarted donor's ready line to its first served lookup.
#[derive(Debug, Serialize)]
pub(super) struct RestartResult {
    /// `tcp`, `tls` or `quic`.
    pub(super) transport: String,
    /// Each restart's time, in milliseconds.
    pub(super) ms: Vec<f64>,
    /// Their median.
    pub(super) median_ms: f64,
}

/// Kill the donor with SIGKILL and start it again, `restarts` times per
/// transport; each time, connect and look up 24 rows over that transport
/// as soon as the ready line appears (retrying until it works), and time it.
pub(super) fn restart_times(
    rt: &tokio::runtime::Runtime,
    donor: &mut DonorProcess,
    serve_args: &[String],
    rack: Option<&Rack>,
    digests: &[(u32, TableDigest)],
    args: &super::FloorArgs,
    pinned: bool,
) -> Result<Vec<RestartResult>> {
    let (transports, restarts) = (&args.network(), args.restarts);
    let serve: Vec<&str> = serve_args.iter().map(String::as_str).collect();
    let rows: Vec<u64> = (0..24).collect();
    let mut out = Vec::new();
    // RDMA's restarts are not timed here (`rdma` measures what it can).
    for &t in transports.iter().filter(|t| t.is_stream()) {
        let mut ms = Vec::new();
        for _ in 0..restarts {
            let opts = options(rack, digests, t)?;
            donor.signal(libc::SIGKILL);
            donor.wait(Duration::from_secs(10));
            // Started from the servers' CPU, as the first donor was: it
            // inherits this thread's placement.
            let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
            if pinned && !super::pin_to(cpus - 1) {
                anyhow::bail!("cannot pin the restarted donor to CPU {}", cpus - 1);
            }
            let started = DonorProcess::start(&serve);
            if pinned && !super::pin_to(0) {
                anyhow::bail!("cannot pin the client back to CPU 0");
            }
            *donor = started?;
            let ready = Instant::now();
            let addr = donor.endpoint(t).context("the restarted donor's address")?;
            let mut buf = vec![0u8; rows.len() * ROW_BYTES];
            loop {
                let served = rt.block_on(async {
                    let c = DonorClient::connect(addr, &opts).await?;
                    c.lookup(
                        &[Request {
                            table: 1,
                            rows: &rows,
                        }],
                        &mut buf,
                    )
                    .await
                });
                if served.is_ok() {
                    break;
                }
                if ready.elapsed() > Duration::from_secs(30) {
                    anyhow::bail!("no lookup served over {t} 30 s after the ready line");
                }
            }
            ms.push(ready.elapsed().as_secs_f64() * 1e3);
        }
        let mut sorted = ms.clone();
        sorted.sort_by(f64::total_cmp);
        let median_ms = sorted.get(sorted.len() / 2).copied().unwrap_or(0.0);
        out.push(RestartResult {
            transport: t.to_string(),
            ms,
            median_ms,
        });
    }
    Ok(out)
}
