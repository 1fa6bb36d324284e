//! Log setup shared by the rack's binaries: to stderr (journald captures
//! it under systemd), ANSI colours only on a terminal, the level from
//! `RUST_LOG` or the binary's default.

use std::io::IsTerminal;

/// Install the global log subscriber; `default_filter` applies when `RUST_LOG` is unset.
pub fn init_logging(default_filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}
