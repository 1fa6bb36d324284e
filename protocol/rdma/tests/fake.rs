//! The core over the fake provider: a donor's region book and a node's
//! reader in one process, with every fault the fake injects.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engram_protocol::{ROW_BYTES, TableDigest};
use engram_rdma::book::RegionBook;
use engram_rdma::fake::{FakeFault, FakeProvider};
use engram_rdma::plan::{Fault, Outcome};
use engram_rdma::reader::{DEFAULT_SLOT_ROWS, Reader, Session, Step, qp_options};
use engram_rdma::verbs::{Completion, DeviceSpec, Fabric, Provider, ReadWr, WcStatus};

const ROWS: u64 = 1000;

fn table(version: u8) -> Vec<u8> {
    (0..ROWS as usize * ROW_BYTES)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(version))
        .collect()
}

struct Rig {
    provider: FakeProvider,
    book: Arc<RegionBook>,
    addr: SocketAddr,
    digest: TableDigest,
    session: Session,
    reader: Option<Reader>,
}

impl Rig {
    fn new(port: u16) -> Self {
        let provider = FakeProvider::new();
        let book = RegionBook::new(Arc::new(provider.clone()), DeviceSpec::default());
        let digest = TableDigest([1; 32]);
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        assert!(book.publish(0, ROWS, digest, Arc::new(table(1))).is_ok());
        assert!(book.listen(addr).is_ok());
        Self {
            provider,
            book,
            addr,
            digest,
            session: Session::default(),
            reader: None,
        }
    }

    /// One lookup as the node does it: learn, connect, read, with a deadline.
    fn lookup(&mut self, rows: &[u64], out: &mut [u8]) -> Result<(), Fault> {
        let deadline = Instant::now() + Duration::from_millis(200);
        loop {
            match self.session.step(0, Instant::now()) {
                Step::Learn => {
                    let Some(g) = self.book.grant(0, "node-1") else {
                        return Err(Fault::PeerGone);
                    };
                    assert!(self.session.learned(&g, &self.digest).is_ok());
                }
                Step::Connect(token) => {
                    match self.provider.connect(
                        self.addr,
                        &token,
                        &qp_options(Duration::from_secs(1), Fabric::default()),
                    ) {
                        Ok(qp) => {
                            self.reader = Some(Reader::new(qp, DEFAULT_SLOT_ROWS));
                            self.session.connected();
                        }
                        Err(_) => {
                            self.session.connect_failed(Instant::now());
                            return Err(Fault::PeerGone);
                        }
                    }
                }
                Step::Backoff(_) => return Err(Fault::PeerGone),
                Step::Read(layout) => {
                    let Some(reader) = self.reader.as_mut() else {
                        return Err(Fault::Local);
                    };
                    let read = match reader.start(rows, &layout) {
                        Ok(r) => r,
                        Err(_) => {
                            let f = reader.dead().unwrap_or(Fault::PeerGone);
                            self.session.fault(0, f);
                            return Err(f);
                        }
                    };
                    let r = loop {
                        reader.poll();
                        match reader.outcome(&read) {
                            Outcome::Pending if Instant::now() < deadline => {
                                std::thread::yield_now()
                            }
                            Outcome::Pending => {
                                reader.abandon(read);
                                break Err(Fault::Timeout);
                            }
                            Outcome::Done => break reader.finish(read, rows, &layout, out),
                            Outcome::Failed(f) => {
                                reader.release(read);
                                break Err(f);
                            }
                        }
                    };
                    if let Err(f) = r {
                        self.session.fault(0, f);
                    }
                    return r;
                }
            }
        }
    }
}

fn expect_rows(t: &[u8], rows: &[u64], out: &[u8]) {
    for (i, &r) in rows.iter().enumerate() {
        let r = r as usize;
        assert_eq!(
            &out[i * ROW_BYTES..(i + 1) * ROW_BYTES],
            &t[r * ROW_BYTES..(r + 1) * ROW_BYTES],
            "row {r}"
        );
    }
}

fn rows24(k: u64) -> Vec<u64> {
    (0..24).map(|i| (i * 41 + k * 7) % ROWS).collect()
}

