//! A table's RDMA check words kept in systemd's fd store beside it: the
//! first start computes them into a memfd and stores it; a restart takes
//! them back instead of hashing every row again, and a damaged copy is
//! refused and computed anew. The store is the test's stand-in for systemd
//! (`NotifySocket`), the verbs the fake's; a READ of a check word through
//! a queue pair shows the words registered are the rows' own.
//!
//! One test in this binary: it sets `NOTIFY_SOCKET` for the process.

use std::net::SocketAddr;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use cluster_config::RdmaDevice;
use daemon_runtime::notify::Notifier;
use engram_protocol::ROW_BYTES;
use engram_rdma::check::{check_word, seed};
use engram_rdma::fake::FakeProvider;
use engram_rdma::verbs::{Provider, QpOptions, ReadWr};
use engram_store::resident::{MlockMode, ResidentTable};
use memory_donor::fdstore::FdStore;
use memory_donor::rdma::{open_book, snapshot, sync_kept};
use rack_harness::{NotifySocket, free_port, gen_table};

const ROWS: u64 = 3_000;

/// Register `table` with `store` on a new fake fabric, then READ row
/// `row`'s check word through a queue pair and return it.
fn register_and_read_word(table: &ResidentTable, store: &FdStore, row: u64) -> Result<u64> {
    let fake = FakeProvider::new();
    let addr: SocketAddr = ([127, 0, 0, 1], free_port()?).into();
    let book = open_book(Arc::new(fake.clone()), addr, &RdmaDevice::default())?;
    let n = sync_kept(&book, snapshot(std::slice::from_ref(table)), Some(store));
    anyhow::ensure!(n == 1, "not registered");
    book.listen(addr)?;
    let g = book.grant(table.id, "node-1").context("no grant")?;
    let opts = QpOptions {
        send_depth: 4,
        buffer_bytes: 4096,
        connect_timeout: Duration::from_secs(1),
        fabric: Default::default(),
    };
    let mut qp = fake.connect(addr, &g.token, &opts)?;
    qp.post_reads(&[ReadWr {
        wr_id: 1,
        local_offset: 0,
        len: 8,
        remote_addr: g.checks_addr + 8 * row,
        rkey: g.checks_rkey,
        signaled: true,
    }])?;
    let mut done = Vec::new();
    qp.poll(&mut done, 4)?;
    anyhow::ensure!(done.len() == 1, "no completion");
    let word = qp.landed(0, 8).context("landed")?;
    Ok(u64::from_le_bytes(word.try_into()?))
}

fn checks_stored(notify: &NotifySocket) -> Vec<String> {
    notify
        .stored()
        .into_iter()
        .filter(|n| n.ends_with("-checks"))
        .collect()
}

#[test]
fn check_words_are_kept_in_the_fd_store_and_taken_back_on_a_restart() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let notify = NotifySocket::bind(dir.path())?;
    // SAFETY: the only test in this binary, before it starts any thread
    // that reads the environment.
    unsafe { std::env::set_var("NOTIFY_SOCKET", &notify.path) };
    let notifier = Arc::new(Notifier::from_env()?);
    let (path, _) = gen_table(dir.path(), "t7.etab", 7, ROWS, 5)?;
    let (table, _) = ResidentTable::load(7, &path, None, true, MlockMode::Off, |_| None)?;
    let want = |row: u64| {
        let r = &table.memory_bytes()[row as usize * ROW_BYTES..][..ROW_BYTES];
        check_word(seed(&table.digest), row, r)
    };
    let stored_within = |n: usize| {
        for _ in 0..500 {
            if checks_stored(&notify).len() == n {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    };

    // First start: computed, registered, kept.
    let first = FdStore::with_handed(Arc::clone(&notifier), true, Vec::new());
    assert_eq!(register_and_read_word(&table, &first, 1234)?, want(1234));
    assert!(stored_within(1), "{:?}", notify.stored());
    let name = checks_stored(&notify)[0].clone();
    assert!(name.starts_with("etab-7-"), "{name}");

    // A restart: handed back, taken, not computed or stored again.
    let before = notify.messages().len();
    let second = FdStore::with_handed(Arc::clone(&notifier), true, notify.stored_files()?);
    assert_eq!(register_and_read_word(&table, &second, 2999)?, want(2999));
    std::thread::sleep(Duration::from_millis(100));
    let after: Vec<String> = notify.messages()[before..]
        .iter()
        .map(|(_, m)| m.clone())
        .collect();
    assert!(
        after.iter().all(|m| !m.contains("FDSTORE")),
        "taken back, yet stored or removed again: {after:?}"
    );

    // A damaged copy: refused, removed, computed and kept anew.
    let handed = notify.stored_files()?;
    let (_, words) = handed.iter().find(|(n, _)| *n == name).context("kept")?;
    words.write_all_at(&[0xA5; 8], 8 * 10)?;
    let third = FdStore::with_handed(Arc::clone(&notifier), true, handed);
    assert_eq!(register_and_read_word(&table, &third, 10)?, want(10));
    assert!(stored_within(1), "{:?}", notify.stored());
    let log: Vec<String> = notify.messages().into_iter().map(|(_, m)| m).collect();
    assert!(
        log.iter()
            .any(|m| m.contains("FDSTOREREMOVE=1") && m.contains(&name)),
        "{log:?}"
    );

    // Not served over RDMA any more: released from the store.
    FdStore::with_handed(notifier, true, notify.stored_files()?).release_checks();
    assert!(stored_within(0), "{:?}", notify.stored());
    Ok(())
}
