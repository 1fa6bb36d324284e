//! The donor's Prometheus metrics: a `prometheus-client` collector that
//! reads [`DonorState`] at scrape time. The lookup path never touches the
//! registry; it only bumps the relaxed atomics in `stats`, so a scrape
//! costs the scraper, not the lookups.
//!
//! Series (all prefixed `engram_donor_`): `lookups_total`, `rows_total`,
//! `bytes_total`, `pings_total`, `errors_total{code}`,
//! `refusals_total{plane,reason}`, `quic_validated_total`,
//! `connection_errors_total{reason}`, `service_time_seconds` (histogram),
//! `connections_open`, `connections_accepted_total`,
//! `connections_refused_total`, `table_state{table,layer,state}`,
//! `table_rows{table,layer}`, `table_loaded_bytes{table,layer}`,
//! `table_bytes{table,layer}`, `table_memory_bytes{table,layer}`, `draining`, `cpu_seconds_total`, `uptime_seconds`,
//! `certificate_expiry_timestamp_seconds{certificate}` (with TLS: the donor's
//! own certificate, `host`, and the rack CA's, `ca`, as now loaded).

use std::sync::Arc;

use daemon_runtime::metrics::{Render, render_registry};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::{Registry, Unit};

use crate::stats::StatsSnapshot;
use crate::status::{DonorState, LoadState, Phase};

/// Prometheus buckets of the service-time histogram, in nanoseconds
/// (counted to the latency histogram's 1%): 5 us .. 100 ms.
pub const METRIC_BOUNDS_NS: [u64; 16] = [
    5_000,
    10_000,
    20_000,
    30_000,
    50_000,
    100_000,
    200_000,
    300_000,
    500_000,
    1_000_000,
    2_000_000,
    5_000_000,
    10_000_000,
    20_000_000,
    50_000_000,
    100_000_000,
];

/// Reads the donor's status into metric families.
#[derive(Debug)]
pub struct DonorCollector {
    status: Arc<DonorState>,
}

impl DonorCollector {
    /// A collector over `status`.
    pub fn new(status: Arc<DonorState>) -> Self {
        Self { status }
    }
}

fn counter(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    v: u64,
) -> Result<(), std::fmt::Error> {
    ConstCounter::new(v).encode(encoder.encode_descriptor(name, help, None, MetricType::Counter)?)
}

fn gauge(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    v: i64,
) -> Result<(), std::fmt::Error> {
    ConstGauge::new(v).encode(encoder.encode_descriptor(name, help, unit, MetricType::Gauge)?)
}

impl Collector for DonorCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let s = self.status.stats.snapshot();
        let e = &mut encoder;
        self.encode_traffic(e, &s)?;
        self.encode_connections(e, &s)?;
        self.encode_tables(e)?;
        let draining = i64::from(self.status.phase() == Phase::Draining);
        gauge(e, "draining", "1 once a drain started.", None, draining)?;
        ConstCounter::new(daemon_runtime::metrics::process_cpu_seconds()).encode(
            e.encode_descriptor(
                "cpu",
                "CPU time the donor's process has taken, user and system (over a node's engram_node_model_tokens_total: donor CPU per token).",
                Some(&Unit::Seconds),
                MetricType::Counter,
            )?,
        )?;
        let up = self.status.started.elapsed().as_secs_f64();
        ConstGauge::new(up).encode(e.encode_descriptor(
            "uptime",
            "Time since the donor started.",
            Some(&Unit::Seconds),
            MetricType::Gauge,
        )?)?;
        if let Some(tls) = self.status.tls.get() {
            encode_certificates(e, &tls.material())?;
        }
        Ok(())
    }
}

