use super::*;
use crate::tls::tests::donor_and_node;
use std::io::{Read, Write};

fn configs() -> (
    tempfile::TempDir,
    Arc<rustls::ClientConfig>,
    Arc<rustls::ServerConfig>,
) {
    let (dir, donor, node) = donor_and_node();
    let server = donor.server_config(&[b"x"]).expect("server");
    let client = node.client_config(&[b"x"]).expect("client");
    (dir, client, server)
}

fn name() -> ServerName<'static> {
    crate::tls::server_name("donor-a").expect("name")
}

/// Both ends here: handshake in memory, then the two record layers.
fn pair() -> (Records, Records) {
    let (_dir, client, server) = configs();
    let mut c = Handshake::client(client, name()).expect("client");
    let mut s = Handshake::server(server).expect("server");
    let (mut to_s, mut to_c) = (Vec::new(), Vec::new());
    let mut plain = Vec::new();
    let (mut c_done, mut s_done) = (false, false);
    for _ in 0..16 {
        if !c_done {
            c_done = c.advance(&mut to_c, &mut to_s, &mut plain).expect("client") == Progress::Done;
        }
        if !s_done {
            s_done = s.advance(&mut to_s, &mut to_c, &mut plain).expect("server") == Progress::Done;
        }
        if c_done && s_done && to_s.is_empty() && to_c.is_empty() {
            break;
        }
    }
    assert!(c_done && s_done, "the handshake completes");
    assert!(plain.is_empty());
    assert_eq!(
        crate::tls::peer_identity(s.peer_certificates()).as_deref(),
        Some("node-1")
    );
    (
        c.into_records().expect("client records"),
        s.into_records().expect("server records"),
    )
}

/// Open every record in `wire`, returning the data and whether the peer
/// closed.
fn open_all(r: &mut Records, wire: &mut Vec<u8>) -> Result<(Vec<u8>, bool), RecordError> {
    let mut data = Vec::new();
    let mut at = 0;
    let mut closed = false;
    while let Some(len) = record_len(&wire[at..])? {
        assert!(wire.len() >= at + len, "whole records only");
        match r.open(&mut wire[at..at + len])? {
            Opened::Data(range) => data.extend_from_slice(&wire[at..at + len][range]),
            Opened::Nothing => {}
            Opened::Closed => closed = true,
        }
        at += len;
    }
    wire.drain(..at);
    Ok((data, closed))
}

#[test]
fn records_sealed_here_open_here_both_ways_at_any_size() {
    let (mut c, mut s) = pair();
    for size in [0usize, 1, 6_336, MAX_PLAIN, MAX_PLAIN + 1, 100_000, 1 << 20] {
        let msg: Vec<u8> = (0..size).map(|i| (i * 7 + size) as u8).collect();
        let mut wire = Vec::new();
        c.seal(&msg, &mut wire).expect("seal");
        assert_eq!(wire.len(), size.div_ceil(MAX_PLAIN) * (HEADER + 17) + size);
        assert_eq!(open_all(&mut s, &mut wire).expect("open").0, msg);
        s.seal(&msg, &mut wire).expect("seal");
        assert_eq!(open_all(&mut c, &mut wire).expect("open").0, msg);
    }
    let mut wire = Vec::new();
    c.seal_close_notify(&mut wire).expect("close");
    assert_eq!(open_all(&mut s, &mut wire).expect("open"), (vec![], true));
}

#[test]
fn a_changed_byte_a_replayed_record_or_a_bad_header_is_an_error() {
    let (mut c, mut s) = pair();
    let mut wire = Vec::new();
    c.seal(b"rows", &mut wire).expect("seal");
    let mut flipped = wire.clone();
    flipped[HEADER + 1] ^= 1;
    assert!(matches!(
        open_all(&mut s, &mut flipped),
        Err(RecordError::Decrypt)
    ));
    // The receiver's sequence moved on: a later record fails too (the
    // session is dead after any error), and a record replayed fails.
    let (mut c, mut s) = pair();
    let mut wire2 = Vec::new();
    c.seal(b"rows", &mut wire2).expect("seal");
    let replay = wire2.clone();
    assert_eq!(open_all(&mut s, &mut wire2).expect("open").0, b"rows");
    assert!(matches!(
        open_all(&mut s, &mut replay.clone()),
        Err(RecordError::Decrypt)
    ));
    for bad in [
        &[22u8, 3, 3, 0, 40][..],
        &[23, 3, 3, 0x48, 0x20],
        &[23, 3, 3, 0, 3],
    ] {
        assert!(
            matches!(record_len(bad), Err(RecordError::BadHeader { .. })),
            "{bad:?}"
        );
    }
    assert_eq!(record_len(&[23, 3, 3]).expect("short"), None);
    let _ = wire;
}

