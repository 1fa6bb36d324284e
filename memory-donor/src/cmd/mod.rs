//! One module per subcommand group: `serve` (the daemon) and `tables`
//! (`gen`, `pack`, `verify`, `inspect`). A running donor is operated with
//! `engram-cluster status|drain|swap`.

pub mod serve;
pub mod tables;
