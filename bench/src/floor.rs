//! `engram-bench floor`: the donor against the network floor, in one run.
//!
//! The floor is a raw blocking-socket ping-pong that moves exactly the
//! donor's request and answer sizes between two processes on loopback and
//! does nothing else. The donor series sends real lookups of random rows of
//! a table of at least 1 GiB through the project's client. Series alternate
//! within each round so that drift in the machine's state hits both alike;
//! the report gives medians over rounds and the donor/floor ratios.
//!
//! A second floor, for diagnosis, also gathers the requested rows from the
//! same tables in RAM (prefetched together, then copied, as the donor
//! does) before it answers: the least any server of these rows can do, so
//! that the donor's ratio to it is what its software adds.
//!
//! A third, the protocol's floor ([`proto`]), speaks the real protocol
//! with nothing beyond what PROTOCOL.md requires; the least protocol
//! client ([`raw`]) against it and against the donor splits the donor's
//! gap into what the protocol costs and what the donor adds.

mod host;
mod pace;
mod proto;
mod quic;
mod raw;
mod rdma;
mod report;
mod split;
mod transports;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use cluster_config::Transport;
use engram_protocol::messages::{
    LookupSection, RowsSection, begin_rows, encode_lookup, payload_checksum,
};
use engram_protocol::synthetic::{SplitMix64, first_mismatch};
use engram_protocol::{ROW_BYTES, TableDigest};
use inference_node::{DEFAULT_BUSY_POLL, DonorClient, Request};
use rack_harness::{DonorProcess, bin, gen_table};
use serde::Serialize;

use self::report::Report;
use crate::stats::{Latency, Summary, median_summary};

/// Settings of one floor run.
#[derive(Debug, Clone, clap::Args)]
pub struct FloorArgs {
    /// Rows per table (default: 1.03 GiB of rows).
    #[arg(long, default_value_t = 4_200_000)]
    rows_per_table: u64,
    /// Timed lookups per series per round.
    #[arg(long, default_value_t = 20_000)]
    lookups: usize,
    /// Untimed lookups before each series.
    #[arg(long, default_value_t = 2_000)]
    warmup: usize,
    /// Rounds (each runs every series once); medians are over rounds.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Where to write the tables (default: a temporary directory).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Do not pin the client and the servers to separate CPUs.
    #[arg(long)]
    no_pin: bool,
    /// Transports to measure, against plain TCP through the same client
    /// (TLS and QUIC: the donor gets a rack PKI made for the run; rdma: the
    /// node's CPU per lookup with the fake provider, and lookups on an RDMA
    /// device where there is one, else skipped with the reason).
    /// `unix`: the donor also listens on a host socket, and this process
    /// maps its tables through it (the node's host source), measured
    /// against the node's own local copy and the donor over loopback.
    #[arg(long, value_delimiter = ',', default_value = "tcp,tls,quic", value_parser = parse_transport)]
    transports: Vec<Via>,
    /// For `--transports rdma` on a host with an RDMA device: an IP address
    /// on the device for the donor's `rdma://` listener.
    #[arg(long)]
    rdma_addr: Option<std::net::IpAddr>,
    /// Connections opened per transport for the set-up times.
    #[arg(long, default_value_t = 50)]
    connects: usize,
    /// Donor restarts per transport for the ready-to-first-lookup times (0: none).
    #[arg(long, default_value_t = 3)]
    restarts: usize,
    /// Both servers poll before they sleep in a read, for this many
    /// microseconds: the donor (`--busy-poll-us`) and the floor server
    /// alike, so that with the polling clients both sides poll
    /// (like for like). 0: both servers block.
    #[arg(long, default_value_t = 0)]
    pub(crate) server_busy_poll_us: u64,
    /// Every series waits this long (spinning) from the end of one timed
    /// lookup to the start of its next, so that each server has been idle
    /// as long as every other before each request (docs/benchmarks.md,
    /// "The same pause before every lookup"). 0: back to back.
    #[arg(long, default_value_t = 10)]
    pub(crate) pause_us: u64,
    /// More arguments for the donor's `serve` (repeat the flag), e.g.
    /// `--donor-arg=--copy-tables` to serve a copy instead of the table
    /// files' pages.
    #[arg(long = "donor-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub(crate) donor_args: Vec<String>,
}

/// Arguments of the floor's server side.
#[derive(Debug, Clone, clap::Args)]
pub struct FloorServerArgs {
    /// Poll the socket for this many microseconds before a blocking read.
    #[arg(long, default_value_t = 0)]
    poll_us: u64,
    /// Table files to gather rows from, for requests that ask for it
    /// (loaded as the donor loads them, digests trusted).
    #[arg(long = "gather", value_name = "FILE")]
    gather: Vec<PathBuf>,
    /// Serve the QUIC floor too, with this certificate (DER)...
    #[arg(long, requires = "quic_key")]
    quic_cert: Option<PathBuf>,
    /// ...and its key (PKCS#8 DER).
    #[arg(long, requires = "quic_cert")]
    quic_key: Option<PathBuf>,
}

/// Set in a floor request's answer size: gather the rows it names.
const GATHER: u32 = 1 << 31;

/// Set in a floor request's answer size too: checksum the answer as a Rows
/// answer must carry one (XXH3-64 of every byte after the first 8, written
/// in the first 8), and the client checks it before the answer counts.
const CHECKSUM: u32 = 1 << 30;

/// Where a gathering request's rows start: after the request and answer
/// sizes and the row count (u32 each); then one u64 per row.
const GATHER_ROWS_AT: usize = 12;

/// How the floor reaches the donor: a network transport, or its host
/// socket (`unix`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// Over the network (loopback).
    Net(Transport),
    /// Through its host socket, its tables mapped.
    Unix,
}

impl std::fmt::Display for Via {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Net(t) => t.fmt(f),
            Self::Unix => f.write_str("unix"),
        }
    }
}

fn parse_transport(s: &str) -> Result<Via, String> {
    if s == "unix" {
        return Ok(Via::Unix);
    }
    Transport::parse(s)
        .map(Via::Net)
        .ok_or_else(|| format!("{s:?} is not one of tcp, tls, quic, rdma, unix"))
}

