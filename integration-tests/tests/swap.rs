//! Table hot swap and SIGHUP reload on the real donor: a client pinned to
//! the old version gets VersionMismatch after the switch (never rows of
//! the new one), a client pinned to the new version gets the new rows, an
//! invalid config is rejected and the running one kept, timeouts change
//! live, and a swap that RAM would not hold is refused unless in place.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use engram_protocol::control::donor_control_client::DonorControlClient;
use engram_protocol::control::{ListTablesRequest, SwapTableRequest};
use engram_protocol::synthetic::first_mismatch;
use engram_protocol::{ErrorCode, ROW_BYTES, TableDigest};
use inference_node::{ClientError, ClientOptions, DonorClient, Request};
use rack_harness::rack_toml::{DonorEntry, RackToml, TableEntry};
use rack_harness::runtime as rt;
use rack_harness::{DonorProcess, OpsAddrs, gen_table};
use tonic::Code;
use tonic::transport::Channel;

async fn connect(
    addr: std::net::SocketAddr,
    digest: TableDigest,
) -> Result<DonorClient, ClientError> {
    DonorClient::connect(addr, &ClientOptions::new("t", vec![(1, digest)])).await
}

async fn rows(c: &DonorClient, rows: &[u64]) -> Result<Vec<u8>, ClientError> {
    let mut out = vec![0u8; rows.len() * ROW_BYTES];
    c.lookup(&[Request { table: 1, rows }], &mut out).await?;
    Ok(out)
}

fn is_version_mismatch(e: &ClientError) -> bool {
    matches!(
        e,
        ClientError::Section {
            code: ErrorCode::VersionMismatch,
            ..
        }
    )
}

async fn control(ops: &OpsAddrs) -> DonorControlClient<Channel> {
    DonorControlClient::connect(ops.control_uri())
        .await
        .expect("control")
}

fn swap(
    table: u32,
    path: &std::path::Path,
    digest: Option<TableDigest>,
    in_place: bool,
) -> SwapTableRequest {
    SwapTableRequest {
        table_id: table,
        path: path.display().to_string(),
        expected_digest: digest.map(|d| d.to_hex()).unwrap_or_default(),
        in_place,
    }
}

const ROWS: u64 = 100_000;
const SAMPLE: [u64; 6] = [0, 1, 17, 4_999, 77_777, ROWS - 1];

