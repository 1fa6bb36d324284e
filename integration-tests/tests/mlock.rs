//! `--mlock require`: the donor's table memory is really locked, as the
//! kernel counts it (`VmLck` in `/proc/PID/status`).

use rack_harness::{DonorProcess, gen_table};

const ROWS: u64 = 100_000;

/// `VmLck` of process `pid`, in bytes.
fn locked_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmLck:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no VmLck in\n{status}"));
    kb * 1024
}

/// True when this process may lock more than the memlock limit (root, or
/// CAP_IPC_LOCK), so the donor it starts may too.
fn may_lock_all() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn mlock_require_locks_every_table_byte() {
    if !may_lock_all() {
        if std::env::var_os("ENGRAM_REQUIRE_MLOCK").is_some() {
            panic!("ENGRAM_REQUIRE_MLOCK is set but this test does not run as root");
        }
        eprintln!("skipped: locking 2 x {ROWS} rows needs root or CAP_IPC_LOCK");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let (t1, _) = gen_table(dir.path(), "l1.etab", 1, ROWS, 1).expect("gen");
    let (t14, _) = gen_table(dir.path(), "l14.etab", 14, ROWS, 2).expect("gen");
    let tables = [
        format!("1={}", t1.display()),
        format!("14={}", t14.display()),
    ];
    let donor = DonorProcess::start(&[
        "--table",
        &tables[0],
        "--table",
        &tables[1],
        "--listen",
        "127.0.0.1:0",
        "--mlock",
        "require",
    ])
    .expect("donor starts with its tables locked");
    let table_bytes = 2 * ROWS * engram_protocol::ROW_BYTES as u64;
    let locked = locked_bytes(donor.id());
    assert!(
        locked >= table_bytes,
        "VmLck {locked} bytes does not cover the tables' {table_bytes} bytes"
    );
    assert!(donor.log().contains("locked=true"), "{}", donor.log());
}
