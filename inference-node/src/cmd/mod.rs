//! One module per subcommand: `run` (a paced run over an input, with a
//! trace and a summary) and `serve` (the daemon) run the node's model;
//! `engines` serves the host's engine processes;
//! `fetch` (rows by hand), `canary` (paced random lookups) and `engram`
//! (`addresses`, `token-map`, `gpu-check`) are tools.

pub mod canary;
pub mod engines;
pub mod engram;
pub mod fetch;
pub mod run;
pub mod serve;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Log SIGHUP and go on (a process that cannot reload a config is not
/// ended by the reload signal's default action).
pub fn ignore_hangups(what: &'static str) {
    tokio::spawn(async move {
        let Ok(mut hup) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        else {
            return;
        };
        while hup.recv().await.is_some() {
            tracing::warn!("SIGHUP: {what} does not reload its config; restart it to apply one");
        }
    });
}

/// Set `stop` on SIGINT or SIGTERM (the run ends after its current step).
pub fn stop_on_signals(stop: Arc<AtomicBool>) {
    tokio::spawn(async move {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            () = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
        }
        stop.store(true, Ordering::Relaxed);
    });
}
