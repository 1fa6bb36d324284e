//! PROTOCOL.md, point by point, against the real donor: the behaviours a
//! client written from the document alone relies on (frame-level errors and
//! their codes, request ids and details, the caps, `max_payload`, `busy`,
//! the credential, reserved fields, the Hello timeout). Raw bytes on a raw
//! socket, so nothing here goes through the project's own client.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use engram_protocol::messages::{LookupSection, encode_lookup};
use engram_protocol::{
    ErrorCode, Frame, FrameHeader, FrameKind, HEADER_LEN, Hello, Limits, PROTOCOL_VERSION,
    TableDigest, decode,
};
use rack_harness::{DonorProcess, gen_table};

/// A 1,000-row table and a donor serving it with extra `serve` flags.
fn donor(extra: &[&str]) -> (tempfile::TempDir, TableDigest, DonorProcess) {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, digest) = gen_table(dir.path(), "t.etab", 1, 1000, 2).expect("gen");
    let table = path.display().to_string();
    let mut args = vec!["--table", &table, "--listen", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    let donor = DonorProcess::start(&args).expect("donor starts");
    (dir, digest, donor)
}

fn hello(credential: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    Hello {
        version: PROTOCOL_VERSION,
        node: "doc-client",
        credential,
    }
    .encode(&mut out, 0)
    .expect("hello");
    out
}

fn connect(donor: &DonorProcess) -> TcpStream {
    let s = TcpStream::connect(donor.addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    s
}

/// One whole frame from the socket, as raw (header, payload) bytes; `None`
/// at the end of the stream.
fn read_frame(s: &mut TcpStream) -> Option<Vec<u8>> {
    let mut head = [0u8; HEADER_LEN];
    match s.read_exact(&mut head) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return None,
        Err(e) => panic!("read: {e}"),
    }
    let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
    let mut frame = head.to_vec();
    frame.resize(HEADER_LEN + len, 0);
    s.read_exact(&mut frame[HEADER_LEN..]).expect("payload");
    Some(frame)
}

/// The Error in `frame`: (request id, code, detail).
fn error_of(frame: &[u8]) -> (u64, ErrorCode, u64) {
    let d = decode(frame, &Limits::default())
        .expect("valid")
        .expect("whole");
    match d.frame {
        Frame::Error(e) => (d.header.request_id, e.code, e.detail),
        other => panic!("expected an Error, got {other:?}"),
    }
}

/// A connection past its handshake (the Welcome read and returned).
fn ready(donor: &DonorProcess, credential: &[u8]) -> (TcpStream, Vec<u8>) {
    let mut s = connect(donor);
    s.write_all(&hello(credential)).expect("hello");
    let welcome = read_frame(&mut s).expect("an answer to Hello");
    (s, welcome)
}

fn lookup(id: u64, digest: TableDigest, rows: &[u64]) -> Vec<u8> {
    let mut out = Vec::new();
    encode_lookup(
        &mut out,
        id,
        &[LookupSection {
            table_id: 1,
            digest_prefix: digest.prefix(),
            rows,
        }],
    )
    .expect("encode");
    out
}

/// The connection still answers: a Lookup gets its Rows.
fn still_serves(s: &mut TcpStream, digest: TableDigest, id: u64) {
    s.write_all(&lookup(id, digest, &[1, 2, 3])).expect("write");
    let f = read_frame(s).expect("rows");
    let d = decode(&f, &Limits::default())
        .expect("valid")
        .expect("whole");
    assert_eq!(d.header.request_id, id);
    assert!(
        matches!(d.frame, Frame::Rows(r) if r.total_rows() == 3),
        "{d:?}"
    );
}

/// The donor closes the connection (after whatever it still had to say).
fn closes(s: &mut TcpStream) {
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).expect("closed, not timed out");
}

fn raw_header(kind: u8, flags: u8, reserved: u16, id: u64, len: u32) -> Vec<u8> {
    let mut h = len.to_le_bytes().to_vec();
    h.push(kind);
    h.push(flags);
    h.extend_from_slice(&reserved.to_le_bytes());
    h.extend_from_slice(&id.to_le_bytes());
    h
}

