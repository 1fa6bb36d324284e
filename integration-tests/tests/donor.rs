//! The real `memory-donor` process on 127.0.0.1:0 and the real client.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use engram_protocol::messages::{LookupSection, encode_lookup};
use engram_protocol::synthetic::{SplitMix64, first_mismatch};
use engram_protocol::{
    ErrorCode, Frame, Hello, Limits, PROTOCOL_VERSION, ROW_BYTES, TableDigest, decode,
};
use inference_node::{ClientError, ClientOptions, DonorClient, Request};
use rack_harness::rack_toml::{DonorEntry, RackToml, TableEntry};
use rack_harness::runtime as rt;
use rack_harness::{DonorProcess, gen_table};

const ROWS: u64 = 200_000;
const SEED: u64 = 11;

fn one_table() -> (
    tempfile::TempDir,
    std::path::PathBuf,
    TableDigest,
    DonorProcess,
) {
    one_table_with(&[])
}

/// A 200,000-row table and a donor serving it, with extra `serve` flags.
fn one_table_with(
    extra: &[&str],
) -> (
    tempfile::TempDir,
    std::path::PathBuf,
    TableDigest,
    DonorProcess,
) {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, digest) = gen_table(dir.path(), "l1.etab", 1, ROWS, SEED).expect("gen");
    let table = path.display().to_string();
    let mut args = vec!["--table", &table, "--listen", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    let donor = DonorProcess::start(&args).expect("donor starts");
    (dir, path, digest, donor)
}

async fn client(donor: &DonorProcess, digest: TableDigest) -> DonorClient {
    DonorClient::connect(
        donor.addr,
        &ClientOptions::new("test-node", vec![(1, digest)]),
    )
    .await
    .expect("connects")
}

#[test]
fn ten_thousand_random_rows_match_the_generator_byte_for_byte() {
    let (_dir, _path, digest, donor) = one_table();
    rt().block_on(async {
        let c = client(&donor, digest).await;
        assert_eq!(c.tables().len(), 1);
        assert_eq!(c.tables()[0].rows, ROWS);
        let mut rng = SplitMix64::new(1);
        let mut checked = 0;
        // 24- and 48-row batches, as the model asks, plus the first and last rows.
        for batch in 0..300 {
            let n = if batch % 2 == 0 { 24 } else { 48 };
            let mut rows: Vec<u64> = (0..n).map(|_| rng.below(ROWS)).collect();
            if batch == 0 {
                rows[0] = 0;
                rows[1] = ROWS - 1;
            }
            let mut out = vec![0u8; rows.len() * ROW_BYTES];
            c.lookup(
                &[Request {
                    table: 1,
                    rows: &rows,
                }],
                &mut out,
            )
            .await
            .expect("lookup");
            assert_eq!(
                first_mismatch(SEED, 1, &rows, &out),
                None,
                "a row differs from the generator"
            );
            checked += rows.len();
        }
        assert!(checked >= 10_000, "{checked}");
    });
}

#[test]
fn pipelined_lookups_on_one_connection_each_get_their_own_rows() {
    let (_dir, _path, digest, donor) = one_table();
    rt().block_on(async {
        let c = std::sync::Arc::new(client(&donor, digest).await);
        let mut tasks = Vec::new();
        for t in 0..64u64 {
            let c = std::sync::Arc::clone(&c);
            tasks.push(tokio::spawn(async move {
                let rows: Vec<u64> = (0..24).map(|i| (t * 1000 + i * 7) % ROWS).collect();
                let mut out = vec![0u8; 24 * ROW_BYTES];
                c.lookup(
                    &[Request {
                        table: 1,
                        rows: &rows,
                    }],
                    &mut out,
                )
                .await
                .expect("lookup");
                first_mismatch(SEED, 1, &rows, &out).is_none()
            }));
        }
        for t in tasks {
            assert!(
                t.await.expect("task"),
                "a pipelined answer went to the wrong request"
            );
        }
    });
}

