//! The data plane on every transport (TCP, TLS, QUIC) against one real
//! donor process listening on all three: lookups of every size that
//! matters (1, 24, 48, 248 and 249 rows around the 64 KiB of one TLS
//! buffer, 1,000, and the donor's `max_rows`), pipelined bursts of 64 on
//! one connection, a serving batch of 64 sequences and a 32k-position
//! prefill through the embedded node, and readers that read slowly or not
//! at all. Each case checks every row against the generator or a local
//! copy, and that the donor served it: the nodes route to the donor and
//! then an SSD copy, which would serve the same rows silently if the
//! donor's connection failed. No connection is ever closed on an error,
//! except the stalled reader's, which the write timeout cuts off.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cluster_config::{Config, Transport};
use engram_protocol::synthetic::{SplitMix64, first_mismatch};
use engram_protocol::{Frame, Limits, LookupSection, ROW_BYTES, TableDigest};
use inference_node::client::{ClientOptions, DonorClient, Request, TlsClient};
use inference_node::embed::{EmbeddedNode, MetricsAt, OpenOptions, Segment};
use inference_node::memory::Routers;
use inference_node::metrics::NodeMetrics;
use inference_node::tls::NodeTls;
use rack_harness::rack_toml::{
    DonorEntry, LinkEntry, ModelSection, NodeEntry, RackToml, RouteEntry, TableEntry, TlsSection,
};
use rack_harness::{DonorProcess, gen_hashed_table, rack_pki, runtime as rt, sample, scrape};

/// Hashing base of the tables (about 120,000 rows each).
const BASE: u64 = 5000;
const SEED: u64 = 5;
/// The donor's frame cap, in rows.
const MAX_ROWS: usize = engram_protocol::frame::DEFAULT_MAX_ROWS as usize;
/// Lookup sizes: around one TLS send buffer (248 rows is the largest
/// answer under 64 KiB, 249 the smallest over), a serving batch, the cap.
const SIZES: [usize; 7] = [1, 24, 48, 248, 249, 1000, MAX_ROWS];
const TRANSPORTS: [Transport; 3] = [Transport::Tcp, Transport::Tls, Transport::Quic];
/// The donor's write timeout: what cuts a reader that stopped reading off.
const WRITE_TIMEOUT_MS: u64 = 1500;

fn free_port() -> u16 {
    rack_harness::free_port().expect("free port")
}

fn node_of(t: Transport) -> &'static str {
    match t {
        Transport::Tcp => "n-tcp",
        Transport::Tls => "n-tls",
        Transport::Quic => "n-quic",
        Transport::Rdma => unreachable!("not in the matrix"),
    }
}

/// Donor `d` on TCP, TLS and QUIC serving tables 1 and 14; nodes `n-tcp`,
/// `n-tls` and `n-quic` reach it over the transport their names say, each
/// route `["d", "ssd"]` with hedging off, and windows (a token every 20 s,
/// a grace of 1 s) and timeouts no slow machine reaches, so the SSD copy
/// serves only if the donor fails;
/// node `ref` reads its own copies in RAM.
struct Rack {
    _dir: tempfile::TempDir,
    config: Config,
    digests: [(u32, TableDigest); 2],
    rows: [u64; 2],
    donor: DonorProcess,
}

