//! Progress for long work (generating, packing, verifying, loading a table):
//! for a person at a terminal, a bar redrawn in place on stderr (the
//! `indicatif` crate: percent, bytes, rate, time left); elsewhere (a pipe,
//! the journal: `$JOURNAL_STREAM`) a line at most every couple of seconds,
//! with bytes and rate, handed to a sink (stderr for the tools, the log for
//! the daemon). Either way a final line at 100%, and optionally every
//! update, unthrottled, to a tap (the donor's load state).

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Where progress lines go.
pub type ProgressSink = Box<dyn FnMut(&ProgressLine) + Send>;

/// One progress report.
#[derive(Debug, Clone, PartialEq)]
pub struct ProgressLine {
    /// What is being done ("generating layer 1").
    pub what: String,
    /// Units done.
    pub done: u64,
    /// Units in total.
    pub total: u64,
    /// Bytes per second so far.
    pub bytes_per_sec: f64,
    /// True for the final report.
    pub finished: bool,
}

impl ProgressLine {
    /// Percent done, 0..=100.
    pub fn percent(&self) -> f64 {
        if self.total == 0 {
            100.0
        } else {
            self.done as f64 * 100.0 / self.total as f64
        }
    }
}

impl std::fmt::Display for ProgressLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {:5.1}% ({} of {} rows, {:.0} MB/s){}",
            self.what,
            self.percent(),
            self.done,
            self.total,
            self.bytes_per_sec / 1e6,
            if self.finished { ", done" } else { "" }
        )
    }
}

/// Rate-limits progress reports.
pub struct Progress {
    what: String,
    total: u64,
    bytes_per_unit: u64,
    started: Instant,
    last: Instant,
    every: Duration,
    sink: ProgressSink,
    tap: Option<Box<dyn FnMut(u64) + Send>>,
    bar: Option<ProgressBar>,
}

/// True when progress is for a person watching: stderr is a terminal and
/// not the journal's stream.
pub fn on_terminal() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("JOURNAL_STREAM").is_none()
}

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Progress")
            .field("what", &self.what)
            .field("total", &self.total)
            .finish()
    }
}

impl Progress {
    /// Report `total` units of `bytes_per_unit` bytes each to `sink`.
    pub fn new(
        what: impl Into<String>,
        total: u64,
        bytes_per_unit: u64,
        sink: ProgressSink,
    ) -> Self {
        let now = Instant::now();
        Self {
            what: what.into(),
            total,
            bytes_per_unit,
            started: now,
            last: now,
            every: Duration::from_secs(2),
            sink,
            tap: None,
            bar: None,
        }
    }

    /// Draw a bar on `target` instead of throttled lines (the final line
    /// still goes to the sink).
    pub fn with_bar(mut self, target: ProgressDrawTarget) -> Self {
        let style = ProgressStyle::with_template(
            "{msg} [{bar:32}] {percent:>3}% {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
        let bar = ProgressBar::with_draw_target(Some(self.total * self.bytes_per_unit), target)
            .with_style(style)
            .with_message(self.what.clone());
        self.bar = Some(bar);
        self
    }

    /// A bar on stderr where a person watches ([`on_terminal`]).
    fn bar_if_watched(self) -> Self {
        if on_terminal() {
            self.with_bar(ProgressDrawTarget::stderr())
        } else {
            self
        }
    }

    /// Also hand every update's units done to `tap`, unthrottled (keep it cheap).
    pub fn with_tap(mut self, tap: impl FnMut(u64) + Send + 'static) -> Self {
        self.tap = Some(Box::new(tap));
        self
    }

    /// Progress to stderr: a bar at a terminal, else one line per report.
    pub fn stderr(what: impl Into<String>, total: u64, bytes_per_unit: u64) -> Self {
        Self::new(what, total, bytes_per_unit, Box::new(|l| eprintln!("{l}"))).bar_if_watched()
    }

    /// Progress to the log at info level (a bar at a terminal, and the
    /// final line in the log).
    pub fn log(what: impl Into<String>, total: u64, bytes_per_unit: u64) -> Self {
        Self::new(
            what,
            total,
            bytes_per_unit,
            Box::new(
                |l| tracing::info!(what = %l.what, done = l.done, total = l.total, percent = l.percent(), "progress: {l}"),
            ),
        )
        .bar_if_watched()
    }

    fn line(&self, done: u64, finished: bool) -> ProgressLine {
        let secs = self.started.elapsed().as_secs_f64().max(1e-9);
        ProgressLine {
            what: self.what.clone(),
            done,
            total: self.total,
            bytes_per_sec: (done * self.bytes_per_unit) as f64 / secs,
            finished,
        }
    }

    /// Note that `done` units are complete; reports if enough time has passed.
    pub fn update(&mut self, done: u64) {
        if let Some(tap) = self.tap.as_mut() {
            tap(done);
        }
        if let Some(bar) = &self.bar {
            bar.set_position(done.min(self.total) * self.bytes_per_unit);
            return;
        }
        if self.last.elapsed() >= self.every {
            self.last = Instant::now();
            let line = self.line(done, false);
            (self.sink)(&line);
        }
    }

    /// Final report; returns the elapsed time.
    pub fn finish(mut self) -> Duration {
        if let Some(tap) = self.tap.as_mut() {
            tap(self.total);
        }
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        let line = self.line(self.total, true);
        (self.sink)(&line);
        self.started.elapsed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use engram_sync::Mutex;

    #[test]
    fn reports_are_rate_limited_and_the_last_is_final() {
        let lines = Arc::new(Mutex::new(Vec::new()));
        let l2 = Arc::clone(&lines);
        let mut p = Progress::new("x", 10, 264, Box::new(move |l| l2.lock().push(l.clone())));
        for i in 0..10 {
            p.update(i);
        }
        p.finish();
        let lines = lines.lock();
        assert_eq!(lines.len(), 1, "updates within 2 s are not reported");
        assert!(lines[0].finished);
        assert_eq!(lines[0].percent(), 100.0);
        assert!(lines[0].to_string().contains("10 of 10 rows"));
    }

    #[test]
    fn a_bar_replaces_the_lines_but_not_the_final_one() {
        let lines = Arc::new(Mutex::new(Vec::new()));
        let l2 = Arc::clone(&lines);
        let mut p = Progress::new("x", 10, 264, Box::new(move |l| l2.lock().push(l.clone())))
            .with_bar(ProgressDrawTarget::hidden());
        p.every = Duration::ZERO;
        let bar = p.bar.clone().expect("a bar");
        assert_eq!(bar.length(), Some(2640));
        p.update(4);
        assert_eq!(bar.position(), 4 * 264);
        assert!(lines.lock().is_empty(), "no lines while a bar shows");
        p.update(99);
        assert_eq!(bar.position(), 2640, "never past the end");
        p.finish();
        assert!(bar.is_finished());
        let lines = lines.lock();
        assert_eq!(lines.len(), 1);
        assert!(lines[0].finished);
    }
}
