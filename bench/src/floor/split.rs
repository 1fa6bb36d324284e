//! Where a series' lookups spend their time, from the kernel's own
//! accounting: the CPU time and the time waiting for a CPU of every thread
//! of the client's process and of the serving process (`schedstat`), read
//! around each chunk of a series, outside the timed lookups. Only one
//! series runs at a time, so the serving process's time in a chunk is that
//! series' (its other threads wake a few times a second). What neither
//! process spends on a CPU is waiting for a wake-up to arrive. On a
//! virtual machine part of each wake-up is charged to the threads
//! themselves (the exits to the hypervisor that send the interrupt and
//! that leave an idle CPU), so a client that sleeps costs CPU on both
//! ends: compare a blocking series with its polling twin.

use std::time::{Duration, Instant};

use serde::Serialize;

/// CPU time and run-queue time of all threads of a process so far.
#[derive(Debug, Clone, Copy, Default)]
struct ProcessTime {
    on_cpu: Duration,
    waiting: Duration,
}

impl ProcessTime {
    /// Summed over `/proc/<pid>/task/*/schedstat`; zero where it cannot
    /// be read (a process gone, a kernel without schedstat): the split then
    /// shows nothing rather than failing the run.
    fn of(pid: u32) -> Self {
        let mut t = Self::default();
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            return t;
        };
        for task in tasks.flatten() {
            let Ok(s) = std::fs::read_to_string(task.path().join("schedstat")) else {
                continue;
            };
            let mut f = s.split_whitespace().map(|w| w.parse::<u64>().unwrap_or(0));
            t.on_cpu += Duration::from_nanos(f.next().unwrap_or(0));
            t.waiting += Duration::from_nanos(f.next().unwrap_or(0));
        }
        t
    }
}

/// Both processes' times and the clock, at one moment.
#[derive(Debug, Clone, Copy)]
pub(super) struct Mark {
    at: Instant,
    client: ProcessTime,
    server: ProcessTime,
}

impl Mark {
    /// Now, for this process and the server `server_pid`.
    pub(super) fn now(server_pid: u32) -> Self {
        Self {
            client: ProcessTime::of(std::process::id()),
            server: ProcessTime::of(server_pid),
            at: Instant::now(),
        }
    }
}

/// A series' totals over its timed chunks.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Split {
    lookups: u64,
    wall: Duration,
    client: Duration,
    server: Duration,
    server_waiting: Duration,
}

impl Split {
    /// Add the chunk of `lookups` between `before` and `after`. A thread
    /// that ended between them takes its time with it: never negative.
    pub(super) fn add(&mut self, before: &Mark, after: &Mark, lookups: usize) {
        self.lookups += lookups as u64;
        self.wall += after.at.saturating_duration_since(before.at);
        self.client += after.client.on_cpu.saturating_sub(before.client.on_cpu);
        self.server += after.server.on_cpu.saturating_sub(before.server.on_cpu);
        self.server_waiting += after.server.waiting.saturating_sub(before.server.waiting);
    }

    /// Means per lookup, in microseconds; `None` before any lookup or where
    /// the kernel keeps no schedstat.
    pub(super) fn per_lookup(&self) -> Option<PerLookup> {
        if self.lookups == 0 || (self.client.is_zero() && self.server.is_zero()) {
            return None;
        }
        let us = |d: Duration| d.as_secs_f64() * 1e6 / self.lookups as f64;
        let (wall, client, server) = (us(self.wall), us(self.client), us(self.server));
        Some(PerLookup {
            wall_us: wall,
            client_cpu_us: client,
            server_cpu_us: server,
            server_waiting_us: us(self.server_waiting),
            neither_us: (wall - client - server).max(0.0),
        })
    }
}

/// One series' split, per lookup (means).
#[derive(Debug, Clone, Copy, Serialize)]
pub(super) struct PerLookup {
    /// Wall time per lookup, the untimed work between lookups included.
    pub(super) wall_us: f64,
    /// CPU of every thread of the client's process.
    pub(super) client_cpu_us: f64,
    /// CPU of every thread of the serving process.
    pub(super) server_cpu_us: f64,
    /// The serving process's threads runnable but waiting for a CPU.
    pub(super) server_waiting_us: f64,
    /// Wall time on no CPU of either process (at least: the two ends'
    /// CPU overlaps a little), the wake-ups.
    pub(super) neither_us: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_cpu_grows_with_work_and_a_split_divides_by_lookups() {
        let pid = std::process::id();
        let before = Mark::now(pid);
        // Burn 20 ms of this process's CPU (bounded in wall time).
        let t = Instant::now();
        let mut x = 0u64;
        while ProcessTime::of(pid).on_cpu < before.client.on_cpu + Duration::from_millis(20)
            && t.elapsed() < Duration::from_secs(10)
        {
            for _ in 0..10_000 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
            }
        }
        let after = Mark::now(pid);
        let mut s = Split::default();
        s.add(&before, &after, 4);
        let p = s.per_lookup().expect("schedstat is readable here");
        // 20 ms of CPU over 4 lookups: at least 5 ms each, on both "sides"
        // (the same process is client and server here).
        assert!(p.client_cpu_us >= 5_000.0, "{p:?}");
        assert!(p.server_cpu_us >= 5_000.0, "{p:?}");
        assert!(p.wall_us > 0.0, "{p:?}");
        // Nothing measured: no split rather than a division by zero.
        assert!(Split::default().per_lookup().is_none());
        // A process that is gone reads as zero, not an error.
        assert_eq!(ProcessTime::of(u32::MAX).on_cpu, Duration::ZERO);
    }
}