#[test]
fn a_garbage_connection_does_not_disturb_a_good_client() {
    let (_dir, _path, digest, donor) = one_table();
    rt().block_on(async {
        let c = client(&donor, digest).await;
        let rows: Vec<u64> = (0..24).collect();
        let mut out = vec![0u8; 24 * ROW_BYTES];
        c.lookup(
            &[Request {
                table: 1,
                rows: &rows,
            }],
            &mut out,
        )
        .await
        .expect("before");
        let addr = donor.addr;
        let garbage = tokio::task::spawn_blocking(move || {
            let mut rng = SplitMix64::new(99);
            for i in 0..50 {
                let Ok(mut s) = TcpStream::connect(addr) else {
                    continue;
                };
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let mut junk = vec![0u8; 16 + (i * 37) % 3000];
                junk.iter_mut().for_each(|b| *b = rng.next_u64() as u8);
                if i % 3 == 0 {
                    // A header claiming a 4 GiB payload.
                    junk[..16]
                        .copy_from_slice(&[255, 255, 255, 255, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
                }
                let _ = s.write_all(&junk);
                let mut sink = Vec::new();
                let _ = s.read_to_end(&mut sink);
            }
        });
        // The good client keeps working while the garbage flows.
        for i in 0..200u64 {
            let rows: Vec<u64> = (0..24).map(|k| (i * 24 + k) % ROWS).collect();
            c.lookup(
                &[Request {
                    table: 1,
                    rows: &rows,
                }],
                &mut out,
            )
            .await
            .expect("during garbage");
            assert!(first_mismatch(SEED, 1, &rows, &out).is_none());
        }
        garbage.await.expect("garbage thread");
        c.lookup(
            &[Request {
                table: 1,
                rows: &rows,
            }],
            &mut out,
        )
        .await
        .expect("after");
    });
    assert!(donor.log().contains("ready"), "donor still alive");
}

/// Send raw frames and read one answer, for what the client refuses to send.
fn raw_exchange(addr: std::net::SocketAddr, frames: &[u8]) -> Vec<u8> {
    let mut s = rack_harness::hello_stream(addr, "raw");
    s.write_all(frames).expect("write");
    s.shutdown(std::net::Shutdown::Write).expect("half close");
    let mut all = Vec::new();
    s.read_to_end(&mut all).expect("read");
    all
}

#[test]
fn a_wrong_digest_prefix_gets_version_mismatch_and_a_wrong_pin_is_refused() {
    let (_dir, _path, digest, donor) = one_table();
    let mut lookup = Vec::new();
    let rows = [1u64, 2, 3];
    encode_lookup(
        &mut lookup,
        7,
        &[LookupSection {
            table_id: 1,
            digest_prefix: digest.prefix() ^ 1,
            rows: &rows,
        }],
    )
    .expect("encode");
    let answer = raw_exchange(donor.addr, &lookup);
    let limits = Limits::default();
    let welcome = decode(&answer, &limits).expect("valid").expect("welcome");
    let rows_frame = decode(&answer[welcome.len..], &limits)
        .expect("valid")
        .expect("answer");
    assert_eq!(rows_frame.header.request_id, 7);
    match rows_frame.frame {
        Frame::Rows(r) => {
            let (s, data) = r.sections().next().expect("one section");
            assert_eq!(s.status, Some(ErrorCode::VersionMismatch));
            assert!(data.is_empty(), "no rows of another version");
        }
        other => panic!("expected Rows, got {other:?}"),
    }
    rt().block_on(async {
        let wrong = TableDigest([7; 32]);
        let e = DonorClient::connect(donor.addr, &ClientOptions::new("n", vec![(1, wrong)]))
            .await
            .expect_err("pin");
        assert!(
            matches!(e, ClientError::DigestMismatch { table: 1, .. }),
            "{e:?}"
        );
        assert!(e.retry_elsewhere());
        let e = DonorClient::connect(donor.addr, &ClientOptions::new("n", vec![(9, digest)]))
            .await
            .expect_err("table");
        assert!(
            matches!(e, ClientError::TableMissing { table: 9, .. }),
            "{e:?}"
        );
    });
}

#[test]
fn out_of_range_rows_and_unknown_tables_get_typed_errors() {
    let (_dir, _path, digest, donor) = one_table();
    rt().block_on(async {
        let c = client(&donor, digest).await;
        let mut out = vec![0u8; 2 * ROW_BYTES];
        let e = c
            .lookup(
                &[Request {
                    table: 1,
                    rows: &[5, ROWS],
                }],
                &mut out,
            )
            .await
            .expect_err("out of range");
        assert!(
            matches!(
                e,
                ClientError::Section {
                    table: 1,
                    code: ErrorCode::RowOutOfRange
                }
            ),
            "{e:?}"
        );
        assert!(
            !e.retry_elsewhere(),
            "out of range at the pinned version is out of range everywhere"
        );
        let e = c
            .lookup(
                &[Request {
                    table: 2,
                    rows: &[5, 6],
                }],
                &mut out,
            )
            .await
            .expect_err("not pinned");
        assert!(matches!(e, ClientError::NotPinned(2)), "{e:?}");
        // The connection is still good.
        c.lookup(
            &[Request {
                table: 1,
                rows: &[5, 6],
            }],
            &mut out,
        )
        .await
        .expect("still serving");
    });
    let mut lookup = Vec::new();
    encode_lookup(
        &mut lookup,
        3,
        &[LookupSection {
            table_id: 42,
            digest_prefix: 0,
            rows: &[1],
        }],
    )
    .expect("encode");
    let answer = raw_exchange(donor.addr, &lookup);
    let limits = Limits::default();
    let welcome = decode(&answer, &limits).expect("valid").expect("welcome");
    match decode(&answer[welcome.len..], &limits)
        .expect("valid")
        .expect("answer")
        .frame
    {
        Frame::Rows(r) => assert_eq!(
            r.sections().next().map(|s| s.0.status),
            Some(Some(ErrorCode::UnknownTable))
        ),
        other => panic!("expected Rows, got {other:?}"),
    }
}

#[test]
fn sigterm_drains_with_goodbye_and_no_client_error() {
    // A long drain timeout: the donor exits early only because the client,
    // having seen Goodbye, closes once its requests are answered.
    let (_dir, _path, digest, mut donor) = one_table_with(&["--drain-timeout-ms", "30000"]);
    let runtime = rt();
    let (served, _client) = runtime.block_on(async {
        let c = std::sync::Arc::new(client(&donor, digest).await);
        // Four workers keep lookups in flight until the donor says Goodbye.
        let mut workers = Vec::new();
        for w in 0..4u64 {
            let c = std::sync::Arc::clone(&c);
            workers.push(tokio::spawn(async move {
                let mut n = 0u64;
                let mut out = vec![0u8; 24 * ROW_BYTES];
                while !c.is_draining() {
                    let rows: Vec<u64> =
                        (0..24).map(|k| (w * 10_000 + n * 24 + k) % ROWS).collect();
                    match c
                        .lookup(
                            &[Request {
                                table: 1,
                                rows: &rows,
                            }],
                            &mut out,
                        )
                        .await
                    {
                        Ok(()) => n += 1,
                        Err(ClientError::Draining) => break,
                        Err(e) => return Err(e),
                    }
                    assert!(first_mismatch(SEED, 1, &rows, &out).is_none());
                }
                Ok(n)
            }));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        donor.signal(libc::SIGTERM);
        let mut total = 0;
        for w in workers {
            total += tokio::time::timeout(Duration::from_secs(10), w)
                .await
                .expect("workers stop after Goodbye")
                .expect("worker")
                .expect("no client error during the drain");
        }
        assert!(c.is_draining(), "the client saw Goodbye");
        (total, c)
    });
    assert!(served > 0);
    // The client is still alive here: it closed its side by itself.
    let status = donor
        .wait(Duration::from_secs(10))
        .expect("donor exits long before its drain timeout");
    assert!(
        status.success(),
        "exit status {status:?}; log:\n{}",
        donor.log()
    );
    // The log is read by another thread: wait for its last lines, not a snapshot.
    let drained = donor.wait_line(Duration::from_secs(5), |l| {
        l.contains("drained").then_some(())
    });
    assert!(drained.is_ok(), "{}", donor.log());
}

#[test]
fn connections_beyond_the_bound_get_busy_and_silent_ones_are_closed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, digest) = gen_table(dir.path(), "t.etab", 1, 1000, 1).expect("gen");
    let donor = DonorProcess::start(&[
        "--table",
        &path.display().to_string(),
        "--listen",
        "127.0.0.1:0",
        "--max-connections",
        "2",
        "--hello-timeout-ms",
        "300",
    ])
    .expect("donor");
    // A connection that never says Hello is closed after the hello timeout.
    let mut silent = TcpStream::connect(donor.addr).expect("connect");
    silent
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let started = std::time::Instant::now();
    let mut sink = Vec::new();
    silent
        .read_to_end(&mut sink)
        .expect("closed by the donor, not timed out here");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "closed after {:?}",
        started.elapsed()
    );
    rt().block_on(async {
        let a = client(&donor, digest).await;
        let b = client(&donor, digest).await;
        let e = DonorClient::connect(donor.addr, &ClientOptions::new("c", vec![(1, digest)]))
            .await
            .expect_err("busy");
        assert!(
            matches!(
                e,
                ClientError::Refused {
                    code: ErrorCode::Busy,
                    ..
                }
            ),
            "{e:?}"
        );
        drop(b);
        // The freed slot is reusable once the donor notices the close.
        let mut ok = false;
        for _ in 0..100 {
            if DonorClient::connect(donor.addr, &ClientOptions::new("c", vec![(1, digest)]))
                .await
                .is_ok()
            {
                ok = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(ok, "a slot was freed");
        let mut out = vec![0u8; ROW_BYTES];
        a.lookup(
            &[Request {
                table: 1,
                rows: &[3],
            }],
            &mut out,
        )
        .await
        .expect("a still served");
    });
}

#[test]
fn serves_from_the_cluster_config_with_a_credential() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (p1, d1) = gen_table(dir.path(), "l1.etab", 1, 5000, 3).expect("gen");
    let (p14, d14) = gen_table(dir.path(), "l14.etab", 14, 6000, 3).expect("gen");
    std::fs::write(dir.path().join("secret"), "let-me-in\n").expect("secret");
    let mut rack = RackToml::new("t");
    rack.rack.credential_file = Some("secret".into());
    rack.table = vec![
        TableEntry::new(1, &p1, 5000, d1),
        TableEntry::new(14, &p14, 6000, d14),
    ];
    rack.donor = vec![DonorEntry::new("d", ["127.0.0.1:0"], [1, 14])];
    let cfg = dir.path().join("rack.toml");
    rack.write(&cfg).expect("config");
    let donor = DonorProcess::start(&["--config", &cfg.display().to_string(), "--name", "d"])
        .expect("donor");
    rt().block_on(async {
        let mut opts = ClientOptions::new("n", vec![(1, d1), (14, d14)]);
        let e = DonorClient::connect(donor.addr, &opts)
            .await
            .expect_err("no credential");
        assert!(
            matches!(
                e,
                ClientError::Refused {
                    code: ErrorCode::Unauthorized,
                    ..
                }
            ),
            "{e:?}"
        );
        opts.credential = Some(b"let-me-in".to_vec());
        let c = DonorClient::connect(donor.addr, &opts)
            .await
            .expect("connects");
        assert_eq!(c.donor(), "d");
        // One message, two tables: 24 rows each.
        let r1: Vec<u64> = (0..24).map(|i| i * 200).collect();
        let r14: Vec<u64> = (0..24).map(|i| i * 250 + 1).collect();
        let mut out = vec![0u8; 48 * ROW_BYTES];
        c.lookup(
            &[
                Request {
                    table: 1,
                    rows: &r1,
                },
                Request {
                    table: 14,
                    rows: &r14,
                },
            ],
            &mut out,
        )
        .await
        .expect("48");
        let (a, b) = out.split_at(24 * ROW_BYTES);
        assert!(first_mismatch(3, 1, &r1, a).is_none());
        assert!(first_mismatch(3, 14, &r14, b).is_none());
    });
}

#[test]
fn a_donor_refuses_a_table_whose_pinned_digest_differs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (p1, _) = gen_table(dir.path(), "l1.etab", 1, 100, 3).expect("gen");
    let mut rack = RackToml::new("t");
    rack.table = vec![TableEntry::new(1, &p1, 100, TableDigest([9; 32]))];
    rack.donor = vec![DonorEntry::new("d", ["127.0.0.1:0"], [1])];
    let cfg = dir.path().join("rack.toml");
    rack.write(&cfg).expect("config");
    let out = std::process::Command::new(rack_harness::bin("memory-donor"))
        .args([
            "serve",
            "--config",
            &cfg.display().to_string(),
            "--name",
            "d",
        ])
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("config pins"), "{err}");
}

