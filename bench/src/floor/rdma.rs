//! `engram-bench floor --transports rdma`.
//!
//! Two measurements:
//! - **On hardware** (an RDMA device, daemons built with `--features rdma`,
//!   `--rdma-addr` an IP on the device): a second donor listens on TLS and
//!   `rdma://`, and the node's own donor source reads 24- and 48-row
//!   lookups over RDMA, against the same lookups over TLS on the same donor.
//!   Elsewhere this part is skipped, with the reason in the report.
//! - **Everywhere, with the fake provider**: the node's CPU time per lookup
//!   on the RDMA path (building the work requests, posting, polling the
//!   completion, checking the check words, copying the rows out), against
//!   the TCP client's CPU time per lookup (not polling: its CPU time is its
//!   work, not its waiting) on the floor's donor in the same run. The fake
//!   "NIC" copies the rows when they are posted; that copy is a real NIC's
//!   work and is subtracted (and reported).

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use cluster_config::Transport;
use engram_protocol::synthetic::{SplitMix64, first_mismatch, synthetic_rows};
use engram_protocol::{ROW_BYTES, TableDigest};
use engram_rdma::book::RegionBook;
use engram_rdma::fake::FakeProvider;
use engram_rdma::plan::{Layout, Outcome};
use engram_rdma::reader::{DEFAULT_SLOT_ROWS, Reader, qp_options};
use engram_rdma::verbs::{DeviceSpec, Fabric, Provider};
use inference_node::source::rdma::RdmaPath;
use inference_node::source::{DonorSource, RowSource};
use inference_node::{DonorClient, Request};
use rack_harness::{DonorProcess, free_port};
use serde::Serialize;

use super::{SEED, Tables, transports};
use crate::stats::{median, print_table};

/// Rows of the in-process table the fake provider reads (264 MiB).
const FAKE_ROWS: u64 = 1 << 20;

/// The RDMA part of a floor run.
#[derive(Debug, Serialize)]
pub(super) struct RdmaReport {
    /// Why the hardware series did not run, when they did not.
    pub(super) skipped: Option<String>,
    /// Lookups over RDMA and over TLS on the same donor, on hardware.
    pub(super) hardware: Vec<HardwareSeries>,
    /// The node's CPU time per lookup, fake RDMA against the TCP client.
    pub(super) cpu: Vec<CpuCost>,
    /// What the check words cost the donor: computing them for the fake's
    /// table (rows, milliseconds), at registration.
    pub(super) checks_rows: u64,
    pub(super) checks_ms: f64,
}

/// One lookup size on hardware.
#[derive(Debug, Serialize)]
pub(super) struct HardwareSeries {
    rows: usize,
    rdma_p50_us: f64,
    rdma_p99_us: f64,
    tls_p50_us: f64,
    tls_p99_us: f64,
}

/// The node's CPU time per lookup of `rows` rows.
#[derive(Debug, Serialize)]
pub(super) struct CpuCost {
    rows: usize,
    /// Median over rounds of the RDMA path's CPU time per lookup, NIC copy excluded.
    rdma_ns: f64,
    /// The fake NIC's copying per lookup (excluded above).
    nic_copy_ns: f64,
    /// Median over rounds of the TCP client's CPU time per lookup.
    tcp_ns: f64,
    /// `rdma_ns / tcp_ns`.
    ratio: f64,
    /// Of `rdma_ns`: recomputing the check words and copying the rows out.
    verify_ns: f64,
    rdma_rounds_ns: Vec<f64>,
    tcp_rounds_ns: Vec<f64>,
}

/// CPU time this thread has used.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through the valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn random_rows(rng: &mut SplitMix64, n: usize, bound: u64) -> Vec<u64> {
    (0..n).map(|_| rng.next_u64() % bound).collect()
}

/// The fake side: a region book over an in-process synthetic table and a
/// reader connected to it.
struct FakeRig {
    provider: FakeProvider,
    checks_ms: f64,
    reader: Reader,
    layout: Layout,
    _book: Arc<RegionBook>,
}

