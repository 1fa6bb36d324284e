//! The client and server sessions run against each other, byte for byte,
//! with no socket: the handshake, pipelined lookups, a cancelled request,
//! refusals, the drain, and what a broken peer gets.

use std::time::{Duration, Instant};

use super::client::{
    self, ClientSession, Incoming, Kind, Request, SessionError, encode_lookup_frame,
};
use super::server::{Closed, ServerSession, Step};
use super::toy::{self, ToyDonor};
use crate::messages::LookupSection;
use crate::synthetic::first_mismatch;
use crate::{ErrorCode, FrameHeader, Goodbye, Limits, ROW_BYTES, TableDigest};

/// A donor session, its service, and the bytes it has answered.
struct Donor {
    session: ServerSession,
    svc: ToyDonor,
    out: Vec<u8>,
}

impl Donor {
    fn new() -> Self {
        Self {
            session: ServerSession::new(Limits::default(), true),
            svc: ToyDonor::default(),
            out: Vec::new(),
        }
    }

    /// Take `bytes` in chunks of `chunk`, stepping after each; the steps
    /// other than NeedInput, and everything answered.
    fn feed(&mut self, bytes: &[u8], chunk: usize) -> (Vec<Step>, Vec<u8>) {
        let mut steps = Vec::new();
        for piece in bytes.chunks(chunk.max(1)) {
            self.session.rb.push(piece);
            loop {
                match self.session.step(&mut self.svc, &mut self.out) {
                    Step::NeedInput => break,
                    s @ Step::Close(_) => {
                        steps.push(s);
                        return (steps, std::mem::take(&mut self.out));
                    }
                    s => steps.push(s),
                }
            }
        }
        (steps, std::mem::take(&mut self.out))
    }
}

/// Split a byte stream into whole frames.
fn frames(mut bytes: &[u8]) -> Vec<&[u8]> {
    let mut v = Vec::new();
    while let Ok(Some(h)) = FrameHeader::peek_unbounded(bytes) {
        v.push(&bytes[..h.frame_len()]);
        bytes = &bytes[h.frame_len()..];
    }
    assert!(bytes.is_empty(), "a partial frame left over");
    v
}

/// A client and a donor past the handshake.
fn connected() -> (ClientSession<()>, Donor) {
    let mut c = ClientSession::new(toy::client_config());
    let mut d = Donor::new();
    let mut hello = Vec::new();
    c.hello(&mut hello).expect("hello");
    let (steps, answer) = d.feed(&hello, usize::MAX);
    assert_eq!(steps, vec![Step::Ready]);
    c.welcome(&answer).expect("welcome");
    (c, d)
}

fn lookup(c: &mut ClientSession<()>, rows: &[u64], out: &mut Vec<u8>) -> u64 {
    let id = c.begin(Kind::Lookup, ()).expect("begin");
    let mut sections: Vec<LookupSection<'_>> = Vec::new();
    let req = [Request {
        table: toy::TABLE,
        rows,
    }];
    c.sections(&req, &mut sections).expect("sections");
    encode_lookup_frame(out, id, &sections).expect("encode");
    id
}

#[test]
fn the_handshake_gives_the_donors_tables_and_readies_both_sides() {
    let (c, d) = connected();
    assert_eq!(c.donor(), "toy");
    assert_eq!(c.tables().len(), 1);
    assert_eq!(c.tables()[0].digest, toy::digest());
    assert!(d.session.is_ready());
    assert!(!c.is_draining() && c.closed().is_none());
}

