//! `engram-protocol`: the engram-rack contract.
//!
//! What it is: the 264-byte row encoding and its dequantization (`row`), the
//! row encodings of every model's table (`encoding`), the
//! deterministic synthetic rows every test can check against (`synthetic`),
//! the table version (`digest`), the `.etab` table file layout (`etab`),
//! Engram row addressing from compressed token ids (`hashing`), Qwen4Exp's
//! n-gram table addressing from raw token ids (`qwen4exp`), and the
//! data-plane frame codec (`frame` for framing, `messages` for payloads),
//! and the data plane's client and server sessions as state machines
//! (`session`).
//!
//! What it is not: it does no IO, owns no sockets, runs no async runtime and
//! reads no clock. Bytes come in, typed values go out, and back; the daemons
//! do the IO. `PROTOCOL.md` at the repository root documents every byte.
//!
//! With the `control` feature, `control` holds the generated gRPC types and
//! stubs of the donor's control plane (the IO lives in tonic, not here).

#![warn(missing_docs)]

#[cfg(feature = "control")]
pub mod control;
pub mod decode;
pub mod digest;
pub mod encoding;
pub mod etab;
pub mod frame;
pub mod hashing;
pub mod messages;
pub mod model_config;
#[cfg(feature = "control")]
pub mod node_api;
pub mod qwen4exp;
pub mod ring;
pub mod row;
pub mod session;
pub mod synthetic;

pub use decode::{Decoded, Frame, decode};
pub use digest::{DigestBuilder, TableDigest};
pub use frame::{
    ErrorCode, FrameError, FrameHeader, FrameKind, HEADER_LEN, Limits, PROTOCOL_VERSION,
    PROTOCOL_VERSION_V1,
};
pub use messages::{
    EncodeError, ErrorFrame, Goodbye, Hello, LookupRef, LookupSection, Region, RegionQuery,
    RowsRef, RowsSection, TableInfo, Welcome, WelcomeRef,
};
pub use row::{ROW_BYTES, ROW_VALUES, RowBytes, RowError};