/// Points 1 and 2: a Lookup over the caps keeps the connection, whatever its
/// size; any other oversized frame is `frame_too_large` and closes.
#[test]
fn lookups_over_the_caps_keep_the_connection_whatever_their_size() {
    let (_dir, digest, donor) = donor(&["--max-rows", "48"]);
    let (mut s, _) = ready(&donor, b"");
    // max_rows + 1 rows, in one section and split over two.
    let rows: Vec<u64> = (0..49).collect();
    s.write_all(&lookup(3, digest, &rows)).expect("write");
    assert_eq!(
        error_of(&read_frame(&mut s).expect("error")),
        (3, ErrorCode::RequestTooLarge, 48)
    );
    // One section of max_rows + 200 rows: past the frame maximum (the old
    // cut-off was max_rows + 126), refused from its header, payload skipped.
    let rows: Vec<u64> = (0..248).collect();
    let big = lookup(4, digest, &rows);
    s.write_all(&big).expect("write");
    assert_eq!(
        error_of(&read_frame(&mut s).expect("error")),
        (4, ErrorCode::RequestTooLarge, 48)
    );
    // 65 sections of one row: too many sections, also past the frame maximum.
    let sections: Vec<LookupSection> = (0..65)
        .map(|_| LookupSection {
            table_id: 1,
            digest_prefix: digest.prefix(),
            rows: &[7],
        })
        .collect();
    let mut many = Vec::new();
    encode_lookup(&mut many, 5, &sections).expect("encode");
    s.write_all(&many).expect("write");
    assert_eq!(
        error_of(&read_frame(&mut s).expect("error")),
        (5, ErrorCode::RequestTooLarge, 48)
    );
    // A Lookup header declaring 100,000 bytes: refused from the header, its
    // payload skipped as it arrives, and the connection goes on after it.
    let declared = 100_000u32;
    s.write_all(&raw_header(3, 0, 0, 6, declared))
        .expect("write");
    s.write_all(&vec![0xAB; declared as usize])
        .expect("payload");
    assert_eq!(
        error_of(&read_frame(&mut s).expect("error")),
        (6, ErrorCode::RequestTooLarge, 48)
    );
    still_serves(&mut s, digest, 7);
    // Any other frame that large: frame_too_large with its id and the
    // maximum, and the connection closes.
    s.write_all(&raw_header(6, 0, 0, 8, declared))
        .expect("write");
    let (id, code, detail) = error_of(&read_frame(&mut s).expect("error"));
    assert_eq!((id, code), (8, ErrorCode::FrameTooLarge));
    assert_eq!(
        detail,
        u64::from(Limits::for_rows(48).for_requests().max_payload)
    );
    closes(&mut s);
}

/// Before the handshake only a Hello fits: a larger frame is `frame_too_large`.
#[test]
fn before_the_handshake_a_large_frame_is_frame_too_large() {
    let (_dir, _, donor) = donor(&[]);
    let mut s = connect(&donor);
    s.write_all(&raw_header(3, 0, 0, 1, 10_000)).expect("write");
    let (id, code, detail) = error_of(&read_frame(&mut s).expect("error"));
    assert_eq!((id, code), (1, ErrorCode::FrameTooLarge));
    assert_eq!(detail, engram_protocol::messages::MAX_HELLO_PAYLOAD as u64);
    closes(&mut s);
}

/// Point 3: `max_payload` follows the documented formula.
#[test]
fn welcome_max_payload_follows_the_documented_formula() {
    let formula = |r: u64| {
        (16 + 12 * 64 + 264 * r)
            .max(8 + 16 * 64 + 8 * r)
            .max(49_423)
    };
    for (flags, rows) in [(&[][..], 16_384u64), (&["--max-rows", "128"][..], 128)] {
        let (_dir, _, donor) = donor(flags);
        let (_, welcome) = ready(&donor, b"");
        let d = decode(&welcome, &Limits::default())
            .expect("valid")
            .expect("whole");
        let Frame::Welcome(w) = d.frame else {
            panic!("expected Welcome, got {:?}", d.frame)
        };
        assert_eq!(u64::from(w.max_rows), rows);
        assert_eq!(u64::from(w.max_payload), formula(rows), "max_rows {rows}");
    }
}

/// Point 4: `busy` answers the Hello of a client over the bound (a
/// stranger never takes a served slot), then the close.
#[test]
fn busy_answers_the_hello_at_the_bound() {
    let (_dir, _, donor) = donor(&["--max-connections", "1"]);
    let (_held, _) = ready(&donor, b"");
    // Connected and silent: not refused (it holds no served slot yet).
    let mut s = connect(&donor);
    s.set_read_timeout(Some(Duration::from_millis(300)))
        .expect("timeout");
    let mut b = [0u8; 1];
    let silent = Read::read(&mut s, &mut b);
    assert!(
        matches!(&silent, Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)),
        "{silent:?}"
    );
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    s.write_all(&hello(b"")).expect("hello");
    let (id, code, detail) = error_of(&read_frame(&mut s).expect("busy"));
    assert_eq!((id, code, detail), (0, ErrorCode::Busy, 1));
    closes(&mut s);
}

