//! The table resident in the node's own RAM, loaded (and its digest
//! verified) with the memory donor's loader: the same code path that a donor
//! trusts, so a node with RAM to spare serves itself exactly as a donor would.

use std::path::Path;
use std::sync::Arc;

use engram_store::resident::{ExpectedTable, LoadError, MlockMode, ResidentTable};
use tokio::time::Instant;

use super::{
    FetchFuture, FetchJob, FetchSlot, ProbeFuture, RowSource, SourceError, SourceKind, TableView,
};

/// A table in local RAM.
#[derive(Debug)]
pub struct LocalRam {
    table: Arc<ResidentTable>,
}

impl LocalRam {
    /// Load `path` as table `id`; it must be what `pin` says (digest
    /// recomputed unless `trust_digest`).
    pub fn load(
        id: u32,
        path: &Path,
        pin: ExpectedTable,
        trust_digest: bool,
    ) -> Result<Self, LoadError> {
        let (table, _) =
            ResidentTable::load(id, path, Some(pin), trust_digest, MlockMode::Try, |_| None)?;
        Ok(Self {
            table: Arc::new(table),
        })
    }

    /// How its rows are encoded.
    pub fn encoding(&self) -> engram_protocol::encoding::RowEncoding {
        self.table.encoding
    }

    /// Copy rows out; no await point, so it is also the synchronous API.
    pub fn read(&self, table: u32, rows: &[u64], out: &mut [u8]) -> Result<(), SourceError> {
        let t = &self.table;
        if table != t.id {
            return Err(SourceError::BadRequest(format!(
                "this copy holds table {}, not {table}",
                t.id
            )));
        }
        super::gather_rows(t, rows, out)
    }
}

impl super::Gather for LocalRam {
    fn gather(&self, table: u32, rows: &[u64], out: &mut [u8]) -> Result<(), SourceError> {
        self.read(table, rows, out)
    }
}

impl RowSource for LocalRam {
    fn name(&self) -> &str {
        "local"
    }

    fn kind(&self) -> SourceKind {
        SourceKind::Local
    }

    fn fetch<'a>(
        &'a self,
        table: u32,
        rows: &'a [u64],
        buf: Vec<u8>,
        _deadline: Instant,
    ) -> FetchFuture<'a> {
        super::gather_fetch(self, table, rows, buf)
    }

    fn fetch_job(self: Arc<Self>, job: FetchJob, slot: &mut FetchSlot) {
        super::gather_job(&*self, job, slot);
    }

    fn probe(&self) -> ProbeFuture<'_> {
        Box::pin(async move { Ok(vec![(self.table.id, self.table.digest)]) })
    }

    fn view(&self, table: u32) -> Option<TableView> {
        (table == self.table.id).then(|| TableView::new(Arc::clone(&self.table), None, false))
    }

    fn may_view(&self, table: u32) -> bool {
        table == self.table.id
    }
}