#[test]
fn rows_equal_the_table_in_one_doorbell_per_token() {
    let mut rig = Rig::new(9001);
    let t = table(1);
    let mut out = vec![0u8; 48 * ROW_BYTES];
    for k in 0..50 {
        let rows = rows24(k);
        assert_eq!(rig.lookup(&rows, &mut out[..24 * ROW_BYTES]), Ok(()));
        expect_rows(&t, &rows, &out);
    }
    let c = rig.reader.as_ref().map(Reader::counts).unwrap_or_default();
    assert_eq!((c.doorbells, c.wrs, c.signaled), (50, 50 * 48, 50));
    // 48 rows (both tables' share of a token): still one doorbell.
    let rows: Vec<u64> = (0..48).map(|i| i * 13).collect();
    assert_eq!(rig.lookup(&rows, &mut out), Ok(()));
    expect_rows(&t, &rows, &out);
    let c = rig.reader.as_ref().map(Reader::counts).unwrap_or_default();
    assert_eq!((c.doorbells, c.wrs, c.signaled), (51, 50 * 48 + 96, 51));
}

#[test]
fn a_swapped_table_is_never_read_as_the_new_version() {
    let mut rig = Rig::new(9002);
    let mut out = vec![0u8; 24 * ROW_BYTES];
    assert_eq!(rig.lookup(&rows24(1), &mut out), Ok(()));
    // The donor swaps to version 2: the node's old key now fails.
    let d2 = TableDigest([2; 32]);
    assert!(rig.book.publish(0, ROWS, d2, Arc::new(table(2))).is_ok());
    assert_eq!(rig.lookup(&rows24(2), &mut out), Err(Fault::Revoked));
    // Learning again finds version 2, which this node does not pin.
    let Some(g) = rig.book.grant(0, "node-1") else {
        panic!("no grant")
    };
    let mut s = Session::default();
    assert!(s.learned(&g, &rig.digest).is_err());
    // Pinning version 2, its rows are version 2's.
    rig.digest = d2;
    assert_eq!(rig.lookup(&rows24(3), &mut out), Ok(()));
    expect_rows(&table(2), &rows24(3), &out);
}

#[test]
fn each_fault_fails_the_lookup_with_zero_wrong_rows_and_the_next_one_recovers() {
    let cases = [
        (
            FakeFault::CompletionError(WcStatus::RetryExceeded),
            Fault::PeerGone,
        ),
        (
            FakeFault::CompletionError(WcStatus::RemoteInvalidRequest),
            Fault::Rejected,
        ),
        (FakeFault::LoseCompletion, Fault::Timeout),
        (FakeFault::Late(Duration::from_millis(500)), Fault::Timeout),
        (FakeFault::Revoke, Fault::Revoked),
        (FakeFault::DeadQueuePair, Fault::PeerGone),
    ];
    let t = table(1);
    for (i, (inject, want)) in cases.into_iter().enumerate() {
        let mut rig = Rig::new(9100 + i as u16);
        let mut out = vec![0u8; 24 * ROW_BYTES];
        assert_eq!(rig.lookup(&rows24(0), &mut out), Ok(()));
        let fabric = Arc::clone(rig.provider.fabric());
        fabric.inject(rig.addr, inject);
        let mut bad = vec![0xEEu8; 24 * ROW_BYTES];
        let began = Instant::now();
        assert_eq!(rig.lookup(&rows24(1), &mut bad), Err(want), "{inject:?}");
        assert!(began.elapsed() < Duration::from_millis(400), "{inject:?}");
        assert!(bad.iter().all(|&b| b == 0xEE), "{inject:?}: no row written");
        if inject == FakeFault::Revoke {
            // The test revoked the live registration behind the book's
            // back: publish again, as a swap would.
            assert!(
                rig.book
                    .publish(0, ROWS, rig.digest, Arc::new(table(1)))
                    .is_ok()
            );
        }
        assert_eq!(rig.lookup(&rows24(2), &mut out), Ok(()), "{inject:?}");
        expect_rows(&t, &rows24(2), &out);
    }
}

