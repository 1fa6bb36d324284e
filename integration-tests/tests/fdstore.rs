//! Instant restarts from systemd's file descriptor store, under a fake
//! systemd that keeps the descriptors the donor hands it and passes them
//! back when it starts the donor again (`LISTEN_FDS`, `LISTEN_FDNAMES`):
//! a donor that copies its tables (`--copy-tables`, as one with RDMA, a
//! host socket or a NUMA node does) killed with SIGKILL serves the same
//! copy again without reading
//! its file; a copy of another version, or one that is not complete, is
//! refused, released from the store and the file loaded; a swapped-in
//! version replaces the old one in the store. A donor serving tables from
//! their files' pages (`--map-files`) keeps a descriptor of each file under
//! its mark and, restarted, serves the pages again without reading them
//! while the file is unchanged; it exits when its file is opened for
//! writing.

use std::time::{Duration, Instant};

use engram_protocol::control::SwapTableRequest;
use engram_protocol::control::donor_control_client::DonorControlClient;
use engram_protocol::synthetic::first_mismatch;
use engram_protocol::{ROW_BYTES, TableDigest};
use engram_store::kept;
use inference_node::{ClientOptions, DonorClient, Request};
use rack_harness::{DonorProcess, NotifySocket, Process, gen_table, runtime};

const ROWS: u64 = 300_000;
const SAMPLE: [u64; 6] = [0, 1, 14, 15, 123_457, ROWS - 1];

/// The donor's rows of table 1 equal the generator's for `seed`.
fn serves(donor: &DonorProcess, digest: TableDigest, seed: u64) {
    runtime().block_on(async {
        let c = DonorClient::connect(donor.addr, &ClientOptions::new("t", vec![(1, digest)]))
            .await
            .expect("connect");
        let mut out = vec![0u8; SAMPLE.len() * ROW_BYTES];
        c.lookup(
            &[Request {
                table: 1,
                rows: &SAMPLE,
            }],
            &mut out,
        )
        .await
        .expect("lookup");
        assert_eq!(first_mismatch(seed, 1, &SAMPLE, &out), None);
    });
}

/// A donor under `notify` with `args`, ready; it copies its tables (the
/// kept copy is what most tests here are about) unless `args` say
/// `--map-files`.
fn start(notify: &NotifySocket, args: &[&str]) -> (DonorProcess, Duration) {
    let mut args = args.to_vec();
    if !args.contains(&"--map-files") {
        args.push("--copy-tables");
    }
    let began = Instant::now();
    let p = Process::launch_donor_under(notify, &args).expect("spawn");
    let d = p.ready().expect("ready");
    (d, began.elapsed())
}

/// The generation a log line names (`generation=N`).
fn generation(log: &str, marker: &str) -> Option<String> {
    let line = log.lines().find(|l| l.contains(marker))?;
    let g = line.split("generation=").nth(1)?;
    Some(g.split_whitespace().next()?.to_string())
}