#[test]
fn swap_table_switches_versions_without_mixing_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (v1, d1) = gen_table(dir.path(), "v1.etab", 1, ROWS, 1).expect("gen v1");
    let (v2, d2) = gen_table(dir.path(), "v2.etab", 1, ROWS, 2).expect("gen v2");
    let (other, d_other) = gen_table(dir.path(), "l14.etab", 14, 1000, 2).expect("gen l14");
    let t = format!("1={}", v1.display());
    let donor = DonorProcess::start(&[
        "--table",
        &t,
        "--listen",
        "127.0.0.1:0",
        "--control",
        "127.0.0.1:0",
    ])
    .expect("donor");
    let ops = donor.ops().expect("ops");
    rt().block_on(async {
        let old = Arc::new(connect(donor.addr, d1).await.expect("pinned to v1"));
        let out = rows(&old, &SAMPLE).await.expect("v1 rows");
        assert_eq!(first_mismatch(1, 1, &SAMPLE, &out), None);
        let mut c = control(&ops).await;

        // Refusals first, each with its code; nothing changes.
        let e = c
            .swap_table(swap(1, &v2, Some(d1), false))
            .await
            .expect_err("wrong digest");
        assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
        let e = c
            .swap_table(swap(1, &v2, None, false))
            .await
            .expect_err("no expected digest");
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains("expected_digest is required"), "{e:?}");
        let e = c
            .swap_table(swap(9, &v2, Some(d2), false))
            .await
            .expect_err("no table 9");
        assert_eq!(e.code(), Code::NotFound, "{e:?}");
        let e = c
            .swap_table(swap(1, &other, Some(d_other), false))
            .await
            .expect_err("another layer");
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        let e = c
            .swap_table(swap(1, &v1, Some(d1), false))
            .await
            .expect_err("same version");
        assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");

        // A client pinned to v1 keeps asking through the swap: every answer
        // it gets is v1's rows, until VersionMismatch.
        let stop = Arc::new(AtomicBool::new(false));
        let worker = {
            let (old, stop) = (Arc::clone(&old), Arc::clone(&stop));
            tokio::spawn(async move {
                let mut ok = 0u64;
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let r: Vec<u64> = (0..24).map(|k| (n * 24 + k * 4_001) % ROWS).collect();
                    n += 1;
                    match rows(&old, &r).await {
                        Ok(out) => {
                            assert_eq!(
                                first_mismatch(1, 1, &r, &out),
                                None,
                                "v1 pin got other rows"
                            );
                            ok += 1;
                        }
                        Err(e) if is_version_mismatch(&e) => return ok,
                        Err(e) => panic!("unexpected error: {e}"),
                    }
                }
                ok
            })
        };
        let r = c
            .swap_table(swap(1, &v2, Some(d2), false))
            .await
            .expect("swap accepted")
            .into_inner();
        assert_eq!((r.old_digest, r.new_digest), (d1.to_hex(), d2.to_hex()));
        // Served from the file's pages (the default): 15 rows to a 4 KiB page.
        assert_eq!(r.bytes, ROWS.div_ceil(15) * 4096);
        let took = donor
            .wait_line(Duration::from_secs(60), |l| {
                l.contains("table swapped").then(|| l.to_string())
            })
            .expect("swapped");
        eprintln!("{took}");
        let served_before = tokio::time::timeout(Duration::from_secs(20), worker)
            .await
            .expect("the v1 client sees VersionMismatch")
            .expect("worker");
        stop.store(true, Ordering::Relaxed);
        assert!(served_before > 0);
        let e = rows(&old, &SAMPLE).await.expect_err("old pin");
        assert!(is_version_mismatch(&e), "{e:?}");

        // New connections: Welcome announces v2.
        let e = connect(donor.addr, d1).await.expect_err("v1 is gone");
        assert!(matches!(e, ClientError::DigestMismatch { .. }), "{e:?}");
        let new = connect(donor.addr, d2).await.expect("pinned to v2");
        let out = rows(&new, &SAMPLE).await.expect("v2 rows");
        assert_eq!(first_mismatch(2, 1, &SAMPLE, &out), None);
        let list = c
            .list_tables(ListTablesRequest {})
            .await
            .expect("list")
            .into_inner();
        assert_eq!(list.tables[0].digest, d2.to_hex());
        assert_eq!(list.tables[0].path, v2.display().to_string());
    });
}

/// Table 1 at `path`, pinned to `digest`, and donor `d` with a 0.05 GiB
/// budget and a control plane.
fn config(path: &std::path::Path, digest: TableDigest) -> RackToml {
    let mut rack = RackToml::new("t");
    rack.table = vec![TableEntry::new(1, path, ROWS2, digest)];
    rack.donor = vec![DonorEntry {
        control: Some("127.0.0.1:0".into()),
        ram_gib: 0.05,
        headroom_gib: Some(0.0),
        ..DonorEntry::new("d", ["127.0.0.1:0"], [1])
    }];
    rack
}

/// 120,000 rows are 31.7 MB: one version fits the 53.7 MB (0.05 GiB) budget, two do not.
const ROWS2: u64 = 120_000;

