//! Row sources: everything that can answer "these rows of this table" for
//! the router, behind one trait. `LocalRam` (the table resident in the
//! node's own RAM), `Donor` (a memory donor over the data plane, or over
//! RDMA: `rdma`) and `Ssd`
//! (the node's `.etab` copy, read with io_uring or a pread pool). Tests add
//! their own (a fake transport with fault injection).
//!
//! A source fills the caller's buffer with exactly the rows asked for, or
//! fails with a [`SourceError`] that says whether another source may do
//! better and whether the failure counts against the source's breaker.

mod donor;
mod host;
mod local;
pub mod rdma;
pub mod ssd;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use engram_protocol::TableDigest;
use engram_store::resident::{ResidentTable, RowLayout, RowRef};
use thiserror::Error;
use tokio::time::Instant;

pub use donor::{ControlTls, DonorSource};
pub use host::{HostCounters, HostSource};
pub use local::LocalRam;
pub use ssd::SsdSource;

use crate::client::ClientError;

/// How often each source is tended ([`RowSource::tend`]): a donor that
/// drains while the node routes nothing to it (its breaker open, or a
/// replica that is not asked) sees the node close its connection within
/// this, instead of waiting out its drain timeout.
pub const TEND_INTERVAL: std::time::Duration = std::time::Duration::from_millis(10);

/// What kind of place rows come from (a metrics label and a log field).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SourceKind {
    /// The node's own RAM.
    Local,
    /// A memory donor.
    Donor,
    /// The node's SSD copy.
    Ssd,
}

impl fmt::Display for SourceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Local => "local",
            Self::Donor => "donor",
            Self::Ssd => "ssd",
        })
    }
}

/// Why a source did not deliver.
#[derive(Debug, Clone, Error)]
pub enum SourceError {
    /// No answer by the deadline.
    #[error("no answer by the deadline")]
    Timeout,
    /// The source cannot be reached (connect refused, connection lost).
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// The source serves another version of the table.
    #[error("table {table}: {detail}")]
    VersionMismatch {
        /// The table id.
        table: u32,
        /// How the source's version differs from the pinned one.
        detail: String,
    },
    /// The answer failed its checks (checksum, row encoding): discarded.
    #[error("corrupt answer: {0}")]
    Corrupt(String),
    /// The source is draining (Goodbye) and takes no new lookups.
    #[error("draining")]
    Draining,
    /// The source answered with an error that another source may not have.
    #[error("{0}")]
    Failed(String),
    /// The request itself is wrong (row out of range, too many rows): no
    /// source will do better.
    #[error("bad request: {0}")]
    BadRequest(String),
}

impl SourceError {
    /// True when another source may well succeed.
    pub fn retry_elsewhere(&self) -> bool {
        !matches!(self, Self::BadRequest(_))
    }
}

impl From<ClientError> for SourceError {
    fn from(e: ClientError) -> Self {
        match e {
            ClientError::Timeout(_) => Self::Timeout,
            ClientError::Connect { .. } | ClientError::Disconnected(_) => {
                Self::Unavailable(e.to_string())
            }
            ClientError::DigestMismatch {
                table,
                pinned,
                advertised,
                ..
            } => Self::VersionMismatch {
                table,
                detail: format!("serves digest {advertised}, not the pinned {pinned}"),
            },
            ClientError::Section {
                table,
                code: engram_protocol::ErrorCode::VersionMismatch,
            } => Self::VersionMismatch {
                table,
                detail: "the donor's table changed version".into(),
            },
            ClientError::Corrupt(m) => Self::Corrupt(m),
            ClientError::Draining => Self::Draining,
            ClientError::NotPinned(_) | ClientError::BadRequest(_) => {
                Self::BadRequest(e.to_string())
            }
            ref other if !other.retry_elsewhere() => Self::BadRequest(e.to_string()),
            ClientError::Refused {
                code: engram_protocol::ErrorCode::Draining,
                ..
            } => Self::Draining,
            _ => Self::Failed(e.to_string()),
        }
    }
}

/// A boxed fetch in progress (sources are used as trait objects): how it
/// went, and the buffer it was given (filled when it went well), back for
/// the caller to reuse.
pub type FetchFuture<'a> =
    Pin<Box<dyn Future<Output = (Result<(), SourceError>, Vec<u8>)> + Send + 'a>>;

/// A fetch the router hands a source, owning what it needs so that its
/// future can outlive the lookup's borrows and live in a [`FetchSlot`]
/// reused from lookup to lookup: the row list and the buffer are the
/// router's, and come back with the outcome ([`FetchDone`]).
#[derive(Debug)]
pub struct FetchJob {
    /// The table.
    pub table: u32,
    /// The rows, in order.
    pub rows: Vec<u64>,
    /// Filled with the rows (`rows.len()` times the table's row size) when the fetch goes
    /// well; empty when the source could not keep it.
    pub buf: Vec<u8>,
    /// Fail by then.
    pub deadline: Instant,
}

