//! SIGHUP: re-read the cluster config and work out what changes. What can
//! change live: the log level, the hello/idle/write/drain timeouts, the
//! credential, a higher connection bound, digest trust and memory locking
//! for later loads, and each served table's version (a hot swap, see
//! `swap`). What needs a restart (logged, not applied): addresses, the
//! donor's name, tables added or removed, a lower connection bound. An
//! invalid config changes nothing: its diagnostics are logged and the
//! running config stays.

use std::path::PathBuf;

use cluster_config::Config;
use engram_protocol::TableDigest;

use crate::orders::SwapRequest;
use crate::spec::{Overrides, ServeError, ServeSpec};

/// Where the config came from, to read it again.
#[derive(Debug, Clone)]
pub struct ReloadSource {
    /// The cluster config file.
    pub path: PathBuf,
    /// This donor's name in it.
    pub name: String,
    /// Command-line flags, which win over the file on every reload too.
    pub overrides: Overrides,
}

/// A served table as the reload compares it: id, version, file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServedTable {
    /// The table id.
    pub id: u32,
    /// The version served.
    pub digest: TableDigest,
    /// The table file it was loaded from (empty when not known).
    pub path: PathBuf,
}

/// What a reload changes.
#[derive(Debug, Clone)]
pub struct ReloadPlan {
    /// The new spec; addresses and the table list stay as they were.
    pub spec: ServeSpec,
    /// Tables to swap to another version.
    pub swaps: Vec<SwapRequest>,
    /// Changes that need a restart (not applied).
    pub restart: Vec<String>,
}

impl ReloadSource {
    /// Read the config again (as at start, flags over the file).
    pub fn read(&self) -> Result<ServeSpec, ServeError> {
        let config = Config::load(&self.path).map_err(|e| ServeError::Config(e.to_string()))?;
        let mut spec = ServeSpec::from_config(&config, &self.name)?;
        self.overrides.apply(&mut spec)?;
        Ok(spec)
    }
}

/// Compare a freshly read spec with the running one and what is served.
pub fn plan(running: &ServeSpec, new: ServeSpec, served: &[ServedTable]) -> ReloadPlan {
    let mut restart = Vec::new();
    let mut spec = new;
    if spec.listen != running.listen {
        restart.push(format!("listen {:?} -> {:?}", running.listen, spec.listen));
        spec.listen.clone_from(&running.listen);
    }
    if spec.control != running.control {
        restart.push(format!(
            "control {:?} -> {:?}",
            running.control, spec.control
        ));
        spec.control = running.control;
    }
    if spec.metrics != running.metrics {
        restart.push(format!(
            "metrics {:?} -> {:?}",
            running.metrics, spec.metrics
        ));
        spec.metrics = running.metrics;
    }
    let mut swaps = Vec::new();
    for t in &spec.tables {
        let Some(id) = t.id else { continue };
        let Some(now) = served.iter().find(|s| s.id == id) else {
            restart.push(format!("table {id} added"));
            continue;
        };
        let want = t.pinned.map(|p| p.digest);
        let other_version = want.is_some_and(|d| d != now.digest);
        if other_version || (want.is_none() && t.path != now.path) {
            swaps.push(SwapRequest {
                table: id,
                path: t.path.clone(),
                expected: want,
                in_place: false,
            });
        }
    }
    for s in served {
        if !spec.tables.iter().any(|t| t.id == Some(s.id)) {
            restart.push(format!("table {} removed", s.id));
        }
    }
    // The table list stays what is served; swaps change versions in place.
    spec.tables.clone_from(&running.tables);
    ReloadPlan {
        spec,
        swaps,
        restart,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::TableSpec;
    use engram_store::resident::ExpectedTable;

    fn spec(tables: &[(u32, &str, u8)]) -> ServeSpec {
        let mut s = ServeSpec::from_flags("d", vec!["127.0.0.1:1".parse().expect("addr")], vec![]);
        s.tables = tables
            .iter()
            .map(|&(id, path, d)| TableSpec {
                id: Some(id),
                path: path.into(),
                pinned: Some(ExpectedTable {
                    digest: TableDigest([d; 32]),
                    layer: id,
                    rows: 10,
                }),
                encoding: None,
                tensor_scale: None,
            })
            .collect();
        s
    }

    fn served(list: &[(u32, &str, u8)]) -> Vec<ServedTable> {
        list.iter()
            .map(|&(id, path, d)| ServedTable {
                id,
                digest: TableDigest([d; 32]),
                path: path.into(),
            })
            .collect()
    }

    #[test]
    fn a_new_digest_is_a_swap_and_the_rest_needs_a_restart() {
        let running = spec(&[(1, "/a", 1), (14, "/b", 2)]);
        let now = served(&[(1, "/a", 1), (14, "/b", 2)]);
        let p = plan(&running, spec(&[(1, "/a", 1), (14, "/b", 2)]), &now);
        assert!(p.swaps.is_empty() && p.restart.is_empty(), "{p:?}");

        let p = plan(&running, spec(&[(1, "/a2", 9), (14, "/b", 2)]), &now);
        assert_eq!(
            p.swaps,
            vec![SwapRequest {
                table: 1,
                path: "/a2".into(),
                expected: Some(TableDigest([9; 32])),
                in_place: false
            }]
        );
        assert_eq!(
            p.spec.tables, running.tables,
            "the list stays until swapped"
        );

        let mut moved = spec(&[(1, "/a", 1), (7, "/c", 3)]);
        moved.listen = vec![cluster_config::Endpoint::new(
            cluster_config::Transport::Tcp,
            "127.0.0.1:2".parse().expect("addr"),
        )];
        let p = plan(&running, moved, &now);
        assert_eq!(p.spec.listen, running.listen);
        let all = p.restart.join("; ");
        assert!(
            all.contains("listen")
                && all.contains("table 7 added")
                && all.contains("table 14 removed"),
            "{all}"
        );
    }

    #[test]
    fn a_failed_swap_is_retried_by_the_next_reload() {
        // The config already names version 9, but version 1 is still served.
        let running = spec(&[(1, "/a2", 9)]);
        let p = plan(&running, spec(&[(1, "/a2", 9)]), &served(&[(1, "/a", 1)]));
        assert_eq!(p.swaps.len(), 1);
    }
}