impl Rack {
    fn start() -> Self {
        // The node's warnings (a lost connection and why) show with a
        // failure.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
            )
            .with_test_writer()
            .try_init();
        let dir = tempfile::tempdir().expect("tempdir");
        let (l1, d1) = gen_hashed_table(dir.path(), "l1.etab", 1, BASE, SEED).expect("gen");
        let (l14, d14) = gen_hashed_table(dir.path(), "l14.etab", 14, BASE, SEED).expect("gen");
        let params = engram_protocol::hashing::HashParams::new(
            engram_protocol::hashing::Preset::from_base(BASE).expect("preset"),
        )
        .expect("params");
        let rows = [params.layers[0].rows, params.layers[1].rows];
        let path = write_config(dir.path(), [(&l1, d1), (&l14, d14)], rows);
        rack_pki(&path).expect("rack PKI");
        let config = Config::load(&path).expect("valid config");
        let donor = DonorProcess::start(&["--config", &path.display().to_string(), "--name", "d"])
            .expect("donor starts");
        Self {
            _dir: dir,
            config,
            digests: [(1, d1), (14, d14)],
            rows,
            donor,
        }
    }

    fn addr(&self, t: Transport) -> SocketAddr {
        self.donor.endpoint(t).expect("the donor listens on it")
    }

    fn metrics(&self) -> String {
        let addr = self
            .config
            .donor("d")
            .and_then(|d| d.metrics)
            .expect("metrics");
        scrape(addr).expect("scrape")
    }

    /// The donor's `connection_errors_total` samples: (reason, count).
    fn connection_errors(&self) -> Vec<(String, f64)> {
        self.metrics()
            .lines()
            .filter_map(|l| {
                let rest = l.strip_prefix("engram_donor_connection_errors_total{reason=\"")?;
                let (reason, value) = rest.split_once("\"} ")?;
                Some((reason.to_string(), value.parse().ok()?))
            })
            .collect()
    }

    fn accepted(&self) -> f64 {
        sample(&self.metrics(), "engram_donor_connections_accepted_total").unwrap_or(0.0)
    }

    /// Node `node`'s client options over `t` (its own certificate).
    fn opts(&self, t: Transport) -> ClientOptions {
        let node = node_of(t);
        let mut o = ClientOptions::new(node, self.digests.to_vec());
        o.transport = t;
        o.connect_timeout = Duration::from_secs(10);
        o.lookup_timeout = Duration::from_secs(30);
        if t.is_secure() {
            let files = self.config.tls_files(node).expect("tls files");
            o.tls = Some(TlsClient {
                tls: NodeTls::load(&files).expect("node material"),
                server_name: cluster_config::tls::server_name("d").expect("name"),
            });
        }
        o
    }

    /// `n` random row ids of table `slot` (0: table 1, 1: table 14).
    fn random_rows(&self, slot: usize, n: usize, seed: u64) -> Vec<u64> {
        let mut s = SplitMix64::new(seed);
        (0..n).map(|_| s.below(self.rows[slot])).collect()
    }

    /// No connection was closed on an error, on any transport.
    fn assert_no_connection_errors(&self) {
        let errors = self.connection_errors();
        assert!(
            errors.is_empty(),
            "connections closed on errors: {errors:?}"
        );
    }
}

fn write_config(dir: &Path, tables: [(&Path, TableDigest); 2], rows: [u64; 2]) -> PathBuf {
    let (tcp, tls, quic, metrics) = (free_port(), free_port(), free_port(), free_port());
    let mut rack = RackToml::new("t");
    rack.rack.tls = Some(TlsSection::default());
    rack.table = [1, 14]
        .into_iter()
        .zip(tables)
        .zip(rows)
        .map(|((layer, (path, digest)), rows)| TableEntry::new(layer, path, rows, digest))
        .collect();
    let listen = [
        format!("tcp://127.0.0.1:{tcp}"),
        format!("tls://127.0.0.1:{tls}"),
        format!("quic://127.0.0.1:{quic}"),
    ];
    rack.donor = vec![DonorEntry {
        metrics: Some(format!("127.0.0.1:{metrics}")),
        write_timeout_ms: Some(WRITE_TIMEOUT_MS),
        clients: Some(vec!["n-tcp".into(), "n-tls".into(), "n-quic".into()]),
        ..DonorEntry::new("d", listen, [1, 14])
    }];
    let routes = |sources: &[&str]| -> Vec<RouteEntry> {
        [(1, tables[0].0), (14, tables[1].0)]
            .into_iter()
            .map(|(t, path)| RouteEntry {
                grace_us: Some(1_000_000),
                ..RouteEntry::new(t, sources.iter().copied())
                    .ssd_path(path)
                    .hedge("off")
            })
            .collect()
    };
    for t in TRANSPORTS {
        rack.node.push(NodeEntry {
            tokens_per_second: Some(0.05),
            probe_interval_ms: Some(200),
            connect_timeout_ms: Some(10_000),
            lookup_timeout_ms: Some(30_000),
            link: vec![LinkEntry::new("d", t)],
            ..NodeEntry::new(node_of(t), routes(&["d", "ssd"]))
        });
    }
    rack.node.push(NodeEntry::new("ref", routes(&["local"])));
    rack.model = Some(ModelSection::synthetic(BASE, 3, 8, 2));
    let path = dir.join("rack.toml");
    rack.write(&path).expect("config");
    path
}

