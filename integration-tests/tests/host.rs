//! The host socket (`unix://PATH`) against a real donor process: the node
//! maps the donor's tables and serves lookups from the mapping (the donor
//! answers no lookup), the memory is sealed (every way to write it fails),
//! a user the donor does not allow is refused and counted, a `kill -9` of
//! the donor under load costs no lookup, a hot swap while four threads
//! read never gives a torn or wrong row, and a planar donor's memory is
//! what engines' host-table kernels read while its network rows stay the
//! same.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cluster_config::Config;
use engram_protocol::synthetic::{SplitMix64, first_mismatch};
use engram_protocol::{ROW_BYTES, TableDigest};
use engram_store::resident::ExpectedTable;
use engram_store::resident::RowLayout;
use inference_node::client::{ClientOptions, DonorClient, Request};
use inference_node::memory::Routers;
use inference_node::metrics::NodeMetrics;
use inference_node::source::{HostCounters, HostSource, RowSource, SourceError};
use rack_harness::rack_toml::{DonorEntry, NodeEntry, RackToml, RouteEntry, TableEntry};
use rack_harness::{DonorProcess, free_port, gen_table, runtime as rt, sample, scrape};

const ROWS: u64 = 50_000;

struct Rack {
    dir: tempfile::TempDir,
    config: Config,
    socket: PathBuf,
    tables: [(PathBuf, TableDigest); 2],
}

/// Donor `d` on loopback TCP and a host socket, serving table 1 (version
/// `v1`, seed 1; `v2`, seed 2, sits beside it for swaps), with a control
/// plane and metrics; node `n` routes table 1 to `["d", "ssd"]`. `edit`
/// changes the donor's entry.
fn rack(edit: impl FnOnce(&mut DonorEntry)) -> Rack {
    let dir = tempfile::tempdir().expect("tempdir");
    let (v1, d1) = gen_table(dir.path(), "v1.etab", 1, ROWS, 1).expect("gen v1");
    let (v2, d2) = gen_table(dir.path(), "v2.etab", 1, ROWS, 2).expect("gen v2");
    let socket = dir.path().join("d.sock");
    let mut toml = RackToml::new("t");
    toml.table = vec![TableEntry::new(1, &v1, ROWS, d1)];
    let listen = [
        format!("127.0.0.1:{}", free_port().expect("port")),
        format!("unix://{}", socket.display()),
    ];
    let mut donor = DonorEntry {
        ram_gib: 4.0,
        headroom_gib: Some(1.0),
        control: Some(format!("127.0.0.1:{}", free_port().expect("port"))),
        metrics: Some(format!("127.0.0.1:{}", free_port().expect("port"))),
        ..DonorEntry::new("d", listen, [1])
    };
    edit(&mut donor);
    toml.donor = vec![donor];
    let route = RouteEntry::new(1, ["d", "ssd"]).ssd_path(&v1).hedge("off");
    toml.node = vec![NodeEntry {
        tokens_per_second: Some(1.0),
        probe_interval_ms: Some(100),
        ..NodeEntry::new("n", vec![route])
    }];
    let path = dir.path().join("rack.toml");
    toml.write(&path).expect("config");
    let config = Config::load(&path).expect("valid config");
    Rack {
        dir,
        config,
        socket,
        tables: [(v1, d1), (v2, d2)],
    }
}

impl Rack {
    fn start(&self) -> DonorProcess {
        DonorProcess::start(&[
            "--config",
            &self.config.path.display().to_string(),
            "--name",
            "d",
        ])
        .expect("donor starts")
    }

    fn metrics(&self) -> String {
        scrape(
            self.config
                .donor("d")
                .and_then(|d| d.metrics)
                .expect("metrics"),
        )
        .expect("scrape")
    }

    fn pin(&self, v: usize) -> Vec<(u32, ExpectedTable)> {
        vec![(
            1,
            ExpectedTable {
                digest: self.tables[v].1,
                layer: 1,
                rows: ROWS,
            },
        )]
    }
}

fn random_rows(seed: u64, n: usize) -> Vec<u64> {
    let mut s = SplitMix64::new(seed);
    (0..n).map(|_| s.below(ROWS)).collect()
}

