//! What the serving loop (`supervise`) is asked to do, and the answers:
//! an [`Order`] (a reload on SIGHUP, a table swap from the control plane),
//! a swap's request, its acceptance and why one is refused. Plain types:
//! the mailbox is in `status`, the work in `reload` and `swap`.

use std::path::PathBuf;

use engram_protocol::TableDigest;
use thiserror::Error;
use tokio::sync::oneshot;

/// Something the serving loop is asked to do.
#[derive(Debug)]
pub enum Order {
    /// Re-read the config file (SIGHUP).
    Reload,
    /// Load another version of a table and switch to it (the control plane).
    Swap(SwapRequest, Reply),
}

/// A request to serve another version of a table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SwapRequest {
    /// The table's data-plane id.
    pub table: u32,
    /// The new version's file.
    pub path: PathBuf,
    /// The digest the file must have, if known.
    pub expected: Option<TableDigest>,
    /// Unload the old version first (a short outage of this table).
    pub in_place: bool,
}

/// A swap that passed its checks and is being loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SwapAccepted {
    /// The version served until the switch.
    pub old: TableDigest,
    /// The version being loaded.
    pub new: TableDigest,
    /// Row bytes of the new version.
    pub bytes: u64,
    /// True when the old version is unloaded first.
    pub in_place: bool,
}

/// Where the answer to a swap order goes.
pub type Reply = oneshot::Sender<Result<SwapAccepted, SwapError>>;

/// Why a swap was refused or failed.
#[derive(Debug, Error)]
pub enum SwapError {
    /// Tables are still loading, or the donor drains.
    #[error("the donor is not serving (loading or draining)")]
    NotServing,
    /// Another swap is being loaded.
    #[error("another swap is under way; try again when it is done")]
    Busy,
    /// The donor does not serve that table.
    #[error("table {0} is not served by this donor")]
    UnknownTable(u32),
    /// The file cannot be used.
    #[error("{0}")]
    BadFile(String),
    /// The file is not one this donor may load on request (outside its
    /// table directories).
    #[error("{0}")]
    NotAllowed(String),
    /// The file is not the expected version.
    #[error("{path}: digest is {actual}, not the expected {expected}")]
    WrongVersion {
        /// The new table file, as shown to people.
        path: String,
        /// The digest the request expected.
        expected: TableDigest,
        /// The digest the file's header gives.
        actual: TableDigest,
    },
    /// The file is the version already served.
    #[error("table {table} is already at digest {digest}")]
    AlreadyServed {
        /// The table id.
        table: u32,
        /// The version served now, which the file also holds.
        digest: TableDigest,
    },
    /// Not enough RAM.
    #[error("{0}")]
    NoRoom(String),
    /// Loading the new version failed.
    #[error("loading the new version failed: {0}")]
    Load(String),
}
