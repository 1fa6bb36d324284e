//! A kept table on reserved huge pages. Its own test binary: reserving and
//! releasing the host's huge pages while other tests load memfds would hand
//! them huge pages they do not expect (cargo runs test binaries one at a
//! time).

use engram_store::generate::{GenSpec, generate};
use engram_store::kept;
use engram_store::resident::{Backing, ExpectedTable, LoadOptions, MlockMode, ResidentTable};

/// The tests here change the host's pool one at a time.
static POOL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The host's huge page pool grown by `more` pages (root only) until
/// dropped.
struct Reserved {
    before: u64,
    _one_at_a_time: std::sync::MutexGuard<'static, ()>,
}

const POOL_SIZE: &str = "/proc/sys/vm/nr_hugepages";

impl Reserved {
    fn grow(more: u64) -> Option<Self> {
        let guard = POOL.lock().unwrap_or_else(|e| e.into_inner());
        let before: u64 = std::fs::read_to_string(POOL_SIZE)
            .ok()?
            .trim()
            .parse()
            .ok()?;
        std::fs::write(POOL_SIZE, (before + more).to_string()).ok()?;
        let grown = Self {
            before,
            _one_at_a_time: guard,
        };
        let (_, free) = kept::huge_pages_free()?;
        (free >= more * (2 << 20)).then_some(grown)
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        let _ = std::fs::write(POOL_SIZE, self.before.to_string());
    }
}

fn table(dir: &std::path::Path) -> (std::path::PathBuf, ExpectedTable, LoadOptions) {
    let path = dir.join("t.etab");
    let spec = GenSpec::new(1, 10_000, 4);
    let meta = generate(&path, &spec, None).expect("gen");
    let pin = ExpectedTable {
        digest: meta.digest,
        layer: 1,
        rows: 10_000,
    };
    let opts = LoadOptions {
        backing: Backing::Memfd,
        mlock: MlockMode::Try,
        ..LoadOptions::default()
    };
    (path, pin, opts)
}

#[test]
fn reserved_huge_pages_back_a_kept_table() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, pin, opts) = table(dir.path());
    let Some(_pool) = Reserved::grow(64) else {
        eprintln!("skipped: cannot reserve huge pages (not root?)");
        return;
    };
    let loaded = ResidentTable::load_with(Some(1), &path, &opts, |_| None);
    let adopted = loaded.as_ref().ok().map(|(t, _)| {
        let f = t.kept().expect("kept").file.try_clone().expect("dup");
        ResidentTable::adopt(1, f, &pin, false)
    });
    let (t, _) = loaded.expect("load");
    assert_eq!(t.kept().expect("kept").pages, kept::Pages::HugeTlb);
    let again = adopted.expect("adopted").expect("adopt");
    assert_eq!(again.kept().expect("kept").pages, kept::Pages::HugeTlb);
    for r in [0, 14, 15, 9_999] {
        assert_eq!(
            again.row(r).map(|x| x.to_vec()),
            t.row(r).map(|x| x.to_vec())
        );
    }
}

#[test]
fn huge_pages_promised_to_another_mapping_are_not_counted_free() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, _, opts) = table(dir.path());
    let Some(_pool) = Reserved::grow(4) else {
        eprintln!("skipped: cannot reserve huge pages (not root?)");
        return;
    };
    // Another mapping is promised every free huge page and touches none.
    let (page, free) = kept::huge_pages_free().expect("meminfo");
    // SAFETY: a NUL-terminated name; a new descriptor we then own.
    let fd = unsafe { libc::memfd_create(c"other".as_ptr(), libc::MFD_HUGETLB) };
    assert!(fd >= 0, "{}", std::io::Error::last_os_error());
    // SAFETY: fd is new and owned by nothing else.
    let other = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    other.set_len(free).expect("size");
    // SAFETY: a private memfd, mapped and never touched.
    let promised = unsafe { memmap2::MmapOptions::new().len(free as usize).map(&other) };
    let counted = kept::huge_pages_free();
    let loaded = promised
        .is_ok()
        .then(|| ResidentTable::load_with(Some(1), &path, &opts, |_| None));
    drop(promised);
    assert_eq!(counted, Some((page, 0)), "{free} bytes were free");
    let (t, _) = loaded.expect("mapped").expect("load");
    assert_ne!(t.kept().expect("kept").pages, kept::Pages::HugeTlb);
    assert_eq!(t.row(9_999).map(|r| r.to_vec().len()), Some(264));
}