/// Wait (at most 10 s) for `f`.
fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn the_node_maps_the_donors_tables_and_the_donor_answers_no_lookup() {
    let rack = rack(|_| ());
    let donor = rack.start();
    let log = donor.log();
    assert!(
        log.contains(&format!("unix://{}", rack.socket.display())),
        "{log}"
    );
    rt().block_on(async {
        let metrics = Arc::new(NodeMetrics::new());
        let mem = Routers::from_config(&rack.config, "n", &metrics)
            .await
            .expect("memory");
        let router = mem.router(1).expect("router");
        for (i, n) in [1usize, 24, 48, 249, 16_384].into_iter().enumerate() {
            let rows = random_rows(i as u64, n);
            let mut out = vec![0u8; n * ROW_BYTES];
            // The first lookups may come before the mapping does.
            let t0 = Instant::now();
            let f = loop {
                let f = router.fetch(&rows, &mut out).await.expect("fetch");
                if f.source.as_deref() == Some("d") || t0.elapsed() > Duration::from_secs(10) {
                    break f;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            };
            assert_eq!(f.source.as_deref(), Some("d"), "{n} rows");
            assert_eq!(first_mismatch(1, 1, &rows, &out), None, "{n} rows");
        }
    });
    // Every row came from the mapping: the donor answered no lookup.
    let m = rack.metrics();
    assert_eq!(sample(&m, "engram_donor_lookups_total"), Some(0.0), "{m}");
    // SIGTERM ends it promptly, host clients and all, and its socket goes.
    let mut donor = donor;
    donor.signal(libc::SIGTERM);
    let st = donor
        .wait(Duration::from_secs(15))
        .expect("the donor exits");
    assert!(st.success(), "{st:?}");
    assert!(!rack.socket.exists(), "the socket file is removed");
}

#[test]
fn the_shared_memory_is_sealed_and_a_user_not_allowed_is_refused() {
    // Only root (this test, to check the descriptor) and uid or gid 4242.
    let rack = rack(|d| {
        d.host_uids = Some(vec![0, 4242]);
        d.host_gids = Some(vec![4242]);
    });
    let _donor = rack.start();
    let file = raw_first_table(&rack.socket);
    // The descriptor is read-only: writes through it fail.
    // SAFETY: pwrite of one byte from a literal.
    let n = unsafe { libc::pwrite(file.as_raw_fd(), b"x".as_ptr().cast(), 1, 0) };
    assert!(n < 0, "a write through the descriptor");
    // Opened again for writing, the seals refuse every change.
    let rw = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .expect("reopen for writing (root)");
    let e = std::os::unix::fs::FileExt::write_at(&rw, b"x", 0).expect_err("write is sealed");
    assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
    let e = rw.set_len(1).expect_err("shrink is sealed");
    assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
    let len = rw.metadata().expect("stat").len();
    let e = rw.set_len(len + 4096).expect_err("grow is sealed");
    assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
    // SAFETY: a shared writable mapping is asked for and must be refused.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            rw.as_raw_fd(),
            0,
        )
    };
    assert_eq!(
        p,
        libc::MAP_FAILED,
        "a writable shared mapping of sealed memory"
    );

    // A process of another user (uid 65534) is refused by its credentials,
    // with the reason, and counted. The socket is opened to everyone here
    // so that only the donor's check stands in the way.
    std::fs::set_permissions(
        rack.dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("chmod dir");
    std::fs::set_permissions(
        &rack.socket,
        std::os::unix::fs::PermissionsExt::from_mode(0o666),
    )
    .expect("chmod socket");
    let said = first_message_as(&rack.socket, 65534, 65534);
    assert!(
        said.contains("uid 65534 gid 65534") && said.contains("is not allowed"),
        "{said}"
    );
    wait_for("the refusal counted", || {
        sample(
            &rack.metrics(),
            "engram_donor_refusals_total{plane=\"host\",reason=\"peer_not_allowed\"}",
        ) == Some(1.0)
    });
}