#[test]
fn pipelined_lookups_are_answered_in_order_with_the_right_rows_however_the_bytes_are_cut() {
    for chunk in [1, 7, 24, 4096, usize::MAX] {
        let (mut c, mut d) = connected();
        let asks: [&[u64]; 3] = [&[0, 1, 2], &[999, 5], &[17; 24]];
        let mut wire = Vec::new();
        let ids: Vec<u64> = asks
            .iter()
            .map(|rows| lookup(&mut c, rows, &mut wire))
            .collect();
        assert_eq!(c.in_flight(), 3);
        let (steps, answers) = d.feed(&wire, chunk);
        assert!(steps.is_empty(), "{steps:?}");
        let answers = frames(&answers);
        assert_eq!(answers.len(), 3);
        for ((frame, rows), id) in answers.iter().zip(asks).zip(&ids) {
            assert_eq!(c.receive(frame), Ok(Incoming::Answer(*id)));
            let req = [Request {
                table: toy::TABLE,
                rows,
            }];
            let mut got = vec![0u8; rows.len() * ROW_BYTES];
            client::rows(c.limits(), frame, &req, &[], &mut got).expect("rows");
            assert_eq!(first_mismatch(toy::SEED, toy::LAYER, rows, &got), None);
            c.finish(*id);
        }
        assert_eq!(c.in_flight(), 0);
        assert_eq!(d.svc.lookups, 3);
    }
}

#[test]
fn a_cancelled_requests_late_answer_is_dropped_and_a_never_sent_id_breaks_the_session() {
    let (mut c, mut d) = connected();
    let mut wire = Vec::new();
    let id = lookup(&mut c, &[3], &mut wire);
    c.finish(id);
    let (_, answer) = d.feed(&wire, usize::MAX);
    assert_eq!(c.receive(&answer), Ok(Incoming::Stale));
    // The same answer as if to a request never sent.
    let mut forged = answer.clone();
    forged[8..16].copy_from_slice(&99u64.to_le_bytes());
    let e = c.receive(&forged).expect_err("never sent");
    assert!(matches!(e, SessionError::Protocol(_)), "{e}");
    assert!(c.closed().is_some());
    assert_eq!(c.begin(Kind::Ping, ()), Err(e));
}

#[test]
fn a_second_answer_and_an_answer_of_the_wrong_kind_are_violations() {
    let (mut c, mut d) = connected();
    let ping = c.begin(Kind::Ping, ()).expect("begin");
    let mut wire = Vec::new();
    client::encode_ping_frame(&mut wire, ping);
    let (_, pong) = d.feed(&wire, usize::MAX);
    assert_eq!(d.svc.pings, 1);
    assert!(d.session.take_pinged());
    assert_eq!(c.receive(&pong), Ok(Incoming::Answer(ping)));
    client::pong(c.limits(), &pong).expect("pong");
    assert!(matches!(c.receive(&pong), Err(SessionError::Protocol(_))));

    let (mut c, mut d) = connected();
    let mut wire = Vec::new();
    let id = lookup(&mut c, &[1], &mut wire);
    let (_, rows) = d.feed(&wire, usize::MAX);
    let mut as_pong = Vec::new();
    crate::messages::encode_ping(&mut as_pong, id, true);
    assert!(matches!(
        c.receive(&as_pong),
        Err(SessionError::Protocol(_))
    ));
    assert!(c.receive(&rows).is_err(), "the session stays closed");
}

