//! `engram-store`: the Engram table store that both daemons use.
//!
//! What it is: `.etab` table files (`table_file`: open, check, stream,
//! verify, write; `verify` checks one on every core), tables held resident in RAM (`resident`), reading V4.1
//! checkpoints (`checkpoint`) and packing them into tables (`pack`), the
//! synthetic table generator (`generate`), the progress reporting the
//! long-running ones share (`progress`), and how work beside serving runs
//! (`background`: low priority, in slices).
//!
//! What it is not: a server or a client. It opens files and maps memory,
//! never a socket; the wire format lives in `engram-protocol` (which this
//! crate builds on, adding the IO), the serving in `memory-donor`, the
//! fetching in `inference-node`. Both daemons depend on it and never on
//! each other.

#![warn(missing_docs)]

pub mod background;
pub mod checkpoint;
pub mod fill;
pub mod generate;
pub mod holes;
pub mod kept;
pub mod kept_checks;
pub mod numa;
pub mod pack;
pub mod pack_ngram;
pub mod progress;
pub mod resident;
pub mod resume;
pub mod rowref;
pub mod table_file;
pub mod verify;
