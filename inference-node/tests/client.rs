//! The client against a scripted donor on 127.0.0.1:0, for what a real
//! donor will not do on demand: stall reads, answer late, say Goodbye.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use engram_protocol::messages::{RowsSection, begin_rows, finish_rows};
use engram_protocol::{Frame, Goodbye, Limits, ROW_BYTES, TableDigest, TableInfo, Welcome, decode};
use inference_node::{ClientError, ClientOptions, DonorClient, Request};

const DIGEST: TableDigest = TableDigest([3; 32]);

/// Read frames from a blocking socket until `n` whole frames arrived; returns them raw.
fn read_frames(s: &mut TcpStream, buf: &mut Vec<u8>, n: usize) -> Vec<Vec<u8>> {
    let limits = Limits::for_rows(20_000);
    let mut out = Vec::new();
    let mut chunk = vec![0u8; 1 << 16];
    while out.len() < n {
        match decode(buf, &limits) {
            Ok(Some(d)) => {
                out.push(buf[..d.len].to_vec());
                buf.drain(..d.len);
                continue;
            }
            Ok(None) => {}
            Err(e) => panic!("the client sent an unframed stream: {e}"),
        }
        let k = s.read(&mut chunk).expect("read");
        assert!(k > 0, "client closed early");
        buf.extend_from_slice(&chunk[..k]);
    }
    out
}

/// Accept one client, read its Hello, answer Welcome for table 1.
fn handshake(listener: &TcpListener) -> (TcpStream, Vec<u8>) {
    let (mut s, _) = listener.accept().expect("accept");
    s.set_nodelay(true).expect("nodelay");
    let mut buf = Vec::new();
    read_frames(&mut s, &mut buf, 1);
    let mut w = Vec::new();
    let tables = [TableInfo::v41(1, 1, 1 << 20, DIGEST)];
    Welcome {
        version: 1,
        donor: "scripted",
        max_rows: 20_000,
        max_payload: u32::MAX,
        tables: &tables,
    }
    .encode(&mut w, 0)
    .expect("welcome");
    s.write_all(&w).expect("write welcome");
    (s, buf)
}

fn answer(s: &mut TcpStream, frame: &[u8]) {
    s.write_all(&rows_answer(frame, 0x38, None))
        .expect("write rows");
}

