//! What both daemons run on besides their own work, in one place:
//! logging (`logging`), systemd's readiness and watchdog protocol
//! (`notify`), the Prometheus `/metrics` endpoint (`metrics`), the bounded
//! accept loop of their gRPC servers (`accept`), the latency histogram
//! every percentile is computed with (`latency`), the host socket's
//! packets (`hostsock`), and the budget of connections not yet
//! authenticated (`preauth`). It knows nothing of the cluster config: the
//! daemons hand it plain values.

#![warn(missing_docs)]

pub mod accept;
pub mod hostsock;
pub mod latency;
pub mod logging;
pub mod metrics;
pub mod notify;
pub mod preauth;