impl FloorArgs {
    /// The secure transports asked for, in a fixed order (TLS, then QUIC).
    fn secure(&self) -> Vec<Transport> {
        [Transport::Tls, Transport::Quic]
            .into_iter()
            .filter(|t| self.has(*t))
            .collect()
    }

    /// Whether network transport `t` was asked for.
    fn has(&self, t: Transport) -> bool {
        self.transports.contains(&Via::Net(t))
    }

    /// The network transports asked for.
    fn network(&self) -> Vec<Transport> {
        self.transports
            .iter()
            .filter_map(|v| match v {
                Via::Net(t) => Some(*t),
                Via::Unix => None,
            })
            .collect()
    }

    /// Whether the host socket was asked for.
    fn unix(&self) -> bool {
        self.transports.contains(&Via::Unix)
    }
}

const SEED: u64 = 2026;
const TABLES: [(u32, &str); 2] = [(1, "layer1.etab"), (14, "layer14.etab")];

/// Request and answer sizes of a lookup of `sections` x 24 rows, from the real encoders.
fn sizes(sections: usize) -> Result<(usize, usize)> {
    sizes_of(sections, 24)
}

/// Request and answer sizes of a lookup of `sections` x `per` rows.
fn sizes_of(sections: usize, per: usize) -> Result<(usize, usize)> {
    let rows: Vec<u64> = (0..per as u64).collect();
    let secs: Vec<LookupSection<'_>> = (0..sections)
        .map(|i| LookupSection {
            table_id: i as u32,
            digest_prefix: 0,
            rows: &rows,
        })
        .collect();
    let mut req = Vec::new();
    encode_lookup(&mut req, 1, &secs)?;
    let heads: Vec<RowsSection> = (0..sections)
        .map(|i| RowsSection {
            table_id: i as u32,
            status: None,
            row_count: per as u32,
            row_bytes: 0,
        })
        .collect();
    let mut ans = Vec::new();
    begin_rows(&mut ans, 1, &heads)?;
    Ok((req.len(), ans.len() + sections * per * ROW_BYTES))
}

/// The floor server: read a request (its first 8 bytes give the request and
/// answer sizes), write the answer; one thread per connection, blocking IO.
pub fn floor_server(args: &FloorServerArgs) -> Result<()> {
    let poll = Duration::from_micros(args.poll_us);
    let mut tables = Vec::new();
    for path in &args.gather {
        let opts = engram_store::resident::LoadOptions {
            trust_digest: true,
            ..Default::default()
        };
        let (t, _) = engram_store::resident::ResidentTable::load_with(None, path, &opts, |_| None)
            .with_context(|| format!("loading {}", path.display()))?;
        tables.push(t);
    }
    let tables = std::sync::Arc::new(tables);
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let quic = match (&args.quic_cert, &args.quic_key) {
        (Some(c), Some(k)) => format!(",quic://{}", quic::serve(c, k)?),
        _ => String::new(),
    };
    // The protocol's floor on a listener of its own.
    let proto = TcpListener::bind("127.0.0.1:0")?;
    let proto_addr = proto.local_addr()?;
    {
        let tables = std::sync::Arc::clone(&tables);
        std::thread::spawn(move || proto::serve(proto, tables, poll));
    }
    eprintln!("ready listen={},{proto_addr}{quic}", listener.local_addr()?);
    // Large enough for a bulk lookup's answer (16,384 rows, 4.3 MB).
    let answer = vec![0x5Au8; 8 << 20];
    for stream in listener.incoming() {
        let mut s = stream?;
        s.set_nodelay(true)?;
        let mut answer = answer.clone();
        let tables = std::sync::Arc::clone(&tables);
        std::thread::spawn(move || {
            // Large enough for a bulk lookup's request (16,384 row ids).
            let mut buf = vec![0u8; 256 << 10];
            loop {
                let mut have = 0;
                let mut want = usize::MAX;
                while have < want {
                    spin_until_readable(&s, poll);
                    match s.read(&mut buf[have..]) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => have += n,
                    }
                    if want == usize::MAX && have >= 8 {
                        want = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
                        if want < 8 || want > buf.len() {
                            return;
                        }
                    }
                }
                let resp = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]);
                let len = ((resp & !(GATHER | CHECKSUM)) as usize).min(answer.len());
                if resp & GATHER != 0 && gather(&tables, &buf[..want], &mut answer[..len]).is_none()
                {
                    return;
                }
                if resp & CHECKSUM != 0 && len >= 8 {
                    let sum = payload_checksum(&answer[8..len]);
                    answer[..8].copy_from_slice(&sum.to_le_bytes());
                }
                if s.write_all(&answer[..len]).is_err() {
                    return;
                }
            }
        });
    }
    Ok(())
}

/// Gather the rows `request` names into the tail of `answer` (rows
/// `24 i .. 24 i + 24` from table `i`, round robin): every row prefetched
/// first, then copied, as the donor does. `None` for a request that does
/// not fit or names a row out of range.
fn gather(
    tables: &[engram_store::resident::ResidentTable],
    request: &[u8],
    answer: &mut [u8],
) -> Option<()> {
    let word = |at: usize, n: usize| request.get(at..at + n);
    let k = u32::from_le_bytes(word(8, 4)?.try_into().ok()?) as usize;
    let ids = word(GATHER_ROWS_AT, k.checked_mul(8)?)?;
    let start = answer.len().checked_sub(k.checked_mul(ROW_BYTES)?)?;
    if tables.is_empty() {
        return None;
    }
    let row = |i: usize| {
        let id = u64::from_le_bytes(ids[i * 8..i * 8 + 8].try_into().unwrap_or_default());
        (&tables[(i / 24) % tables.len()], id)
    };
    // Every row prefetched first (as the donor does) up to a window's
    // worth; a longer request keeps the window ahead of the copies.
    for i in 0..k.min(PREFETCH_AHEAD) {
        let (t, id) = row(i);
        t.prefetch(id);
    }
    for i in 0..k {
        if i + PREFETCH_AHEAD < k {
            let (t, id) = row(i + PREFETCH_AHEAD);
            t.prefetch(id);
        }
        let (t, id) = row(i);
        t.row(id)?
            .write_to(&mut answer[start + i * ROW_BYTES..][..ROW_BYTES]);
    }
    Some(())
}

