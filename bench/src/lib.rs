//! `engram-bench`'s reusable parts: seed 000's timing model for one token
//! ([`model`]) and the charts reports are drawn with ([`plot`]). The
//! measurements themselves live in the binary.

pub mod locality;
pub mod model;
pub mod plot;