#[test]
fn a_restarted_donor_is_reconnected_and_its_region_learned_again() {
    let mut rig = Rig::new(9200);
    let mut out = vec![0u8; 24 * ROW_BYTES];
    assert_eq!(rig.lookup(&rows24(0), &mut out), Ok(()));
    let g1 = rig.session.layout(0).map(|l| l.generation);
    // kill -9: the donor's queue pairs die and its book goes away.
    rig.provider.fabric().kill(rig.addr);
    let provider = rig.provider.clone();
    rig.book = RegionBook::new(Arc::new(provider.clone()), DeviceSpec::default());
    assert_eq!(rig.lookup(&rows24(1), &mut out), Err(Fault::PeerGone));
    // While it is down, connects fail and back off.
    assert!(matches!(rig.session.step(0, Instant::now()), Step::Learn));
    // It comes back: same address, new registrations.
    assert!(
        rig.book
            .publish(0, ROWS, rig.digest, Arc::new(table(1)))
            .is_ok()
    );
    assert!(rig.book.listen(rig.addr).is_ok());
    assert_eq!(rig.lookup(&rows24(2), &mut out), Ok(()));
    expect_rows(&table(1), &rows24(2), &out);
    assert_ne!(rig.session.layout(0).map(|l| l.generation), g1);
}

#[test]
fn a_queue_pair_without_a_granted_token_is_refused() {
    let rig = Rig::new(9300);
    let opts = qp_options(Duration::from_secs(1), Fabric::default());
    assert!(rig.provider.connect(rig.addr, &[0; 16], &opts).is_err());
    assert!(rig.provider.connect(rig.addr, b"short", &opts).is_err());
    let Some(g) = rig.book.grant(0, "node-1") else {
        panic!("no grant")
    };
    assert!(rig.provider.connect(rig.addr, &g.token, &opts).is_ok());
    assert!(
        rig.provider.connect(rig.addr, &g.token, &opts).is_err(),
        "used once"
    );
}

/// A raw queue pair of `depth` entries on `rig`'s donor, on `fabric`, and
/// the region of table 0 (rows address and key).
fn raw_qp(
    rig: &Rig,
    depth: usize,
    fabric: Fabric,
) -> (Box<dyn engram_rdma::verbs::QueuePair>, u64, u32) {
    let Some(g) = rig.book.grant(0, "node-1") else {
        panic!("no grant")
    };
    let opts = engram_rdma::verbs::QpOptions {
        send_depth: depth,
        buffer_bytes: 64 * ROW_BYTES,
        connect_timeout: Duration::from_secs(1),
        fabric,
    };
    let qp = rig
        .provider
        .connect(rig.addr, &g.token, &opts)
        .expect("connected");
    (qp, g.rows_addr, g.rows_rkey)
}

/// `n` one-row READs into consecutive rows of the buffer, the last one
/// signalled.
fn reads(n: usize, addr: u64, rkey: u32) -> Vec<ReadWr> {
    (0..n)
        .map(|i| ReadWr {
            wr_id: i as u64,
            local_offset: i * ROW_BYTES,
            len: ROW_BYTES as u32,
            remote_addr: addr + (i * ROW_BYTES) as u64,
            rkey,
            signaled: i + 1 == n,
        })
        .collect()
}

fn poll_all(qp: &mut Box<dyn engram_rdma::verbs::QueuePair>) -> Vec<Completion> {
    let mut out = Vec::new();
    qp.poll(&mut out, 64).expect("polled");
    out
}

/// Send-queue entries are held until a completion at or after them is
/// polled, across doorbells: a post past the depth fails as hardware's
/// does, and polling frees the room.
#[test]
fn the_send_queue_holds_its_entries_until_their_completion_is_polled() {
    let rig = Rig::new(9400);
    let (mut qp, addr, rkey) = raw_qp(&rig, 8, Fabric::default());
    assert!(qp.post_reads(&reads(5, addr, rkey)).is_ok());
    let e = qp
        .post_reads(&reads(4, addr, rkey))
        .expect_err("past the depth");
    assert!(
        e.to_string().contains("5 of 8 send queue entries in use"),
        "{e}"
    );
    assert!(qp.post_reads(&reads(3, addr, rkey)).is_ok(), "exactly full");
    assert_eq!(
        poll_all(&mut qp).len(),
        2,
        "one signalled completion a doorbell"
    );
    assert!(
        qp.post_reads(&reads(8, addr, rkey)).is_ok(),
        "all room again"
    );
}

