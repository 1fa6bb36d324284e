//! The node's Prometheus metrics: per table and per source. Routers take
//! their handles once at construction (each is an `Arc` around atomics), so
//! the lookup path updates counters without allocating or hashing labels.
//!
//! The fetch histogram is time observed by the node (queueing, network,
//! the donor's work); the donor's own service time is the donor's
//! `engram_donor_service_time_seconds`.

use engram_sync::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Labels of a per-table series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TableLabels {
    /// Table id.
    pub table: String,
}

/// Labels of a per-table, per-source series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabels {
    /// Table id.
    pub table: String,
    /// Source name (a donor, `ssd`, `local`).
    pub source: String,
}

/// Labels of the certificate series: `host` (the node's own) or `ca`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CertificateLabels {
    /// `host` or `ca`.
    pub certificate: String,
}

/// Labels of a per-source series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceOnly {
    /// Source name.
    pub source: String,
}

mod model;
pub use model::{ModelMetrics, ModelSeries};

type HistFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn fetch_histogram() -> Histogram {
    // 5 us .. ~160 ms.
    Histogram::new(exponential_buckets(5e-6, 2.0, 16))
}

/// Every series the node exports.
#[derive(Debug)]
pub struct NodeMetrics {
    registry: Mutex<Registry>,
    /// Client-observed fetch time per table and source (successful fetches).
    pub fetch_seconds: HistFamily<SourceLabels>,
    /// Lookups per table, whatever their outcome.
    pub lookups: Family<TableLabels, Counter>,
    /// Lookups answered after the table's deadline.
    pub deadline_misses: Family<TableLabels, Counter>,
    /// Lookups also sent to another source after the hedge delay.
    pub hedges_sent: Family<TableLabels, Counter>,
    /// Lookups won by a source that was asked as a hedge.
    pub hedges_won: Family<SourceLabels, Counter>,
    /// Lookups sent to the next source after a failure.
    pub failovers: Family<TableLabels, Counter>,
    /// Failures per table and source, by kind.
    pub source_errors: Family<ErrorLabels, Counter>,
    /// 0 closed, 1 half-open, 2 open.
    pub breaker_state: Family<SourceOnly, Gauge>,
    /// Times a host-local donor went away while its tables stayed mapped
    /// (and kept being served from the mapping).
    pub host_gaps: Family<SourceOnly, Counter>,
    /// Generations of a host-local donor's tables put in service (each
    /// table's first mapping included).
    pub host_generations: Family<SourceOnly, Counter>,
    /// Answers refused because the source serves another table version.
    pub version_mismatches: Family<SourceLabels, Counter>,
    /// Answers discarded because a checksum or row check failed.
    pub checksum_failures: Family<SourceLabels, Counter>,
    /// Rows delivered, by the source that delivered them.
    pub rows_served: Family<SourceLabels, Counter>,
    /// Lookups answered with zeros under the `zeros` policy.
    pub zeros_served: Family<TableLabels, Counter>,
    /// Lookups that failed under the `fail` policy.
    pub failed_lookups: Family<TableLabels, Counter>,
    /// 1 for the engine reading each table's SSD copy now (0 for the rest).
    pub ssd_engine: Family<SsdLabels, Gauge>,
    /// Lookups to a donor with an RDMA path, by how they went (`rdma`, or
    /// `stream` while RDMA was not usable).
    pub rdma_lookups: Family<RdmaLabels, Counter>,
    /// Failed RDMA reads, by fault.
    pub rdma_faults: Family<RdmaLabels, Counter>,
    /// Time a `Generate` request waited before joining the running batch.
    pub queue_seconds: Histogram,
    /// Sequences in each step the daemon ran.
    pub batch_size: Histogram,
    /// Sequences in the daemon's running batch now.
    pub batch_sequences: Gauge,
    /// The model loop's deployment series (`engram_node_model_*`).
    pub model: ModelMetrics,
    /// Each routed table's window at the node's token rate (what
    /// `engram-cluster plan` computes).
    pub table_window_seconds: Family<TableLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    /// End of validity of the node's certificate and the rack CA, in
    /// seconds since the Unix epoch (with `[rack.tls]`).
    pub certificate_expiry_timestamp_seconds: Family<CertificateLabels, Gauge>,
    /// How long the engines' GPU waits on their rings spun, per layer
    /// (from the rings' headers; each at its bucket's midpoint).
    pub ring_gpu_wait_seconds: HistFamily<RingLabels>,
    /// Ring waits that passed the GPU's deadline (zeros on the GPU).
    pub ring_gpu_timeouts: Family<RingLabels, Counter>,
    /// Ring faults: sections without rows under a `fail` policy, told to
    /// the engine (it stops).
    pub ring_faults: Family<RingLabels, Counter>,
}

