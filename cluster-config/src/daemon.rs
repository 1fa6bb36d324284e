//! Plumbing both daemons share, in one place: logging (`logging`),
//! systemd's readiness and watchdog protocol (`notify`), the Prometheus
//! `/metrics` endpoint (`metrics`) and the bounded accept loop of their gRPC
//! servers (`accept`).

pub mod accept;
pub mod logging;
pub mod metrics;
pub mod notify;