#[test]
fn sighup_reloads_rejects_bad_configs_and_swaps_within_ram() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (v1, d1) = gen_table(dir.path(), "v1.etab", 1, ROWS2, 1).expect("gen v1");
    let (v2, d2) = gen_table(dir.path(), "v2.etab", 1, ROWS2, 2).expect("gen v2");
    let cfg = dir.path().join("rack.toml");
    config(&v1, d1).write(&cfg).expect("config");
    let donor = DonorProcess::start(&["--config", &cfg.display().to_string(), "--name", "d"])
        .expect("donor");
    let ops = donor.ops().expect("ops");
    let runtime = rt();

    // An invalid config: rejected with its diagnostics, nothing changes.
    // The unknown key is text after the last table the config has, donor d.
    let text = config(&v2, d2).to_toml().expect("toml") + "colour = \"blue\"\n";
    std::fs::write(&cfg, text).expect("config");
    donor.signal(libc::SIGHUP);
    let line = donor
        .wait_line(Duration::from_secs(10), |l| {
            l.contains("reload: the config was rejected")
                .then(|| l.to_string())
        })
        .expect("rejected");
    donor
        .wait_line(Duration::from_secs(5), |l| {
            l.contains("colour").then_some(())
        })
        .unwrap_or_else(|e| panic!("the diagnostic names the key: {line}\n{e}"));
    runtime.block_on(async {
        let c = connect(donor.addr, d1).await.expect("still v1");
        assert_eq!(
            first_mismatch(1, 1, &SAMPLE, &rows(&c, &SAMPLE).await.expect("rows")),
            None
        );
    });

    // v2 and a short hello timeout: the timeout applies at once; the swap
    // is refused, since both versions would not fit the RAM budget.
    let mut short_hello = config(&v2, d2);
    short_hello.donor[0].hello_timeout_ms = Some(300);
    short_hello.write(&cfg).expect("config");
    donor.signal(libc::SIGHUP);
    donor
        .wait_line(Duration::from_secs(10), |l| {
            l.contains("reload: config applied").then_some(())
        })
        .expect("applied");
    let refusal = donor
        .wait_line(Duration::from_secs(10), |l| {
            l.contains("swap refused").then(|| l.to_string())
        })
        .expect("swap refused for RAM");
    assert!(
        refusal.contains("does not fit") && refusal.contains("in place"),
        "{refusal}"
    );
    let began = Instant::now();
    let mut silent = std::net::TcpStream::connect(donor.addr).expect("connect");
    silent
        .set_read_timeout(Some(Duration::from_secs(4)))
        .expect("timeout");
    let mut buf = [0u8; 256];
    let _ = std::io::Read::read(&mut silent, &mut buf);
    assert!(
        began.elapsed() < Duration::from_secs(3),
        "the reloaded 300 ms hello timeout closed the silent connection (took {:?})",
        began.elapsed()
    );

    runtime.block_on(async {
        let mut c = control(&ops).await;
        let list = c
            .list_tables(ListTablesRequest {})
            .await
            .expect("list")
            .into_inner();
        assert_eq!(list.tables[0].digest, d1.to_hex(), "v1 still served");
        assert!(
            list.tables[0].error.contains("does not fit"),
            "{:?}",
            list.tables[0]
        );
        let e = c
            .swap_table(swap(1, &v2, Some(d2), false))
            .await
            .expect_err("no room");
        assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
        // In place: the old version goes first, so one fits.
        c.swap_table(swap(1, &v2, Some(d2), true))
            .await
            .expect("in place");
    });
    donor
        .wait_line(Duration::from_secs(30), |l| {
            l.contains("table swapped").then_some(())
        })
        .expect("swapped in place");
    runtime.block_on(async {
        let c = connect(donor.addr, d2).await.expect("v2");
        assert_eq!(
            first_mismatch(2, 1, &SAMPLE, &rows(&c, &SAMPLE).await.expect("rows")),
            None
        );
    });
    // The same config again: nothing left to swap.
    donor.signal(libc::SIGHUP);
    donor
        .wait_line(Duration::from_secs(10), |l| {
            (l.contains("reload: config applied") && l.contains("swaps=0")).then_some(())
        })
        .expect("idempotent reload");
}