/// Rows a gather prefetches ahead of the one it copies.
const PREFETCH_AHEAD: usize = 64;

/// Check `s` without sleeping (`recv` with `MSG_PEEK | MSG_DONTWAIT`) for
/// up to `budget`, as the donor's busy-poll mode does, before a read.
fn spin_until_readable(s: &TcpStream, budget: Duration) {
    use std::os::fd::AsRawFd;
    if budget.is_zero() {
        return;
    }
    let t = Instant::now();
    let mut probe = [0u8; 1];
    while t.elapsed() < budget {
        // SAFETY: recv writes at most one byte into `probe` (peeked, not consumed).
        let n = unsafe {
            libc::recv(
                s.as_raw_fd(),
                probe.as_mut_ptr().cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        if n >= 0 {
            return;
        }
        std::hint::spin_loop();
    }
}

/// One `recv` that does not wait (`MSG_DONTWAIT`): bytes read, 0 at the
/// peer's close, negative when nothing is there (or on an error).
fn recv_now(s: &TcpStream, buf: &mut [u8]) -> isize {
    use std::os::fd::AsRawFd;
    // SAFETY: recv writes at most buf.len() bytes into buf.
    unsafe {
        libc::recv(
            s.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    }
}

/// `s` (a second handle to its socket, non-blocking) registered with
/// `rt`'s reactor, for a client that sleeps in the runtime.
fn in_runtime(s: &TcpStream, rt: &tokio::runtime::Runtime) -> Result<tokio::net::TcpStream> {
    let s = s.try_clone()?;
    s.set_nonblocking(true)?;
    let _in = rt.enter();
    Ok(tokio::net::TcpStream::from_std(s)?)
}

/// One blocking ping-pong connection to the floor server.
struct FloorConn {
    s: TcpStream,
    req: Vec<u8>,
    resp: Vec<u8>,
    /// Poll with non-blocking reads for up to this long before blocking.
    poll: Duration,
    /// Ask the server to gather this many random rows below this bound
    /// (and check them); `None`: move bytes only.
    gather: Option<(usize, u64, SplitMix64)>,
    /// The row ids of the gathering request being timed.
    asked: Vec<u64>,
    /// Check the answer's checksum ([`CHECKSUM`]) inside the timing.
    checksum: bool,
    /// Lookups so far: the rows are checked on every 16th, outside the
    /// timing, as the donor series check theirs (so that the client's CPU
    /// per lookup compares like for like).
    n: u64,
    /// The same socket registered with the bench's runtime, for
    /// [`FloorConn::one_in_runtime`].
    runtime: Option<tokio::net::TcpStream>,
}

impl FloorConn {
    fn new(addr: SocketAddr, req_len: usize, resp_len: usize, poll: Duration) -> Result<Self> {
        let s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        let mut req = vec![0xA5u8; req_len];
        req[..4].copy_from_slice(&(req_len as u32).to_le_bytes());
        req[4..8].copy_from_slice(&(resp_len as u32).to_le_bytes());
        Ok(Self {
            s,
            req,
            resp: vec![0u8; resp_len],
            poll,
            gather: None,
            asked: Vec::new(),
            checksum: false,
            n: 0,
            runtime: None,
        })
    }

    /// Register the socket with `rt` for [`Self::one_in_runtime`].
    fn in_runtime(mut self, rt: &tokio::runtime::Runtime) -> Result<Self> {
        self.runtime = Some(in_runtime(&self.s, rt)?);
        Ok(self)
    }

    /// The server checksums each answer and the client checks it, as the
    /// protocol requires of any server and client of these rows.
    fn checksummed(mut self) -> Self {
        let resp = u32::from_le_bytes([self.req[4], self.req[5], self.req[6], self.req[7]]);
        self.req[4..8].copy_from_slice(&(resp | CHECKSUM).to_le_bytes());
        self.checksum = true;
        self
    }

    /// The same sizes, the server gathering `rows` random rows of tables of
    /// `rows_per_table` into each answer.
    fn gathering(mut self, rows: usize, rows_per_table: u64, seed: u64) -> Result<Self> {
        if rows > BULK_ROWS
            || GATHER_ROWS_AT + rows * 8 > self.req.len()
            || rows * ROW_BYTES > self.resp.len()
        {
            bail!("a gathering floor request of {rows} rows does not fit the lookup's sizes");
        }
        let resp = self.resp.len() as u32 | GATHER;
        self.req[4..8].copy_from_slice(&resp.to_le_bytes());
        self.req[8..12].copy_from_slice(&(rows as u32).to_le_bytes());
        self.gather = Some((rows, rows_per_table, SplitMix64::new(seed)));
        self.asked = vec![0; rows];
        Ok(self)
    }

    fn one(&mut self, pace: &mut pace::Pacer) -> Result<Duration> {
        let t = self.begin(pace);
        self.s.write_all(&self.req)?;
        let mut have = 0;
        while have < self.resp.len() && t.elapsed() < self.poll {
            match recv_now(&self.s, &mut self.resp[have..]) {
                0 => bail!("floor server closed the connection"),
                n if n > 0 => have += n as usize,
                _ => std::hint::spin_loop(),
            }
        }
        self.s.read_exact(&mut self.resp[have..])?;
        self.end(t, pace)
    }

    /// [`Self::one`] through the runtime's socket, on the runtime: the
    /// client sleeps in its reactor, as an async client that watches
    /// several sockets and timers must.
    async fn one_in_runtime(&mut self, pace: &mut pace::Pacer) -> Result<Duration> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let t = self.begin(pace);
        let s = self
            .runtime
            .as_mut()
            .context("the floor connection is not in the runtime")?;
        s.write_all(&self.req).await?;
        s.read_exact(&mut self.resp).await?;
        self.end(t, pace)
    }

    /// Draw the rows of a gathering request (outside the timing), then
    /// start the timing.
    fn begin(&mut self, pace: &mut pace::Pacer) -> Instant {
        if let Some((rows, bound, rng)) = self.gather.as_mut() {
            for (i, id) in self.asked.iter_mut().take(*rows).enumerate() {
                *id = rng.below(*bound);
                let at = GATHER_ROWS_AT + i * 8;
                self.req[at..at + 8].copy_from_slice(&id.to_le_bytes());
            }
        }
        pace.start()
    }

    /// The answer is in: check its checksum (when asked to), end the
    /// timing, and check its rows on every 16th lookup.
    fn end(&mut self, t: Instant, pace: &mut pace::Pacer) -> Result<Duration> {
        if self.checksum {
            let sum = u64::from_le_bytes(self.resp[..8].try_into().unwrap_or_default());
            if payload_checksum(&self.resp[8..]) != sum {
                bail!("the floor's answer failed its checksum");
            }
        }
        let took = pace.took(t);
        self.n += 1;
        let check = self.n.is_multiple_of(CHECK_EVERY);
        if let Some(&(rows, ..)) = self.gather.as_ref().filter(|_| check) {
            let at = self.resp.len() - rows * ROW_BYTES;
            for (s, ids) in self.asked[..rows].chunks(24).enumerate() {
                let bytes = &self.resp[at + s * 24 * ROW_BYTES..][..ids.len() * ROW_BYTES];
                if let Some(r) = first_mismatch(SEED, TABLES[s % TABLES.len()].0, ids, bytes) {
                    bail!("the gathering floor returned a wrong row: row {r}");
                }
            }
        }
        Ok(took)
    }
}

/// Random lookups through the client, every answer checked against the generator.
struct DonorSeries {
    /// Row ids per section (24, or [`BULK_ROWS`] for the bulk series).
    per: usize,
    ids: Vec<Vec<u64>>,
    out: Vec<u8>,
    rows_per_table: u64,
    rng: SplitMix64,
    n: u64,
}

impl DonorSeries {
    fn new(sections: usize, per: usize, rows_per_table: u64, seed: u64) -> Self {
        Self {
            per,
            ids: vec![vec![0; per]; sections],
            out: vec![0u8; sections * per * ROW_BYTES],
            rows_per_table,
            rng: SplitMix64::new(seed),
            n: 0,
        }
    }

    async fn one(&mut self, client: &DonorClient, pace: &mut pace::Pacer) -> Result<Duration> {
        for v in &mut self.ids {
            v.iter_mut()
                .for_each(|r| *r = self.rng.below(self.rows_per_table));
        }
        let reqs: Vec<Request<'_>> = self
            .ids
            .iter()
            .zip(TABLES)
            .map(|(rows, (table, _))| Request { table, rows })
            .collect();
        let t = pace.start();
        client.lookup(&reqs, &mut self.out).await?;
        let elapsed = pace.took(t);
        // Check answers outside the timed window (every 16th lookup).
        self.n += 1;
        if self.n.is_multiple_of(CHECK_EVERY) {
            for (s, rows) in self.ids.iter().enumerate() {
                let layer = TABLES[s].0;
                let bytes = &self.out[s * self.per * ROW_BYTES..(s + 1) * self.per * ROW_BYTES];
                if let Some(r) = first_mismatch(SEED, layer, rows, bytes) {
                    bail!("donor returned a wrong row: table {layer} row {r}");
                }
            }
        }
        Ok(elapsed)
    }
}

/// Pin the calling thread (and processes it starts afterwards) to one CPU.
pub(crate) fn pin_to(cpu: usize) -> bool {
    // SAFETY: cpu_set_t is plain data; sched_setaffinity reads it and touches nothing else.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    /// The floor, its client polling for this long before blocking.
    Floor(Duration),
    /// The floor gathering the rows, its client polling as above.
    Gathering(Duration),
    /// The floor gathering the rows and checksumming its answers, the
    /// client checking them, polling as above.
    GatheringSummed(Duration),
    /// The donor through `clients[i]`.
    Donor(usize),
    /// The donor through the least client the protocol allows
    /// ([`raw::RawDonorConn`]), polling for this long before blocking.
    RawDonor(Duration),
    /// The same least client on the bench's runtime, sleeping in its
    /// reactor ([`raw::RawDonorConn::one_in_runtime`]).
    RawDonorInRuntime,
    /// The floor gathering the rows, its client on the bench's runtime,
    /// sleeping in its reactor ([`FloorConn::one_in_runtime`]).
    GatheringInRuntime,
    /// quinn itself moving the same bytes, its client polling like the
    /// project's.
    QuicFloor,
    /// The least protocol client against the protocol's floor
    /// ([`proto`]), polling for this long before blocking.
    ProtoFloor(Duration),
}

struct Series {
    kind: Kind,
    floor: Option<FloorConn>,
    quic: Option<quic::QuicFloorConn>,
    raw: Option<raw::RawDonorConn>,
    donor: DonorSeries,
    /// This series runs one lookup for every `share` of the others (the
    /// bulk series: each moves 4.3 MB).
    share: usize,
    /// The process that answers this series (the floor server or the donor).
    server_pid: u32,
    /// Its timed chunks' CPU and wake-up time, both ends.
    split: split::Split,
    /// The same pause before each of its lookups as before every other
    /// series' ([`pace`]).
    pacer: pace::Pacer,
    result: SeriesResult,
}

impl Series {
    fn run(
        &mut self,
        n: usize,
        rt: &tokio::runtime::Runtime,
        clients: &[DonorClient],
        lat: &mut Latency,
    ) -> Result<usize> {
        let n = n.div_ceil(self.share);
        self.pacer.begin();
        match (self.kind, self.floor.as_mut()) {
            (Kind::Floor(_) | Kind::Gathering(_) | Kind::GatheringSummed(_), Some(f)) => {
                for _ in 0..n {
                    lat.record(f.one(&mut self.pacer)?);
                }
                Ok(n)
            }
            (Kind::RawDonor(_) | Kind::ProtoFloor(_), _) => {
                let r = self
                    .raw
                    .as_mut()
                    .context("raw client series without a connection")?;
                for _ in 0..n {
                    lat.record(r.one(&mut self.pacer)?);
                }
                Ok(n)
            }
            (Kind::GatheringInRuntime, Some(f)) => rt.block_on(async {
                for _ in 0..n {
                    lat.record(f.one_in_runtime(&mut self.pacer).await?);
                }
                Ok(n)
            }),
            (Kind::RawDonorInRuntime, _) => {
                let (r, pace) = (
                    self.raw
                        .as_mut()
                        .context("raw client series without a connection")?,
                    &mut self.pacer,
                );
                rt.block_on(async {
                    for _ in 0..n {
                        lat.record(r.one_in_runtime(pace).await?);
                    }
                    Ok(n)
                })
            }
            (Kind::Donor(i), _) => {
                let (d, c, pace) = (&mut self.donor, &clients[i], &mut self.pacer);
                rt.block_on(async {
                    for _ in 0..n {
                        lat.record(d.one(c, pace).await?);
                    }
                    Ok(n)
                })
            }
            (Kind::QuicFloor, _) => {
                let q = self
                    .quic
                    .as_mut()
                    .context("QUIC floor series without a connection")?;
                let pace = &mut self.pacer;
                rt.block_on(async {
                    for _ in 0..n {
                        lat.record(q.one(DEFAULT_BUSY_POLL, pace).await?);
                    }
                    Ok(n)
                })
            }
            (
                Kind::Floor(_)
                | Kind::Gathering(_)
                | Kind::GatheringSummed(_)
                | Kind::GatheringInRuntime,
                None,
            ) => {
                bail!("floor series without a connection")
            }
        }
    }
}

#[derive(Debug, Serialize)]
struct SeriesResult {
    series: String,
    rows: usize,
    request_bytes: usize,
    answer_bytes: usize,
    rounds: Vec<Summary>,
    median: Summary,
    /// Where its lookups' time went, both ends (means over all rounds).
    split: Option<split::PerLookup>,
    /// The share of its lookups that started later than the pause after
    /// the last, its own work between lookups being longer ([`pace`]).
    pause_overran: f64,
}

/// Run the floor benchmark.
pub fn run(args: &FloorArgs) -> Result<()> {
    crate::rack::kill_children_on_interrupt()?;
    let tmp = tempfile::tempdir()?;
    let tables = generate_tables(args, tmp.path())?;
    let secure = args.secure();
    let socket = tmp.path().join("donor.sock");
    let extra = if args.unix() {
        vec![format!("unix://{}", socket.display())]
    } else {
        Vec::new()
    };
    let rack = transports::Rack::write_with(tmp.path(), &tables, &secure, &extra)?;
    let quic_cert = if args.has(Transport::Quic) {
        Some(quic::make_cert(tmp.path())?)
    } else {
        None
    };
    let mut servers = Servers::start(
        &tables,
        rack.as_ref(),
        args.no_pin,
        args.server_busy_poll_us,
        &args.donor_args,
        quic_cert.as_ref(),
    )?;
    let pinned = servers.pinned;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let clients = connect_clients(&rt, &servers.donor, rack.as_ref(), &tables.digests, &secure)?;
    let series = series_for(&rt, &servers, quic_cert.as_ref(), &tables, args, &secure)?;
    let results = measure(series, args, &rt, &clients)?;
    drop(clients);
    let host = if args.unix() {
        Some(host::run(&socket, &tables, args)?)
    } else {
        None
    };
    let (setup, restart, rdma) =
        connection_costs(&rt, &mut servers, rack.as_ref(), &tables, args, tmp.path())?;
    let (donor, clean) = servers.stop();
    let mut ratios = report::ratios(&results, &secure);
    if let Some(h) = &host {
        ratios.extend(report::host_ratios(h, &results, &secure));
    }
    let report = Report {
        args,
        gib: tables.gib,
        pinned,
        results,
        ratios,
        setup,
        restart,
        clean,
        rdma,
        host,
        udp: if args.has(Transport::Quic) {
            Some(quic::offloads()?)
        } else {
            None
        },
    };
    if args.json {
        return report.print_json();
    }
    report.print_text(&donor);
    Ok(())
}

/// Every series' connection to its server, made.
fn series_for(
    rt: &tokio::runtime::Runtime,
    servers: &Servers,
    quic_cert: Option<&(PathBuf, PathBuf)>,
    tables: &Tables,
    args: &FloorArgs,
    secure: &[Transport],
) -> Result<Vec<Series>> {
    let quic_floor = match (quic_cert, servers.floor.endpoint(Transport::Quic)) {
        (Some((cert, _)), Some(addr)) => Some((addr, cert.as_path())),
        _ => None,
    };
    let donor_tcp = servers
        .donor
        .endpoint(Transport::Tcp)
        .context("the donor does not listen on tcp")?;
    // The floor server's second plain listener.
    let proto = servers
        .floor
        .endpoints
        .iter()
        .filter(|e| e.transport == Transport::Tcp)
        .nth(1)
        .map(|e| e.addr)
        .context("the floor server announced no protocol's floor")?;
    build_series(
        rt,
        Pids {
            floor: servers.floor.id(),
            donor: servers.donor.id(),
        },
        (servers.floor.addr, proto),
        (donor_tcp, &tables.digests),
        quic_floor,
        args.rows_per_table,
        secure,
    )
}

/// What a connection costs beyond its lookups: set-up per transport, a
/// restarted donor's first lookup, and (`--transports rdma`) the RDMA
/// series.
fn connection_costs(
    rt: &tokio::runtime::Runtime,
    servers: &mut Servers,
    rack: Option<&transports::Rack>,
    tables: &Tables,
    args: &FloorArgs,
    tmp: &Path,
) -> Result<(
    Vec<transports::SetupResult>,
    Vec<transports::RestartResult>,
    Option<rdma::RdmaReport>,
)> {
    let pinned = servers.pinned;
    let setup = transports::setup_times(
        rt,
        &servers.donor,
        rack,
        &tables.digests,
        &args.network(),
        args.connects,
    )?;
    let restart = transports::restart_times(
        rt,
        &mut servers.donor,
        &servers.serve_args,
        rack,
        &tables.digests,
        args,
        pinned,
    )?;
    let rdma = if args.has(Transport::Rdma) {
        Some(rdma::run(rt, tmp, tables, &servers.donor, args)?)
    } else {
        None
    };
    Ok((setup, restart, rdma))
}

/// The tables the donor serves.
pub(crate) struct Tables {
    /// Size of each table in GiB.
    gib: f64,
    /// `(table id, digest)` of each, as the clients pin them.
    digests: Vec<(u32, TableDigest)>,
    /// `ID=PATH` of each, for the donor's `--table`.
    table_args: Vec<String>,
    /// Each table's file.
    paths: Vec<PathBuf>,
    /// Rows per table.
    rows: u64,
}

/// Generate the tables in `--dir`, or in `tmp` without one.
fn generate_tables(args: &FloorArgs, tmp: &Path) -> Result<Tables> {
    let dir = args.dir.clone().unwrap_or_else(|| tmp.to_path_buf());
    std::fs::create_dir_all(&dir)?;
    let gib = (args.rows_per_table * ROW_BYTES as u64) as f64 / (1u64 << 30) as f64;
    eprintln!(
        "generating 2 tables of {} rows ({gib:.2} GiB each) in {}",
        args.rows_per_table,
        dir.display()
    );
    let mut digests: Vec<(u32, TableDigest)> = Vec::new();
    let mut table_args = Vec::new();
    let mut paths = Vec::new();
    for (id, name) in TABLES {
        let (path, digest) = gen_table(&dir, name, id, args.rows_per_table, SEED)?;
        digests.push((id, digest));
        table_args.push(format!("{id}={}", path.display()));
        paths.push(path);
    }
    Ok(Tables {
        gib,
        digests,
        table_args,
        paths,
        rows: args.rows_per_table,
    })
}

/// The donor and the floor server, each a child process.
struct Servers {
    floor: DonorProcess,
    donor: DonorProcess,
    /// The donor's `serve` arguments (to restart it).
    serve_args: Vec<String>,
    /// Whether the servers run on the last CPU and this thread on CPU 0.
    pinned: bool,
}

impl Servers {
    /// Start the donor on `tables` (from `rack`'s config when there is
    /// one: TCP, TLS and QUIC) and the floor server, then pin this thread
    /// (unless `no_pin`).
    fn start(
        tables: &Tables,
        rack: Option<&transports::Rack>,
        no_pin: bool,
        busy_poll_us: u64,
        extra: &[String],
        quic_cert: Option<&(PathBuf, PathBuf)>,
    ) -> Result<Self> {
        let config;
        let mut serve_args: Vec<&str> = match rack {
            Some(r) => {
                config = r.config.display().to_string();
                vec!["--config", config.as_str(), "--name", transports::DONOR]
            }
            None => vec!["--listen", "127.0.0.1:0", "--name", transports::DONOR],
        };
        if rack.is_none() {
            for t in &tables.table_args {
                serve_args.extend(["--table", t.as_str()]);
            }
        }
        let poll = busy_poll_us.to_string();
        if busy_poll_us > 0 {
            serve_args.extend(["--busy-poll-us", poll.as_str()]);
        }
        serve_args.extend(extra.iter().map(String::as_str));
        // Servers on the last CPU, the client on the first: the same placement
        // for the floor and the donor, run after run.
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let pinned = !no_pin && cpus >= 2 && pin_to(cpus - 1);
        eprintln!("starting the donor and the floor server");
        let donor = DonorProcess::start(&serve_args)?;
        let serve_args: Vec<String> = serve_args.iter().map(|a| a.to_string()).collect();
        let mut floor_cmd = Command::new(bin("engram-bench"));
        floor_cmd.args(["floor-server", "--poll-us", poll.as_str()]);
        for p in &tables.paths {
            floor_cmd.arg("--gather").arg(p);
        }
        if let Some((cert, key)) = quic_cert {
            floor_cmd
                .arg("--quic-cert")
                .arg(cert)
                .arg("--quic-key")
                .arg(key);
        }
        let floor = DonorProcess::spawn(floor_cmd)?;
        if pinned && !pin_to(0) {
            bail!("cannot pin the client to CPU 0");
        }
        Ok(Self {
            floor,
            donor,
            serve_args,
            pinned,
        })
    }

    /// Stop both; the donor comes back for its log, with whether it exited cleanly on SIGTERM.
    fn stop(self) -> (DonorProcess, bool) {
        let Self {
            floor, mut donor, ..
        } = self;
        donor.signal(libc::SIGTERM);
        let clean = donor
            .wait(Duration::from_secs(10))
            .is_some_and(|s| s.success());
        drop(floor);
        (donor, clean)
    }
}

/// Connect the clients to the donor: TCP `[polling, not polling]`, then
/// one project client (polling) per transport of `secure`.
fn connect_clients(
    rt: &tokio::runtime::Runtime,
    donor: &DonorProcess,
    rack: Option<&transports::Rack>,
    digests: &[(u32, TableDigest)],
    secure: &[Transport],
) -> Result<Vec<DonorClient>> {
    let connect = |transport: Transport, busy_poll: Duration| {
        let mut opts = transports::options(rack, digests, transport)?;
        opts.busy_poll = busy_poll;
        let addr = donor
            .endpoint(transport)
            .with_context(|| format!("the donor does not listen on {transport}"))?;
        rt.block_on(DonorClient::connect(addr, &opts))
            .with_context(|| format!("connecting to the donor over {transport}"))
    };
    // The project's client as it comes (polling, DEFAULT_BUSY_POLL), and
    // with polling off; the floor's client blocking (the baseline) and
    // polling alike, so that each way of waiting has its like to compare.
    let mut clients = vec![
        connect(Transport::Tcp, DEFAULT_BUSY_POLL)?,
        connect(Transport::Tcp, Duration::ZERO)?,
    ];
    for &t in secure {
        clients.push(connect(t, DEFAULT_BUSY_POLL)?);
    }
    Ok(clients)
}

/// The series, in the order [`ratios`] reads them: per size (24 rows, then
/// 48), floor blocking, floor polling, donor, donor not polling, the
/// gathering floor blocking and polling, the donor over each transport of
/// `secure`, the QUIC floor with QUIC, the donor through the least
/// protocol client blocking and polling, the floor gathering and
/// checksumming blocking and polling, the least protocol client against
/// the protocol's floor ([`proto`]) blocking and polling, the donor
/// through the least protocol client sleeping in the runtime, the
/// gathering floor, its client sleeping in the runtime, then the first of
/// these again.
fn build_series(
    rt: &tokio::runtime::Runtime,
    pids: Pids,
    (floor, proto): (SocketAddr, SocketAddr),
    (donor, digests): (SocketAddr, &[(u32, TableDigest)]),
    quic_floor: Option<(SocketAddr, &Path)>,
    rows_per_table: u64,
    secure: &[Transport],
) -> Result<Vec<Series>> {
    let to = Endpoints {
        rt,
        pids,
        floor,
        proto,
        donor,
        digests,
        quic_floor,
        rows_per_table,
    };
    let mut series: Vec<Series> = Vec::new();
    for sections in [1usize, 2] {
        for (kind, name) in kinds(secure, quic_floor.is_some()) {
            let seed = 7 + series.len() as u64;
            series.push(to.series(kind, &name, sections, seed)?);
        }
    }
    // Bulk: one connection's 16,384-row lookup against a raw ping-pong of
    // the same bytes (unshaped loopback).
    let (req, ans) = sizes_of(1, BULK_ROWS)?;
    for (kind, name) in [
        (Kind::Floor(Duration::ZERO), "floor, blocking client"),
        (Kind::Donor(0), "donor, project client"),
        (
            Kind::Gathering(Duration::ZERO),
            "floor gathering rows, blocking client",
        ),
    ] {
        let seed = 7 + series.len() as u64;
        series.push(Series {
            kind,
            floor: match kind {
                Kind::Floor(poll) => Some(FloorConn::new(floor, req, ans, poll)?),
                Kind::Gathering(poll) => Some(FloorConn::new(floor, req, ans, poll)?.gathering(
                    BULK_ROWS,
                    rows_per_table,
                    seed,
                )?),
                Kind::Donor(_)
                | Kind::QuicFloor
                | Kind::RawDonor(_)
                | Kind::RawDonorInRuntime
                | Kind::GatheringInRuntime
                | Kind::GatheringSummed(_)
                | Kind::ProtoFloor(_) => None,
            },
            quic: None,
            raw: None,
            donor: DonorSeries::new(1, BULK_ROWS, rows_per_table, seed),
            share: BULK_SHARE,
            server_pid: pids.serving(kind),
            split: split::Split::default(),
            pacer: pace::Pacer::new(Duration::ZERO),
            result: SeriesResult {
                series: format!("{name}, {BULK_ROWS} rows (bulk)"),
                rows: BULK_ROWS,
                request_bytes: req,
                answer_bytes: ans,
                rounds: Vec::new(),
                median: Summary::default(),
                split: None,
                pause_overran: 0.0,
            },
        });
    }
    Ok(series)
}

/// The kinds of series measured at each size, with their names.
fn kinds(secure: &[Transport], quic_floor: bool) -> Vec<(Kind, String)> {
    let mut kinds = vec![
        (
            Kind::Floor(Duration::ZERO),
            "floor, blocking client".to_string(),
        ),
        (
            Kind::Floor(DEFAULT_BUSY_POLL),
            "floor, polling client".to_string(),
        ),
        (Kind::Donor(0), "donor, project client".to_string()),
        (Kind::Donor(1), "donor, client not polling".to_string()),
        (
            Kind::Gathering(Duration::ZERO),
            "floor gathering rows, blocking client".to_string(),
        ),
        (
            Kind::Gathering(DEFAULT_BUSY_POLL),
            "floor gathering rows, polling client".to_string(),
        ),
    ];
    for (i, t) in secure.iter().enumerate() {
        kinds.push((
            Kind::Donor(2 + i),
            format!("donor over {t}, project client"),
        ));
    }
    if quic_floor {
        kinds.push((Kind::QuicFloor, "QUIC floor (quinn), polling client".into()));
    }
    // Blocking, then polling: `@` in a name is the way it waits.
    type Waits = fn(Duration) -> Kind;
    let pairs: [(Waits, &str); 3] = [
        (Kind::RawDonor, "donor, least protocol client @"),
        (
            Kind::GatheringSummed,
            "floor gathering and checksumming rows, @ client",
        ),
        (
            Kind::ProtoFloor,
            "protocol's floor, least protocol client @",
        ),
    ];
    for (kind, name) in pairs {
        for (poll, word) in [(Duration::ZERO, "blocking"), (DEFAULT_BUSY_POLL, "polling")] {
            kinds.push((kind(poll), name.replace('@', word)));
        }
    }
    kinds.push((
        Kind::RawDonorInRuntime,
        "donor, least protocol client sleeping in the runtime".to_string(),
    ));
    kinds.push((
        Kind::GatheringInRuntime,
        "floor gathering rows, client sleeping in the runtime".to_string(),
    ));
    // The same series again, on its own connection: how far apart two
    // identical series come out is what the run can resolve.
    kinds.push((
        Kind::RawDonorInRuntime,
        "donor, least protocol client sleeping in the runtime, again".to_string(),
    ));
    kinds
}

/// The processes of the two servers.
#[derive(Debug, Clone, Copy)]
struct Pids {
    floor: u32,
    donor: u32,
}

impl Pids {
    /// The process that answers a series of `kind`.
    fn serving(self, kind: Kind) -> u32 {
        match kind {
            Kind::Donor(_) | Kind::RawDonor(_) | Kind::RawDonorInRuntime => self.donor,
            Kind::Floor(_)
            | Kind::Gathering(_)
            | Kind::GatheringInRuntime
            | Kind::GatheringSummed(_)
            | Kind::QuicFloor
            | Kind::ProtoFloor(_) => self.floor,
        }
    }
}

/// Where the series' servers listen.
struct Endpoints<'a> {
    rt: &'a tokio::runtime::Runtime,
    pids: Pids,
    floor: SocketAddr,
    /// The protocol's floor, in the floor server's process.
    proto: SocketAddr,
    donor: SocketAddr,
    digests: &'a [(u32, TableDigest)],
    quic_floor: Option<(SocketAddr, &'a Path)>,
    rows_per_table: u64,
}

impl Endpoints<'_> {
    /// One series of `kind` at `sections` x 24 rows, its connection made.
    fn series(&self, kind: Kind, name: &str, sections: usize, seed: u64) -> Result<Series> {
        let (req, ans) = sizes(sections)?;
        let rows = sections * 24;
        let (rt, floor, donor, digests, quic_floor, rows_per_table) = (
            self.rt,
            self.floor,
            self.donor,
            self.digests,
            self.quic_floor,
            self.rows_per_table,
        );
        let quic_conn = match (kind, quic_floor) {
            (Kind::QuicFloor, Some((addr, cert))) => Some(
                rt.block_on(quic::QuicFloorConn::connect(addr, cert, req, ans))
                    .context("connecting to the QUIC floor")?,
            ),
            _ => None,
        };
        let floor_conn = match kind {
            Kind::Floor(poll) => Some(FloorConn::new(floor, req, ans, poll)?),
            Kind::Gathering(poll) => Some(FloorConn::new(floor, req, ans, poll)?.gathering(
                rows,
                rows_per_table,
                seed,
            )?),
            Kind::GatheringSummed(poll) => Some(
                FloorConn::new(floor, req, ans, poll)?
                    .gathering(rows, rows_per_table, seed)?
                    .checksummed(),
            ),
            Kind::GatheringInRuntime => Some(
                FloorConn::new(floor, req, ans, Duration::ZERO)?
                    .gathering(rows, rows_per_table, seed)?
                    .in_runtime(rt)?,
            ),
            Kind::Donor(_)
            | Kind::QuicFloor
            | Kind::RawDonor(_)
            | Kind::RawDonorInRuntime
            | Kind::ProtoFloor(_) => None,
        };
        let raw_to = match kind {
            Kind::RawDonor(poll) => Some((donor, poll)),
            Kind::RawDonorInRuntime => Some((donor, Duration::ZERO)),
            Kind::ProtoFloor(poll) => Some((self.proto, poll)),
            _ => None,
        };
        let raw = match raw_to {
            Some((to, poll)) => {
                let c =
                    raw::RawDonorConn::connect(to, digests, sections, rows_per_table, seed, poll)?;
                Some(if matches!(kind, Kind::RawDonorInRuntime) {
                    c.in_runtime(rt)?
                } else {
                    c
                })
            }
            None => None,
        };
        Ok(Series {
            kind,
            floor: floor_conn,
            quic: quic_conn,
            raw,
            donor: DonorSeries::new(sections, 24, rows_per_table, seed),
            share: 1,
            server_pid: self.pids.serving(kind),
            split: split::Split::default(),
            pacer: pace::Pacer::new(Duration::ZERO),
            result: SeriesResult {
                series: format!("{name}, {rows} rows"),
                rows,
                request_bytes: req,
                answer_bytes: ans,
                rounds: Vec::new(),
                median: Summary::default(),
                split: None,
                pause_overran: 0.0,
            },
        })
    }
}

/// Every series checks the rows of one lookup in this many, outside the timing.
const CHECK_EVERY: u64 = 16;

/// Rows of the bulk series' lookups (the donors' default frame cap).
pub(crate) const BULK_ROWS: usize = 16_384;

/// The bulk series run one lookup for this many of the others'.
const BULK_SHARE: usize = 100;

/// Lookups a series runs before the next series takes its turn.
const CHUNK: usize = 250;

/// Seeds the order in which the series take their turns ([`measure_round`]).
const SHUFFLE_SEED: u64 = 0x005e_ed0f_0de5;

/// Put `order` in a random order (Fisher-Yates).
fn shuffle(order: &mut [usize], rng: &mut SplitMix64) {
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
}

/// Warm up every series, run the rounds, and take each series' medians over rounds.
fn measure(
    mut series: Vec<Series>,
    args: &FloorArgs,
    rt: &tokio::runtime::Runtime,
    clients: &[DonorClient],
) -> Result<Vec<SeriesResult>> {
    for s in &mut series {
        s.pacer = pace::Pacer::new(Duration::from_micros(args.pause_us));
    }
    // Warm up every series, then alternate them in chunks, in a new order
    // each pass, so that any drift of the machine lands on all of them alike.
    for s in &mut series {
        let mut lat = Latency::default();
        s.run(args.warmup, rt, clients, &mut lat)?;
    }
    for round in 0..args.rounds {
        eprintln!("round {} of {}", round + 1, args.rounds);
        measure_round(&mut series, round, args.lookups, rt, clients)?;
    }
    Ok(series
        .into_iter()
        .map(|mut s| {
            s.result.median = median_summary(&s.result.rounds);
            s.result.split = s.split.per_lookup();
            s.result.pause_overran = s.pacer.overran();
            s.result
        })
        .collect())
}

/// One round: `lookups` timed lookups per series, the series taking turns
/// in chunks, in a new random order each pass.
fn measure_round(
    series: &mut [Series],
    round: usize,
    lookups: usize,
    rt: &tokio::runtime::Runtime,
    clients: &[DonorClient],
) -> Result<()> {
    let mut lat: Vec<Latency> = series.iter().map(|_| Latency::default()).collect();
    // A new order every pass: in a fixed one each series always follows
    // the same other, and what that one leaves behind (a CPU that spun or
    // slept, the host's view of it) lands on it alone. Two identical
    // series were 2 to 5% apart at p50 in a fixed order, within 1.4% in
    // shuffled ones (docs/benchmarks.md, "A new order every pass").
    let mut order: Vec<usize> = (0..series.len()).collect();
    let mut rng = SplitMix64::new(SHUFFLE_SEED ^ round as u64);
    let mut done = 0;
    while done < lookups {
        crate::rack::check_interrupted()?;
        let n = CHUNK.min(lookups - done);
        shuffle(&mut order, &mut rng);
        for &i in &order {
            let (s, l) = (&mut series[i], &mut lat[i]);
            let before = split::Mark::now(s.server_pid);
            let ran = s.run(n, rt, clients, l)?;
            s.split.add(&before, &split::Mark::now(s.server_pid), ran);
        }
        done += n;
    }
    for (s, l) in series.iter_mut().zip(&lat) {
        s.result.rounds.push(l.summary());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// Every pass runs every series once, and a series follows a different
    /// one from pass to pass.
    #[test]
    fn each_pass_runs_every_series_once_after_changing_others() {
        let mut rng = SplitMix64::new(SHUFFLE_SEED);
        let mut order: Vec<usize> = (0..30).collect();
        let (mut orders, mut before_five) = (HashSet::new(), HashSet::new());
        for _ in 0..20 {
            shuffle(&mut order, &mut rng);
            let mut sorted = order.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..30).collect::<Vec<_>>());
            orders.insert(order.clone());
            let at = order.iter().position(|&i| i == 5).expect("series 5 runs");
            before_five.insert(at.checked_sub(1).map(|p| order[p]));
        }
        assert_eq!(orders.len(), 20);
        assert!(before_five.len() >= 10, "{before_five:?}");
    }
}
