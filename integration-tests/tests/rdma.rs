//! RDMA with the fake verbs provider: the donor's real serving stack (its
//! TLS data plane, region book and RegionQuery answers) and the node's real
//! memory (routers, breakers, probes, the SSD copy) in one process, sharing
//! the fake fabric. Rows are checked against the synthetic generator.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use cluster_config::{Config, Transport};
use engram_protocol::synthetic::first_mismatch;
use engram_protocol::{ErrorCode, ROW_BYTES};
use engram_rdma::fake::{FakeFault, FakeProvider};
use engram_rdma::verbs::{DeviceSpec, Fabric, Provider, WcStatus};
use engram_store::kept;
use engram_store::resident::{Backing, ExpectedTable, LoadOptions, MlockMode, ResidentTable};
use inference_node::memory::Routers;
use inference_node::metrics::{NodeMetrics, RdmaLabels};
use memory_donor::server::{self, Shared};
use memory_donor::tls::{Access, DonorTls};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use rack_harness::rack_toml::{
    DonorEntry, NodeEntry, RackToml, RdmaSection, RouteEntry, TableEntry, TlsSection,
};
use rack_harness::{free_port, gen_table, rack_pki, runtime};

const ROWS: u64 = 4_000;
const SEED: u64 = 77;
const SEED_V2: u64 = 78;
const TABLES: [u32; 2] = [1, 14];

/// The process's fake fabric (one provider a process).
fn fake() -> &'static FakeProvider {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    static FAKE: OnceLock<FakeProvider> = OnceLock::new();
    FAKE.get_or_init(|| {
        let p = FakeProvider::new();
        let installed: Arc<dyn Provider> = Arc::new(p.clone());
        if engram_rdma::install(installed).is_err() {
            panic!("another provider was installed first");
        }
        p
    })
}

/// A rack: one donor (TLS + RDMA, plus plaintext TCP on loopback) and one
/// node whose routes read the donor, then the SSD copy.
struct Rack {
    _dir: tempfile::TempDir,
    config: Config,
    rdma: SocketAddr,
    tcp: SocketAddr,
    paths: Vec<PathBuf>,
}

impl Rack {
    /// A rack whose donor speaks `secure` (`tls` or `quic`) beside RDMA.
    fn new(secure: &str) -> Result<Self> {
        Self::with(secure, None)
    }

    /// [`Rack::new`], the donor with `[donor.rdma]` settings `rdma`.
    fn with(secure: &str, rdma: Option<RdmaSection>) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let mut paths = Vec::new();
        let mut rack = RackToml::new("rdma");
        rack.rack.tls = Some(TlsSection::default());
        for id in TABLES {
            let (path, digest) = gen_table(dir.path(), &format!("t{id}.etab"), id, ROWS, SEED)?;
            rack.table.push(TableEntry::new(id, &path, ROWS, digest));
            paths.push(path);
        }
        let (tls, tcp, rdma_port) = (free_port()?, free_port()?, free_port()?);
        let tls_addr: SocketAddr = ([127, 0, 0, 1], tls).into();
        let tcp_addr: SocketAddr = ([127, 0, 0, 1], tcp).into();
        // The fake fabric needs no socket; each rack gets its own address.
        let rdma_addr: SocketAddr = ([127, 0, 0, 1], rdma_port).into();
        let listen = [
            format!("{secure}://{tls_addr}"),
            format!("tcp://{tcp_addr}"),
            format!("rdma://{rdma_addr}"),
        ];
        rack.donor.push(DonorEntry {
            ram_gib: 4.0,
            headroom_gib: Some(0.5),
            drain_timeout_ms: Some(200),
            rdma,
            ..DonorEntry::new("donor-a", listen, TABLES)
        });
        let route = |(id, path): (&u32, &PathBuf)| RouteEntry {
            hard_timeout_ms: Some(300),
            ..RouteEntry::new(*id, ["donor-a", "ssd"])
                .ssd_path(path)
                .hedge("off")
        };
        rack.node.push(NodeEntry {
            probe_interval_ms: Some(100),
            tokens_per_second: Some(2.0),
            breaker_failures: Some(1000),
            ..NodeEntry::new("node-a", TABLES.iter().zip(&paths).map(route).collect())
        });
        let path = dir.path().join("rack.toml");
        rack.write(&path)?;
        rack_pki(&path)?;
        let config = Config::load(&path).context("config")?;
        Ok(Self {
            _dir: dir,
            config,
            rdma: rdma_addr,
            tcp: tcp_addr,
            paths,
        })
    }

    fn table(&self, i: usize, path: &Path) -> Result<ResidentTable> {
        let (t, _) = ResidentTable::load(TABLES[i], path, None, true, MlockMode::Off, |_| None)?;
        Ok(t)
    }
}