impl FakeRig {
    fn new() -> Result<Self> {
        let provider = FakeProvider::new();
        let book = RegionBook::new(Arc::new(provider.clone()), DeviceSpec::default());
        let mut rows = vec![0u8; FAKE_ROWS as usize * ROW_BYTES];
        synthetic_rows(SEED, 1, 0, &mut rows);
        // Any version will do: it seeds the check words.
        let digest = TableDigest([7; 32]);
        let published = book.publish(1, FAKE_ROWS, digest, Arc::new(rows))?;
        let addr: SocketAddr = ([127, 0, 0, 1], 1).into();
        book.listen(addr)?;
        let region = book.grant(1, "bench").context("the fake region")?;
        let qp = provider.connect(
            addr,
            &region.token,
            &qp_options(Duration::from_secs(1), Fabric::default()),
        )?;
        Ok(Self {
            provider,
            checks_ms: published.checks.as_secs_f64() * 1e3,
            reader: Reader::new(qp, DEFAULT_SLOT_ROWS),
            layout: Layout::from_region(&region),
            _book: book,
        })
    }

    /// One lookup, start to copied rows.
    fn lookup(&mut self, rows: &[u64], out: &mut [u8]) -> Result<()> {
        let read = self
            .reader
            .start(rows, &self.layout)
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        loop {
            self.reader.poll();
            match self.reader.outcome(&read) {
                Outcome::Pending => std::hint::spin_loop(),
                Outcome::Done => break,
                Outcome::Failed(f) => bail!("fake read failed: {f}"),
            }
        }
        self.reader
            .finish(read, rows, &self.layout, out)
            .map_err(|f| anyhow::anyhow!("{f}"))
    }
}

/// Measure the CPU cost of a lookup both ways, `rounds` rounds of `n`.
fn cpu_costs(
    rt: &tokio::runtime::Runtime,
    tcp: &DonorClient,
    rows_per_table: u64,
    n: usize,
    rounds: usize,
) -> Result<(Vec<CpuCost>, f64)> {
    let mut rig = FakeRig::new()?;
    let mut out = Vec::new();
    for rows in [24usize, 48] {
        let mut buf = vec![0u8; rows * ROW_BYTES];
        let (mut rdma_rounds, mut tcp_rounds, mut copies) = (Vec::new(), Vec::new(), Vec::new());
        let mut rng = SplitMix64::new(SEED ^ rows as u64);
        for round in 0..rounds.max(1) {
            // The fake first: its rows are checked once a round.
            let check = random_rows(&mut rng, rows, FAKE_ROWS);
            rig.lookup(&check, &mut buf)?;
            if let Some(r) = first_mismatch(SEED, 1, &check, &buf) {
                bail!("fake RDMA: row {r} is wrong");
            }
            let lists: Vec<Vec<u64>> = (0..n)
                .map(|_| random_rows(&mut rng, rows, FAKE_ROWS))
                .collect();
            let (copy0, _) = rig.provider.fabric().nic_work();
            let t0 = thread_cpu();
            for l in &lists {
                rig.lookup(l, &mut buf)?;
            }
            let cpu = thread_cpu() - t0;
            let copy = rig.provider.fabric().nic_work().0 - copy0;
            rdma_rounds.push((cpu.saturating_sub(copy)).as_nanos() as f64 / n as f64);
            copies.push(copy.as_nanos() as f64 / n as f64);
            let lists: Vec<Vec<u64>> = (0..n)
                .map(|_| random_rows(&mut rng, rows, rows_per_table))
                .collect();
            let t0 = thread_cpu();
            rt.block_on(async {
                for l in &lists {
                    tcp.lookup(&[Request { table: 1, rows: l }], &mut buf)
                        .await?;
                }
                anyhow::Ok(())
            })?;
            let cpu = thread_cpu() - t0;
            tcp_rounds.push(cpu.as_nanos() as f64 / n as f64);
            eprintln!(
                "rdma cpu, {rows} rows, round {}: fake RDMA {:.0} ns, TCP client {:.0} ns a lookup",
                round + 1,
                rdma_rounds[round],
                tcp_rounds[round]
            );
        }
        // The check words and the copy alone, on the last lookup's slot.
        let verify_ns = verify_cost(&mut rig, &mut rng, rows, n, &mut buf)?;
        let (r, t) = (median(rdma_rounds.clone()), median(tcp_rounds.clone()));
        out.push(CpuCost {
            rows,
            rdma_ns: r,
            nic_copy_ns: median(copies),
            tcp_ns: t,
            ratio: if t > 0.0 { r / t } else { 0.0 },
            verify_ns,
            rdma_rounds_ns: rdma_rounds,
            tcp_rounds_ns: tcp_rounds,
        });
    }
    Ok((out, rig.checks_ms))
}