/// Point 5: the credential is the file's content without its line ending;
/// a donor without one accepts any.
#[test]
fn the_credential_is_the_file_without_its_line_ending() {
    let dir = tempfile::tempdir().expect("tempdir");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, b"s3cret\r\n").expect("write");
    let (_t, digest, donor) = donor(&["--credential-file", &secret.display().to_string()]);
    for bad in [&b"s3cret\r\n"[..], b"s3cret\n", b"", b"s3cre"] {
        let (mut s, answer) = ready(&donor, bad);
        assert_eq!(
            error_of(&answer),
            (0, ErrorCode::Unauthorized, 0),
            "{bad:?}"
        );
        closes(&mut s);
    }
    let (mut s, _) = ready(&donor, b"s3cret");
    still_serves(&mut s, digest, 1);
    // Without a credential, any is accepted.
    let (_t2, digest, open) = self::donor(&[]);
    for any in [&b""[..], b"anything"] {
        let (mut s, _) = ready(&open, any);
        still_serves(&mut s, digest, 1);
    }
}

/// Points 6 and 10: request ids and details of `malformed`, and reserved
/// fields.
#[test]
fn malformed_frames_carry_the_documented_id_and_detail() {
    let (_dir, digest, donor) = donor(&[]);
    // Header errors (unknown kind, flags, reserved bytes): request id 0.
    for header in [
        raw_header(99, 0, 0, 5, 0),
        raw_header(6, 1, 0, 5, 0),
        raw_header(6, 0, 1, 5, 0),
    ] {
        let (mut s, _) = ready(&donor, b"");
        s.write_all(&header).expect("write");
        assert_eq!(
            error_of(&read_frame(&mut s).expect("error")),
            (0, ErrorCode::Malformed, 0)
        );
        closes(&mut s);
    }
    // A body that does not parse (a reserved payload field not 0): the
    // frame's id, detail 0.
    let (mut s, _) = ready(&donor, b"");
    let mut bad = lookup(9, digest, &[1]);
    bad[HEADER_LEN + 4] = 1;
    s.write_all(&bad).expect("write");
    assert_eq!(
        error_of(&read_frame(&mut s).expect("error")),
        (9, ErrorCode::Malformed, 0)
    );
    closes(&mut s);
}

/// Point 7: a client's Pong is ignored; donor frames from a client close.
#[test]
fn a_clients_pong_is_ignored_and_donor_frames_are_malformed() {
    let (_dir, digest, donor) = donor(&[]);
    let (mut s, _) = ready(&donor, b"");
    s.write_all(&raw_header(7, 0, 0, 3, 0)).expect("pong");
    still_serves(&mut s, digest, 4);
    for kind in [
        FrameKind::Welcome,
        FrameKind::Rows,
        FrameKind::Error,
        FrameKind::Goodbye,
        FrameKind::Region,
    ] {
        let (mut s, _) = ready(&donor, b"");
        // The kind alone is refused, before its payload is parsed.
        let payload = vec![0u8; 8];
        s.write_all(&raw_header(kind as u8, 0, 0, 12, payload.len() as u32))
            .expect("header");
        s.write_all(&payload).expect("payload");
        assert_eq!(
            error_of(&read_frame(&mut s).expect("error")),
            (12, ErrorCode::Malformed, kind as u64),
            "{kind:?}"
        );
        closes(&mut s);
    }
}

/// Point 8: request id 0 is refused for Lookup and Ping.
#[test]
fn a_request_with_id_zero_is_refused() {
    let (_dir, digest, donor) = donor(&[]);
    let (mut s, _) = ready(&donor, b"");
    s.write_all(&lookup(0, digest, &[1])).expect("write");
    assert_eq!(
        error_of(&read_frame(&mut s).expect("error")),
        (0, ErrorCode::Malformed, FrameKind::Lookup as u64)
    );
    closes(&mut s);
    let (mut s, _) = ready(&donor, b"");
    s.write_all(&raw_header(6, 0, 0, 0, 0)).expect("write");
    assert_eq!(
        error_of(&read_frame(&mut s).expect("error")),
        (0, ErrorCode::Malformed, FrameKind::Ping as u64)
    );
    closes(&mut s);
}