/// Labels of the RDMA series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RdmaLabels {
    /// The donor.
    pub source: String,
    /// `rdma` or `stream` (lookups); `revoked`, `peer_gone`, `rejected`,
    /// `local`, `timeout`, `corrupt` (faults).
    pub kind: String,
}

/// Labels of the SSD engine series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SsdLabels {
    /// Table id.
    pub table: String,
    /// `io_uring` or `pread`.
    pub engine: String,
    /// `true` when reads bypass the page cache (O_DIRECT).
    pub direct: String,
    /// `true` when each page read is checked against its checksum.
    pub page_checksums: String,
    /// The reads' I/O priority (`realtime:4`, `best-effort:4`, `idle`).
    pub ioprio: String,
}

/// Labels of an engine-ring series: the Engram layer of the section.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RingLabels {
    /// The Engram layer (1 or 14).
    pub layer: String,
}

/// The engine's wait histogram as Prometheus buckets: each bound is a
/// ring bucket's upper bound (PROTOCOL.md 6.1), so every bucket maps to
/// one.
fn ring_wait_histogram() -> Histogram {
    let bounds = (0..engram_protocol::ring::WAIT_BUCKETS - 1)
        .map(|b| engram_protocol::ring::wait_bucket_bounds(b).1 * 1e-9);
    Histogram::new(bounds)
}

/// Labels of an error series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// Table id.
    pub table: String,
    /// Source name.
    pub source: String,
    /// `timeout`, `unavailable`, `version`, `corrupt`, `draining`, `failed`, `bad_request`.
    pub kind: String,
}