/// The check words' verification and the copy alone, per lookup of
/// `rows` rows: nanoseconds.
fn verify_cost(
    rig: &mut FakeRig,
    rng: &mut SplitMix64,
    rows: usize,
    n: usize,
    buf: &mut [u8],
) -> Result<f64> {
    let l = random_rows(rng, rows, FAKE_ROWS);
    let read = rig
        .reader
        .start(&l, &rig.layout)
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    while rig.reader.outcome(&read) == Outcome::Pending {
        rig.reader.poll();
    }
    let slot = rig.reader.slot_bytes(&read).to_vec();
    let t0 = thread_cpu();
    for _ in 0..n {
        engram_rdma::plan::verify_into(&l, &rig.layout, &slot, buf)
            .map_err(|f| anyhow::anyhow!("{f}"))?;
    }
    let ns = (thread_cpu() - t0).as_nanos() as f64 / n as f64;
    rig.reader.release(read);
    Ok(ns)
}

/// The hardware series, or why they cannot run here.
fn hardware(
    rt: &tokio::runtime::Runtime,
    dir: &Path,
    tables: &Tables,
    rdma_ip: Option<IpAddr>,
    n: usize,
    warmup: usize,
) -> Result<std::result::Result<Vec<HardwareSeries>, String>> {
    let provider = match engram_rdma::provider() {
        Ok(p) => p,
        Err(e) => return Ok(Err(e.to_string())),
    };
    let Some(ip) = rdma_ip else {
        return Ok(Err(
            "an RDMA device is present: give --rdma-addr IP (an address on it)".into(),
        ));
    };
    let rdma_addr = SocketAddr::new(ip, free_port()?);
    let sub = dir.join("rdma");
    std::fs::create_dir_all(&sub)?;
    let rack = transports::Rack::write_with(
        &sub,
        tables,
        &[Transport::Tls],
        &[format!("rdma://{rdma_addr}")],
    )?
    .context("the RDMA rack")?;
    let config = rack.config.display().to_string();
    let donor = DonorProcess::start(&["--config", &config, "--name", transports::DONOR])?;
    // RDMA is set up after the ready line: wait for its own line.
    let serving = donor.wait_line(Duration::from_secs(600), |l| {
        (l.contains("serving one-sided reads") || l.contains("is not served"))
            .then(|| l.contains("serving one-sided reads"))
    });
    if !serving.unwrap_or(false) {
        return Ok(Err(format!(
            "the donor did not serve rdma://{rdma_addr} (a build without --features rdma, or \
             the address is not on the device); its log:\n{}",
            donor.log()
        )));
    }
    let tls = donor
        .endpoint(Transport::Tls)
        .context("the donor's TLS address")?;
    let opts = transports::options(Some(&rack), &tables.digests, Transport::Tls)?;
    let metrics = inference_node::metrics::NodeMetrics::new();
    let path = RdmaPath::new(
        transports::DONOR,
        rdma_addr,
        provider,
        Duration::from_secs(2),
        Fabric::default(),
        inference_node::source::rdma::RdmaCounters::new(&metrics, transports::DONOR),
    );
    let source = DonorSource::new(transports::DONOR, vec![tls], opts.clone()).with_rdma(Some(path));
    let client = rt.block_on(DonorClient::connect(tls, &opts))?;
    measure_hardware(rt, &source, &client, tables, n, warmup)
}