/// How a [`FetchJob`] went, and the job back for its buffers.
pub type FetchDone = (Result<(), SourceError>, FetchJob);

/// A boxed fetch in progress that keeps its allocation from one fetch to
/// the next when the next future has the same layout (the same source
/// kind): the router keeps a few and puts each fetch in one, so a lookup
/// in the steady state allocates nothing for its future.
pub type FetchSlot = tokio_util::sync::ReusableBoxFuture<'static, FetchDone>;

/// An empty slot: holds a future that never ends and takes no memory.
pub fn empty_slot() -> FetchSlot {
    FetchSlot::new(std::future::pending())
}

/// Drop whatever `slot` holds (a fetch nobody waits for any more: a lost
/// hedge), so that what it holds (a request's place on a connection, a
/// job) is let go now; frees the slot's memory.
pub fn clear_slot(slot: &mut FetchSlot) {
    slot.set(std::future::pending());
}

/// What a health probe found: the digest of each table the source serves.
pub type ProbeFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Vec<(u32, TableDigest)>, SourceError>> + Send + 'a>>;

/// A source that copies rows out of memory it holds (the node's own RAM,
/// a donor's mapped memory): no await point, so its fetch runs inline.
pub(crate) trait Gather: Send + Sync + 'static {
    /// Copy `rows` of `table` into `out` (each at the table's row size).
    fn gather(&self, table: u32, rows: &[u64], out: &mut [u8]) -> Result<(), SourceError>;
}

/// [`RowSource::fetch`] of a [`Gather`] source.
pub(crate) fn gather_fetch<'a, G: Gather>(
    src: &'a G,
    table: u32,
    rows: &'a [u64],
    mut buf: Vec<u8>,
) -> FetchFuture<'a> {
    Box::pin(async move {
        let res = src.gather(table, rows, &mut buf);
        (res, buf)
    })
}

/// Copy `rows` of `t` into `out` (`rows.len()` times the table's row
/// size, checked):
/// every row's cache lines asked for first, then the copies, so their
/// memory latencies overlap.
pub(crate) fn gather_rows(
    t: &ResidentTable,
    rows: &[u64],
    out: &mut [u8],
) -> Result<(), SourceError> {
    let size = t.row_bytes();
    if out.len() != rows.len() * size {
        return Err(SourceError::BadRequest("output buffer size".into()));
    }
    for &r in rows {
        t.prefetch(r);
    }
    for (&r, dst) in rows.iter().zip(out.chunks_exact_mut(size)) {
        let row = t.row(r).ok_or_else(|| {
            SourceError::BadRequest(format!("row {r} is out of range ({} rows)", t.rows))
        })?;
        row.write_to(dst);
    }
    Ok(())
}

/// [`RowSource::fetch_job`] of a [`Gather`] source: gathered now, the
/// future only hands the outcome over.
pub(crate) fn gather_job<G: Gather>(src: &G, mut job: FetchJob, slot: &mut FetchSlot) {
    let res = src.gather(job.table, &job.rows, &mut job.buf);
    slot.set(std::future::ready((res, job)));
}

/// A place rows can come from.
pub trait RowSource: Send + Sync + fmt::Debug + 'static {
    /// Its name in logs and metrics (a donor's name, `ssd`, `local`).
    fn name(&self) -> &str;

    /// What kind of source it is.
    fn kind(&self) -> SourceKind;

    /// False while it takes no new lookups (a donor that said Goodbye).
    fn accepting(&self) -> bool {
        true
    }

    /// Take in what the source sent unasked while nothing was routed to it
    /// (a donor's Goodbye or close) and close what it has finished with,
    /// whatever its breaker says. Called every [`TEND_INTERVAL`]; cheap when
    /// there is nothing to read.
    fn tend(&self) {}

    /// Wake the path to this source ahead of a lookup expected soon (a
    /// donor: a Ping on its connection, so that its connection thread is
    /// running, and busy-polling where it does, when the lookup comes).
    /// Never blocks; called on the node's runtime. Default: nothing.
    fn warm(&self) {}

    /// Fill `buf` (`rows.len()` times the table's row size) with the rows of `table`, in
    /// order, or fail by `deadline`; the buffer comes back either way
    /// (empty if the source could not keep it), so the caller's buffers
    /// are reused from lookup to lookup.
    fn fetch<'a>(
        &'a self,
        table: u32,
        rows: &'a [u64],
        buf: Vec<u8>,
        deadline: Instant,
    ) -> FetchFuture<'a>;

    /// [`Self::fetch`] as the router runs it: `job` owned, its future put
    /// in `slot` (its memory reused when it fits). The default boxes a
    /// [`Self::fetch`] inside (one allocation a fetch); the node's own
    /// sources put their fetch in the slot directly.
    fn fetch_job(self: Arc<Self>, job: FetchJob, slot: &mut FetchSlot) {
        slot.set(async move {
            let FetchJob {
                table,
                rows,
                buf,
                deadline,
            } = job;
            let (res, buf) = self.fetch(table, &rows, buf, deadline).await;
            (
                res,
                FetchJob {
                    table,
                    rows,
                    buf,
                    deadline,
                },
            )
        });
    }

    /// Check health and versions out of band, for re-admission after
    /// failures: the tables it serves now, with their digests.
    fn probe(&self) -> ProbeFuture<'_>;

    /// Table `table`'s memory, for a source that holds it in this process's
    /// address space at its pinned version (a host-local donor's mapping,
    /// the node's `local` copy); `None` for any other.
    fn view(&self, table: u32) -> Option<TableView> {
        let _ = table;
        None
    }

    /// Whether [`Self::view`] may give a view of `table`, now or once a
    /// host socket hands it over (a host-local donor, the node's own
    /// copy); false lets a caller that would wait for one not wait.
    fn may_view(&self, table: u32) -> bool {
        let _ = table;
        false
    }
}