/// The donor's first message to a process of `uid` and `gid` (a child
/// forked here that drops to them, connects and reads).
fn first_message_as(socket: &Path, uid: u32, gid: u32) -> String {
    let addr = daemon_runtime::hostsock::sockaddr(socket).expect("path");
    let mut pipe = [0i32; 2];
    // SAFETY: pipe(2) into our array.
    assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
    // SAFETY: the child calls only async-signal-safe functions (setgroups,
    // setgid, setuid, socket, connect, recv, write, _exit) on memory set
    // up before the fork.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork");
    if pid == 0 {
        // SAFETY: as above.
        unsafe {
            let mut buf = [0u8; 4096];
            let ok = libc::setgroups(0, std::ptr::null()) == 0
                && libc::setgid(gid) == 0
                && libc::setuid(uid) == 0;
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET, 0);
            let n = if ok
                && fd >= 0
                && libc::connect(
                    fd,
                    (&raw const addr).cast(),
                    size_of::<libc::sockaddr_un>() as libc::socklen_t,
                ) == 0
            {
                libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0)
            } else {
                -1
            };
            if n > 0 {
                libc::write(pipe[1], buf.as_ptr().cast(), n as usize);
            }
            libc::_exit(0);
        }
    }
    // SAFETY: closing our copy of the write end.
    unsafe { libc::close(pipe[1]) };
    // SAFETY: the read end is ours alone now.
    let mut r = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(pipe[0]) };
    let mut said = String::new();
    let _ = std::io::Read::read_to_string(&mut r, &mut said);
    let mut status = 0;
    // SAFETY: reaping our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    said
}

/// The first descriptor the donor sends on a new connection.
fn raw_first_table(socket: &Path) -> std::fs::File {
    raw_first_table_message(socket).1
}

/// The first message with a descriptor the donor sends on a new
/// connection, and the descriptor.
fn raw_first_table_message(socket: &Path) -> (serde_json::Value, std::fs::File) {
    use daemon_runtime::hostsock::{MAX_MESSAGE, connect, recv};
    let sock = connect(socket).expect("connect");
    let mut buf = vec![0u8; MAX_MESSAGE + 1];
    for _ in 0..8 {
        let (n, fd) = recv(sock.as_raw_fd(), &mut buf).expect("recv");
        assert!(n > 0 && n <= MAX_MESSAGE, "a message of {n} bytes");
        if let Some(f) = fd {
            return (serde_json::from_slice(&buf[..n]).expect("json"), f);
        }
    }
    panic!("no descriptor in the donor's first messages")
}