/// The donor's serving stack, in process.
struct Donor {
    shared: Arc<Shared>,
    tls: Arc<DonorTls>,
    files: cluster_config::TlsFiles,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Donor {
    async fn start(rack: &Rack) -> Result<Self> {
        let spec = memory_donor::spec::ServeSpec::from_config(&rack.config, "donor-a")?;
        let tables = (0..TABLES.len())
            .map(|i| rack.table(i, &rack.paths[i]))
            .collect::<Result<Vec<_>>>()?;
        let shared = Shared::new(spec.server.clone(), tables);
        let Some((files, _)) = &spec.tls else {
            bail!("the rack has a PKI")
        };
        let tls = DonorTls::load(files, Access::from_config(&rack.config, "donor-a"))?;
        shared.set_tls(Arc::clone(&tls));
        let files = files.clone();
        let mut listeners = Vec::new();
        for e in &spec.listen {
            match e.transport {
                Transport::Tls => listeners.push(server::Listener::Tls(
                    tokio::net::TcpListener::bind(e.addr).await?,
                )),
                Transport::Quic => {
                    let config =
                        server::quic::server_config(&shared).map_err(anyhow::Error::msg)?;
                    listeners.push(server::Listener::Quic(quinn::Endpoint::server(
                        config, e.addr,
                    )?))
                }
                Transport::Tcp => listeners.push(server::Listener::Tcp(
                    tokio::net::TcpListener::bind(e.addr).await?,
                )),
                _ => {}
            }
        }
        let device = spec.rdma.clone().unwrap_or_default();
        let snapshot = memory_donor::rdma::snapshot(&shared.tables());
        let book = memory_donor::rdma::open_book(engram_rdma::provider()?, rack.rdma, &device)?;
        memory_donor::rdma::sync(&book, snapshot);
        if book.listen(rack.rdma).is_ok() {
            shared.set_rdma(book, None);
        }
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(server::run(listeners, Arc::clone(&shared), async move {
            let _ = rx.await;
        }));
        Ok(Self {
            shared,
            tls,
            files,
            stop: Some(tx),
            task,
        })
    }

    /// Stop: the queue pairs die at once (as when the process is killed),
    /// the data plane drains (Goodbye, then closed within the config's
    /// 200 ms drain timeout), and the registrations and the listener go.
    async fn kill(mut self, rack: &Rack) {
        fake().fabric().kill(rack.rdma);
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let _ = self.task.await;
    }
}

/// `n` lookups of 24 random rows of each table; every answer's rows are
/// checked against the generator of `seed`. Returns the sources that served.
async fn lookups(memory: &Routers, n: usize, seed: u64, salt: u64) -> Result<Vec<String>> {
    let mut served = Vec::new();
    let mut out = vec![0u8; 24 * ROW_BYTES];
    for k in 0..n as u64 {
        for (i, &id) in TABLES.iter().enumerate() {
            let rows: Vec<u64> = (0..24u64)
                .map(|j| (j * 2_654_435_761 + k * 97 + salt + i as u64) % ROWS)
                .collect();
            let Some(router) = memory.router(id) else {
                bail!("no router for table {id}")
            };
            let f = router.fetch(&rows, &mut out).await?;
            if let Some(r) = first_mismatch(seed, id, &rows, &out) {
                bail!(
                    "table {id}: row {r} is not the pinned version's (served by {:?})",
                    f.source
                );
            }
            served.push(f.source.map_or_else(|| "zeros".into(), |s| s.to_string()));
        }
    }
    Ok(served)
}

/// READs carried out to this rack's donor.
fn reads(rack: &Rack) -> u64 {
    fake().fabric().reads_at(rack.rdma)
}

/// The donor and a node on `rack`, after `n` lookups of each table all
/// served by the donor.
async fn warm(rack: &Rack, n: usize) -> Result<(Donor, Routers, NodeMetrics)> {
    let donor = Donor::start(rack).await?;
    let metrics = NodeMetrics::new();
    let memory = node_with(rack, &metrics).await?;
    let served = lookups(&memory, n, SEED, 0).await?;
    if !served.iter().all(|s| s == "donor-a") {
        bail!("warm-up lookups not all from the donor: {served:?}");
    }
    Ok((donor, memory, metrics))
}

/// A node whose metrics the test reads.
async fn node_with(rack: &Rack, metrics: &NodeMetrics) -> Result<Routers> {
    Ok(Routers::from_config(&rack.config, "node-a", metrics).await?)
}

fn count(family: &Family<RdmaLabels, Counter>, kind: &str) -> u64 {
    family
        .get_or_create(&RdmaLabels {
            source: "donor-a".into(),
            kind: kind.into(),
        })
        .get()
}

#[test]
fn rows_over_rdma_equal_the_table_with_two_reads_a_row() -> Result<()> {
    fake();
    let rack = Rack::new("tls")?;
    runtime().block_on(async {
        let donor = Donor::start(&rack).await?;
        let metrics = NodeMetrics::new();
        let memory = node_with(&rack, &metrics).await?;
        let before = reads(&rack);
        let served = lookups(&memory, 300, SEED, 0).await?;
        assert!(served.iter().all(|s| s == "donor-a"), "{served:?}");
        // A row and its check word a row, nothing over TLS: 600 lookups.
        assert_eq!(reads(&rack) - before, 600 * 48);
        assert_eq!(count(&metrics.rdma_lookups, "rdma"), 600);
        assert_eq!(count(&metrics.rdma_lookups, "stream"), 0);
        assert_eq!(donor.shared.rdma().map(|b| b.tables().len()), Some(2));
        donor.kill(&rack).await;
        Ok(())
    })
}

/// `[donor.rdma]`'s fabric settings reach both ends: the donor's
/// listener (the traffic class of what it sends) and every queue pair the
/// node makes to it (ACK timeout, retries, class).
#[test]
fn both_ends_take_the_fabric_settings_of_the_donors_config() -> Result<()> {
    fake();
    let rack = Rack::with(
        "tls",
        Some(RdmaSection {
            ack_timeout_ms: Some(4),
            retry_count: Some(3),
            traffic_class: Some(106),
            ..RdmaSection::default()
        }),
    )?;
    runtime().block_on(async {
        let (donor, _memory, _metrics) = warm(&rack, 5).await?;
        let want = Fabric {
            ack_timeout: Duration::from_millis(4),
            retry_count: 3,
            traffic_class: Some(106),
        };
        let (listener, qps) = fake().fabric().fabric_at(rack.rdma);
        assert_eq!(listener, Some(want));
        assert!(!qps.is_empty() && qps.iter().all(|f| *f == want), "{qps:?}");
        donor.kill(&rack).await;
        Ok(())
    })
}

/// A table kept in a memfd as a donor under systemd keeps it, served over
/// RDMA on a kernel that pins shared memory only through a writable
/// mapping (before Linux 6.2; the fake refuses as it does): registered
/// through the writable shared view (`rw-s`), refused without it. Shared
/// on the host socket afterwards, the memfd is sealed against new writers
/// while the view stays. A restarted donor's adopted copy gets its view
/// back while unsealed, and not once sealed.
#[test]
fn a_kept_table_registers_through_its_writable_view_and_is_still_sealed_for_sharing() -> Result<()>
{
    let rack = Rack::new("tls")?;
    let load = |view: bool| -> Result<ResidentTable> {
        let opts = LoadOptions {
            backing: Backing::Memfd,
            rdma_view: view,
            trust_digest: true,
            mlock: MlockMode::Off,
            threads: 1,
            ..LoadOptions::default()
        };
        Ok(ResidentTable::load_with(Some(TABLES[0]), &rack.paths[0], &opts, |_| None)?.0)
    };
    let provider = FakeProvider::new();
    provider.fabric().refuse_read_only_shared(true);
    let device = cluster_config::RdmaDevice::default();
    let publish = |t: &ResidentTable| -> Result<usize> {
        let book = memory_donor::rdma::open_book(Arc::new(provider.clone()), rack.rdma, &device)?;
        let snap = memory_donor::rdma::snapshot(std::slice::from_ref(t));
        Ok(memory_donor::rdma::sync(&book, snap))
    };
    // Sealed read-only and mapped r--s: refused, as such a kernel does.
    let plain = load(false)?;
    assert!(kept::is_sealed_read_only(
        &plain.kept().context("kept")?.file
    ));
    assert_eq!(publish(&plain)?, 0);
    assert!(provider.fabric().registered_perms().is_empty());
    // With the view: registered through a writable shared mapping.
    let t = load(true)?;
    assert!(t.memory().has_writable_view());
    assert_eq!(publish(&t)?, 1);
    assert_eq!(provider.fabric().registered_perms(), ["rw-s", "rw-p"]);
    let k = t.kept().context("kept")?;
    assert!(
        !kept::is_sealed_read_only(&k.file),
        "sealed only when shared"
    );
    let want = ExpectedTable {
        digest: t.digest,
        layer: t.layer,
        rows: t.rows,
    };
    // A restarted donor: the unsealed copy gets its view again.
    let again = ResidentTable::adopt(t.id, k.file.try_clone()?, &want, true)?;
    assert!(again.memory().has_writable_view());
    drop(again);
    // Shared on the host socket: sealed against new writers, the view kept.
    assert!(kept::seal_for_sharing(&k.file));
    assert!(kept::is_sealed_read_only(&k.file));
    assert!(
        kept::writable_view(&k.file, 4096).is_err(),
        "a new writer is refused"
    );
    assert_eq!(
        t.memory().registration_bytes()[..ROW_BYTES],
        t.memory_bytes()[..ROW_BYTES]
    );
    assert_eq!(publish(&t)?, 1, "the view still registers");
    // Adopted once sealed: no view (served, but not registered here).
    let sealed = ResidentTable::adopt(t.id, k.file.try_clone()?, &want, true)?;
    assert!(!sealed.memory().has_writable_view());
    assert_eq!(publish(&sealed)?, 0);
    Ok(())
}

#[test]
fn regions_are_learned_over_quic_too() -> Result<()> {
    fake();
    let rack = Rack::new("quic")?;
    runtime().block_on(async {
        let before = reads(&rack);
        let (donor, _memory, metrics) = warm(&rack, 50).await?;
        assert_eq!(reads(&rack) - before, 100 * 48);
        assert_eq!(count(&metrics.rdma_lookups, "rdma"), 100);
        donor.kill(&rack).await;
        Ok(())
    })
}

#[test]
fn a_swap_revokes_the_old_region_and_no_row_of_the_new_version_is_used() -> Result<()> {
    fake();
    let rack = Rack::new("tls")?;
    runtime().block_on(async {
        let (donor, memory, metrics) = warm(&rack, 20).await?;
        // Table 1 moves to another version on the donor, as a swap does it:
        // the new table in place, then the book follows.
        let dir = tempfile::tempdir()?;
        let (v2, _) = gen_table(dir.path(), "t1v2.etab", 1, ROWS, SEED_V2)?;
        let new = rack.table(0, &v2)?;
        let old = {
            let mut t = donor.shared.tables_mut();
            std::mem::replace(&mut t[0], new)
        };
        drop(old);
        let gens_before = donor.shared.rdma().map(|b| b.tables());
        donor.shared.sync_rdma();
        assert_ne!(donor.shared.rdma().map(|b| b.tables()), gens_before);
        // The node pins version 1: its old key fails (remote access), the
        // region it learns again holds version 2 (refused): every table 1
        // row comes from the SSD copy, and every one is version 1's.
        let served = lookups(&memory, 50, SEED, 1).await?;
        let t1: Vec<&String> = served.iter().step_by(2).collect();
        assert!(t1.iter().all(|s| *s == "ssd"), "{t1:?}");
        // The first read after the swap met the revoked key.
        assert!(count(&metrics.rdma_faults, "revoked") >= 1);
        donor.kill(&rack).await;
        Ok(())
    })
}

#[test]
fn a_node_cut_off_loses_its_queue_pairs_and_tokens_at_the_recheck() -> Result<()> {
    fake();
    let rack = Rack::new("tls")?;
    runtime().block_on(async {
        let (donor, memory, metrics) = warm(&rack, 20).await?;
        let Some(book) = donor.shared.rdma().cloned() else {
            bail!("no RDMA on the donor")
        };
        // The token was granted to the identity that asked, and its queue
        // pair is tracked under it.
        assert_eq!(book.owners(), vec![Arc::<str>::from("node-a")]);
        // The donor's `clients` stop naming node-a; the recheck (every
        // second, and at each SIGHUP) cuts its TLS session and its queue
        // pairs, which an RDMA reader could otherwise use for ever.
        let mut access = Access::from_config(&rack.config, "donor-a");
        access.data_clients.retain(|c| c != "node-a");
        donor.tls.reload(&donor.files, access)?;
        let shared = Arc::clone(&donor.shared);
        let cut = tokio::task::spawn_blocking(move || shared.recheck_sessions()).await?;
        assert!(cut >= 2, "{cut} sessions and queue pairs cut");
        assert!(book.owners().is_empty(), "{:?}", book.owners());
        let refusals = donor.shared.stats.refusals();
        assert!(
            refusals
                .iter()
                .any(|((plane, reason), n)| (*plane, *reason) == ("rdma", "revoked") && *n >= 1),
            "{refusals:?}"
        );
        // Not one READ more reaches the donor: the node reads its SSD copy.
        let before = reads(&rack);
        let served = lookups(&memory, 20, SEED, 5).await?;
        assert!(served.iter().all(|s| s == "ssd"), "{served:?}");
        assert_eq!(reads(&rack), before, "a READ on a cut queue pair");
        assert!(count(&metrics.rdma_lookups, "rdma") >= 40);
        donor.kill(&rack).await;
        Ok(())
    })
}

#[test]
fn each_injected_fault_fails_over_within_the_deadline_and_rdma_comes_back() -> Result<()> {
    fake();
    let rack = Rack::new("tls")?;
    runtime().block_on(async {
        let (donor, memory, metrics) = warm(&rack, 5).await?;
        let faults = [
            FakeFault::CompletionError(WcStatus::RetryExceeded),
            FakeFault::CompletionError(WcStatus::RemoteInvalidRequest),
            FakeFault::CompletionError(WcStatus::RemoteAccess),
            FakeFault::LoseCompletion,
            FakeFault::Late(Duration::from_secs(2)),
            FakeFault::Revoke,
            FakeFault::DeadQueuePair,
            // Late detection: silence until the queue pair's retries run
            // out (16.8 ms x 8 with the default fabric settings).
            FakeFault::Silence,
        ];
        let Some(router) = memory.router(1) else {
            bail!("no router")
        };
        for (k, fault) in faults.into_iter().enumerate() {
            fake().fabric().inject(rack.rdma, fault);
            let rows: Vec<u64> = (0..24).map(|j| (j * 131 + k as u64 * 7) % ROWS).collect();
            let mut out = vec![0u8; 24 * ROW_BYTES];
            let began = Instant::now();
            let f = router.fetch(&rows, &mut out).await?;
            let took = began.elapsed();
            assert_eq!(f.source.as_deref(), Some("ssd"), "{fault:?}: {f:?}");
            assert_eq!(first_mismatch(SEED, 1, &rows, &out), None, "{fault:?}");
            // Within the route's hard timeout (300 ms), with slack for a busy machine.
            assert!(took < Duration::from_millis(600), "{fault:?}: {took:?}");
            if fault == FakeFault::Revoke {
                // The fault deregistered the live regions behind the book's
                // back; the donor registers them again (as a restart would).
                let snapshot = memory_donor::rdma::snapshot(&donor.shared.tables());
                if let Some(book) = donor.shared.rdma() {
                    book.retain(&[]);
                    memory_donor::rdma::sync(book, snapshot);
                }
            }
            // The next lookups learn the region again, connect a new queue
            // pair, and read over RDMA. (A read without a completion holds
            // its queue pair's later completions back; the node gives the
            // queue pair up after `ORPHAN_LIMIT` and connects another.)
            back_over_rdma(&rack, &memory, &format!("{fault:?}")).await?;
        }
        // Counted by fault: RetryExceeded, the dead queue pair and the
        // silence as the donor gone; the rejected read; two revocations; the lost and the
        // late completion as timeouts (or as the queue pair given up).
        assert_eq!(count(&metrics.rdma_faults, "rejected"), 1);
        assert!(count(&metrics.rdma_faults, "revoked") >= 2);
        assert!(count(&metrics.rdma_faults, "peer_gone") >= 3);
        assert!(count(&metrics.rdma_faults, "timeout") >= 1);
        donor.kill(&rack).await;
        Ok(())
    })
}

/// A queue pair given up (its donor's end gone) is torn down off the
/// node's async workers and after the path's lock is let go: a real
/// teardown (destroying the queue pair, deregistering its buffer) blocks in
/// the driver. On a runtime of one thread, the test's, no queue pair may be
/// dropped on that thread.
#[test]
fn a_dead_queue_pair_is_torn_down_off_the_async_workers() -> Result<()> {
    fake();
    let rack = Rack::new("tls")?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let (donor, memory, _metrics) = warm(&rack, 5).await?;
        let worker = std::thread::current().id();
        let before = fake().fabric().queue_pair_drops(rack.rdma).len();
        fake().fabric().inject(rack.rdma, FakeFault::DeadQueuePair);
        let router = memory.router(1).context("no router")?;
        let rows: Vec<u64> = (0..24).map(|j| j * 97 % ROWS).collect();
        let mut out = vec![0u8; 24 * ROW_BYTES];
        let f = router.fetch(&rows, &mut out).await?;
        assert_eq!(f.source.as_deref(), Some("ssd"), "{f:?}");
        let deadline = Instant::now() + Duration::from_secs(5);
        let drops = loop {
            let d = fake().fabric().queue_pair_drops(rack.rdma);
            if d.len() > before {
                break d;
            }
            if Instant::now() > deadline {
                bail!("the dead queue pair was never torn down");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        assert!(
            drops[before..].iter().all(|t| *t != worker),
            "a queue pair was torn down on the async worker"
        );
        // And RDMA comes back on a new queue pair.
        back_over_rdma(&rack, &memory, "after the teardown").await?;
        donor.kill(&rack).await;
        Ok(())
    })
}

/// Wait (up to 2 s) until lookups are served by the donor over RDMA again.
async fn back_over_rdma(rack: &Rack, memory: &Routers, what: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut salt = 1000;
    loop {
        let before = reads(rack);
        let served = lookups(memory, 1, SEED, salt).await?;
        if served.iter().all(|s| s == "donor-a") && reads(rack) - before == 2 * 48 {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{what}: not read over RDMA again: {served:?}");
        }
        salt += 1;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[test]
fn a_restarted_donor_is_readmitted_and_its_regions_learned_again() -> Result<()> {
    fake();
    let rack = Rack::new("tls")?;
    runtime().block_on(async {
        let (donor, memory, _metrics) = warm(&rack, 5).await?;
        let gens: Vec<(u32, u64)> = donor.shared.rdma().map(|b| b.tables()).unwrap_or_default();
        donor.kill(&rack).await;
        // While it is down: the SSD copy, 0 wrong rows.
        let served = lookups(&memory, 10, SEED, 1).await?;
        assert!(served.iter().all(|s| s == "ssd"), "{served:?}");
        let donor = Donor::start(&rack).await?;
        let new: Vec<(u32, u64)> = donor.shared.rdma().map(|b| b.tables()).unwrap_or_default();
        assert!(
            new.iter().all(|n| !gens.contains(n)),
            "new generations: {gens:?} {new:?}"
        );
        // The probe re-admits it (100 ms interval); then RDMA again.
        tokio::time::sleep(Duration::from_millis(300)).await;
        back_over_rdma(&rack, &memory, "after the restart").await?;
        donor.kill(&rack).await;
        Ok(())
    })
}

#[test]
fn a_donor_without_rdma_is_read_over_tls_and_plaintext_gets_no_region() -> Result<()> {
    fake();
    let rack = Rack::new("tls")?;
    runtime().block_on(async {
        // Something else holds the RDMA address: the donor cannot listen
        // there and serves on TLS only (as a host without a device does).
        let squatter =
            fake().listen(rack.rdma, &DeviceSpec::default(), Arc::new(|_: &[u8]| None))?;
        let donor = Donor::start(&rack).await?;
        assert!(donor.shared.rdma().is_none());
        let metrics = NodeMetrics::new();
        let memory = node_with(&rack, &metrics).await?;
        let before = reads(&rack);
        let served = lookups(&memory, 50, SEED, 0).await?;
        assert!(served.iter().all(|s| s == "donor-a"), "{served:?}");
        assert_eq!(reads(&rack), before, "nothing over RDMA");
        assert_eq!(count(&metrics.rdma_lookups, "stream"), 100);
        drop(squatter);
        donor.kill(&rack).await;

        // A donor that serves RDMA never hands a region out in the clear.
        let donor = Donor::start(&rack).await?;
        let pinned: Vec<_> = rack
            .config
            .tables
            .iter()
            .map(|t| (t.id, t.digest))
            .collect();
        let opts = inference_node::ClientOptions::new("node-a", pinned);
        let client = inference_node::DonorClient::connect(rack.tcp, &opts).await?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        match client.region(1, deadline).await {
            Err(inference_node::client::ClientError::Donor { code, .. }) => {
                assert_eq!(code, ErrorCode::Unauthorized)
            }
            other => bail!("a region over plaintext: {other:?}"),
        }
        // The connection stays: a lookup still works on it.
        let mut out = vec![0u8; 24 * ROW_BYTES];
        let rows: Vec<u64> = (0..24).collect();
        client
            .lookup(
                &[inference_node::Request {
                    table: 1,
                    rows: &rows,
                }],
                &mut out,
            )
            .await?;
        assert_eq!(first_mismatch(SEED, 1, &rows, &out), None);
        donor.kill(&rack).await;
        Ok(())
    })
}

#[test]
fn a_donor_built_without_rdma_says_so_and_serves_on_its_other_addresses() -> Result<()> {
    let rack = Rack::new("tls")?;
    let config = rack.config.path.display().to_string();
    let donor = rack_harness::DonorProcess::start(&["--config", &config, "--name", "donor-a"])?;
    let tls = rack
        .config
        .donor("donor-a")
        .and_then(|d| d.endpoints(Some(Transport::Tls)).first().copied())
        .context("tls endpoint")?;
    let want = format!(
        "rdma://{} is not served: this build has no RDMA support (built without the `rdma` \
         feature); nodes reach this donor over {tls}",
        rack.rdma
    );
    // RDMA is set up after READY: the line comes after the ready line.
    donor.wait_line(Duration::from_secs(30), |l| {
        l.contains("is not served").then_some(())
    })?;
    let log = donor.log();
    let ready = log.find("ready listen=").context("no ready line")?;
    let rdma = log.find("is not served").context("no rdma line")?;
    assert!(ready < rdma, "RDMA set up before READY:\n{log}");
    // A build with the feature on a host without a device says "no RDMA
    // device found" instead (scripts/rdma-check.sh shows it).
    if engram_rdma::HAS_VERBS {
        assert!(log.contains("is not served: no RDMA device found"), "{log}");
    } else {
        assert!(log.contains(&want), "{log}");
    }
    assert!(!log.contains("ready listen=rdma"), "{log}");
    Ok(())
}