/// Each size over RDMA and over TLS from the same donor, alternating.
fn measure_hardware(
    rt: &tokio::runtime::Runtime,
    source: &DonorSource,
    client: &DonorClient,
    tables: &Tables,
    n: usize,
    warmup: usize,
) -> Result<std::result::Result<Vec<HardwareSeries>, String>> {
    let mut out = Vec::new();
    let mut rng = SplitMix64::new(SEED);
    for rows in [24usize, 48] {
        let mut buf = vec![0u8; rows * ROW_BYTES];
        let (mut rdma, mut tls_us) = (Vec::new(), Vec::new());
        for i in 0..warmup + n {
            let l = random_rows(&mut rng, rows, tables.rows);
            let t = Instant::now();
            let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
            let (res, back) = rt.block_on(source.fetch(1, &l, std::mem::take(&mut buf), deadline));
            buf = back;
            res.map_err(|e| anyhow::anyhow!("rdma fetch: {e}"))?;
            let a = t.elapsed();
            if let Some(r) = first_mismatch(SEED, 1, &l, &buf) {
                bail!("rdma: row {r} is wrong");
            }
            let t = Instant::now();
            rt.block_on(client.lookup(&[Request { table: 1, rows: &l }], &mut buf))?;
            let b = t.elapsed();
            if i >= warmup {
                rdma.push(a.as_secs_f64() * 1e6);
                tls_us.push(b.as_secs_f64() * 1e6);
            }
        }
        let counts = source.rdma().and_then(RdmaPath::counts);
        if counts.is_none_or(|c| c.wrs == 0) {
            return Ok(Err(
                "the node read over TLS: RDMA was not usable (see the log)".into(),
            ));
        }
        let q = |v: &mut Vec<f64>, p: f64| {
            v.sort_by(f64::total_cmp);
            v[((v.len() - 1) as f64 * p) as usize]
        };
        out.push(HardwareSeries {
            rows,
            rdma_p50_us: q(&mut rdma, 0.5),
            rdma_p99_us: q(&mut rdma, 0.99),
            tls_p50_us: q(&mut tls_us, 0.5),
            tls_p99_us: q(&mut tls_us, 0.99),
        });
    }
    Ok(Ok(out))
}

/// Run both parts.
pub(super) fn run(
    rt: &tokio::runtime::Runtime,
    dir: &Path,
    tables: &Tables,
    floor_donor: &DonorProcess,
    args: &super::FloorArgs,
) -> Result<RdmaReport> {
    let (hardware, skipped) =
        match hardware(rt, dir, tables, args.rdma_addr, args.lookups, args.warmup)? {
            Ok(h) => (h, None),
            Err(why) => {
                eprintln!("rdma on hardware: skipped: {why}");
                (Vec::new(), Some(why))
            }
        };
    let mut opts = inference_node::ClientOptions::new("engram-bench", tables.digests.clone());
    opts.busy_poll = Duration::ZERO;
    opts.lookup_timeout = crate::LOOKUP_TIMEOUT;
    let addr = floor_donor
        .endpoint(Transport::Tcp)
        .context("the floor donor's TCP address")?;
    let tcp = rt.block_on(DonorClient::connect(addr, &opts))?;
    let (cpu, checks_ms) = cpu_costs(rt, &tcp, tables.rows, args.lookups, args.rounds)?;
    Ok(RdmaReport {
        skipped,
        hardware,
        cpu,
        checks_rows: FAKE_ROWS,
        checks_ms,
    })
}

impl RdmaReport {
    /// The report's text.
    pub(super) fn print_text(&self) {
        match &self.skipped {
            Some(why) => println!("rdma on hardware: skipped: {why}"),
            None => {
                println!(
                    "rdma on hardware: the node's donor source, RDMA against TLS, same donor:"
                );
                let rows: Vec<Vec<String>> = self
                    .hardware
                    .iter()
                    .map(|h| {
                        vec![
                            h.rows.to_string(),
                            format!("{:.1}", h.rdma_p50_us),
                            format!("{:.1}", h.rdma_p99_us),
                            format!("{:.1}", h.tls_p50_us),
                            format!("{:.1}", h.tls_p99_us),
                        ]
                    })
                    .collect();
                print_table(
                    &[
                        "rows",
                        "rdma p50 us",
                        "rdma p99 us",
                        "tls p50 us",
                        "tls p99 us",
                    ],
                    &rows,
                );
            }
        }
        println!(
            "node CPU per lookup, fake RDMA provider (post, poll, check words, copy out; the \
             fake NIC's copy excluded) against the TCP client (not polling), medians of rounds:"
        );
        let rows: Vec<Vec<String>> = self
            .cpu
            .iter()
            .map(|c| {
                vec![
                    c.rows.to_string(),
                    format!("{:.0}", c.rdma_ns),
                    format!("{:.0}", c.verify_ns),
                    format!("{:.0}", c.nic_copy_ns),
                    format!("{:.0}", c.tcp_ns),
                    format!("{:.3}x", c.ratio),
                ]
            })
            .collect();
        print_table(
            &[
                "rows",
                "rdma ns",
                "of which checks+copy ns",
                "(nic copy ns)",
                "tcp ns",
                "rdma / tcp",
            ],
            &rows,
        );
        println!(
            "donor: check words for {} rows computed in {:.1} ms at registration (8 bytes a row, 3.0% of the table)",
            self.checks_rows, self.checks_ms
        );
    }
}