impl Default for NodeMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl NodeMetrics {
    /// All series, registered under `engram_node_`. Long because it is
    /// one list: every series the node exports with its help text, in one
    /// place (docs/node.md's table of node metrics follows it).
    pub fn new() -> Self {
        let m = Self {
            registry: Mutex::new(Registry::with_prefix("engram_node")),
            fetch_seconds: Family::new_with_constructor(fetch_histogram),
            lookups: Family::default(),
            deadline_misses: Family::default(),
            hedges_sent: Family::default(),
            hedges_won: Family::default(),
            failovers: Family::default(),
            source_errors: Family::default(),
            breaker_state: Family::default(),
            host_gaps: Family::default(),
            host_generations: Family::default(),
            version_mismatches: Family::default(),
            checksum_failures: Family::default(),
            rows_served: Family::default(),
            zeros_served: Family::default(),
            failed_lookups: Family::default(),
            ssd_engine: Family::default(),
            rdma_lookups: Family::default(),
            rdma_faults: Family::default(),
            // 100 us .. ~52 s.
            queue_seconds: Histogram::new(exponential_buckets(1e-4, 2.0, 20)),
            // 1, 2, 4 .. 1024 sequences.
            batch_size: Histogram::new(exponential_buckets(1.0, 2.0, 11)),
            batch_sequences: Gauge::default(),
            model: ModelMetrics::default(),
            table_window_seconds: Family::default(),
            certificate_expiry_timestamp_seconds: Family::default(),
            ring_gpu_wait_seconds: Family::new_with_constructor(ring_wait_histogram),
            ring_gpu_timeouts: Family::default(),
            ring_faults: Family::default(),
        };
        {
            let mut r = m.registry.lock();
            r.register(
                "fetch_seconds",
                "Time from sending a lookup to a source to its valid answer, seen by the node",
                m.fetch_seconds.clone(),
            );
            r.register("lookups", "Lookups per table", m.lookups.clone());
            r.register(
                "deadline_misses",
                "Lookups answered after the table's window plus grace",
                m.deadline_misses.clone(),
            );
            r.register(
                "hedges_sent",
                "Lookups also sent to the next source",
                m.hedges_sent.clone(),
            );
            r.register("hedges_won", "Lookups won by a hedge", m.hedges_won.clone());
            r.register(
                "failovers",
                "Lookups sent to the next source after a failure",
                m.failovers.clone(),
            );
            r.register(
                "source_errors",
                "Failed attempts by kind",
                m.source_errors.clone(),
            );
            r.register(
                "breaker_state",
                "Circuit breaker per source: 0 closed, 1 half-open, 2 open",
                m.breaker_state.clone(),
            );
            r.register(
                "host_gaps",
                "Times a host-local donor went away while its tables stayed mapped and served",
                m.host_gaps.clone(),
            );
            r.register(
                "host_generations",
                "Generations of a host-local donor's tables put in service, each table's first mapping included",
                m.host_generations.clone(),
            );
            r.register(
                "version_mismatches",
                "Answers refused: the source serves another table version",
                m.version_mismatches.clone(),
            );
            r.register(
                "checksum_failures",
                "Answers discarded: checksum or row check failed",
                m.checksum_failures.clone(),
            );
            r.register(
                "rows_served",
                "Rows delivered, by source",
                m.rows_served.clone(),
            );
            r.register(
                "zeros_served",
                "Lookups answered with zeros (policy zeros: Engram suppressed)",
                m.zeros_served.clone(),
            );
            r.register(
                "failed_lookups",
                "Lookups failed after every source (policy fail)",
                m.failed_lookups.clone(),
            );
            r.register(
                "rdma_lookups",
                "Lookups to a donor with an RDMA path: read over RDMA, or over the stream transport while RDMA was not usable",
                m.rdma_lookups.clone(),
            );
            r.register(
                "rdma_faults",
                "Failed RDMA reads by fault (the lookup failed over)",
                m.rdma_faults.clone(),
            );
            r.register(
                "queue_seconds",
                "Time a Generate request waited before joining the running batch",
                m.queue_seconds.clone(),
            );
            r.register(
                "batch_size",
                "Sequences in each step of the daemon's batch",
                m.batch_size.clone(),
            );
            r.register(
                "batch_sequences",
                "Sequences in the daemon's running batch now",
                m.batch_sequences.clone(),
            );
            r.register(
                "ssd_engine",
                "The engine reading each table's SSD copy (1 in use), whether reads are O_DIRECT and pages checked, and the I/O priority they have",
                m.ssd_engine.clone(),
            );
            r.register(
                "table_window_seconds",
                "Each routed table's window at the node's token rate: the time its rows have before their block (engram-cluster plan's window)",
                m.table_window_seconds.clone(),
            );
            r.register(
                "certificate_expiry_timestamp_seconds",
                "End of validity of the node's certificate (host) and of the rack CA (ca), in seconds since the Unix epoch",
                m.certificate_expiry_timestamp_seconds.clone(),
            );
            r.register(
                "ring_gpu_wait_seconds",
                "How long the engines' GPU waits for ring rows spun, per Engram layer (the engine's histogram in the ring header, each wait at its bucket's midpoint)",
                m.ring_gpu_wait_seconds.clone(),
            );
            r.register(
                "ring_gpu_timeouts",
                "Engine ring waits that passed the GPU's deadline (the GPU used zeros), per Engram layer",
                m.ring_gpu_timeouts.clone(),
            );
            r.register(
                "ring_faults",
                "Engine ring sections without rows under the fail policy, told to the engine (it stops), per Engram layer",
                m.ring_faults.clone(),
            );
            m.model.register(&mut r);
        }
        m
    }

    /// Show when the certificates of `material` (the node's TLS material,
    /// as loaded now) stop being valid.
    pub fn set_certificates(&self, material: &cluster_config::tls::Material) {
        for (which, der) in [
            ("host", material.chain.first()),
            ("ca", material.ca.first()),
        ] {
            if let Some(t) = der.and_then(|d| cluster_config::pki::not_after_unix(d)) {
                let labels = CertificateLabels {
                    certificate: which.into(),
                };
                self.certificate_expiry_timestamp_seconds
                    .get_or_create(&labels)
                    .set(t);
            }
        }
    }

    /// The text exposition of every series.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let r = self.registry.lock();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &r);
        out
    }
}
