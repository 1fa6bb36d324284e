//! What a donor serves, from its flags or from the cluster config: the
//! tables (ids, files, pinned versions), the addresses, the server's
//! limits and timeouts, and why a start fails ([`ServeError`]). Plain
//! values: loading them is `load`'s, serving them `serve`'s.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use cluster_config::{Config, Endpoint, TlsFiles, Transport};
use engram_protocol::Limits;
use thiserror::Error;

use crate::server::{self, ServerConfig};
use crate::status::DonorState;
use crate::tls::Access;
use cluster_config::MlockMode;
use engram_store::resident::{ExpectedTable, LoadError};

/// One table to serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableSpec {
    /// Id to serve it under (default: its layer).
    pub id: Option<u32>,
    /// Its file.
    pub path: PathBuf,
    /// What the config says the table is, if it says.
    pub pinned: Option<ExpectedTable>,
    /// The rows' encoding the config declares, if it does: a file of
    /// another encoding is refused before it is read.
    pub encoding: Option<engram_protocol::encoding::RowEncoding>,
    /// The table scale the config declares (an F32's bits), if it does: a
    /// file with another is refused before it is read.
    pub tensor_scale: Option<u32>,
}

impl std::str::FromStr for TableSpec {
    type Err = String;

    /// `FILE` or `ID=FILE`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once('=') {
            Some((id, path)) if !id.is_empty() && id.chars().all(|c| c.is_ascii_digit()) => {
                let id = id
                    .parse()
                    .map_err(|_| format!("table id {id:?} is not a 32-bit number"))?;
                Ok(Self {
                    id: Some(id),
                    path: path.into(),
                    pinned: None,
                    encoding: None,
                    tensor_scale: None,
                })
            }
            _ => Ok(Self {
                id: None,
                path: s.into(),
                pinned: None,
                encoding: None,
                tensor_scale: None,
            }),
        }
    }
}

/// Everything `serve` needs.
#[derive(Debug, Clone)]
pub struct ServeSpec {
    /// Data-plane behaviour.
    pub server: ServerConfig,
    /// Addresses to bind, each with its transport.
    pub listen: Vec<Endpoint>,
    /// The certificate files and access rules, when the rack has a PKI.
    pub tls: Option<(TlsFiles, Access)>,
    /// Tables to load.
    pub tables: Vec<TableSpec>,
    /// Skip recomputing digests at load.
    pub trust_digest: bool,
    /// Memory locking.
    pub mlock: MlockMode,
    /// Under systemd, keep tables in its fd store for the next start.
    pub fd_store: bool,
    /// Serve rows from the table files' pages ([`Backing::Mapped`]).
    pub map_files: bool,
    /// Bind the tables' memory to this NUMA node.
    pub numa_node: Option<u32>,
    /// How the tables lie in their memfds (planar for engines' kernels).
    pub host_layout: cluster_config::KeptLayout,
    /// Threads that read, place and hash a table at load (0: every core).
    pub load_threads: usize,
    /// Control-plane (gRPC) address to bind.
    pub control: Option<SocketAddr>,
    /// Prometheus `/metrics` address to bind.
    pub metrics: Option<SocketAddr>,
    /// Log filter from the config, if it sets one.
    pub log_level: Option<String>,
    /// Bytes the tables may take (`ram_gib - headroom_gib`), when configured.
    pub ram_budget: Option<u64>,
    /// The only directories a control-plane swap may load files from.
    pub table_dirs: Vec<PathBuf>,
    /// The RDMA device of an `rdma://` address.
    pub rdma: Option<cluster_config::RdmaDevice>,
    /// The host socket (`unix://PATH`), whose clients map the tables.
    pub host: Option<server::host::HostSpec>,
}

