//! The client's error type: the session's ([`SessionError`], from
//! engram-protocol), which carries the driver's own failures too (a failed
//! connect, a deadline). Each kind says whether another source may succeed
//! (`retry_elsewhere`), so failover is decided from types, not strings.

pub use engram_protocol::session::client::SessionError as ClientError;