fn set_rcvbuf(listener: &TcpListener, bytes: libc::c_int) {
    use std::os::fd::AsRawFd;
    // SAFETY: setsockopt reads one c_int from a valid pointer.
    let r = unsafe {
        libc::setsockopt(
            listener.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&raw const bytes).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(r, 0, "setsockopt");
}

fn opts() -> ClientOptions {
    let mut o = ClientOptions::new("t", vec![(1, DIGEST)]);
    o.max_rows = 20_000;
    o
}

/// A 3-row lookup still works on `client`'s connection (the scripted
/// donor answers it with [`answer`]).
async fn small_lookup_works(client: &DonorClient) {
    let small = [1u64, 2, 3];
    let mut out = vec![0u8; 3 * ROW_BYTES];
    client
        .lookup(
            &[Request {
                table: 1,
                rows: &small,
            }],
            &mut out,
        )
        .await
        .expect("the connection still works");
    assert!(out.iter().all(|&b| b == 0x38));
}

const TIMED_OUT: usize = 40;

#[tokio::test(flavor = "current_thread")]
async fn lookups_cancelled_mid_write_leave_the_stream_framed() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    // The scripted donor stops reading until told, so big requests block mid-write.
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    // A small receive buffer makes the client's writes block sooner.
    set_rcvbuf(&listener, 4096);
    let donor = std::thread::spawn(move || {
        let (mut s, mut buf) = handshake(&listener);
        go_rx.recv().expect("go");
        // Every frame must parse; the good lookup (3 rows) comes last.
        let mut seen = 0;
        loop {
            let f = read_frames(&mut s, &mut buf, 1);
            seen += 1;
            let d = decode(&f[0], &Limits::for_rows(20_000))
                .expect("valid")
                .expect("whole");
            if matches!(d.frame, Frame::Lookup(l) if l.total_rows() == 3) {
                answer(&mut s, &f[0]);
                return seen;
            }
        }
    });
    let client = DonorClient::connect(addr, &opts()).await.expect("connect");
    // 40 x 160 KB is more than the socket buffers take: some write blocks.
    let rows: Vec<u64> = (0..20_000).collect();
    let mut out = vec![0u8; rows.len() * ROW_BYTES];
    for _ in 0..TIMED_OUT {
        let deadline = tokio::time::Instant::now() + Duration::from_millis(50);
        let e = client
            .lookup_until(
                &[Request {
                    table: 1,
                    rows: &rows,
                }],
                &mut out,
                deadline,
            )
            .await;
        assert!(matches!(e, Err(ClientError::Timeout(_))), "{e:?}");
    }
    go_tx.send(()).expect("go");
    small_lookup_works(&client).await;
    let frames = donor.join().expect("donor");
    // Fewer frames than requests: a timed-out request never got to write its own
    // frame (it was still finishing an earlier one's tail), so a write was
    // really cancelled midway, and the stream stayed framed all the same.
    assert!(
        frames <= TIMED_OUT,
        "{frames} frames: no write was cut short, the test proves nothing"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_goodbye_while_idle_is_seen_before_the_next_request_and_closes_the_client() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (bye_tx, bye_rx) = std::sync::mpsc::channel::<()>();
    let donor = std::thread::spawn(move || {
        let (mut s, mut buf) = handshake(&listener);
        let f = read_frames(&mut s, &mut buf, 1);
        answer(&mut s, &f[0]);
        let mut bye = Vec::new();
        Goodbye { grace_ms: 5000 }.encode(&mut bye);
        s.write_all(&bye).expect("goodbye");
        bye_tx.send(()).expect("said goodbye");
        // The client must send nothing more and close its side.
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).expect("the client closes");
        rest.len()
    });
    let client = DonorClient::connect(addr, &opts()).await.expect("connect");
    let mut out = vec![0u8; ROW_BYTES];
    client
        .lookup(
            &[Request {
                table: 1,
                rows: &[9],
            }],
            &mut out,
        )
        .await
        .expect("first");
    // Once the Goodbye is on our side of the socket, let the runtime idle
    // (its reactor notices the socket became readable), then ask again.
    tokio::task::spawn_blocking(move || bye_rx.recv())
        .await
        .expect("join")
        .expect("goodbye sent");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let e = client
        .lookup(
            &[Request {
                table: 1,
                rows: &[9],
            }],
            &mut out,
        )
        .await;
    assert!(
        matches!(e, Err(ClientError::Draining)),
        "a request after Goodbye: {e:?}"
    );
    assert!(client.is_draining());
    assert_eq!(
        donor.join().expect("donor"),
        0,
        "nothing was sent after the Goodbye"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_goodbye_then_a_close_while_idle_reads_as_draining_not_as_a_failure() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (bye_tx, bye_rx) = std::sync::mpsc::channel::<()>();
    let donor = std::thread::spawn(move || {
        let (mut s, mut buf) = handshake(&listener);
        let f = read_frames(&mut s, &mut buf, 1);
        answer(&mut s, &f[0]);
        let mut bye = Vec::new();
        Goodbye { grace_ms: 5000 }.encode(&mut bye);
        s.write_all(&bye).expect("goodbye");
        // The drain ends at once: the connection closes behind the Goodbye.
        s.shutdown(std::net::Shutdown::Both).expect("close");
        bye_tx.send(()).expect("said goodbye and closed");
    });
    let client = DonorClient::connect(addr, &opts()).await.expect("connect");
    let mut out = vec![0u8; ROW_BYTES];
    let req = [Request {
        table: 1,
        rows: &[9],
    }];
    client.lookup(&req, &mut out).await.expect("first");
    tokio::task::spawn_blocking(move || bye_rx.recv())
        .await
        .expect("join")
        .expect("goodbye sent");
    tokio::time::sleep(Duration::from_millis(20)).await;
    // Both the Goodbye and the end of the stream wait on our side: the
    // Goodbye is read first, so the lookup is refused as draining.
    let e = client.lookup(&req, &mut out).await;
    assert!(
        matches!(e, Err(ClientError::Draining)),
        "a request after Goodbye and close: {e:?}"
    );
    assert!(client.is_draining());
    donor.join().expect("donor");
}

#[tokio::test(flavor = "current_thread")]
async fn a_wrong_kind_of_answer_closes_the_connection() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let donor = std::thread::spawn(move || {
        let (mut s, mut buf) = handshake(&listener);
        let f = read_frames(&mut s, &mut buf, 1);
        let id = decode(&f[0], &Limits::default())
            .expect("valid")
            .expect("whole")
            .header
            .request_id;
        let mut pong = Vec::new();
        engram_protocol::messages::encode_ping(&mut pong, id, true);
        s.write_all(&pong).expect("pong");
    });
    let client = DonorClient::connect(addr, &opts()).await.expect("connect");
    let mut out = vec![0u8; ROW_BYTES];
    let e = client
        .lookup(
            &[Request {
                table: 1,
                rows: &[9],
            }],
            &mut out,
        )
        .await
        .expect_err("pong for a lookup");
    assert!(matches!(e, ClientError::Protocol(_)), "{e:?}");
    assert!(client.is_closed());
    donor.join().expect("donor");
}