#[test]
fn kill_9_of_the_donor_under_load_costs_no_lookup() {
    let rack = rack(|_| ());
    let mut donor = rack.start();
    let metrics = NodeMetrics::new();
    let source = inference_node::metrics::SourceOnly { source: "d".into() };
    let counters = HostCounters {
        gaps: metrics.host_gaps.get_or_create(&source).clone(),
        generations: metrics.host_generations.get_or_create(&source).clone(),
    };
    let src = Arc::new(
        HostSource::with_counters("d", rack.socket.clone(), rack.pin(0), Some(counters))
            .expect("watch"),
    );
    wait_for("the mapping", || src.is_mapped(1));
    let generation = src.generation(1);
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let readers: Vec<_> = (0..4u64)
        .map(|k| {
            let (src, stop, done) = (Arc::clone(&src), Arc::clone(&stop), Arc::clone(&done));
            std::thread::spawn(move || {
                let mut out = vec![0u8; 24 * ROW_BYTES];
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    let rows = random_rows(k * 1_000_000 + i, 24);
                    src.read(1, &rows, &mut out)
                        .expect("served through the kill");
                    assert_eq!(first_mismatch(1, 1, &rows, &out), None);
                    done.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    donor.signal(libc::SIGKILL);
    donor.wait(Duration::from_secs(10)).expect("killed");
    let at_kill = done.load(Ordering::Relaxed);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        done.load(Ordering::Relaxed) > at_kill,
        "lookups go on after the kill"
    );
    wait_for("the gap counted", || src.gaps() == 1);
    let text = metrics.render();
    assert_eq!(
        sample(&text, "engram_node_host_gaps_total{source=\"d\"}"),
        Some(1.0),
        "{text}"
    );
    // Back: a new load (no fd store here), so a new generation, readied
    // while the readers read the old one, then put in their place.
    drop(donor);
    let _donor = rack.start();
    wait_for("the new generation", || {
        src.generation(1).is_some_and(|g| Some(g) != generation)
    });
    // The first mapping and the new generation, each put in service once.
    assert_eq!(src.generations(), 2);
    let text = metrics.render();
    assert_eq!(
        sample(&text, "engram_node_host_generations_total{source=\"d\"}"),
        Some(2.0),
        "{text}"
    );
    std::thread::sleep(Duration::from_millis(100));
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        r.join().expect("no reader failed");
    }
}

#[test]
fn a_swap_while_four_threads_read_gives_no_torn_or_wrong_row() {
    let rack = rack(|_| ());
    let donor = rack.start();
    let ops = donor.ops().expect("ops");
    let v1 = Arc::new(HostSource::new("d", rack.socket.clone(), rack.pin(0)).expect("watch"));
    let v2 = HostSource::new("d", rack.socket.clone(), rack.pin(1)).expect("watch");
    wait_for("v1 mapped", || v1.is_mapped(1));
    // An engine's view of v1, held across the swap.
    let held = v1.view(1).expect("a view of v1");
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..4u64)
        .map(|k| {
            let (src, stop) = (Arc::clone(&v1), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut out = vec![0u8; 48 * ROW_BYTES];
                let (mut ok, mut mismatched) = (0u64, 0u64);
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    let rows = random_rows(k * 1_000_000 + i, 48);
                    i += 1;
                    match src.read(1, &rows, &mut out) {
                        Ok(()) => {
                            // Every row v1's, whole: never torn, never v2's.
                            assert_eq!(first_mismatch(1, 1, &rows, &out), None, "a v1 reader");
                            ok += 1;
                        }
                        Err(SourceError::VersionMismatch { .. }) => mismatched += 1,
                        Err(e) => panic!("unexpected: {e}"),
                    }
                }
                (ok, mismatched)
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    rt().block_on(async {
        use engram_protocol::control::SwapTableRequest;
        use engram_protocol::control::donor_control_client::DonorControlClient;
        let mut c = DonorControlClient::connect(ops.control_uri())
            .await
            .expect("control");
        c.swap_table(SwapTableRequest {
            table_id: 1,
            path: rack.tables[1].0.display().to_string(),
            expected_digest: rack.tables[1].1.to_hex(),
            in_place: false,
        })
        .await
        .expect("swap");
    });
    wait_for("v2 mapped by its pin", || v2.is_mapped(1));
    wait_for("v1 unmapped", || !v1.is_mapped(1));
    let mut out = vec![0u8; 24 * ROW_BYTES];
    let rows = random_rows(99, 24);
    v2.read(1, &rows, &mut out).expect("v2 rows");
    assert_eq!(first_mismatch(2, 1, &rows, &out), None, "v2's rows");
    // The held view still maps v1, whole, after the source let it go; a
    // fresh view is v2's.
    assert!(v1.view(1).is_none());
    assert_eq!(held.digest(), rack.tables[0].1);
    let all: Vec<u64> = (0..ROWS).collect();
    let bytes: Vec<u8> = all
        .iter()
        .flat_map(|&r| held.row(r).expect("row").to_vec())
        .collect();
    assert_eq!(
        first_mismatch(1, 1, &all, &bytes),
        None,
        "the held view is v1's"
    );
    assert_eq!(held.bytes().len(), ROWS as usize * ROW_BYTES);
    assert_eq!(v2.view(1).map(|v| v.digest()), Some(rack.tables[1].1));
    drop(held);
    std::thread::sleep(Duration::from_millis(50));
    stop.store(true, Ordering::Relaxed);
    let mut total = (0, 0);
    for r in readers {
        let (ok, mm) = r.join().expect("no reader failed");
        total.0 += ok;
        total.1 += mm;
    }
    assert!(
        total.0 > 0 && total.1 > 0,
        "reads before and after: {total:?}"
    );
    let probed = rt().block_on(v1.probe()).expect("probe");
    assert!(
        probed.contains(&(1, rack.tables[1].1)),
        "v1's source reports the donor's new version: {probed:?}"
    );
}

/// The lines of `pid`'s `numa_maps` for the donor's table memory.
fn table_numa_maps(pid: u32) -> Vec<String> {
    std::fs::read_to_string(format!("/proc/{pid}/numa_maps"))
        .expect("numa_maps")
        .lines()
        .filter(|l| l.contains("memfd:engram-table"))
        .map(str::to_string)
        .collect()
}

#[test]
fn numa_node_binds_the_tables_for_the_donor_and_every_process_that_maps_them() {
    // This host has one NUMA node (0); the binding shows in numa_maps as
    // the mapping's policy, for the donor and for a process mapping it.
    let bound = rack(|d| d.numa_node = Some(0));
    let donor = bound.start();
    let maps = table_numa_maps(donor.id());
    assert!(!maps.is_empty(), "the donor maps no table memory");
    assert!(maps.iter().all(|l| l.contains(" bind:0 ")), "{maps:?}");
    let host = HostSource::new("d", bound.socket.clone(), bound.pin(0)).expect("host source");
    wait_for("the mapping", || host.is_mapped(1));
    // Touch every row: the pages this process maps are node 0's.
    let all: Vec<u64> = (0..ROWS).collect();
    let mut out = vec![0u8; all.len() * ROW_BYTES];
    host.read(1, &all, &mut out).expect("read");
    assert_eq!(first_mismatch(1, 1, &all, &out), None);
    let mine = table_numa_maps(std::process::id());
    assert!(
        mine.iter()
            .any(|l| l.contains(" bind:0 ") && l.contains(" N0=")),
        "this process's mapping: {mine:?}"
    );
    drop(host);
    drop(donor);

    // A node this host does not have: the donor says so and exits.
    let far = rack(|d| d.numa_node = Some(7));
    let mut p = DonorProcess::launch(&[
        "--config",
        &far.config.path.display().to_string(),
        "--name",
        "d",
    ])
    .expect("launch");
    let st = p.wait(Duration::from_secs(30)).expect("the donor exits");
    assert!(!st.success());
    let log = p.log();
    assert!(
        log.contains("NUMA node 7 is not online on this host (its nodes: 0)"),
        "{log}"
    );
}

#[test]
fn a_planar_donor_shares_engine_layout_and_answers_the_same_rows() {
    let rack = rack(|d| d.host_layout = Some("planar".into()));
    let donor = rack.start();
    // The host socket says so, with where the scales start.
    let scales_at = engram_store::kept::planar_scales_at(ROWS).expect("at") as usize;
    let (said, _) = raw_first_table_message(&rack.socket);
    assert_eq!(said["layout"], "planar", "{said}");
    assert_eq!(said["scales_at"], scales_at as u64, "{said}");
    let host = HostSource::new("d", rack.socket.clone(), rack.pin(0)).expect("host source");
    wait_for("the mapping", || host.is_mapped(1));
    let view = host.view(1).expect("view");
    assert_eq!(view.layout(), RowLayout::Planar { scales_at });
    assert_eq!(view.offset(3), None, "split rows have no single offset");
    // Every row, through the mapping and where a kernel reads it.
    let all: Vec<u64> = (0..ROWS).collect();
    let mut out = vec![0u8; all.len() * ROW_BYTES];
    host.read(1, &all, &mut out).expect("read");
    assert_eq!(first_mismatch(1, 1, &all, &out), None);
    let bytes = view.bytes();
    for r in random_rows(5, 1000) {
        let (v, s) = view.offsets(r).expect("offsets");
        let row = &out[r as usize * ROW_BYTES..][..ROW_BYTES];
        assert_eq!((v, s), (r as usize * 256, scales_at + r as usize * 8));
        assert_eq!(&bytes[v..v + 256], &row[..256], "row {r}'s values");
        assert_eq!(&bytes[s..s + 8], &row[256..], "row {r}'s scales");
    }
    // Over the network the donor gathers the same rows from planar memory,
    // for every size up to a long lookup.
    let addr = rack.config.donor("d").expect("donor").listen[0].addr;
    rt().block_on(async {
        let pins = vec![(1, rack.tables[0].1)];
        let c = DonorClient::connect(addr, &ClientOptions::new("n", pins))
            .await
            .expect("connects");
        for n in [1usize, 24, 48, 16_384] {
            let rows = random_rows(n as u64, n);
            let mut got = vec![0u8; n * ROW_BYTES];
            let req = [Request {
                table: 1,
                rows: &rows,
            }];
            c.lookup(&req, &mut got).await.expect("lookup");
            assert_eq!(first_mismatch(1, 1, &rows, &got), None, "{n} rows");
        }
    });
    drop(host);
    drop(donor);
    // Planar without a host socket is refused, naming the key.
    let dir = tempfile::tempdir().expect("tempdir");
    let mut toml = RackToml::new("t");
    toml.table = vec![TableEntry::new(
        1,
        &rack.tables[0].0,
        ROWS,
        rack.tables[0].1,
    )];
    toml.donor = vec![DonorEntry {
        host_layout: Some("planar".into()),
        ..DonorEntry::new("d", ["127.0.0.1:7400"], [1])
    }];
    let path = dir.path().join("rack.toml");
    toml.write(&path).expect("config");
    let e = Config::load(&path).expect_err("planar without a host socket");
    assert!(e.to_string().contains("host_layout"), "{e}");
    assert!(e.to_string().contains("host socket"), "{e}");
}
