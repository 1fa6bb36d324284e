//! RDMA serving: the donor's region book (`engram_rdma::book`) over its
//! resident tables. At start it takes the process's verbs provider; where
//! there is none (no device, or a build without the `rdma` feature) it says
//! so once and which addresses nodes fall back to, and the donor serves on
//! its other transports. Every table is registered with its check words;
//! after a swap or a reload the book follows the tables (the new version
//! registered before the old one is deregistered). Nodes learn regions
//! through RegionQuery on a TLS or QUIC connection (`server::handler`).

use std::net::SocketAddr;
use std::sync::Arc;

use cluster_config::{Endpoint, RdmaDevice};
use engram_rdma::book::RegionBook;
use engram_rdma::verbs::DeviceSpec;
use engram_store::resident::ResidentTable;

/// The provider's device settings from the config's.
pub fn device_spec(d: &RdmaDevice) -> DeviceSpec {
    DeviceSpec {
        device: d.device.clone(),
        port: d.port,
        gid_index: d.gid_index,
    }
}

/// Start serving RDMA at `addr`: a book with every table in `tables`
/// registered and a listener for queue pairs. `None` (logged, with the
/// addresses nodes use instead: `fallback`) when this host cannot.
pub fn start(
    donor: &str,
    addr: SocketAddr,
    device: &RdmaDevice,
    tables: &[ResidentTable],
    fallback: &[Endpoint],
) -> Option<Arc<RegionBook>> {
    let others: Vec<String> = fallback.iter().map(ToString::to_string).collect();
    let provider = match engram_rdma::provider() {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(
                donor,
                "rdma://{addr} is not served: {e}; nodes reach this donor over {} instead",
                others.join(", ")
            );
            return None;
        }
    };
    let book = RegionBook::new(provider, device_spec(device));
    let registered = sync(&book, snapshot(tables));
    if let Err(e) = book.listen(addr) {
        tracing::warn!(
            donor,
            "rdma://{addr} is not served: listening failed: {e}; nodes reach this donor over {} \
             instead",
            others.join(", ")
        );
        return None;
    }
    tracing::info!(
        donor,
        provider = book.provider_name(),
        tables = registered,
        registered_bytes = book.registered_bytes(),
        "rdma://{addr}: serving one-sided reads"
    );
    Some(book)
}

/// What the book needs of a resident table: taken under the tables' lock,
/// used after it is released (check words take a while).
pub struct TableRef {
    id: u32,
    rows: u64,
    digest: engram_protocol::TableDigest,
    memory: Arc<dyn engram_rdma::verbs::Memory>,
}

impl std::fmt::Debug for TableRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TableRef")
            .field("id", &self.id)
            .field("rows", &self.rows)
            .field("digest", &self.digest)
            .finish_non_exhaustive()
    }
}

/// The tables as the book sees them.
pub fn snapshot(tables: &[ResidentTable]) -> Vec<TableRef> {
    tables
        .iter()
        .filter(|t| {
            let packed = t.memory().is_packed();
            if !packed {
                tracing::warn!(
                    table = t.id,
                    "rdma: not offered: the table is served from its file's pages (map_files), where rows are not back to back; nodes read it over the other transports"
                );
            }
            packed
        })
        .map(|t| TableRef {
            id: t.id,
            rows: t.rows,
            digest: t.digest,
            memory: t.memory(),
        })
        .collect()
}

/// Make the book hold exactly `tables` at their versions: new versions are
/// registered (replacing the old registration of the same table), tables
/// gone are deregistered. Returns how many tables are registered.
pub fn sync(book: &RegionBook, tables: Vec<TableRef>) -> usize {
    let keep: Vec<_> = tables.iter().map(|t| (t.id, t.digest)).collect();
    for gone in book.retain_or_stale(&keep) {
        tracing::info!(table = gone, "rdma: region deregistered");
    }
    for t in tables {
        if book.holds(t.id, &t.digest) {
            continue;
        }
        match book.publish(t.id, t.rows, t.digest, t.memory) {
            Ok(p) => tracing::info!(
                table = t.id,
                digest = %t.digest,
                generation = p.generation,
                registered_bytes = p.registered,
                checks_ms = p.checks.as_secs_f64() * 1e3,
                register_ms = p.register.as_secs_f64() * 1e3,
                "rdma: region registered"
            ),
            Err(e) => tracing::warn!(
                table = t.id,
                "rdma: {e}; nodes read this table over the other transports"
            ),
        }
    }
    book.tables().len()
}
