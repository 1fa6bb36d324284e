//! The I/O priority of the SSD copy's reads (Linux `ioprio_set(2)`): the
//! io_uring engine puts it in every read's SQE, the pread pool sets it on
//! each of its threads. Real-time reads are served before every
//! best-effort request on the drive (mq-deadline, bfq), so the read window
//! survives a busy neighbour; the class needs CAP_SYS_NICE (or
//! CAP_SYS_ADMIN). Without it the node says so once and reads at
//! best-effort.

use std::sync::atomic::{AtomicBool, Ordering};

use cluster_config::{IoClass, SsdIoprio};

/// `IOPRIO_WHO_PROCESS`: with `who` a thread id (0: the calling thread).
const WHO_PROCESS: libc::c_int = 1;
/// The class sits above 13 bits of level.
const CLASS_SHIFT: u16 = 13;

/// The kernel's encoding of `p` (`IOPRIO_PRIO_VALUE`).
pub fn value(p: SsdIoprio) -> u16 {
    let class = match p.class {
        IoClass::RealTime => 1,
        IoClass::BestEffort => 2,
        IoClass::Idle => 3,
    };
    (class << CLASS_SHIFT) | u16::from(p.level)
}

/// Set the calling thread's I/O priority.
pub fn set_current_thread(p: SsdIoprio) -> std::io::Result<()> {
    // SAFETY: ioprio_set reads its three integer arguments only.
    let r = unsafe {
        libc::syscall(
            libc::SYS_ioprio_set,
            WHO_PROCESS,
            0,
            libc::c_int::from(value(p)),
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The I/O priority of thread `tid`, as the kernel encodes it.
pub fn of_thread(tid: libc::pid_t) -> std::io::Result<u16> {
    // SAFETY: ioprio_get reads its two integer arguments only.
    let r = unsafe { libc::syscall(libc::SYS_ioprio_get, WHO_PROCESS, tid) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(r as u16)
}

/// The calling thread's id.
pub fn current_tid() -> libc::pid_t {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::gettid() }
}

/// Whether this process may read at `p`: tried on a scratch thread (so no
/// thread of the caller's changes).
pub fn permitted(p: SsdIoprio) -> bool {
    std::thread::Builder::new()
        .name("ioprio-check".into())
        .spawn(move || set_current_thread(p).is_ok())
        .ok()
        .and_then(|t| t.join().ok())
        .unwrap_or(false)
}

/// The priority reads will have: `wanted`, or best-effort at its level when
/// real-time is not permitted (said once per process, with the unit
/// setting that grants it).
pub fn effective(wanted: SsdIoprio) -> SsdIoprio {
    if wanted.class != IoClass::RealTime || permitted(wanted) {
        return wanted;
    }
    let fallback = SsdIoprio {
        class: IoClass::BestEffort,
        level: wanted.level,
    };
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            wanted = %wanted,
            using = %fallback,
            "the SSD copy may not read at real-time I/O priority: that needs CAP_SYS_NICE \
             (systemd: AmbientCapabilities=CAP_SYS_NICE in the node's unit); reading at \
             best-effort, so other I/O on the drive can delay it"
        );
    }
    fallback
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priorities_encode_as_the_kernel_does() {
        let p = |class, level| value(SsdIoprio { class, level });
        assert_eq!(p(IoClass::RealTime, 4), (1 << 13) | 4);
        assert_eq!(p(IoClass::BestEffort, 0), 2 << 13);
        assert_eq!(p(IoClass::Idle, 0), 3 << 13);
    }

    #[test]
    fn a_thread_reads_back_the_priority_it_set() {
        let be = SsdIoprio {
            class: IoClass::BestEffort,
            level: 6,
        };
        let got = std::thread::spawn(move || {
            set_current_thread(be).expect("best-effort needs no privilege");
            of_thread(current_tid()).expect("ioprio_get")
        })
        .join()
        .expect("thread");
        assert_eq!(got, value(be));
        // Idle and best-effort are for everyone; the effective priority of
        // a class that needs nothing is the class asked for.
        assert_eq!(effective(be), be);
    }
}