#[test]
fn a_lookup_over_the_row_cap_gets_request_too_large_and_the_connection_goes_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, digest) = gen_table(dir.path(), "t.etab", 1, 1000, 2).expect("gen");
    let donor = DonorProcess::start(&[
        "--table",
        &path.display().to_string(),
        "--listen",
        "127.0.0.1:0",
        "--max-rows",
        "48",
    ])
    .expect("donor");
    let big: Vec<u64> = (0..49).collect();
    let mut frames = Vec::new();
    encode_lookup(
        &mut frames,
        3,
        &[LookupSection {
            table_id: 1,
            digest_prefix: digest.prefix(),
            rows: &big,
        }],
    )
    .expect("encode");
    encode_lookup(
        &mut frames,
        4,
        &[LookupSection {
            table_id: 1,
            digest_prefix: digest.prefix(),
            rows: &big[..2],
        }],
    )
    .expect("encode");
    let answer = raw_exchange(donor.addr, &frames);
    let limits = Limits::default();
    let welcome = decode(&answer, &limits).expect("valid").expect("welcome");
    match welcome.frame {
        Frame::Welcome(w) => assert_eq!(w.max_rows, 48),
        other => panic!("expected Welcome, got {other:?}"),
    }
    let first = decode(&answer[welcome.len..], &limits)
        .expect("valid")
        .expect("error");
    assert_eq!(first.header.request_id, 3);
    match first.frame {
        Frame::Error(e) => {
            assert_eq!(e.code, ErrorCode::RequestTooLarge);
            assert_eq!(e.detail, 48);
        }
        other => panic!("expected Error, got {other:?}"),
    }
    let second = decode(&answer[welcome.len + first.len..], &limits)
        .expect("valid")
        .expect("rows");
    assert_eq!(second.header.request_id, 4);
    assert!(matches!(second.frame, Frame::Rows(r) if r.total_rows() == 2));
}