#[test]
fn keys_are_updated_before_their_limit_and_the_peer_follows() {
    let (mut c, mut s) = pair();
    c.set_update_at(3);
    let mut wire = Vec::new();
    for i in 0..10u8 {
        c.seal(&[i; 100], &mut wire).expect("seal");
    }
    // 10 data records, and a key update each time the sequence reached 3.
    let updates = (wire.len() - 10 * (HEADER + 117)) / (HEADER + 5 + 17);
    assert_eq!(updates, 3);
    let (data, _) = open_all(&mut s, &mut wire).expect("the peer follows");
    assert_eq!(data.len(), 1000);
    assert!(data[900..].iter().all(|&b| b == 9));
}

/// Give `wire` to a buffered rustls connection; the plaintext it read.
fn feed(theirs: &mut rustls::ServerConnection, wire: &[u8]) -> Vec<u8> {
    let mut r = wire;
    let mut got = Vec::new();
    while !r.is_empty() {
        theirs.read_tls(&mut r).expect("read_tls");
        theirs.process_new_packets().expect("theirs opens ours");
        let _ = theirs.reader().read_to_end(&mut got);
    }
    got
}

/// Interoperation with rustls' own (buffered) connections: our records
/// are TLS 1.3 records, and a buffered peer's key updates are followed.
#[test]
fn a_buffered_rustls_peer_reads_our_records_and_its_key_updates_are_followed() {
    let (_dir, client, server) = configs();
    // Ours as the client, rustls' buffered server.
    let mut ours = Handshake::client(client, name()).expect("client");
    let mut theirs = rustls::ServerConnection::new(server).expect("server");
    let (mut to_them, mut to_us, mut plain) = (Vec::new(), Vec::new(), Vec::new());
    let mut done = false;
    for _ in 0..16 {
        if !done {
            done = ours
                .advance(&mut to_us, &mut to_them, &mut plain)
                .expect("ours")
                == Progress::Done;
        }
        let mut r = &to_them[..];
        while !r.is_empty() {
            theirs.read_tls(&mut r).expect("read_tls");
        }
        to_them.clear();
        theirs.process_new_packets().expect("theirs");
        while theirs.wants_write() {
            theirs.write_tls(&mut to_us).expect("write_tls");
        }
        if done && !theirs.is_handshaking() && to_us.is_empty() {
            break;
        }
    }
    assert!(done && !theirs.is_handshaking());
    let mut ours = ours.into_records().expect("records");
    ours.seal(&[5; 40_000], &mut to_them).expect("seal");
    assert_eq!(feed(&mut theirs, &to_them), vec![5; 40_000]);
    // Their key update, asking for ours: followed, and ours is sent first
    // with the next data.
    theirs.refresh_traffic_keys().expect("refresh");
    theirs.writer().write_all(b"after").expect("write");
    let mut wire = Vec::new();
    while theirs.wants_write() {
        theirs.write_tls(&mut wire).expect("write_tls");
    }
    assert_eq!(
        open_all(&mut ours, &mut wire).expect("followed").0,
        b"after"
    );
    let mut back = Vec::new();
    ours.seal(b"answer", &mut back).expect("seal");
    assert_eq!(feed(&mut theirs, &back), b"answer");
}

#[test]
fn a_failed_handshake_gives_the_peer_an_alert() {
    let (_dir, client, _) = configs();
    // A server whose CA the client does not trust.
    let (_dir2, other, _) = donor_and_node();
    let server = other.server_config(&[b"x"]).expect("server");
    let mut c = Handshake::client(client, name()).expect("client");
    let mut s = Handshake::server(server).expect("server");
    let (mut to_s, mut to_c, mut plain) = (Vec::new(), Vec::new(), Vec::new());
    let mut failed = None;
    for _ in 0..8 {
        if let Err(e) = c.advance(&mut to_c, &mut to_s, &mut plain) {
            failed = Some(e);
            break;
        }
        let _ = s.advance(&mut to_s, &mut to_c, &mut plain);
    }
    assert!(failed.is_some(), "an untrusted server fails the handshake");
    // The alert for the server (encrypted with the handshake's keys, as
    // every record after the ServerHello).
    assert!(!to_s.is_empty(), "an alert was written");
}

/// A peer that asks for key updates faster than we send is cut off: what
/// waits for our next record stays bounded.
#[test]
fn key_updates_asked_faster_than_we_send_are_bounded() {
    let (mut c, mut s) = pair();
    let mut failed = None;
    for i in 0..1000 {
        // A KeyUpdate asking for ours, sealed by the client's layer as a
        // handshake record, then its own keys moved on.
        let mut wire = Vec::new();
        c.seal_one(&[KEY_UPDATE, 0, 0, 1, 1], ContentType::Handshake, &mut wire)
            .expect("seal");
        let (seq, next) = match &mut c.kernel {
            Kernel::Client(k) => k.update_tx_secret().expect("update"),
            Kernel::Server(_) => unreachable!("the client's layer"),
        };
        c.tx = Keys::new(seq, next).expect("keys");
        if let Err(e) = open_all(&mut s, &mut wire) {
            failed = Some((i, e));
            break;
        }
    }
    let (i, e) = failed.expect("cut off");
    assert!(
        i > 10 && s.pending.len() <= MAX_PENDING + 64,
        "after {i}: {e}"
    );
    assert!(e.to_string().contains("key updates keep coming"), "{e}");
}
