//! RDMA reads of the full-size tables on the fake provider: a donor's
//! region book publishes each table's packed copy (a sparse memfd, as the
//! donor loads it) with check words for the rows read (the other words are
//! left zero: computing all 768 million would take minutes and 6 GiB), and
//! the node's reader reads the rows at `rows_addr + r * 264` and their
//! check words at `checks_addr + r * 8`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engram_protocol::ROW_BYTES;
use engram_rdma::book::RegionBook;
use engram_rdma::check::{CHECK_BYTES, check_word, seed};
use engram_rdma::fake::FakeProvider;
use engram_rdma::plan::Outcome;
use engram_rdma::reader::{DEFAULT_SLOT_ROWS, Reader, Session, Step, qp_options};
use engram_rdma::verbs::{DeviceSpec, Fabric, Provider};
use engram_store::resident::{Backing, LoadOptions, MlockMode, Registered, ResidentTable};

use super::{LAYERS, Tables};

/// Check words of `rows` of `table`, 8 bytes a row, in zeroed memory as
/// large as all of the table's (a fresh allocation that large is mapped
/// lazily: only the pages written take memory).
fn checks(table: &ResidentTable, rows: &[u64]) -> Vec<u8> {
    let len = usize::try_from(table.rows * CHECK_BYTES as u64).expect("fits");
    let mut m = vec![0u8; len];
    let s = seed(&table.digest);
    for &r in rows {
        let row = table.row(r).expect("in range").to_vec();
        let at = r as usize * CHECK_BYTES;
        m[at..at + CHECK_BYTES].copy_from_slice(&check_word(s, r, &row).to_le_bytes());
    }
    m
}

/// Learn, connect and read `rows` of table `id` as the node does.
fn read(
    provider: &FakeProvider,
    book: &RegionBook,
    addr: SocketAddr,
    t: (u32, &ResidentTable),
    rows: &[u64],
) -> Vec<u8> {
    let (id, table) = t;
    let mut session = Session::default();
    let mut reader = None;
    let mut out = vec![0u8; rows.len() * ROW_BYTES];
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match session.step(id, Instant::now()) {
            Step::Learn => {
                let g = book.grant(id, "n").expect("a region");
                session
                    .learned(&g, &table.digest)
                    .expect("the pinned version");
            }
            Step::Connect(token) => {
                let qp = provider
                    .connect(
                        addr,
                        &token,
                        &qp_options(Duration::from_secs(5), Fabric::default()),
                    )
                    .expect("a queue pair");
                reader = Some(Reader::new(qp, DEFAULT_SLOT_ROWS));
                session.connected();
            }
            Step::Backoff(_) => panic!("connecting failed"),
            Step::Read(layout) => {
                let r = reader.as_mut().expect("connected");
                let mut done = Vec::new();
                for chunk in rows.chunks(DEFAULT_SLOT_ROWS) {
                    let at = done.len();
                    done.resize(at + chunk.len() * ROW_BYTES, 0);
                    let go = r.start(chunk, &layout).expect("reads start");
                    loop {
                        r.poll();
                        match r.outcome(&go) {
                            Outcome::Pending => {
                                assert!(Instant::now() < deadline, "reads never completed");
                                std::thread::yield_now();
                            }
                            Outcome::Done => break,
                            Outcome::Failed(f) => panic!("read failed: {f:?}"),
                        }
                    }
                    r.finish(go, chunk, &layout, &mut done[at..])
                        .expect("rows check");
                }
                out.copy_from_slice(&done);
                return out;
            }
        }
    }
}

/// Every lookup row of both tables over RDMA equals the table's.
pub fn rows(t: &Tables) {
    let provider = FakeProvider::new();
    let book = RegionBook::new(
        Arc::new(provider.clone()) as Arc<dyn Provider>,
        DeviceSpec::default(),
    );
    let addr: SocketAddr = ([127, 0, 0, 1], rack_harness::free_port().expect("port")).into();
    let opts = LoadOptions {
        trust_digest: true,
        mlock: MlockMode::Off,
        backing: Backing::Memfd,
        ..LoadOptions::default()
    };
    let tables: Vec<ResidentTable> = (0..2)
        .map(|i| {
            ResidentTable::load_with(Some(LAYERS[i]), &t.paths[i], &opts, |_| None)
                .expect("load")
                .0
        })
        .collect();
    for (i, table) in tables.iter().enumerate() {
        let rows = t.lookups(i);
        let words = checks(table, &rows);
        let published = book.publish_with(
            LAYERS[i],
            table.rows,
            table.digest,
            Arc::new(Registered(table.memory())),
            Some(Arc::new(words)),
        );
        assert!(published.is_ok(), "table {} registers", LAYERS[i]);
    }
    assert!(book.listen(addr).is_ok());
    for (i, table) in tables.iter().enumerate() {
        let rows = t.lookups(i);
        let out = read(&provider, &book, addr, (LAYERS[i], table), &rows);
        t.check(i, &rows, &out, "rdma");
    }
    assert!(
        provider.fabric().reads_at(addr) >= 2 * (t.lookups(0).len() as u64),
        "two reads a row"
    );
}