#[test]
fn a_trickling_client_is_closed_at_the_hello_deadline() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, _) = gen_table(dir.path(), "t.etab", 1, 100, 2).expect("gen");
    let donor = DonorProcess::start(&[
        "--table",
        &path.display().to_string(),
        "--listen",
        "127.0.0.1:0",
        "--hello-timeout-ms",
        "300",
    ])
    .expect("donor");
    let mut hello = Vec::new();
    Hello {
        version: PROTOCOL_VERSION,
        node: "slow",
        credential: b"",
    }
    .encode(&mut hello, 0)
    .expect("hello");
    let mut s = TcpStream::connect(donor.addr).expect("connect");
    let started = std::time::Instant::now();
    // One byte every 50 ms: each byte would restart a plain read timeout.
    let mut closed = false;
    for b in hello.iter().cycle().take(60) {
        if s.write_all(&[*b]).is_err() {
            closed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let elapsed = started.elapsed();
    assert!(closed, "still open after {elapsed:?}");
    assert!(
        elapsed < Duration::from_secs(2),
        "closed only after {elapsed:?}"
    );
}

#[test]
fn a_hung_donor_times_out_lookups_and_recovers_when_it_resumes() {
    let (_dir, _path, digest, donor) = one_table();
    rt().block_on(async {
        let mut opts = ClientOptions::new("test-node", vec![(1, digest)]);
        opts.lookup_timeout = Duration::from_millis(200);
        let c = DonorClient::connect(donor.addr, &opts)
            .await
            .expect("connects");
        let rows: Vec<u64> = (100..124).collect();
        let mut out = vec![0u8; 24 * ROW_BYTES];
        donor.stop();
        let t = std::time::Instant::now();
        let e = c
            .lookup(
                &[Request {
                    table: 1,
                    rows: &rows,
                }],
                &mut out,
            )
            .await
            .expect_err("hung");
        assert!(matches!(e, ClientError::Timeout(_)), "{e:?}");
        assert!(e.retry_elsewhere());
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        donor.signal(libc::SIGCONT);
        // The late answer to the timed-out request is discarded; new ones work.
        let rows2: Vec<u64> = (500..524).collect();
        c.lookup(
            &[Request {
                table: 1,
                rows: &rows2,
            }],
            &mut out,
        )
        .await
        .expect("resumed");
        assert_eq!(first_mismatch(SEED, 1, &rows2, &out), None);
    });
}

#[test]
fn sigterm_right_after_ready_exits_cleanly() {
    let (_dir, _path, _digest, mut donor) = one_table();
    donor.signal(libc::SIGTERM);
    let status = donor.wait(Duration::from_secs(10)).expect("exits");
    assert!(status.success(), "{status:?}\n{}", donor.log());
}

#[test]
fn busy_poll_serves_the_same_rows_and_still_drains() {
    let (_dir, _path, digest, mut donor) = one_table_with(&["--busy-poll-us", "2000"]);
    let rt = rt();
    let c = rt.block_on(async {
        let c = client(&donor, digest).await;
        let mut rng = SplitMix64::new(5);
        // Lookups back to back (found while spinning) and after pauses
        // longer than the spin (found by the blocking read).
        for i in 0..400u32 {
            let rows: Vec<u64> = (0..24).map(|_| rng.next_u64() % ROWS).collect();
            let mut out = vec![0u8; rows.len() * ROW_BYTES];
            c.lookup(
                &[Request {
                    table: 1,
                    rows: &rows,
                }],
                &mut out,
            )
            .await
            .expect("lookup");
            assert_eq!(first_mismatch(SEED, 1, &rows, &out), None, "lookup {i}");
            if i % 50 == 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        c
    });
    // SIGTERM with the connection still open: the donor drains and exits.
    donor.signal(libc::SIGTERM);
    let status = donor.wait(Duration::from_secs(10)).expect("exits");
    assert!(status.success(), "{status:?}");
    drop(c);
}