/// When the certificates the donor serves with stop being valid: read from
/// the material loaded now, so a rotation (SIGHUP) shows at the next scrape.
fn encode_certificates(
    e: &mut DescriptorEncoder<'_>,
    material: &cluster_config::tls::Material,
) -> Result<(), std::fmt::Error> {
    let mut m = e.encode_descriptor(
        "certificate_expiry_timestamp",
        "End of validity of the donor's certificate (host) and of the rack CA (ca), in seconds since the Unix epoch.",
        Some(&Unit::Seconds),
        MetricType::Gauge,
    )?;
    for (which, der) in [
        ("host", material.chain.first()),
        ("ca", material.ca.first()),
    ] {
        if let Some(t) = der.and_then(|d| cluster_config::pki::not_after_unix(d)) {
            ConstGauge::new(t).encode(m.encode_family(&[("certificate", which)])?)?;
        }
    }
    Ok(())
}

impl DonorCollector {
    /// Lookups, rows, bytes, pings, refusals, errors and the service time.
    fn encode_traffic(
        &self,
        e: &mut DescriptorEncoder<'_>,
        s: &StatsSnapshot,
    ) -> Result<(), std::fmt::Error> {
        counter(e, "lookups", "Lookups answered.", s.lookups)?;
        {
            let mut m = e.encode_descriptor(
                "refusals",
                "Peers turned away by a security check, by plane (data, control) and reason.",
                None,
                MetricType::Counter,
            )?;
            for ((plane, reason), n) in self.status.stats.refusals() {
                let labels = [("plane", plane), ("reason", reason)];
                ConstCounter::new(n).encode(m.encode_family(&labels)?)?;
            }
        }
        {
            let mut m = e.encode_descriptor(
                "connection_errors",
                "Client sessions the donor ended on an error (a timeout, a failed read or write, a TLS or QUIC fault, a frame answered with an error), by reason.",
                None,
                MetricType::Counter,
            )?;
            for (reason, n) in self.status.stats.connection_errors() {
                ConstCounter::new(n).encode(m.encode_family(&[("reason", reason)])?)?;
            }
        }
        counter(e, "rows", "Rows served.", s.rows)?;
        counter(e, "bytes", "Bytes of Rows frames written.", s.bytes)?;
        counter(
            e,
            "pings",
            "Pings answered (a node's warm-up before each step, and its probes).",
            s.pings,
        )?;
        {
            let mut m = e.encode_descriptor(
                "errors",
                "Error answers and error sections, by code.",
                None,
                MetricType::Counter,
            )?;
            for (code, n) in s.errors_seen() {
                let labels = [("code", code.name())];
                ConstCounter::new(n).encode(m.encode_family(&labels)?)?;
            }
        }
        {
            let t = &s.service;
            let groups = t.buckets(&METRIC_BOUNDS_NS);
            let buckets: Vec<(f64, u64)> = METRIC_BOUNDS_NS
                .iter()
                .map(|&b| b as f64 / 1e9)
                .chain([f64::INFINITY])
                .zip(groups)
                .collect();
            let mut m = e.encode_descriptor(
                "service_time",
                "Time from a whole Lookup frame to its answer encoded (the write excluded).",
                Some(&Unit::Seconds),
                MetricType::Histogram,
            )?;
            m.encode_histogram::<NoLabelSet>(t.sum_ns as f64 / 1e9, t.count(), &buckets, None)?;
        }
        Ok(())
    }

    fn encode_connections(
        &self,
        e: &mut DescriptorEncoder<'_>,
        s: &StatsSnapshot,
    ) -> Result<(), std::fmt::Error> {
        let open = i64::try_from(s.open).unwrap_or(i64::MAX);
        gauge(
            e,
            "connections_open",
            "Data-plane connections open and authenticated (each holds one of max_connections).",
            None,
            open,
        )?;
        counter(
            e,
            "connections_accepted",
            "Data-plane connections accepted.",
            s.connections,
        )?;
        counter(
            e,
            "connections_refused",
            "Data-plane connections refused at the connection bound.",
            s.refused,
        )?;
        counter(
            e,
            "quic_validated",
            "QUIC Initials whose source address a token proved (a Retry's, or one from NEW_TOKEN): each counts against its own address's handshakes only. Retries sent: refusals_total{reason=\"quic_retry\"}.",
            s.quic_validated,
        )?;
        Ok(())
    }