#[test]
fn a_wrong_credential_and_a_wrong_pin_are_refused_with_their_reasons() {
    let mut cfg = toy::client_config();
    cfg.credential = b"wrong".to_vec();
    let mut c: ClientSession = ClientSession::new(cfg);
    let mut d = Donor::new();
    let mut hello = Vec::new();
    c.hello(&mut hello).expect("hello");
    let (steps, answer) = d.feed(&hello, usize::MAX);
    assert_eq!(steps, vec![Step::Close(Closed::Refused)]);
    assert_eq!(d.svc.errors, vec![ErrorCode::Unauthorized]);
    let e = c.welcome(&answer).expect_err("refused");
    assert!(
        matches!(
            e,
            SessionError::Refused {
                code: ErrorCode::Unauthorized,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.retry_elsewhere());

    let mut cfg = toy::client_config();
    cfg.pinned = vec![(toy::TABLE, TableDigest([8; 32]))];
    let mut c: ClientSession = ClientSession::new(cfg);
    let mut d = Donor::new();
    let mut hello = Vec::new();
    c.hello(&mut hello).expect("hello");
    let (_, answer) = d.feed(&hello, usize::MAX);
    let e = c.welcome(&answer).expect_err("pin");
    assert!(
        matches!(
            e,
            SessionError::DigestMismatch {
                table: toy::TABLE,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn a_lookup_of_an_unpinned_table_or_over_the_caps_is_refused_before_it_is_sent() {
    let (c, _) = connected();
    let mut sections = Vec::new();
    let other = [Request {
        table: 9,
        rows: &[1],
    }];
    assert_eq!(
        c.sections(&other, &mut sections),
        Err(SessionError::NotPinned(9))
    );
    let many = vec![0u64; 5_000];
    let big = [Request {
        table: toy::TABLE,
        rows: &many,
    }];
    let e = c.sections(&big, &mut sections).expect_err("caps");
    assert!(!e.retry_elsewhere(), "{e}");
}

#[test]
fn sections_from_kept_pins_and_limits_are_the_sessions() {
    // A driver that copies the pins and limits after the Welcome builds
    // the same sections, and refuses the same requests, without the session.
    let (c, _) = connected();
    let (pins, limits) = (c.pins().to_vec(), *c.limits());
    assert_eq!(pins.len(), 1);
    assert_eq!(pins[0].0, toy::TABLE);
    let rows = [3u64, 1, 4];
    let mut two = Vec::new();
    for req in [
        [Request {
            table: toy::TABLE,
            rows: &rows,
        }],
        [Request {
            table: 9,
            rows: &rows,
        }],
    ] {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        let from_session = c.sections(&req, &mut a);
        let kept = client::sections(&limits, &pins, &req, &mut b);
        assert_eq!(from_session, kept);
        assert_eq!(format!("{a:?}"), format!("{b:?}"));
        two.push(kept);
    }
    assert_eq!(two, [Ok(()), Err(SessionError::NotPinned(9))]);
    let many = vec![0u64; limits.max_rows as usize + 1];
    let big = [Request {
        table: toy::TABLE,
        rows: &many,
    }];
    assert!(client::sections(&limits, &pins, &big, &mut Vec::new()).is_err());
}

#[test]
fn a_section_the_donor_cannot_serve_comes_back_typed() {
    let (mut c, mut d) = connected();
    let mut wire = Vec::new();
    let id = lookup(&mut c, &[toy::ROWS], &mut wire);
    let (_, answer) = d.feed(&wire, usize::MAX);
    assert_eq!(c.receive(&answer), Ok(Incoming::Answer(id)));
    let req = [Request {
        table: toy::TABLE,
        rows: &[toy::ROWS],
    }];
    let e = client::rows(c.limits(), &answer, &req, &[], &mut [0u8; ROW_BYTES]).expect_err("range");
    assert_eq!(
        e,
        SessionError::Section {
            table: toy::TABLE,
            code: ErrorCode::RowOutOfRange
        }
    );
    assert!(!e.retry_elsewhere());
}

#[test]
fn a_corrupted_answer_is_corrupt_not_rows() {
    let (mut c, mut d) = connected();
    let mut wire = Vec::new();
    let id = lookup(&mut c, &[4, 5], &mut wire);
    let (_, mut answer) = d.feed(&wire, usize::MAX);
    let last = answer.len() - 1;
    answer[last] ^= 1;
    assert_eq!(c.receive(&answer), Ok(Incoming::Answer(id)));
    let req = [Request {
        table: toy::TABLE,
        rows: &[4, 5],
    }];
    let e = client::rows(c.limits(), &answer, &req, &[], &mut [0u8; 2 * ROW_BYTES])
        .expect_err("corrupt");
    assert!(matches!(e, SessionError::Corrupt(_)), "{e}");
}

#[test]
fn after_a_goodbye_nothing_new_is_sent_and_the_last_answer_closes_the_session() {
    let (mut c, mut d) = connected();
    let mut wire = Vec::new();
    let id = lookup(&mut c, &[1], &mut wire);
    let mut bye = Vec::new();
    Goodbye { grace_ms: 500 }.encode(&mut bye);
    assert_eq!(c.receive(&bye), Ok(Incoming::Goodbye));
    assert!(c.is_draining());
    assert_eq!(c.begin(Kind::Lookup, ()), Err(SessionError::Draining));
    // The request in flight is still answered.
    let (_, answer) = d.feed(&wire, usize::MAX);
    assert_eq!(c.receive(&answer), Ok(Incoming::Answer(id)));
    assert!(c.finish(id), "the last answer ends the drain");
    assert_eq!(c.closed(), Some(&SessionError::Draining));
    assert!(!c.close_if_drained(), "once");
}

#[test]
fn an_unsolicited_error_ends_the_session_and_fails_every_request_in_flight() {
    let (mut c, mut d) = connected();
    let mut sessions: ClientSession<Option<SessionError>> =
        ClientSession::new(toy::client_config());
    let mut hello = Vec::new();
    sessions.hello(&mut hello).expect("hello");
    let (_, welcome) = Donor::new().feed(&hello, usize::MAX);
    sessions.welcome(&welcome).expect("welcome");
    let a = sessions.begin(Kind::Lookup, None).expect("a");
    // A donor's frame kind from the client: the donor refuses and closes,
    // with an Error of request id 0.
    let mut wire = Vec::new();
    Goodbye { grace_ms: 0 }.encode(&mut wire);
    let (steps, err) = d.feed(&wire, usize::MAX);
    assert_eq!(steps, vec![Step::Close(Closed::RefusedKind)]);
    let e = sessions.receive(&err).expect_err("unsolicited");
    assert!(
        matches!(e, SessionError::Disconnected(ref m) if m.contains("malformed")),
        "{e}"
    );
    sessions.close(e.clone(), |slot, why| *slot = Some(why.clone()));
    assert_eq!(sessions.slot(a).and_then(|s| s.clone()), Some(e));
    assert!(c.receive(&err).is_err());
}

#[test]
fn the_donor_refuses_what_breaks_the_rules_and_keeps_an_oversized_lookups_connection() {
    // Not Hello first.
    let mut d = Donor::new();
    let mut ping = Vec::new();
    crate::messages::encode_ping(&mut ping, 1, false);
    let (steps, _) = d.feed(&ping, usize::MAX);
    assert_eq!(steps, vec![Step::Close(Closed::RefusedKind)]);
    assert_eq!(d.session.last_error(), Some(ErrorCode::Malformed));
    // A TLS ClientHello on a plaintext port.
    let mut d = Donor::new();
    let (steps, _) = d.feed(
        &[
            0x16, 0x03, 0x01, 0x02, 0x00, 1, 0, 1, 0xfc, 3, 3, 0, 0, 0, 0, 0,
        ],
        64,
    );
    assert_eq!(steps, vec![Step::Close(Closed::TlsOnPlaintext)]);
    // A Lookup over the row cap after the handshake: refused, skipped, kept.
    let (mut c, mut d) = connected();
    let many = vec![1u64; 20_000];
    let mut wire = Vec::new();
    let sections = [LookupSection {
        table_id: toy::TABLE,
        digest_prefix: toy::digest().prefix(),
        rows: &many,
    }];
    encode_lookup_frame(&mut wire, 1, &sections).expect("encode");
    let id = c.begin(Kind::Lookup, ()).expect("begin");
    assert_eq!(id, 1);
    let next = lookup(&mut c, &[2], &mut wire);
    let (steps, answers) = d.feed(&wire, 1000);
    assert!(steps.is_empty(), "{steps:?}");
    let answers = frames(&answers);
    assert_eq!(answers.len(), 2);
    assert_eq!(c.receive(answers[0]), Ok(Incoming::Answer(id)));
    let req = [Request {
        table: toy::TABLE,
        rows: &many,
    }];
    let e = client::rows(c.limits(), answers[0], &req, &[], &mut []).expect_err("too large");
    assert!(
        matches!(
            e,
            SessionError::Donor {
                code: ErrorCode::RequestTooLarge,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(c.receive(answers[1]), Ok(Incoming::Answer(next)));
}

#[test]
fn idleness_is_measured_from_the_last_read_at_the_time_given() {
    let (mut c, _) = connected();
    let t = Instant::now();
    assert!(c.idle(t), "never read");
    c.read_at(t);
    assert!(!c.idle(t + Duration::from_micros(500)));
    assert!(c.idle(t + client::IDLE_AFTER));
}

#[test]
fn the_fuzz_corpus_holds_the_seeds_and_replays_clean() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
    let write = std::env::var_os("ENGRAM_WRITE_CORPUS").is_some();
    for (target, name, bytes) in toy::seeds() {
        let path = dir.join(target).join(name);
        if write {
            std::fs::create_dir_all(dir.join(target)).expect("mkdir");
            std::fs::write(&path, &bytes).expect("write");
        }
        let kept = std::fs::read(&path).unwrap_or_default();
        assert!(
            kept == bytes,
            "{} is stale: ENGRAM_WRITE_CORPUS=1 cargo test -p engram-protocol corpus",
            path.display()
        );
    }
    let mut replayed = 0;
    for (target, run) in [
        ("frames", toy::fuzz_frames as fn(&[u8])),
        ("server", toy::fuzz_server),
        ("client", toy::fuzz_client),
    ] {
        let entries = std::fs::read_dir(dir.join(target)).expect("corpus directory");
        for e in entries {
            let bytes = std::fs::read(e.expect("entry").path()).expect("read");
            run(&bytes);
            replayed += 1;
        }
    }
    assert!(replayed >= toy::seeds().len());
}

/// An answer whose sections' row sizes are not the ones the tables were
/// announced with is a protocol violation, on both ways of reading it.
#[test]
fn rows_of_another_size_than_announced_are_refused() {
    use crate::messages::{RowsSection, begin_rows, finish_rows};
    let answer = |row_bytes: u16, n: usize| {
        let mut out = Vec::new();
        let s = [RowsSection {
            table_id: 3,
            status: None,
            row_count: 2,
            row_bytes,
        }];
        let start = begin_rows(&mut out, 1, &s).expect("begin");
        out.extend(std::iter::repeat_n(0x38u8, 2 * n));
        finish_rows(&mut out, start).expect("finish");
        out
    };
    let rows = [4u64, 5];
    let req = [Request {
        table: 3,
        rows: &rows,
    }];
    let limits = Limits::default();
    let fp8 = answer(160, 160);
    let mut out = [0u8; 320];
    client::rows(&limits, &fp8, &req, &[160], &mut out).expect("announced size");
    assert_eq!(out, [0x38; 320]);
    let head = &fp8[..crate::HEADER_LEN + 16 + 12];
    client::placed(head, &req, &[160]).expect("placed at the announced size");
    // The table was announced with V4.1's rows (0), the answer says 160;
    // and the other way round.
    for (e, sizes) in [
        (
            client::rows(&limits, &fp8, &req, &[0], &mut out),
            "264 announced",
        ),
        (client::placed(head, &req, &[0]), "264 announced, placed"),
        (
            client::rows(&limits, &answer(0, ROW_BYTES), &req, &[160], &mut [0; 528]),
            "160 announced",
        ),
    ] {
        assert!(
            matches!(e, Err(SessionError::Protocol(_))),
            "{sizes}: {e:?}"
        );
    }
}