/// Wait (at most 10 s) until the store holds exactly `want`: the fake
/// systemd reads the donor's messages on its own thread.
fn stored(notify: &NotifySocket, want: &[String]) -> Vec<String> {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let now = notify.stored();
        if now == want || Instant::now() > end {
            return now;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Overwrite the first page of rows of the table file at `path`.
fn overwrite_first_page(path: &std::path::Path) {
    use std::os::unix::fs::FileExt;
    let f = engram_store::table_file::TableFile::open_any(path).expect("open");
    let at = f.layout.data_start;
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|w| w.write_all_at(&[0x5a; 4096], at))
        .expect("overwrite");
}

fn kill9(mut donor: DonorProcess) {
    donor.signal(libc::SIGKILL);
    assert!(donor.wait(Duration::from_secs(10)).is_some());
}

#[test]
fn a_killed_donor_serves_its_kept_table_again_without_reading_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, digest) = gen_table(dir.path(), "t.etab", 1, ROWS, 5).expect("gen");
    let notify = NotifySocket::bind(dir.path()).expect("notify");
    let table = format!("1={}", path.display());
    let args = [
        "--table",
        &table,
        "--listen",
        "127.0.0.1:0",
        "--mlock",
        "try",
    ];
    let (first, cold) = start(&notify, &args);
    let name = kept::name(1, &digest);
    assert_eq!(
        stored(&notify, std::slice::from_ref(&name)),
        vec![name.clone()]
    );
    let log = first.log();
    let kept_gen = generation(&log, "fd store: table kept").expect("kept line");
    assert!(
        log.contains("progress: loading"),
        "a cold start loads:\n{log}"
    );
    serves(&first, digest, 5);
    kill9(first);

    // Overwrite the file's first page of rows: a donor that read the file
    // now would refuse it (its rows no longer hash to its digest), and
    // serve no row 0 of the generator's.
    overwrite_first_page(&path);

    let (second, warm) = start(&notify, &args);
    let log = second.log();
    assert!(
        log.contains("table adopted from the fd store"),
        "the restart adopts:\n{log}"
    );
    assert!(!log.contains("progress: loading"), "no load:\n{log}");
    assert_eq!(
        generation(&log, "table adopted").as_deref(),
        Some(kept_gen.as_str()),
        "the same copy, not a new load"
    );
    assert_eq!(
        stored(&notify, std::slice::from_ref(&name)),
        vec![name.clone()],
        "still kept, once"
    );
    serves(&second, digest, 5);
    eprintln!(
        "cold start {:.0} ms, restart from the fd store {:.0} ms ({} MB of rows)",
        cold.as_secs_f64() * 1e3,
        warm.as_secs_f64() * 1e3,
        ROWS * ROW_BYTES as u64 / 1_000_000
    );
    // Killed again: the same copy again.
    kill9(second);
    let (third, _) = start(&notify, &args);
    let log = third.log();
    assert_eq!(
        generation(&log, "table adopted").as_deref(),
        Some(kept_gen.as_str())
    );
    serves(&third, digest, 5);
}

#[test]
fn a_copy_of_another_version_or_an_unfinished_one_is_released_and_the_file_loaded() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (v1, d1) = gen_table(dir.path(), "v1.etab", 1, ROWS, 1).expect("gen v1");
    let (v2, d2) = gen_table(dir.path(), "v2.etab", 1, ROWS, 2).expect("gen v2");
    let notify = NotifySocket::bind(dir.path()).expect("notify");
    let t1 = format!("1={}", v1.display());
    let t2 = format!("1={}", v2.display());
    let (first, _) = start(&notify, &["--table", &t1, "--listen", "127.0.0.1:0"]);
    kill9(first);
    assert_eq!(
        stored(&notify, &[kept::name(1, &d1)]),
        vec![kept::name(1, &d1)]
    );

    // Started for v2: v1's copy is stale; released, v2 loaded and kept.
    let (second, _) = start(&notify, &["--table", &t2, "--listen", "127.0.0.1:0"]);
    let log = second.log();
    assert!(
        log.contains("copy of a version not served now; released"),
        "{log}"
    );
    assert!(log.contains("progress: loading"), "{log}");
    assert_eq!(
        stored(&notify, &[kept::name(1, &d2)]),
        vec![kept::name(1, &d2)]
    );
    serves(&second, d2, 2);
    kill9(second);

    // An unfinished copy under v2's name (a load killed half way: sized,
    // never sealed, no record): refused, and v2 loaded from its file.
    notify.clear_store();
    let (f, _, _) = kept::create(ROWS, kept::KeptLayout::Packed, false).expect("memfd");
    notify.store_fd(&kept::name(1, &d2), f.into());
    let (third, _) = start(&notify, &["--table", &t2, "--listen", "127.0.0.1:0"]);
    let log = third.log();
    assert!(
        log.contains("copy refused: its size is not sealed"),
        "{log}"
    );
    assert!(log.contains("progress: loading"), "{log}");
    assert_eq!(
        stored(&notify, &[kept::name(1, &d2)]),
        vec![kept::name(1, &d2)],
        "the new copy only"
    );
    serves(&third, d2, 2);
    kill9(third);

    // A copy loaded with --trust-digest is not taken by a donor that checks
    // digests: it loads (and checks) the file instead.
    let (trusting, _) = start(
        &notify,
        &["--table", &t2, "--listen", "127.0.0.1:0", "--trust-digest"],
    );
    let log = trusting.log();
    assert!(log.contains("table adopted from the fd store"), "{log}");
    kill9(trusting);
    notify.clear_store();
    let (trusting, _) = start(
        &notify,
        &["--table", &t2, "--listen", "127.0.0.1:0", "--trust-digest"],
    );
    kill9(trusting);
    let (checking, _) = start(&notify, &["--table", &t2, "--listen", "127.0.0.1:0"]);
    let log = checking.log();
    assert!(
        log.contains("copy refused: it was loaded with --trust-digest"),
        "{log}"
    );
    assert!(log.contains("progress: loading"), "{log}");
    serves(&checking, d2, 2);
    kill9(checking);

    // --no-fd-store: the handed copy is released and nothing is kept.
    let (fourth, _) = start(
        &notify,
        &["--table", &t2, "--listen", "127.0.0.1:0", "--no-fd-store"],
    );
    serves(&fourth, d2, 2);
    assert!(stored(&notify, &[]).is_empty(), "{:?}", notify.stored());
    assert!(fourth.log().contains("progress: loading"));
}