/// Posting to a queue pair in the error state succeeds, and every request
/// (signalled or not) completes flushed, as on hardware.
#[test]
fn a_dead_queue_pair_takes_posts_and_flushes_every_request() {
    let rig = Rig::new(9500);
    let (mut qp, addr, rkey) = raw_qp(&rig, 16, Fabric::default());
    rig.provider.fabric().inject(
        rig.addr,
        FakeFault::CompletionError(WcStatus::RemoteOperation),
    );
    assert!(qp.post_reads(&reads(3, addr, rkey)).is_ok());
    let got: Vec<WcStatus> = poll_all(&mut qp).iter().map(|c| c.status).collect();
    assert_eq!(
        got,
        [
            WcStatus::RemoteOperation,
            WcStatus::Flushed,
            WcStatus::Flushed
        ]
    );
    assert!(
        qp.post_reads(&reads(4, addr, rkey)).is_ok(),
        "the post is taken"
    );
    let got = poll_all(&mut qp);
    assert_eq!(got.len(), 4, "unsignalled requests complete too");
    assert!(got.iter().all(|c| c.status == WcStatus::Flushed), "{got:?}");
}

/// A donor process that ended disconnects its end: the node's next poll
/// says so (the connection manager's event), before any READ times out.
#[test]
fn a_killed_donor_is_seen_on_the_next_poll_as_disconnected() {
    let rig = Rig::new(9600);
    let (mut qp, addr, rkey) = raw_qp(&rig, 16, Fabric::default());
    assert!(qp.post_reads(&reads(2, addr, rkey)).is_ok());
    assert_eq!(poll_all(&mut qp).len(), 1);
    rig.provider.fabric().kill(rig.addr);
    let mut out = Vec::new();
    let e = qp.poll(&mut out, 64).expect_err("disconnected");
    assert!(e.to_string().contains("RDMA_CM_EVENT_DISCONNECTED"), "{e}");
}

/// A path gone silent completes nothing, and says nothing, until the
/// queue pair's retries run out (`ack_timeout x (retry_count + 1)` of its
/// fabric settings); then retries exceeded, the rest flushed.
#[test]
fn a_silent_path_is_detected_only_when_the_retries_run_out() {
    let rig = Rig::new(9700);
    let fabric = Fabric {
        ack_timeout: Duration::from_millis(2),
        retry_count: 2,
        traffic_class: None,
    };
    let (mut qp, addr, rkey) = raw_qp(&rig, 16, fabric);
    rig.provider.fabric().silence(rig.addr);
    let posted = Instant::now();
    assert!(qp.post_reads(&reads(3, addr, rkey)).is_ok());
    assert!(poll_all(&mut qp).is_empty(), "nothing yet");
    // 4.096 us x 2^9 = 2.1 ms, three tries.
    let gives_up = fabric.effective_ack_timeout() * 3;
    let mut got = Vec::new();
    while got.is_empty() {
        assert!(posted.elapsed() < Duration::from_secs(5), "never detected");
        got = poll_all(&mut qp);
    }
    assert!(posted.elapsed() >= gives_up, "{:?}", posted.elapsed());
    let statuses: Vec<WcStatus> = got.iter().map(|c| c.status).collect();
    assert_eq!(
        statuses,
        [
            WcStatus::RetryExceeded,
            WcStatus::Flushed,
            WcStatus::Flushed
        ]
    );
    assert!(
        qp.landed(0, 3 * ROW_BYTES)
            .is_some_and(|b| b.iter().all(|&b| b == 0)),
        "nothing landed"
    );
    rig.provider.fabric().heal(rig.addr);
}