    /// Each table's state, rows and bytes loaded.
    fn encode_tables(&self, e: &mut DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let views: Vec<_> = self.status.tables.iter().map(|t| t.view()).collect();
        let table_labels = |v: &crate::status::TableView| {
            [("table", v.id.to_string()), ("layer", v.layer.to_string())]
        };
        {
            let mut m = e.encode_descriptor(
                "table_state",
                "1 for each table's current load state, 0 for the others.",
                None,
                MetricType::Gauge,
            )?;
            for v in &views {
                for state in LoadState::ALL {
                    let [a, b] = table_labels(v);
                    let labels = [a, b, ("state", state.name().to_string())];
                    ConstGauge::new(i64::from(v.state == state))
                        .encode(m.encode_family(&labels)?)?;
                }
            }
        }
        let per_table = [
            ("table_rows", "Rows in each table.", None),
            (
                "table_loaded_bytes",
                "Row bytes of each table in memory so far.",
                None,
            ),
            ("table_bytes", "Row bytes of each table in all.", None),
            (
                "table_memory_bytes",
                "Memory each table's rows take as served: its file's pages, its rows back to back, or planar (what engram-cluster plan counts).",
                None,
            ),
        ];
        for (name, help, unit) in per_table {
            let mut m = e.encode_descriptor(name, help, unit, MetricType::Gauge)?;
            for v in &views {
                let x = match name {
                    "table_rows" => v.rows,
                    "table_loaded_bytes" => v.bytes_done,
                    "table_memory_bytes" => v.memory_bytes,
                    _ => v.bytes_total,
                };
                let x = i64::try_from(x).unwrap_or(i64::MAX);
                ConstGauge::new(x).encode(m.encode_family(&table_labels(v))?)?;
            }
        }
        Ok(())
    }
}

/// The donor's registry (prefix `engram_donor`) as a render function for
/// [`daemon_runtime::metrics::serve_metrics`].
pub fn donor_metrics(status: Arc<DonorState>) -> Render {
    let mut registry = Registry::with_prefix("engram_donor");
    registry.register_collector(Box::new(DonorCollector::new(status)));
    render_registry(Arc::new(registry))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_scrape_shows_counts_histogram_and_tables() {
        let status = DonorState::new(
            "d",
            Duration::from_secs(1),
            [(Some(7), "/t.etab".into())],
            true,
        );
        status.tables[0].opened(7, 1, 100, engram_protocol::TableDigest([1; 32]));
        status.tables[0].progress(50, 100);
        let stats = &status.stats;
        stats.lookup(24, 6400, Duration::from_micros(7));
        stats.lookup(24, 6400, Duration::from_micros(70));
        stats.error(engram_protocol::ErrorCode::VersionMismatch);
        let text = donor_metrics(Arc::clone(&status))();
        for line in [
            "engram_donor_lookups_total 2",
            "engram_donor_rows_total 48",
            "engram_donor_bytes_total 12800",
            "engram_donor_errors_total{code=\"version_mismatch\"} 1",
            "engram_donor_service_time_seconds_count 2",
            "engram_donor_service_time_seconds_bucket{le=\"0.000005\"} 0",
            "engram_donor_service_time_seconds_bucket{le=\"0.00001\"} 1",
            "engram_donor_service_time_seconds_bucket{le=\"0.0001\"} 2",
            "engram_donor_service_time_seconds_bucket{le=\"+Inf\"} 2",
            "engram_donor_connections_open 0",
            "engram_donor_table_state{table=\"7\",layer=\"1\",state=\"loading\"} 1",
            "engram_donor_table_state{table=\"7\",layer=\"1\",state=\"ready\"} 0",
            "engram_donor_table_loaded_bytes{table=\"7\",layer=\"1\"} 13200",
            "engram_donor_draining 0",
            // Evictions show at 0 before the first, for rates over them.
            "engram_donor_refusals_total{plane=\"data\",reason=\"preauth_evicted\"} 0",
            "engram_donor_refusals_total{plane=\"control\",reason=\"preauth_evicted\"} 0",
            "# EOF",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in:\n{text}");
        }
    }
}
