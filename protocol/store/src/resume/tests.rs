//! The start decision against a fake store: what is asked of it, and how
//! the table came to be resident in each case.

use super::*;
use crate::generate::{GenSpec, generate};
use engram_sync::Mutex;

/// A store holding at most one copy and one mark, recording each call.
#[derive(Default)]
struct FakeStore {
    holds: bool,
    copy: Mutex<Option<ResidentTable>>,
    mark: Mutex<Option<(FileMark, String)>>,
    calls: Mutex<Vec<String>>,
}

impl KeptCopies for FakeStore {
    fn may_hold(&self) -> bool {
        self.holds
    }

    fn take(&self, id: u32, e: &ExpectedTable, verified: bool, _: bool) -> Option<ResidentTable> {
        self.calls
            .lock()
            .push(format!("take {id} {} verified={verified}", e.rows));
        self.copy.lock().take()
    }

    fn take_file(&self, id: u32, _: &ExpectedTable, verified: bool) -> Option<(FileMark, String)> {
        self.calls
            .lock()
            .push(format!("take_file {id} verified={verified}"));
        self.mark.lock().take()
    }

    fn forget(&self, name: &str) {
        self.calls.lock().push(format!("forget {name}"));
    }

    fn file_changed(&self, name: String) -> Box<dyn FnOnce() + Send + 'static> {
        self.calls.lock().push(format!("check {name}"));
        Box::new(|| panic!("the file did not change"))
    }
}

const ROWS: u64 = 5_000;

fn table(dir: &Path) -> (PathBuf, ExpectedTable) {
    let path = dir.join("t.etab");
    let spec = GenSpec::new(1, ROWS, 4);
    let meta = generate(&path, &spec, None).expect("gen");
    let pin = ExpectedTable {
        digest: meta.digest,
        layer: 1,
        rows: ROWS,
    };
    (path, pin)
}

fn opts(backing: Backing) -> LoadOptions {
    LoadOptions {
        mlock: MlockMode::Off,
        backing,
        threads: 2,
        ..LoadOptions::default()
    }
}

fn calls(s: &FakeStore) -> Vec<String> {
    s.calls.lock().clone()
}

#[test]
fn with_nothing_kept_the_file_is_loaded_and_no_header_is_compared() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, _) = table(dir.path());
    let store = FakeStore::default();
    let (t, r) =
        resume_or_load(Some(7), &path, &opts(Backing::Memfd), &store, |_| None).expect("load");
    assert_eq!((r.how, r.verified, r.locked), (How::Loaded, true, false));
    assert_eq!((t.id, t.rows), (7, ROWS));
    assert!(calls(&store).is_empty(), "{:?}", calls(&store));
}

#[test]
fn a_kept_copy_of_the_version_is_adopted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, pin) = table(dir.path());
    let o = LoadOptions {
        pinned: Some(pin),
        ..opts(Backing::Memfd)
    };
    let (copy, _) = ResidentTable::load_with(Some(7), &path, &o, |_| None).expect("the copy");
    let store = FakeStore {
        holds: true,
        copy: Mutex::new(Some(copy)),
        ..FakeStore::default()
    };
    let (t, r) = resume_or_load(Some(7), &path, &o, &store, |_| None).expect("adopt");
    assert_eq!((r.how, r.verified, r.locked), (How::Adopted, true, false));
    assert_eq!(t.digest, pin.digest);
    assert_eq!(calls(&store), [format!("take 7 {ROWS} verified=true")]);
    // Nothing to adopt: loaded; a trusting load asks for any copy, and the
    // version comes from the header when nothing is pinned.
    let trusting = LoadOptions {
        trust_digest: true,
        ..opts(Backing::Anonymous)
    };
    let (_, r) = resume_or_load(None, &path, &trusting, &store, |_| None).expect("load");
    assert_eq!((r.how, r.verified), (How::Loaded, false));
    assert_eq!(calls(&store)[1], format!("take 1 {ROWS} verified=false"));
}

#[test]
fn file_pages_are_served_on_only_at_their_mark() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, pin) = table(dir.path());
    let o = LoadOptions {
        pinned: Some(pin),
        ..opts(Backing::Mapped)
    };
    let file = std::fs::File::open(&path).expect("open");
    let now = FileMark::of(&file, true).expect("mark");
    // A mark of another change time does not count: loaded, and forgotten.
    let stale = FileMark {
        ctime_nsec: (now.ctime_nsec + 1) % 1_000_000_000,
        ..now
    };
    let store = FakeStore {
        holds: true,
        mark: Mutex::new(Some((stale, "stale".into()))),
        ..FakeStore::default()
    };
    let (first, r) = resume_or_load(Some(7), &path, &o, &store, |_| None).expect("load");
    assert_eq!((r.how, r.verified), (How::Loaded, true));
    assert_eq!(calls(&store), ["take_file 7 verified=true", "forget stale"]);
    // The mark of this file now: its pages are served on and checked.
    let mark = first.file_mark().expect("a mapped table is marked");
    drop(first);
    let store = FakeStore {
        holds: true,
        mark: Mutex::new(Some((mark, "fresh".into()))),
        ..FakeStore::default()
    };
    let (t, r) = resume_or_load(Some(7), &path, &o, &store, |_| None).expect("served on");
    assert_eq!((r.how, r.verified), (How::FilePages, true));
    assert_eq!(t.digest, pin.digest);
    assert_eq!(calls(&store), ["take_file 7 verified=true", "check fresh"]);
}