/// Section 3.10: a RegionQuery on plaintext TCP is refused `unauthorized`
/// with its request id and the table, and the connection stays; with id 0
/// it is `malformed` and closes, as any request.
#[test]
fn a_region_query_in_the_clear_is_unauthorized_and_keeps_the_connection() {
    let (_dir, digest, donor) = donor(&[]);
    let (mut s, _) = ready(&donor, b"");
    let mut q = raw_header(9, 0, 0, 21, 8);
    q.extend_from_slice(&1u32.to_le_bytes());
    q.extend_from_slice(&0u32.to_le_bytes());
    s.write_all(&q).expect("query");
    let f = read_frame(&mut s).expect("error");
    assert_eq!(error_of(&f), (21, ErrorCode::Unauthorized, 0));
    let d = decode(&f, &Limits::default())
        .expect("valid")
        .expect("whole");
    assert!(
        matches!(d.frame, Frame::Error(e) if e.table_id == Some(1)),
        "{d:?}"
    );
    still_serves(&mut s, digest, 22);
    let (mut s, _) = ready(&donor, b"");
    let mut q = raw_header(9, 0, 0, 0, 8);
    q.extend_from_slice(&[0; 8]);
    s.write_all(&q).expect("query");
    assert_eq!(
        error_of(&read_frame(&mut s).expect("error")),
        (0, ErrorCode::Malformed, FrameKind::RegionQuery as u64)
    );
    closes(&mut s);
}

/// Point 9: no Hello within the timeout: the stream ends, with no Error.
#[test]
fn a_silent_connection_is_closed_at_the_hello_timeout_without_an_error() {
    let (_dir, _, donor) = donor(&["--hello-timeout-ms", "300"]);
    let mut s = connect(&donor);
    let started = Instant::now();
    assert_eq!(read_frame(&mut s), None, "the end of the stream, no Error");
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(250), "closed after {took:?}");
    assert!(took < Duration::from_secs(4), "closed after {took:?}");
}

/// The header codec and the donor agree on what a 16-byte header is.
#[test]
fn the_written_header_is_the_documented_layout() {
    let mut h = Vec::new();
    FrameHeader::write(&mut h, FrameKind::Ping, 0x0102_0304_0506_0708, 0);
    assert_eq!(h, raw_header(6, 0, 0, 0x0102_0304_0506_0708, 0));
}

/// The state letter (`R`, `S`, ...) of each thread of `pid` named `conn-*`
/// (the donor's connection threads), from `/proc`.
fn conn_thread_states(pid: u32) -> Vec<char> {
    let mut out = Vec::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for t in tasks.flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if !comm.starts_with("conn-") {
            continue;
        }
        let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        if let Some(state) = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
        {
            out.push(state);
        }
    }
    out
}

/// Section 3.7: after answering a Ping, the connection's thread polls for
/// the next frame (runnable) for up to 1 ms instead of sleeping, and
/// sleeps once that is over; the exchange itself is unchanged (the Pong
/// echoes the id, and a lookup after it is answered).
#[test]
fn after_a_ping_the_connection_polls_for_a_while_then_sleeps() {
    let (_dir, digest, donor) = donor(&[]);
    let (mut s, _) = ready(&donor, b"");
    let pid = donor.id();
    let (mut polling, mut sampled) = (0, 0);
    for id in 1..=20u64 {
        s.write_all(&raw_header(6, 0, 0, id, 0)).expect("ping");
        let pong = read_frame(&mut s).expect("pong");
        let read_at = Instant::now();
        assert_eq!(pong, raw_header(7, 0, 0, id, 0), "a Pong echoing the id");
        // 300 us after the Pong: a thread that went back to a blocking
        // read would have been asleep for most of that.
        while read_at.elapsed() < Duration::from_micros(300) {
            std::hint::spin_loop();
        }
        let states = conn_thread_states(pid);
        // Counted only when looked at well inside the 1 ms.
        if read_at.elapsed() < Duration::from_micros(800) {
            sampled += 1;
            if states.contains(&'R') {
                polling += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(30));
        let states = conn_thread_states(pid);
        assert_eq!(states, vec!['S'], "30 ms after the Pong, asleep in a read");
    }
    assert!(
        sampled >= 5,
        "too few timely samples ({sampled}) on this machine"
    );
    assert!(
        polling * 2 >= sampled,
        "the connection thread was runnable 300 us after the Pong in {polling} of {sampled} samples"
    );
    still_serves(&mut s, digest, 99);
}