/// A table's memory as this process maps it, held open (and unchanged)
/// while the view lives: what an engine that gathers rows itself reads.
///
/// The layout is [`TableView::layout`]'s: rows back to back (row `r` at
/// `r * 264`) for a table in a memfd or in RAM; planar (row `r`'s 256
/// values at `r * 256`, its 8 scale bytes at `scales_at + r * 8`) for a
/// host-local donor's table laid out for engines' host-table kernels; or
/// the table file's pages, 15 rows to a 4 KiB page with 136 bytes of slack
/// at each page's end (row `r` at `(r / 15) * 4096 + (r % 15) * 264`), for
/// a `local` copy served from its file's pages. [`TableView::offsets`]
/// says where any row's values and scales start.
#[derive(Debug, Clone)]
pub struct TableView {
    table: Arc<ResidentTable>,
    generation: Option<u64>,
    shared: bool,
}

impl TableView {
    /// A view of `table`; `shared` when other processes map the same
    /// memory (a host socket's), with the donor's generation.
    pub(crate) fn new(table: Arc<ResidentTable>, generation: Option<u64>, shared: bool) -> Self {
        Self {
            table,
            generation,
            shared,
        }
    }

    /// The mapped bytes (read-only memory: a write faults).
    pub fn bytes(&self) -> &[u8] {
        self.table.memory_bytes()
    }

    /// Its table id.
    pub fn table(&self) -> u32 {
        self.table.id
    }

    /// Its model layer.
    pub fn layer(&self) -> u32 {
        self.table.layer
    }

    /// Its version.
    pub fn digest(&self) -> TableDigest {
        self.table.digest
    }

    /// Its rows.
    pub fn rows(&self) -> u64 {
        self.table.rows
    }

    /// The donor's generation of this memory, for a host socket's.
    pub fn generation(&self) -> Option<u64> {
        self.generation
    }

    /// Whether the memory is a host-local donor's, mapped by every process
    /// on this host that reads it (one physical copy); false for this
    /// process's own copy.
    pub fn shared(&self) -> bool {
        self.shared
    }

    /// True when rows are back to back (V4.1's, or an encoded table's at
    /// its own row size); false for a file's pages or planar.
    pub fn packed(&self) -> bool {
        matches!(self.layout(), RowLayout::Packed | RowLayout::Encoded { .. })
    }

    /// How the rows lie in [`Self::bytes`].
    pub fn layout(&self) -> RowLayout {
        self.table.memory().layout()
    }

    /// Bytes per row (264 but for an encoded table's).
    pub fn row_bytes(&self) -> usize {
        self.layout().row_bytes()
    }

    /// How its rows are encoded.
    pub fn encoding(&self) -> engram_protocol::encoding::RowEncoding {
        self.table.encoding
    }

    /// Its F32 scale, for an encoding with one.
    pub fn tensor_scale(&self) -> Option<f32> {
        self.table.tensor_scale.map(f32::from_bits)
    }

    /// Where row `row` starts in [`Self::bytes`] when its 264 bytes are
    /// contiguous (packed or paged), or `None` past the end or for a
    /// planar table ([`Self::offsets`]).
    pub fn offset(&self, row: u64) -> Option<usize> {
        let layout = self.layout();
        (layout.whole_rows() && row < self.table.rows).then(|| layout.offsets(row).0)
    }

    /// Where row `row`'s values and its scale bytes start in
    /// [`Self::bytes`], in any layout; `None` past the end.
    pub fn offsets(&self, row: u64) -> Option<(usize, usize)> {
        (row < self.table.rows).then(|| self.layout().offsets(row))
    }

    /// The memfd the memory lives in (a host-local donor's, or a copy kept
    /// in one), to hand to another process on this host.
    pub fn file(&self) -> Option<&std::fs::File> {
        self.table.kept().map(|k| &k.file)
    }

    /// Row `row` as it lies in memory, or `None` past the end.
    pub fn row(&self, row: u64) -> Option<RowRef<'_>> {
        self.table.row(row)
    }
}