/// Serve flags that override the config (at start and on every reload).
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    /// `--trust-digest`: skip recomputing digests at load.
    pub trust_digest: bool,
    /// `--no-fd-store`: do not keep tables in systemd's fd store.
    pub no_fd_store: bool,
    /// `--map-files` (true) or `--copy-tables` (false); `None`: the
    /// config's choice.
    pub map_files: Option<bool>,
    /// `--load-threads`: threads that read, place and hash a table at load (0: every core).
    pub load_threads: Option<usize>,
    /// `--busy-poll-us`: how long connection threads busy-poll their socket, in microseconds.
    pub busy_poll_us: Option<u64>,
    /// `--mlock`: whether to lock table memory.
    pub mlock: Option<MlockMode>,
    /// `--max-connections`: most concurrent data-plane connections.
    pub max_connections: Option<usize>,
    /// `--max-rows`: most rows in one lookup.
    pub max_rows: Option<u32>,
    /// `--drain-timeout-ms`: how long a drain waits for clients, in milliseconds.
    pub drain_timeout_ms: Option<u64>,
    /// `--hello-timeout-ms`: how long a new connection has to send Hello, in milliseconds.
    pub hello_timeout_ms: Option<u64>,
    /// `--credential-file`: file holding the credential every Hello must carry.
    pub credential_file: Option<PathBuf>,
    /// `--control`: control-plane (gRPC) address to bind.
    pub control: Option<SocketAddr>,
    /// `--metrics`: Prometheus `/metrics` address to bind.
    pub metrics: Option<SocketAddr>,
}

impl Overrides {
    /// Apply these flags over `spec`.
    pub fn apply(&self, spec: &mut ServeSpec) -> Result<(), ServeError> {
        spec.trust_digest |= self.trust_digest;
        spec.fd_store &= !self.no_fd_store;
        if let Some(m) = self.map_files {
            spec.map_files = m;
        }
        if let Some(n) = self.load_threads {
            spec.load_threads = n.min(1024);
        }
        if let Some(m) = self.mlock {
            spec.mlock = m;
        }
        if let Some(n) = self.max_connections {
            spec.server.max_connections = n.clamp(1, 65_536);
        }
        if let Some(r) = self.max_rows {
            let r = r.clamp(48, engram_protocol::frame::MAX_ROWS_CEILING);
            spec.server.limits = Limits::for_caps(r, spec.server.limits.max_sections);
        }
        if let Some(us) = self.busy_poll_us {
            spec.server.busy_poll = Duration::from_micros(us.min(10_000));
        }
        if let Some(ms) = self.drain_timeout_ms {
            spec.server.drain_timeout = Duration::from_millis(ms);
        }
        if let Some(ms) = self.hello_timeout_ms {
            spec.server.hello_timeout = Duration::from_millis(ms.max(1));
        }
        if self.control.is_some() {
            spec.control = self.control;
        }
        if self.metrics.is_some() {
            spec.metrics = self.metrics;
        }
        if let Some(f) = &self.credential_file {
            let c = cluster_config::read_credential(f)
                .map_err(|e| ServeError::Config(e.to_string()))?;
            spec.server.credential = Some(c);
        }
        Ok(())
    }
}

/// Why the donor could not start.
#[derive(Debug, Error)]
pub enum ServeError {
    /// The config does not describe this donor.
    #[error("{0}")]
    Config(String),
    /// A table failed to load.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// Two tables would be served under one id.
    #[error("two tables are served under id {0}; give ids explicitly with --table ID=FILE")]
    DuplicateId(u32),
    /// An address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address that could not be bound.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
}

impl ServeSpec {
    /// The shared state of a donor about to load this spec's tables.
    pub fn status(&self) -> Arc<DonorState> {
        DonorState::new(
            self.server.name.clone(),
            self.server.drain_timeout,
            self.tables.iter().map(|t| (t.id, t.path.clone())),
            !self.trust_digest,
        )
    }

