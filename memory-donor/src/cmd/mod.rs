//! One module per subcommand group: `serve` (the daemon), `tables` (`gen`,
//! `pack`, `verify`, `inspect`) and `ctl` (a running donor's control
//! plane).

pub mod ctl;
pub mod serve;
pub mod tables;