#[tokio::test(flavor = "current_thread")]
async fn a_goodbye_after_timed_out_lookups_is_seen_by_polling_and_closes_the_client() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let donor = std::thread::spawn(move || {
        let (mut s, mut buf) = handshake(&listener);
        // Hung: the lookups are read but answered only after they timed out.
        let frames = read_frames(&mut s, &mut buf, 3);
        go_rx.recv().expect("the client gave up");
        for f in &frames {
            answer(&mut s, f);
        }
        let mut bye = Vec::new();
        Goodbye { grace_ms: 5000 }.encode(&mut bye);
        s.write_all(&bye).expect("goodbye");
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).expect("the client closes");
        rest.len()
    });
    let client = DonorClient::connect(addr, &opts()).await.expect("connect");
    let mut out = vec![0u8; ROW_BYTES];
    let req = [Request {
        table: 1,
        rows: &[9],
    }];
    for _ in 0..3 {
        let deadline = tokio::time::Instant::now() + Duration::from_millis(20);
        let e = client.lookup_until(&req, &mut out, deadline).await;
        assert!(matches!(e, Err(ClientError::Timeout(_))), "{e:?}");
    }
    go_tx.send(()).expect("go");
    // Nobody sends a lookup any more (an open breaker): polling alone, as
    // the node's tending does, finds the Goodbye and closes the connection.
    let started = std::time::Instant::now();
    while !client.poll_draining() {
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "no Goodbye seen"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        donor.join().expect("donor"),
        0,
        "closed without sending more"
    );
}

/// A Rows answer to `frame` (a Lookup of table 1) with every row byte
/// `fill`, one of them changed when `flip` says which.
fn rows_answer(frame: &[u8], fill: u8, flip: Option<usize>) -> Vec<u8> {
    let d = decode(frame, &Limits::for_rows(20_000))
        .expect("valid")
        .expect("whole");
    let Frame::Lookup(l) = d.frame else {
        panic!("expected a Lookup, got {:?}", d.frame)
    };
    let n = l.total_rows() as u32;
    let mut out = Vec::new();
    let start = begin_rows(
        &mut out,
        d.header.request_id,
        &[RowsSection {
            table_id: 1,
            status: None,
            row_count: n,
            row_bytes: 0,
        }],
    )
    .expect("rows");
    let rows_at = out.len();
    out.resize(out.len() + n as usize * ROW_BYTES, fill);
    finish_rows(&mut out, start).expect("finish");
    if let Some(k) = flip {
        out[rows_at + k] ^= 0x01;
    }
    out
}

#[tokio::test(flavor = "current_thread")]
async fn large_answers_are_read_into_the_callers_buffer_and_a_cancelled_one_is_skipped() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (timed_out_tx, timed_out_rx) = std::sync::mpsc::channel::<()>();
    let donor = std::thread::spawn(move || {
        let (mut s, mut buf) = handshake(&listener);
        // A: half its answer, then the rest once the client gave up on it.
        let a = read_frames(&mut s, &mut buf, 1).remove(0);
        let answer_a = rows_answer(&a, 0x51, None);
        let half = answer_a.len() / 2;
        s.write_all(&answer_a[..half]).expect("write");
        timed_out_rx.recv().expect("the client timed out");
        s.write_all(&answer_a[half..]).expect("write");
        // B whole; C with one row byte flipped; D small.
        for (fill, flip) in [(0x42, None), (0x43, Some(70_001))] {
            let f = read_frames(&mut s, &mut buf, 1).remove(0);
            s.write_all(&rows_answer(&f, fill, flip)).expect("write");
        }
        let d = read_frames(&mut s, &mut buf, 1).remove(0);
        answer(&mut s, &d);
    });
    let client = DonorClient::connect(addr, &opts()).await.expect("connect");
    let rows: Vec<u64> = (0..2_000).collect();
    let ask = [Request {
        table: 1,
        rows: &rows,
    }];
    let mut out = vec![0u8; rows.len() * ROW_BYTES];
    let deadline = tokio::time::Instant::now() + Duration::from_millis(300);
    let e = client.lookup_until(&ask, &mut out, deadline).await;
    assert!(matches!(e, Err(ClientError::Timeout(_))), "{e:?}");
    // The rows that came before the deadline went straight into the
    // caller's buffer, not through the connection's frame buffer.
    assert_eq!(
        out[0], 0x51,
        "the answer's rows were not read into the caller's buffer"
    );
    assert_eq!(
        *out.last().expect("rows"),
        0,
        "the whole answer cannot have come"
    );
    timed_out_tx.send(()).expect("tell the donor");
    // The rest of A is skipped: B's answer is B's.
    let mut out = vec![0u8; rows.len() * ROW_BYTES];
    client.lookup(&ask, &mut out).await.expect("B");
    assert!(out.iter().all(|&b| b == 0x42), "B's rows are not B's");
    // A flipped byte among the rows is caught by the checksum, and the
    // connection goes on.
    let e = client.lookup(&ask, &mut out).await;
    assert!(matches!(e, Err(ClientError::Corrupt(_))), "{e:?}");
    small_lookup_works(&client).await;
    donor.join().expect("donor");
}