#[test]
fn a_swap_replaces_the_kept_version() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (v1, d1) = gen_table(dir.path(), "v1.etab", 1, ROWS, 1).expect("gen v1");
    let (v2, d2) = gen_table(dir.path(), "v2.etab", 1, ROWS, 2).expect("gen v2");
    let notify = NotifySocket::bind(dir.path()).expect("notify");
    let t1 = format!("1={}", v1.display());
    let (donor, _) = start(
        &notify,
        &[
            "--table",
            &t1,
            "--listen",
            "127.0.0.1:0",
            "--control",
            "127.0.0.1:0",
        ],
    );
    let ops = donor.ops().expect("ops");
    runtime().block_on(async {
        let mut c = DonorControlClient::connect(ops.control_uri())
            .await
            .expect("control");
        c.swap_table(SwapTableRequest {
            table_id: 1,
            path: v2.display().to_string(),
            expected_digest: d2.to_hex(),
            in_place: false,
        })
        .await
        .expect("swap accepted");
    });
    let want = vec![kept::name(1, &d2)];
    assert_eq!(stored(&notify, &want), want, "v1 removed, v2 kept");
    assert_ne!(d1, d2);
    serves(&donor, d2, 2);
}

/// A table file and a fake systemd, for a donor serving the file's pages.
struct MappedRack {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
    digest: TableDigest,
    notify: NotifySocket,
    table: String,
}

impl MappedRack {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let (path, digest) = gen_table(dir.path(), "t.etab", 1, ROWS, 5).expect("gen");
        let notify = NotifySocket::bind(dir.path()).expect("notify");
        let table = format!("1={}", path.display());
        Self {
            _dir: dir,
            path,
            digest,
            notify,
            table,
        }
    }

    /// `serve` flags for it.
    fn args(&self) -> [&str; 5] {
        [
            "--table",
            &self.table,
            "--listen",
            "127.0.0.1:0",
            "--map-files",
        ]
    }

    /// What the names of its file's marks start with.
    fn prefix(&self) -> String {
        format!("{}-file-", kept::name(1, &self.digest))
    }
}

