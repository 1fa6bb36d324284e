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
use engram_rdma::verbs::{DeviceSpec, Fabric, Provider, VerbsError};
use engram_store::kept_checks::KeptChecks;
use engram_store::resident::ResidentTable;

use crate::fdstore::FdStore;

/// The provider's device settings from the config's.
fn device_spec(d: &RdmaDevice) -> DeviceSpec {
    DeviceSpec {
        device: d.device.clone(),
        fabric: fabric(d),
    }
}

/// The verbs' fabric settings from the config's (the node's queue pairs
/// to this donor use them too).
pub fn fabric(d: &RdmaDevice) -> Fabric {
    Fabric {
        ack_timeout: d.ack_timeout,
        retry_count: d.retry_count,
        traffic_class: d.traffic_class,
    }
}

/// A region book for a donor listening at `addr`, on the device that
/// address is on (the config's device must be that one when it names one).
pub fn open_book(
    provider: Arc<dyn Provider>,
    addr: SocketAddr,
    device: &RdmaDevice,
) -> Result<Arc<RegionBook>, VerbsError> {
    let spec = provider.device_of(addr, &device_spec(device))?;
    tracing::debug!(%addr, device = ?spec.device, "rdma: the address's device");
    Ok(RegionBook::new(provider, spec))
}

/// Start serving RDMA at `addr`: a book with every table in `tables`
/// registered and a listener for queue pairs. `None` (logged, with the
/// addresses nodes use instead: `fallback`) when this host cannot.
pub fn start(
    donor: &str,
    addr: SocketAddr,
    device: &RdmaDevice,
    tables: Vec<TableRef>,
    fallback: &[Endpoint],
    store: Option<&FdStore>,
) -> Option<Arc<RegionBook>> {
    let others: Vec<String> = fallback.iter().map(ToString::to_string).collect();
    let book = match engram_rdma::provider().and_then(|p| open_book(p, addr, device)) {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!(
                donor,
                "rdma://{addr} is not served: {e}; nodes reach this donor over {} instead",
                others.join(", ")
            );
            return None;
        }
    };
    let registered = sync_kept(&book, tables, store);
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
                    layout = t.memory().layout().name(),
                    encoding = %t.encoding.name(),
                    "rdma: not offered: the table is served from its file's pages (map_files), where rows are not back to back, or its rows are not V4.1's 264 bytes (docs/models.md); nodes read it over the other transports"
                );
            }
            packed
        })
        .map(|t| TableRef {
            id: t.id,
            rows: t.rows,
            digest: t.digest,
            // Through the writable view where the kernel needs one.
            memory: Arc::new(engram_store::resident::Registered(t.memory())),
        })
        .collect()
}

/// Make the book hold exactly `tables` at their versions: new versions are
/// registered (replacing the old registration of the same table), tables
/// gone are deregistered. Returns how many tables are registered.
pub fn sync(book: &RegionBook, tables: Vec<TableRef>) -> usize {
    sync_kept(book, tables, None)
}

/// The check words of `t`: kept by the previous process (`store`), or
/// computed into a memfd to keep for the next start; `None` (the book
/// computes them in memory) without a store.
fn checks_for(t: &TableRef, store: &FdStore) -> Option<(Arc<KeptChecks>, bool)> {
    if !store.is_enabled() {
        return None;
    }
    if let Some(k) = store.take_checks(t.id, t.rows, &t.digest) {
        tracing::info!(
            table = t.id,
            "rdma: check words taken from the fd store, not computed"
        );
        return Some((Arc::new(k), false));
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let seed = engram_rdma::check::seed(&t.digest);
    let rows = t.memory.bytes();
    match KeptChecks::create(t.id, t.rows, &t.digest, |out| {
        engram_rdma::check::table_checks_into(seed, rows, out, threads);
    }) {
        Ok(k) => Some((Arc::new(k), true)),
        Err(e) => {
            tracing::warn!(
                table = t.id,
                "rdma: check words not kept for the next start: {e}"
            );
            None
        }
    }
}

/// [`sync`], the check words taken from and kept in `store`.
pub fn sync_kept(book: &RegionBook, tables: Vec<TableRef>, store: Option<&FdStore>) -> usize {
    let keep: Vec<_> = tables.iter().map(|t| (t.id, t.digest)).collect();
    for gone in book.retain_or_stale(&keep) {
        tracing::info!(table = gone, "rdma: region deregistered");
    }
    for t in tables {
        if book.holds(t.id, &t.digest) {
            continue;
        }
        let checks = store.and_then(|s| checks_for(&t, s));
        let given = checks
            .as_ref()
            .map(|(k, _)| Arc::clone(k) as Arc<dyn engram_rdma::verbs::Memory>);
        let (id, digest) = (t.id, t.digest);
        match book.publish_with(t.id, t.rows, t.digest, t.memory, given) {
            Ok(p) => {
                if let (Some(s), Some((k, true))) = (store, &checks) {
                    s.keep_checks(id, &digest, k);
                }
                tracing::info!(
                    table = id,
                    digest = %digest,
                    generation = p.generation,
                    registered_bytes = p.registered,
                    checks_ms = p.checks.as_secs_f64() * 1e3,
                    register_ms = p.register.as_secs_f64() * 1e3,
                    "rdma: region registered"
                );
            }
            Err(e) => tracing::warn!(
                table = id,
                "rdma: {e}; nodes read this table over the other transports"
            ),
        }
    }
    book.tables().len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use engram_protocol::{ROW_BYTES, TableDigest};
    use engram_rdma::fake::FakeProvider;
    use std::net::IpAddr;

    /// A host of two devices: tables are registered, and queue pairs
    /// listened for, on the device the rdma:// address is on, not the
    /// first one listed; a config naming the other device is refused
    /// with both names.
    #[test]
    fn the_book_registers_and_listens_on_the_device_of_the_address() {
        let fake = FakeProvider::new();
        let (a, b): (IpAddr, IpAddr) = (
            "10.1.0.1".parse().expect("ip"),
            "10.2.0.1".parse().expect("ip"),
        );
        fake.fabric()
            .set_devices(&[("mlx5_0", &[a]), ("mlx5_1", &[b])]);
        let addr = SocketAddr::new(b, 7480);
        let book = open_book(Arc::new(fake.clone()), addr, &RdmaDevice::default()).expect("book");
        book.publish(
            1,
            2,
            TableDigest([3; 32]),
            Arc::new(vec![0u8; 2 * ROW_BYTES]),
        )
        .expect("published");
        book.listen(addr).expect("listening");
        let used = fake.fabric().devices_used();
        assert!(!used.is_empty());
        assert!(used.iter().all(|d| d == "mlx5_1"), "{used:?}");

        let named = RdmaDevice {
            device: Some("mlx5_0".into()),
            ..RdmaDevice::default()
        };
        let e = open_book(Arc::new(fake), addr, &named).expect_err("another device named");
        assert!(
            e.to_string()
                .contains("rdma://10.2.0.1:7480 is on device mlx5_1, not on mlx5_0"),
            "{e}"
        );
    }
}
