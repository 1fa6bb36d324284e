//! The paced node of a drill: `inference-node run` with a trace and
//! progress lines, waited on at chosen tokens, with the drill's events
//! placed on the node's own clock (both read CLOCK_MONOTONIC).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use inference_node::model::StepRecord;
use inference_node::model::clock::monotonic_us;

use super::{PROGRESS_EVERY, die_with_parent};
use crate::{Process, bin};

/// Something the drill did, on the node's clock.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// Microseconds from the start of the node's run.
    pub at_us: f64,
    /// What happened.
    pub what: String,
}

/// A running node.
#[derive(Debug)]
pub struct NodeRun {
    process: Process,
    trace: PathBuf,
    summary: PathBuf,
    tokens: u64,
    rate: f64,
    /// CLOCK_MONOTONIC minus the run's clock, microseconds (the smallest
    /// difference seen on a progress line).
    offset_us: Option<f64>,
    steps_seen: u64,
    events: Vec<Event>,
    metrics: Option<std::net::SocketAddr>,
}

/// What a finished run left.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The trace, one record per step.
    pub steps: Vec<StepRecord>,
    /// The drill's events.
    pub events: Vec<Event>,
    /// Whether the node exited 0.
    pub success: bool,
    /// Its stderr.
    pub log: String,
    /// Its stdout (the summary).
    pub summary: String,
    /// Positions asked for.
    pub tokens: u64,
    /// The token rate.
    pub rate: f64,
}

impl NodeRun {
    /// Start node `name` of `config` for `tokens` positions at `rate`
    /// tokens/s; files go to `stem.jsonl` (trace), `stem.txt` (summary) and `stem.log`
    /// (its stderr, when it is over; `ENGRAM_DRILL_NODE_LOG` sets its log filter).
    /// Returns once its loop runs.
    pub fn start(config: &Path, name: &str, tokens: u64, rate: f64, stem: &Path) -> Result<Self> {
        Self::start_with(config, name, tokens, rate, stem, &[])
    }

    /// [`Self::start`] with more arguments for `inference-node run`
    /// (`--batch`, `--prefill`).
    pub fn start_with(
        config: &Path,
        name: &str,
        tokens: u64,
        rate: f64,
        stem: &Path,
        extra: &[String],
    ) -> Result<Self> {
        let trace = stem.with_extension("jsonl");
        let summary = stem.with_extension("txt");
        let mut cmd = Command::new(bin("inference-node"));
        die_with_parent(&mut cmd);
        cmd.arg("run")
            .arg("--config")
            .arg(config)
            .args(["--name", name])
            .args(["--tokens", &tokens.to_string()])
            .args(["--tokens-per-second", &rate.to_string()])
            .arg("--trace")
            .arg(&trace)
            .args(["--progress-every", &PROGRESS_EVERY.to_string()])
            .args(["--metrics", "127.0.0.1:0"])
            .args(extra)
            .env(
                "RUST_LOG",
                std::env::var("ENGRAM_DRILL_NODE_LOG").unwrap_or_else(|_| "info".into()),
            );
        let out = std::fs::File::create(&summary)
            .with_context(|| format!("creating {}", summary.display()))?;
        let process = Process::spawn_with_stdout(cmd, out.into())?;
        let metrics = process
            .wait_line(Duration::from_secs(60), |l| {
                l.strip_prefix("metrics listen=")
                    .and_then(|a| a.trim().parse().ok())
            })
            .context("the node did not bind its metrics address")?;
        process
            .wait_line(Duration::from_secs(60), |l| {
                l.starts_with("running ").then_some(())
            })
            .context("the node did not start its loop")?;
        Ok(Self {
            process,
            trace,
            summary,
            tokens,
            rate,
            offset_us: None,
            steps_seen: 0,
            events: Vec::new(),
            metrics: Some(metrics),
        })
    }