/// Rows served by `source` for `table`, by the node's own count.
fn served(m: &NodeMetrics, table: u32, source: &str) -> f64 {
    let series = format!("engram_node_rows_served_total{{table=\"{table}\",source=\"{source}\"}}");
    sample(&m.render(), &series).unwrap_or(0.0)
}

/// A lookup of `rows` of table 1 through `c`, every row checked against
/// the generator.
async fn lookup_checked(c: &DonorClient, rows: &[u64]) -> Result<(), String> {
    let mut out = vec![0u8; rows.len() * ROW_BYTES];
    c.lookup(&[Request { table: 1, rows }], &mut out)
        .await
        .map_err(|e| e.to_string())?;
    match first_mismatch(SEED, 1, rows, &out) {
        None => Ok(()),
        Some(at) => Err(format!("row {at} is not the generator's")),
    }
}

#[test]
fn every_lookup_size_is_served_by_the_donor_on_every_transport() {
    let rack = Rack::start();
    rt().block_on(async {
        for t in TRANSPORTS {
            // Straight through one client: each size of one table, then the
            // cap split over both tables in one message.
            let c = DonorClient::connect(rack.addr(t), &rack.opts(t))
                .await
                .unwrap_or_else(|e| panic!("{t}: connect: {e}"));
            for (i, &n) in SIZES.iter().enumerate() {
                let rows = rack.random_rows(0, n, i as u64);
                lookup_checked(&c, &rows)
                    .await
                    .unwrap_or_else(|e| panic!("{t}: a lookup of {n} rows: {e}"));
            }
            let (a, b) = (
                rack.random_rows(0, MAX_ROWS / 2, 90),
                rack.random_rows(1, MAX_ROWS / 2, 91),
            );
            let mut out = vec![0u8; MAX_ROWS * ROW_BYTES];
            c.lookup(
                &[
                    Request { table: 1, rows: &a },
                    Request {
                        table: 14,
                        rows: &b,
                    },
                ],
                &mut out,
            )
            .await
            .unwrap_or_else(|e| panic!("{t}: two sections of {} rows: {e}", MAX_ROWS / 2));
            let (o1, o14) = out.split_at(a.len() * ROW_BYTES);
            assert_eq!(first_mismatch(SEED, 1, &a, o1), None, "{t}, table 1");
            assert_eq!(first_mismatch(SEED, 14, &b, o14), None, "{t}, table 14");
            assert!(!c.is_closed(), "{t}: the connection stays open");

            // Through the node's router, which would fall back to its SSD
            // copy if the donor failed: every size served by the donor.
            let metrics = Arc::new(NodeMetrics::new());
            let mem = Routers::from_config(&rack.config, node_of(t), &metrics)
                .await
                .expect("memory");
            let router = mem.router(1).expect("router");
            let mut total = 0;
            for (i, &n) in SIZES.iter().enumerate() {
                let rows = rack.random_rows(0, n, 100 + i as u64);
                let mut out = vec![0u8; n * ROW_BYTES];
                let f = router.fetch(&rows, &mut out).await.expect("fetch");
                assert_eq!(f.source.as_deref(), Some("d"), "{t}, {n} rows: served by");
                assert_eq!(f.failovers, 0, "{t}, {n} rows");
                assert_eq!(first_mismatch(SEED, 1, &rows, &out), None, "{t}, {n} rows");
                total += n;
            }
            assert_eq!(served(&metrics, 1, "d"), total as f64, "{t}");
            assert_eq!(served(&metrics, 1, "ssd"), 0.0, "{t}");
        }
    });
    rack.assert_no_connection_errors();
}