    /// A spec from flags alone: these tables on these addresses; swaps
    /// may load files from the directories of these tables.
    pub fn from_flags(name: &str, listen: Vec<SocketAddr>, tables: Vec<TableSpec>) -> Self {
        let mut table_dirs: Vec<PathBuf> = Vec::new();
        for t in &tables {
            let dir = match t.path.parent() {
                Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
                _ => PathBuf::from("."),
            };
            if !table_dirs.contains(&dir) {
                table_dirs.push(dir);
            }
        }
        Self {
            server: ServerConfig::new(name),
            listen: listen
                .into_iter()
                .map(|a| Endpoint::new(Transport::Tcp, a))
                .collect(),
            tls: None,
            tables,
            trust_digest: false,
            mlock: MlockMode::Try,
            fd_store: true,
            // Flags give plain TCP addresses only: nothing needs a copy.
            map_files: cluster_config::pages_by_default(false, false, false),
            numa_node: None,
            host_layout: cluster_config::KeptLayout::Packed,
            load_threads: 0,
            control: None,
            metrics: None,
            log_level: None,
            ram_budget: None,
            table_dirs,
            rdma: None,
            host: None,
        }
    }

    /// The spec of donor `name` in a cluster config.
    pub fn from_config(config: &Config, name: &str) -> Result<Self, ServeError> {
        let d = config.donor(name).ok_or_else(|| {
            let names: Vec<&str> = config.donors.iter().map(|d| d.name.as_str()).collect();
            ServeError::Config(format!(
                "{}: no donor named {name:?} (donors: {})",
                config.path.display(),
                names.join(", ")
            ))
        })?;
        let mut server = ServerConfig::new(&d.name);
        server.limits = Limits::for_rows(d.max_rows);
        server.max_connections = d.max_connections;
        server.hello_timeout = d.hello_timeout;
        server.idle_timeout = d.idle_timeout;
        server.write_timeout = d.write_timeout;
        server.drain_timeout = d.drain_timeout;
        server.busy_poll = d.busy_poll;
        server.credential = config
            .credential()
            .map_err(|e| ServeError::Config(e.to_string()))?;
        let tables = d
            .tables
            .iter()
            .filter_map(|id| config.table(*id))
            .map(|t| TableSpec {
                id: Some(t.id),
                path: t.path.clone(),
                pinned: Some(ExpectedTable {
                    digest: t.digest,
                    layer: t.layer,
                    rows: t.rows,
                }),
                encoding: Some(t.encoding),
                tensor_scale: t.tensor_scale.map(f32::to_bits),
            })
            .collect();
        Ok(Self {
            server,
            listen: d.listen.clone(),
            tls: config
                .tls_files(name)
                .map(|f| (f, Access::from_config(config, name))),
            tables,
            trust_digest: d.trust_digest,
            mlock: d.mlock,
            fd_store: d.fd_store,
            map_files: d.map_files,
            numa_node: d.numa_node,
            host_layout: d.host_layout,
            load_threads: d.load_threads,
            control: d.control,
            metrics: d.metrics,
            log_level: d.log_level.clone(),
            ram_budget: Some(d.table_budget_bytes()),
            table_dirs: d.table_dirs.clone(),
            rdma: d.rdma.clone(),
            host: d.host_socket.clone().map(|path| server::host::HostSpec {
                path,
                access: server::host::HostAccess {
                    uids: d.host_uids.clone(),
                    gids: d.host_gids.clone(),
                },
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_specs_parse_with_and_without_ids() {
        assert_eq!(
            "7=/x/a.etab".parse::<TableSpec>(),
            Ok(TableSpec {
                id: Some(7),
                path: "/x/a.etab".into(),
                pinned: None,
                encoding: None,
                tensor_scale: None,
            })
        );
        assert_eq!("a=b.etab".parse::<TableSpec>().map(|t| t.id), Ok(None));
        assert_eq!("/x/a.etab".parse::<TableSpec>().map(|t| t.id), Ok(None));
        assert!("99999999999=a".parse::<TableSpec>().is_err());
    }

    #[test]
    fn from_flags_swaps_may_load_from_the_directories_of_the_tables() {
        let tables = ["1=/a/x.etab", "/a/y.etab", "/b/z.etab", "w.etab"]
            .iter()
            .map(|t| t.parse().expect("table"))
            .collect();
        let s = ServeSpec::from_flags("d", vec![], tables);
        let want: Vec<PathBuf> = ["/a", "/b", "."].iter().map(PathBuf::from).collect();
        assert_eq!(s.table_dirs, want);
    }
}