    /// Wait until the node has run `steps` steps (to the nearest
    /// progress line at or after it).
    pub fn at_step(&mut self, steps: u64) -> Result<()> {
        if steps > self.tokens {
            bail!(
                "step {steps} is past the run's end ({} tokens)",
                self.tokens
            );
        }
        let timeout = Duration::from_secs_f64(steps as f64 / self.rate * 4.0 + 30.0);
        let mut seen = Vec::new();
        self.process
            .wait_line(timeout, |l| {
                let p = parse_progress(l)?;
                seen.push(p);
                (p.0 >= steps).then_some(())
            })
            .with_context(|| format!("waiting for step {steps} of the node's run"))?;
        for (s, end_us, mono_us) in seen {
            let d = mono_us - end_us;
            self.offset_us = Some(self.offset_us.map_or(d, |o: f64| o.min(d)));
            self.steps_seen = self.steps_seen.max(s);
        }
        Ok(())
    }

    /// Wait until `seconds` of the run have passed (the step at that time).
    pub fn at_second(&mut self, seconds: f64) -> Result<()> {
        let step = (seconds * self.rate).round().max(1.0) as u64;
        self.at_step(step)
    }

    /// Now on the node's clock, microseconds.
    pub fn now_us(&self) -> f64 {
        monotonic_us() as f64 - self.offset_us.unwrap_or(0.0)
    }

    /// Record that `what` happened just now; returns its time.
    pub fn event(&mut self, what: impl Into<String>) -> f64 {
        self.event_since(what, monotonic_us())
    }

    /// Record that `what` happened at `mono_us` on this host's monotonic
    /// clock ([`monotonic_us`]), which may be before the node's first
    /// progress line (whose arrival sets the node's clock): it must come,
    /// so this waits for it; returns its time on the node's clock.
    pub fn event_at(&mut self, what: impl Into<String>, mono_us: u64) -> Result<f64> {
        if self.offset_us.is_none() {
            self.at_step(PROGRESS_EVERY.min(self.tokens))?;
        }
        Ok(self.event_since(what, mono_us))
    }

    fn event_since(&mut self, what: impl Into<String>, mono_us: u64) -> f64 {
        let at_us = mono_us as f64 - self.offset_us.unwrap_or(0.0);
        self.events.push(Event {
            at_us,
            what: what.into(),
        });
        at_us
    }

    /// The node's Prometheus text now.
    pub fn metrics(&self) -> Result<String> {
        crate::scrape(self.metrics.context("no metrics address")?)
    }

    /// Wait (at most `timeout`) for the node to exit and read its trace.
    pub fn finish(mut self, timeout: Duration) -> Result<Outcome> {
        let st = self
            .process
            .wait(timeout)
            .with_context(|| format!("the node still runs after {timeout:?}"))?;
        self.process.wait_log_closed(Duration::from_secs(5));
        let steps = read_trace(&self.trace)?;
        let log = self.process.log();
        let log_path = self.trace.with_extension("log");
        std::fs::write(&log_path, &log)
            .with_context(|| format!("writing {}", log_path.display()))?;
        Ok(Outcome {
            steps,
            events: self.events,
            success: st.success(),
            log,
            summary: std::fs::read_to_string(&self.summary).unwrap_or_default(),
            tokens: self.tokens,
            rate: self.rate,
        })
    }
}

/// `progress steps=S end_us=E monotonic_us=M`.
fn parse_progress(l: &str) -> Option<(u64, f64, f64)> {
    let rest = l.strip_prefix("progress ")?;
    let field = |k: &str| {
        rest.split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .and_then(|v| v.parse::<f64>().ok())
    };
    Some((
        field("steps=")? as u64,
        field("end_us=")?,
        field("monotonic_us=")?,
    ))
}

/// A trace's steps (`inference-node run --trace`).
pub fn read_trace(path: &Path) -> Result<Vec<StepRecord>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_str(l).with_context(|| format!("{}:{}", path.display(), i + 1))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_lines_parse() {
        assert_eq!(
            parse_progress("progress steps=15 end_us=150012 monotonic_us=99000123"),
            Some((15, 150_012.0, 99_000_123.0))
        );
        assert_eq!(parse_progress("t=   1s ..."), None);
        assert_eq!(
            parse_progress("progress steps=x end_us=1 monotonic_us=2"),
            None
        );
    }
}