#[test]
fn pipelined_bursts_of_64_are_served_on_one_connection_on_every_transport() {
    let rack = Rack::start();
    rt().block_on(async {
        for t in TRANSPORTS {
            let metrics = Arc::new(NodeMetrics::new());
            let mem = Routers::from_config(&rack.config, node_of(t), &metrics)
                .await
                .expect("memory");
            let router = mem.router(1).expect("router").clone();
            // The connection is made by the first lookup; every burst after
            // it is pipelined on that connection.
            let mut one = vec![0u8; ROW_BYTES];
            router.fetch(&[0], &mut one).await.expect("first lookup");
            let accepted = rack.accepted();
            let mut total = 1;
            for (k, &n) in [24, 48, 249, 1000].iter().enumerate() {
                let mut burst = tokio::task::JoinSet::new();
                for i in 0..64u64 {
                    let rows = rack.random_rows(0, n, 1000 * k as u64 + i);
                    let router = router.clone();
                    burst.spawn(async move {
                        let mut out = vec![0u8; rows.len() * ROW_BYTES];
                        let f = router.fetch(&rows, &mut out).await;
                        (rows, out, f)
                    });
                }
                for (rows, out, f) in burst.join_all().await {
                    let f = f.unwrap_or_else(|e| panic!("{t}: a burst of {n}-row lookups: {e}"));
                    assert_eq!(f.source.as_deref(), Some("d"), "{t}, bursts of {n} rows");
                    assert_eq!(f.failovers, 0, "{t}, bursts of {n} rows");
                    assert_eq!(first_mismatch(SEED, 1, &rows, &out), None, "{t}, {n} rows");
                }
                total += 64 * n;
            }
            assert_eq!(served(&metrics, 1, "d"), total as f64, "{t}");
            assert_eq!(
                rack.accepted(),
                accepted,
                "{t}: no connection was made again"
            );
        }
    });
    rack.assert_no_connection_errors();
}

/// Both layers' rows of a prefetch of `ids` (cut into `segments`) from
/// `mem`, with how each layer was served.
fn prefetch(
    mem: &EmbeddedNode,
    ids: &[i64],
    segments: &[Segment],
) -> [(Vec<u8>, inference_node::embed::Served); 2] {
    let ticket = mem.prefetch(ids, segments).expect("prefetch");
    [1, 14].map(|layer| {
        let mut out = vec![0u8; ticket.bytes()];
        let served = ticket
            .wait(layer, &mut out, Some(Duration::from_secs(60)))
            .unwrap_or_else(|e| panic!("layer {layer}: {e}"));
        (out, served)
    })
}

#[test]
fn a_batch_of_64_sequences_and_a_32k_prefill_through_the_node_are_served_by_the_donor() {
    let rack = Rack::start();
    let open = |node: &str| {
        let opts = OpenOptions {
            metrics: MetricsAt::Off,
        };
        EmbeddedNode::open_with(&rack.config.path, node, &opts).expect("open")
    };
    let reference = open("ref");
    let mut rng = SplitMix64::new(7);
    // A serving batch: 64 sequences of 1 to 17 positions, each after its
    // own three tokens of context.
    let mut batch_ids = Vec::new();
    let mut segments = Vec::new();
    for s in 0..64 {
        let len = 1 + s % 17;
        let context: Vec<i64> = (0..3).map(|_| rng.below(99_000) as i64).collect();
        batch_ids.extend((0..len).map(|_| rng.below(99_000) as i64));
        segments.push(Segment::after(len, &context));
    }
    // A prefill of 32,768 positions.
    let prompt: Vec<i64> = (0..32_768).map(|_| rng.below(99_000) as i64).collect();
    let cases: [(&str, &[i64], Vec<Segment>); 2] = [
        ("a batch of 64 sequences", &batch_ids, segments),
        (
            "a 32k-position prefill",
            &prompt,
            vec![Segment::start(prompt.len())],
        ),
    ];
    let want: Vec<_> = cases
        .iter()
        .map(|(_, ids, segs)| prefetch(&reference, ids, segs))
        .collect();
    for t in TRANSPORTS {
        let mem = open(node_of(t));
        for ((what, ids, segs), want) in cases.iter().zip(&want) {
            for ((rows, served), (want_rows, _)) in prefetch(&mem, ids, segs).iter().zip(want) {
                let layer = served.layer;
                assert_eq!(
                    served.sources,
                    ["d"],
                    "{t}, {what}, layer {layer}: served by"
                );
                assert_eq!(served.failovers, 0, "{t}, {what}, layer {layer}");
                assert!(
                    rows == want_rows,
                    "{t}, {what}, layer {layer}: rows differ from the local copy's"
                );
            }
        }
        let stats = mem.stats().expect("stats");
        assert!(
            stats.iter().all(|s| s.failed == 0 && s.failovers == 0),
            "{t}: {stats:?}"
        );
        // The prefill is a sweep of many messages on one connection.
        assert!(stats[0].messages > 2, "{t}: {stats:?}");
        mem.close(Duration::from_secs(2));
    }
    reference.close(Duration::from_secs(2));
    rack.assert_no_connection_errors();
}

