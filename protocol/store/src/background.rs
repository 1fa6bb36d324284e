//! Work done beside serving: the load of a new generation of a table,
//! mapping a generation in and out of a process that reads it. Such work
//! must not take the CPU from the threads that answer lookups on the same
//! host, nor hold the address space's lock for long: it runs on threads
//! of its own at a low CPU priority ([`lower_this_thread`]) and walks
//! memory in slices ([`slices`]), one system call each.
//!
//! Only a thread that will do nothing else is lowered: an unprivileged
//! process cannot raise a thread's priority again (`RLIMIT_NICE`), so the
//! caller of a lowered thread never inherits its priority.

use std::ops::Range;

/// How low a background thread runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Background {
    /// `SCHED_IDLE`: runs when nothing else on its core wants to, and a
    /// waking thread of any other policy takes the core at once. For work
    /// that only makes a later lookup cheaper (mapping a generation in
    /// before it replaces the one lookups read, unmapping one they left).
    Idle,
    /// The lowest normal priority (nice 19): about 1.5% of a core beside
    /// each busy thread at nice 0, but never starved. For work that must
    /// end (a donor's load of a table it is asked to serve).
    Low,
}

/// Lower the calling thread to `how`; threads it starts afterwards
/// inherit it. Fails only where the kernel refuses (then the thread runs
/// on at its priority).
pub fn lower_this_thread(how: Background) -> std::io::Result<()> {
    let r = match how {
        Background::Idle => {
            let param = libc::sched_param { sched_priority: 0 };
            // SAFETY: pid 0 is the calling thread; `param` outlives the call.
            unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) }
        }
        Background::Low => {
            // SAFETY: gettid has no preconditions.
            let tid = unsafe { libc::gettid() };
            // SAFETY: setpriority on this thread's own id (Linux applies
            // PRIO_PROCESS with a thread id to that thread alone).
            unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 19) }
        }
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Page-aligned ranges of at most `slice` bytes (rounded up to whole 4 KiB
/// pages, at least one) covering `0..len`, in order.
pub fn slices(len: usize, slice: usize) -> impl Iterator<Item = Range<usize>> {
    let step = slice.max(1).div_ceil(PAGE).saturating_mul(PAGE);
    (0..len)
        .step_by(step)
        .map(move |a| a..a.saturating_add(step).min(len))
}

const PAGE: usize = 4096;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_cover_the_length_page_aligned_in_order() {
        let all: Vec<Range<usize>> = slices(10_000, 4096).collect();
        assert_eq!(all, vec![0..4096, 4096..8192, 8192..10_000]);
        let all: Vec<Range<usize>> = slices(10_000, 5000).collect();
        assert_eq!(all, vec![0..8192, 8192..10_000]);
        assert_eq!(slices(0, 4096).count(), 0);
        assert_eq!(slices(5, 0).collect::<Vec<_>>(), vec![0..5]);
        assert_eq!(
            slices(usize::MAX, usize::MAX).last().map(|r| r.end),
            Some(usize::MAX)
        );
    }

    #[test]
    fn a_thread_lowered_stays_lowered_and_its_caller_does_not() {
        // SAFETY: sched_getscheduler on the calling thread.
        let mine = unsafe { libc::sched_getscheduler(0) };
        let (policy, nice) = std::thread::spawn(|| {
            lower_this_thread(Background::Idle).expect("anyone may go idle");
            // SAFETY: as above.
            let policy = unsafe { libc::sched_getscheduler(0) };
            let low = std::thread::spawn(|| {
                lower_this_thread(Background::Low).expect("anyone may lower");
                // SAFETY: getpriority of the calling thread.
                unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) }
            })
            .join()
            .expect("thread");
            (policy, low)
        })
        .join()
        .expect("thread");
        assert_eq!(policy, libc::SCHED_IDLE);
        assert_eq!(nice, 19);
        // SAFETY: as above.
        assert_eq!(unsafe { libc::sched_getscheduler(0) }, mine);
    }
}
