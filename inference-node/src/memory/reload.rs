//! Reloadable reload: a new config applied to the running routers, all or
//! nothing.
//!
//! What can change live: each route's sources and their order, grace, hard
//! timeout, hedge and policy, the window (from `tokens_per_second`), the
//! node's probe interval and breaker threshold, copies' paths and SSD
//! settings (those are reopened), and the donors' addresses, timeouts and
//! credential (those reconnect). What cannot: which tables the
//! node routes and what they are (digest, layer, rows); a config that
//! changes them is refused with [`MemoryError::RestartNeeded`].
//!
//! A reload first makes everything the new config needs that the node does
//! not have yet (new donor sources, new SSD or local copies, opened and
//! checked); if any of that fails nothing has changed. Then it swaps each
//! router's settings and sources in one step (a lookup in flight finishes
//! with what it started with) and restarts the probe loops over the new
//! set of sources; sources no longer used are dropped once the last lookup
//! holding them ends.

use std::fmt;
use std::sync::Arc;

use cluster_config::Config;

use super::{MemoryError, Routers, SourcePool, build, find_node, spawn_probes};
use crate::metrics::NodeMetrics;
use crate::router::{RouteSettings, SourceHealth};
use crate::source::SourceKind;

/// What a reload changed in one table's route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableChanges {
    /// Table id.
    pub table: u32,
    /// What changed, one phrase each (`hedge off -> p99`).
    pub changes: Vec<String>,
}

/// What a reload changed, for the log.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReloadReport {
    /// Node-wide changes (probe interval, breaker threshold).
    pub node: Vec<String>,
    /// Per-table changes; tables without any are left out.
    pub tables: Vec<TableChanges>,
}

impl ReloadReport {
    /// True when the new config changed nothing this node uses.
    pub fn is_empty(&self) -> bool {
        self.node.is_empty() && self.tables.is_empty()
    }
}

impl fmt::Display for ReloadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("nothing changed");
        }
        let mut parts = self.node.clone();
        parts.extend(
            self.tables
                .iter()
                .map(|t| format!("table {}: {}", t.table, t.changes.join(", "))),
        );
        f.write_str(&parts.join("; "))
    }
}

impl Routers {
    /// Apply node `name` of `config` to the running routers, or change
    /// nothing and return why not: the node must route the same tables,
    /// with the same digests, layers and row counts. Sources the node
    /// already has (same donor address, tables and timeouts; same copy
    /// path) are kept with their breakers and connections; new ones are
    /// made, opened and checked before anything is switched.
    pub async fn reload(
        &self,
        config: &Config,
        name: &str,
        metrics: &NodeMetrics,
    ) -> Result<ReloadReport, MemoryError> {
        let mut live = self.live.lock().await;
        let node = find_node(config, name)?;
        self.check_tables(config, node)?;
        let mut report = ReloadReport::default();
        // New certificates first: connections made from now on use them.
        // Bad ones are refused and the old ones stay (the rest still applies).
        match (&live.tls, config.tls_files(&node.name)) {
            (Some(tls), Some(files)) => match tls.reload(&files) {
                Ok(m) => {
                    metrics.set_certificates(&m);
                    report
                        .node
                        .push(format!("TLS certificate reloaded ({})", m.identity));
                }
                Err(e) => tracing::error!(
                    error = %e,
                    "reload: the new TLS certificate or key was refused; the old ones stay"
                ),
            },
            (None, Some(_)) | (Some(_), None) => {
                return Err(MemoryError::RestartNeeded {
                    table: 0,
                    what: "[rack.tls] was added or removed".into(),
                });
            }
            (None, None) => {}
        }
        let built = build(config, node, metrics, &live.pool, live.tls.as_ref()).await?;

        // Nothing has changed yet; from here on nothing fails.
        for h in &built.fresh {
            h.probe_at_start().await;
        }
        if live.probe_interval != node.probe_interval {
            report.node.push(format!(
                "probe interval {:?} -> {:?}",
                live.probe_interval, node.probe_interval
            ));
        }
        if live.breaker_failures != node.breaker_failures {
            report.node.push(format!(
                "breaker failures {} -> {}",
                live.breaker_failures, node.breaker_failures
            ));
        }
        for (mut settings, sources) in built.routes {
            let Some(router) = self.router(settings.table) else {
                continue; // checked above: every routed table has a router
            };
            let (old, old_sources) = (router.settings(), router.sources());
            settings.precise_timers = old.precise_timers;
            let changes = describe(
                (&old, &old_sources[..], &live.pool),
                (&settings, &sources, &built.pool),
            );
            router.reconfigure(settings, sources, metrics);
            if !changes.is_empty() {
                report.tables.push(TableChanges {
                    table: router.table(),
                    changes,
                });
            }
        }
        for h in built.pool.all() {
            h.set_threshold(node.breaker_failures);
        }
        for p in live.probes.drain(..) {
            p.abort();
        }
        live.probes = spawn_probes(&built.pool, node.probe_interval);
        live.pool = built.pool;
        live.probe_interval = node.probe_interval;
        live.breaker_failures = node.breaker_failures;
        Ok(report)
    }

