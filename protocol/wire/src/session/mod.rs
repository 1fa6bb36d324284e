//! The data plane's two sessions as state machines, with no IO and no
//! clock: [`server::ServerSession`] is what every donor connection runs,
//! [`client::ClientSession`] what the node's donor client runs. Bytes and
//! frames go in, answers and decisions come out; the daemons' drivers do
//! the reading, writing, waiting and timing. Because neither touches a
//! socket, the two are tested against each other here, byte for byte, and
//! fuzzed (`protocol/wire/fuzz`) on arbitrary input and event orders.

pub mod client;
mod readbuf;
pub mod server;
#[cfg(test)]
mod tests;
pub mod toy;

pub use readbuf::{INITIAL_BUF, ReadBuf};
