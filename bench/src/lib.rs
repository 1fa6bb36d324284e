//! `engram-bench`'s reusable parts: seed 000's timing model for one token
//! ([`model`]). The measurements themselves live in the binary.

pub mod model;