/// The one name in the store, once it holds exactly one starting with
/// `prefix` and none other.
fn one_stored(notify: &NotifySocket, prefix: &str, not: Option<&str>) -> String {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let now = notify.stored();
        if let [one] = &now[..]
            && one.starts_with(prefix)
            && Some(one.as_str()) != not
        {
            return one.clone();
        }
        assert!(Instant::now() < end, "the store holds {now:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_killed_donor_serves_its_files_pages_again_without_reading_them_while_the_file_is_unchanged() {
    use std::os::unix::fs::PermissionsExt;
    let rack = MappedRack::new();
    let (path, digest, notify) = (&rack.path, rack.digest, &rack.notify);
    let args = rack.args();
    let trusting = [&args[..], &["--trust-digest"]].concat();
    let prefix = rack.prefix();
    let (first, _) = start(notify, &args);
    assert!(first.log().contains("progress: loading"), "{}", first.log());
    let name = one_stored(notify, &prefix, None);
    assert!(name.ends_with("-v"), "hashed: {name}");
    serves(&first, digest, 5);
    kill9(first);

    // Restarted: the same file at the same change time, served at once.
    let (second, _) = start(notify, &args);
    let log = second.log();
    assert!(
        log.contains("table adopted from the fd store: serving the file's pages"),
        "{log}"
    );
    assert!(!log.contains("progress: loading"), "not read:\n{log}");
    assert!(
        log.contains("file_pages=true") && log.contains("verified=true"),
        "{log}"
    );
    assert_eq!(one_stored(notify, &prefix, None), name, "kept as it was");
    serves(&second, digest, 5);
    kill9(second);

    // Any change to the file (here its mode) moves its change time on: the
    // mark no longer counts, and the file is read and hashed again.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let (third, _) = start(notify, &args);
    let log = third.log();
    assert!(
        log.contains("the file changed since it was loaded"),
        "{log}"
    );
    assert!(log.contains("progress: loading"), "read again:\n{log}");
    let renamed = one_stored(notify, &prefix, Some(&name));
    assert!(renamed.ends_with("-v"), "{renamed}");
    serves(&third, digest, 5);
    kill9(third);

    // A donor that trusts digests serves on a hashed mark; one loaded
    // trusting (after a change) leaves a mark a checking donor refuses.
    let (fourth, _) = start(notify, &trusting);
    assert!(
        fourth.log().contains("table adopted from the fd store"),
        "{}",
        fourth.log()
    );
    kill9(fourth);
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let (fifth, _) = start(notify, &trusting);
    assert!(!fifth.log().contains("table adopted"), "{}", fifth.log());
    let trusted = one_stored(notify, &prefix, Some(&renamed));
    assert!(trusted.ends_with("-t"), "{trusted}");
    kill9(fifth);
    let (sixth, _) = start(notify, &args);
    let log = sixth.log();
    assert!(log.contains("its rows were never hashed"), "{log}");
    assert!(log.contains("progress: loading"), "{log}");
    assert!(one_stored(notify, &prefix, Some(&trusted)).ends_with("-v"));
    serves(&sixth, digest, 5);
}

/// Wait (at most 20 s) until `donor`'s log has a line containing `what`.
fn logged(donor: &Process, what: &str) -> String {
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        let log = donor.log();
        if log.contains(what) {
            return log;
        }
        assert!(Instant::now() < end, "no {what:?} in:\n{log}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn pages_served_on_that_no_longer_match_their_checksums_end_the_donor_and_its_mark() {
    use std::os::unix::fs::{FileExt, MetadataExt};
    let rack = MappedRack::new();
    let (path, notify) = (&rack.path, &rack.notify);
    let args = rack.args();
    let prefix = rack.prefix();
    let (first, _) = start(notify, &args);
    one_stored(notify, &prefix, None);
    kill9(first);
    // Served on: its pages are checked against the file's checksums.
    let (second, _) = start(notify, &args);
    logged(&second, "match the file's page checksums");
    kill9(second);

    // A row changed behind the kernel's back (on the disk, say): here a
    // write, and a mark forged for the file as it is now, claimed hashed.
    let f = engram_store::table_file::TableFile::open(path).expect("open");
    let off = f.layout.row_offset(123_457).expect("in range");
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|w| w.write_all_at(&[0x5a], off))
        .expect("write");
    let m = std::fs::metadata(path).expect("stat");
    let forged = format!("{prefix}{}.{:09}-v", m.ctime(), m.ctime_nsec());
    notify.clear_store();
    notify.store_fd(&forged, std::fs::File::open(path).expect("open").into());
    // (It may exit before it says it is ready: the check can be that quick.)
    let mut third = Process::launch_donor_under(notify, &args).expect("spawn");
    let status = third
        .wait(Duration::from_secs(20))
        .expect("the donor exits");
    let log = logged(&third, "does not match its checksum");
    assert_eq!(status.code(), Some(3), "{log}");
    assert!(log.contains("table adopted from the fd store"), "{log}");
    assert_eq!(
        stored(notify, &[]),
        Vec::<String>::new(),
        "the mark is gone"
    );
    // So the next start reads the file, and refuses it.
    let next = Process::launch_donor_under(notify, &args).expect("spawn");
    let err = next
        .ready()
        .expect_err("the file no longer hashes to its digest");
    assert!(format!("{err:#}").contains("rows hash to"), "{err:#}");
}

#[test]
fn a_donor_serving_file_pages_exits_when_its_file_is_opened_for_writing() {
    use std::os::unix::fs::OpenOptionsExt;
    let rack = MappedRack::new();
    let (path, digest, notify) = (&rack.path, rack.digest, &rack.notify);
    let args = rack.args();
    let (mut donor, _) = start(notify, &args);
    serves(&donor, digest, 5);
    let log = donor.log();
    assert!(log.contains("file_pages=true"), "{log}");
    // Kept: a descriptor of the file, named by its mark.
    one_stored(notify, &rack.prefix(), None);
    // The donor holds a read lease: a writer that will not wait is told so,
    // and the donor, told by SIGIO, exits at once instead of serving a
    // file that may change under it.
    let open_w = || {
        std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
    };
    let e = open_w().expect_err("the donor's lease holds the writer back");
    assert_eq!(e.raw_os_error(), Some(libc::EWOULDBLOCK), "{e}");
    let status = donor
        .wait(Duration::from_secs(10))
        .expect("the donor exits");
    assert_eq!(status.code(), Some(3), "{}", donor.log());
    assert!(
        donor
            .log()
            .contains("SIGIO: a table file served from its pages")
    );
    open_w().expect("the lease is gone with the donor");
}

/// A table of another encoding than V4.1's (FP8 rows of 160 bytes) is
/// held in a memfd even under `--map-files`, kept in the store with a
/// version 3 record, and a killed donor serves it again without reading
/// its file, to a client of protocol version 2.
#[test]
fn a_killed_donor_serves_its_kept_table_of_another_encoding_again() {
    use engram_protocol::encoding::RowEncoding;
    use engram_protocol::synthetic::synthetic_encoded_row;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("fp8.etab");
    let out = std::process::Command::new(rack_harness::bin("memory-donor"))
        .args(["gen", "--layer", "1", "--rows", "200000", "--seed", "5"])
        .args(["--encoding", "fp8_per_tensorx160", "--tensor-scale", "0.5"])
        .arg("--out")
        .arg(&path)
        .output()
        .expect("gen");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let digest = engram_store::table_file::TableFile::open_any(&path)
        .expect("open")
        .meta
        .digest;
    let fp8 = RowEncoding::Fp8PerTensor { values: 160 };
    let serves = |donor: &DonorProcess| {
        runtime().block_on(async {
            let mut o = ClientOptions::new("t", vec![(2, digest)]);
            o.version = engram_protocol::PROTOCOL_VERSION;
            let c = DonorClient::connect(donor.addr, &o).await.expect("connect");
            let mut got = vec![0u8; 5 * 160];
            let req = [Request {
                table: 2,
                rows: &SAMPLE[..5],
            }];
            c.lookup(&req, &mut got).await.expect("lookup");
            for (k, &r) in SAMPLE[..5].iter().enumerate() {
                let mut want = vec![0u8; 160];
                synthetic_encoded_row(fp8, 5, 1, r, &mut want);
                assert_eq!(&got[k * 160..][..160], &want[..], "row {r}");
            }
        });
    };
    let notify = NotifySocket::bind(dir.path()).expect("notify");
    let table = format!("2={}", path.display());
    let args = ["--table", &table, "--listen", "127.0.0.1:0", "--map-files"];
    let (first, _) = start(&notify, &args);
    let name = kept::name(2, &digest);
    assert_eq!(
        stored(&notify, std::slice::from_ref(&name)),
        vec![name.clone()],
        "the memfd is kept, not the file's mark"
    );
    assert!(
        first.log().contains("held packed in a memfd"),
        "{}",
        first.log()
    );
    serves(&first);
    kill9(first);
    // A donor that read the file now would refuse it.
    overwrite_first_page(&path);
    let (second, _) = start(&notify, &args);
    let log = second.log();
    assert!(
        log.contains("table adopted from the fd store"),
        "the restart adopts:\n{log}"
    );
    assert!(!log.contains("progress: loading"), "no load:\n{log}");
    serves(&second);
}