/// A TLS client may update its keys at any time (a TLS 1.3 KeyUpdate that
/// asks the donor to update its own too): the donor follows, answers with
/// its new keys, and the session goes on (PROTOCOL.md section 3.9).
#[test]
fn a_tls_client_that_updates_its_keys_keeps_being_answered() {
    let rack = Rack::start();
    let limits = Limits::default();
    let mut raw = Raw::open(&rack, Transport::Tls);
    for i in 0..4u64 {
        if i > 0 {
            let Raw::Tls(s) = &mut raw else {
                unreachable!("opened over TLS")
            };
            s.conn.refresh_traffic_keys().expect("a key update");
        }
        let rows = rack.random_rows(0, 48, 70 + i);
        raw.lookup(&rack, 2 + i, &rows);
        let frame = raw.frame(usize::MAX, Duration::ZERO);
        let d = engram_protocol::decode(&frame, &limits)
            .expect("valid frame")
            .expect("whole frame");
        let Frame::Rows(r) = d.frame else {
            panic!("not a Rows answer: {:?}", d.frame)
        };
        let (_, data) = r.sections().next().expect("a section");
        assert_eq!(first_mismatch(SEED, 1, &rows, data), None, "answer {i}");
    }
    drop(raw);
    rack.assert_no_connection_errors();
}

/// A raw data-plane session (plain TCP, or TLS with node `n-tls`'s
/// certificate) that reads exactly what the test says, when it says.
enum Raw {
    Tcp(TcpStream),
    Tls(Box<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>),
}

impl Raw {
    fn open(rack: &Rack, t: Transport) -> Self {
        let tcp = TcpStream::connect(rack.addr(t)).expect("connect");
        tcp.set_read_timeout(Some(Duration::from_secs(20)))
            .expect("timeout");
        let mut raw = match t {
            Transport::Tcp => Raw::Tcp(tcp),
            Transport::Tls => {
                let files = rack.config.tls_files("n-tls").expect("files");
                let config = NodeTls::load(&files).expect("material").client_config();
                let name = cluster_config::tls::server_name("d").expect("name");
                let session = rustls::ClientConnection::new(config, name).expect("session");
                Raw::Tls(Box::new(rustls::StreamOwned::new(session, tcp)))
            }
            _ => unreachable!("raw sessions are TCP or TLS"),
        };
        let mut hello = Vec::new();
        engram_protocol::Hello {
            version: engram_protocol::PROTOCOL_VERSION,
            node: node_of(t),
            credential: b"",
        }
        .encode(&mut hello, 1)
        .expect("hello");
        raw.write_all(&hello).expect("hello");
        let welcome = raw.frame(usize::MAX, Duration::ZERO);
        assert!(
            matches!(
                engram_protocol::decode(&welcome, &Limits::default()),
                Ok(Some(d)) if matches!(d.frame, Frame::Welcome(_))
            ),
            "no Welcome"
        );
        raw
    }

    fn write_all(&mut self, b: &[u8]) -> std::io::Result<()> {
        match self {
            Raw::Tcp(s) => s.write_all(b),
            Raw::Tls(s) => s.write_all(b).and_then(|()| s.flush()),
        }
    }

    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Raw::Tcp(s) => s.read(b),
            Raw::Tls(s) => s.read(b),
        }
    }

    /// One whole frame, read at most `chunk` bytes at a time with `pause`
    /// after each read.
    fn frame(&mut self, chunk: usize, pause: Duration) -> Vec<u8> {
        let mut buf = Vec::new();
        let mut piece = vec![0u8; chunk.min(1 << 20)];
        loop {
            let want = match engram_protocol::FrameHeader::peek(&buf, &Limits::default()) {
                Ok(Some(h)) if buf.len() >= h.frame_len() => return buf,
                Ok(Some(h)) => h.frame_len() - buf.len(),
                Ok(None) => engram_protocol::HEADER_LEN - buf.len(),
                Err(e) => panic!("bad frame from the donor: {e}"),
            };
            let take = want.min(piece.len());
            let n = self.read(&mut piece[..take]).expect("read");
            assert!(n > 0, "the donor closed the connection");
            buf.extend_from_slice(&piece[..n]);
            if !pause.is_zero() {
                std::thread::sleep(pause);
            }
        }
    }

    fn lookup(&mut self, rack: &Rack, id: u64, rows: &[u64]) {
        let mut out = Vec::new();
        encode(&mut out, rack, id, rows);
        self.write_all(&out).expect("send lookup");
    }
}