    /// The node routes the tables it started with, and they are still the same.
    fn check_tables(
        &self,
        config: &Config,
        node: &cluster_config::Node,
    ) -> Result<(), MemoryError> {
        let restart = |table: u32, what: String| Err(MemoryError::RestartNeeded { table, what });
        for t in &self.tables {
            if node.route(t.id).is_none() {
                return restart(t.id, format!("no longer routed by node {}", node.name));
            }
            let Some(new) = config.table(t.id) else {
                return restart(t.id, "no longer in the config".into());
            };
            if new.digest != t.digest {
                return restart(t.id, format!("digest {} -> {}", t.digest, new.digest));
            }
            if new.layer != t.layer {
                return restart(t.id, format!("layer {} -> {}", t.layer, new.layer));
            }
            if new.rows != t.rows {
                return restart(t.id, format!("rows {} -> {}", t.rows, new.rows));
            }
        }
        for r in &node.routes {
            if !self.tables.iter().any(|t| t.id == r.table) {
                return restart(r.table, format!("newly routed by node {}", node.name));
            }
        }
        Ok(())
    }
}

/// One route's settings and sources, and the pool they come from.
type RouteView<'a> = (&'a RouteSettings, &'a [Arc<SourceHealth>], &'a SourcePool);

/// What changes in one route, in words.
fn describe(
    (old, old_sources, old_pool): RouteView<'_>,
    (new, sources, new_pool): RouteView<'_>,
) -> Vec<String> {
    let mut out = Vec::new();
    let mut note = |what: &str, a: String, b: String| {
        if a != b {
            out.push(format!("{what} {a} -> {b}"));
        }
    };
    note(
        "window",
        format!("{:?}", old.window),
        format!("{:?}", new.window),
    );
    note(
        "grace",
        format!("{:?}", old.grace),
        format!("{:?}", new.grace),
    );
    note(
        "hard timeout",
        format!("{:?}", old.hard_timeout),
        format!("{:?}", new.hard_timeout),
    );
    note("hedge", old.hedge.to_string(), new.hedge.to_string());
    note("policy", old.policy.to_string(), new.policy.to_string());
    note("sources", names(old_sources), names(sources));
    for h in sources.iter().filter(|h| !old_pool.holds(h)) {
        let name = h.source.name();
        out.push(match h.source.kind() {
            SourceKind::Donor if old_pool.donor(name).is_some() => {
                format!("{name}: reconnects (address, tables, timeouts or credential changed)")
            }
            SourceKind::Donor => format!("{name}: new donor"),
            _ => match new_pool.copies.iter().find(|(_, c)| Arc::ptr_eq(c, h)) {
                Some((spec, _)) => format!("{name}: opened {}", spec.path.display()),
                None => format!("{name}: opened"),
            },
        });
    }
    out
}

fn names(sources: &[Arc<SourceHealth>]) -> String {
    let names: Vec<&str> = sources.iter().map(|h| h.source.name()).collect();
    format!("[{}]", names.join(", "))
}