/// Append a Lookup of `rows` of table 1.
fn encode(out: &mut Vec<u8>, rack: &Rack, id: u64, rows: &[u64]) {
    engram_protocol::messages::encode_lookup(
        out,
        id,
        &[LookupSection {
            table_id: 1,
            digest_prefix: rack.digests[0].1.prefix(),
            rows,
        }],
    )
    .expect("encode");
}

/// The donor's resident memory, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmRSS")
        * 1024
}

#[test]
fn a_slow_reader_gets_every_answer_and_a_stalled_one_is_cut_off_without_pinning_memory() {
    let rack = Rack::start();
    let limits = Limits::for_caps(MAX_ROWS as u32, 16);
    for t in [Transport::Tcp, Transport::Tls] {
        // 16 pipelined lookups of 4,096 rows (17 MB of answers), read
        // 16 KiB at a time with a pause after each read: the donor's
        // writes wait on the reader again and again, never for long.
        let mut slow = Raw::open(&rack, t);
        let asked: Vec<Vec<u64>> = (0..16)
            .map(|i| rack.random_rows(0, 4096, 500 + i))
            .collect();
        for (i, rows) in asked.iter().enumerate() {
            slow.lookup(&rack, 2 + i as u64, rows);
        }
        for (i, rows) in asked.iter().enumerate() {
            let frame = slow.frame(16 << 10, Duration::from_micros(300));
            let d = engram_protocol::decode(&frame, &limits)
                .expect("valid frame")
                .expect("whole frame");
            assert_eq!(d.header.request_id, 2 + i as u64, "{t}: answers in order");
            let Frame::Rows(r) = d.frame else {
                panic!("{t}: not a Rows answer: {:?}", d.frame)
            };
            let (_, data) = r.sections().next().expect("a section");
            assert_eq!(first_mismatch(SEED, 1, rows, data), None, "{t}, answer {i}");
        }
        drop(slow);
    }
    rack.assert_no_connection_errors();

    let base_rss = rss(rack.donor.id());
    for (k, t) in [Transport::Tcp, Transport::Tls].into_iter().enumerate() {
        // 64 lookups at the cap (277 MB of answers) that are never read.
        // The donor stops reading requests while its writes wait, so they
        // are sent from a thread of their own, which the donor's close
        // (a failed write) ends.
        let mut stalled = Raw::open(&rack, t);
        let mut requests = Vec::new();
        for i in 0..64 {
            encode(
                &mut requests,
                &rack,
                2 + i,
                &rack.random_rows(0, MAX_ROWS, 900 + i),
            );
        }
        let sender = std::thread::spawn(move || {
            let _ = stalled.write_all(&requests);
            stalled
        });
        // Meanwhile another node is served over the same transport.
        rt().block_on(async {
            let c = DonorClient::connect(rack.addr(t), &rack.opts(t))
                .await
                .expect("a second client connects");
            for i in 0..50 {
                let rows = rack.random_rows(0, 24, i);
                lookup_checked(&c, &rows)
                    .await
                    .expect("served beside a stalled reader");
            }
        });
        // The write timeout cuts the stalled reader off, counted by reason;
        // until then the donor holds no more than a few buffers for it.
        let began = Instant::now();
        let mut peak = 0;
        while rack
            .connection_errors()
            .iter()
            .find(|(r, _)| r == "write_timeout")
            .map_or(0.0, |e| e.1)
            < (k + 1) as f64
        {
            peak = peak.max(rss(rack.donor.id()));
            assert!(
                began.elapsed() < Duration::from_secs(30),
                "{t}: the stalled reader was never cut off: {:?}",
                rack.connection_errors()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let grew = peak.saturating_sub(base_rss);
        assert!(
            grew < 48 << 20,
            "{t}: the donor's memory grew by {grew} bytes for a reader that reads nothing"
        );
        drop(sender.join().expect("sender"));
    }
    let errors = rack.connection_errors();
    assert_eq!(errors, [("write_timeout".to_string(), 2.0)], "{errors:?}");
    let log = rack.donor.log();
    assert!(
        log.contains("connection closed on an error") && log.contains("write_timeout"),
        "{log}"
    );
}
