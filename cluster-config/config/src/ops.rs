//! `engram-cluster status|drain|swap`: the rack's one operator client. It
//! operates donors through their control planes, named as in the rack
//! config (`--config`), or, without a config, by their control addresses
//! (HOST:PORT, dialled in plaintext). With `[rack.tls]` each donor is
//! dialled over TLS as an operator (`--as`, by default the only one in
//! `[rack.tls] operators`): the rack CA as the only root, the operator's
//! certificate and key from the PKI directory, the donor's certificate
//! checked against its name. Without it the control plane is plaintext and
//! answers Drain and SwapTable only from the donor's own host, so these
//! commands work there alone (dialling loopback).

use std::fmt::Write as _;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use cluster_config::tls::Material;
use cluster_config::{Config, ConfigError};
use engram_protocol::TableDigest;
use engram_protocol::control::donor_control_client::DonorControlClient;
use engram_protocol::control::{
    DrainRequest, ListTablesRequest, ListTablesResponse, StatsRequest, StatsResponse,
    SwapTableRequest,
};
use thiserror::Error;
use tonic::Code;
use tonic::transport::{Channel, Endpoint};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// Time to connect (and finish the TLS handshake) to one donor.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Time for one call.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the rack is described and whom to act as.
#[derive(Debug, Clone, clap::Args)]
pub struct Dial {
    /// The rack config (TOML): donors are named as in it. Without it each
    /// donor is given by its control address (HOST:PORT), dialled in plaintext.
    #[arg(long)]
    config: Option<PathBuf>,
    /// The operator to act as: its certificate and key in the rack's PKI
    /// (default: the only name in [rack.tls] operators).
    #[arg(long = "as", value_name = "OPERATOR", requires = "config")]
    operator: Option<String>,
}

/// The operator commands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum OpsCmd {
    /// Health, tables and counters of each donor (every donor with a
    /// control address, or those named); exit code 1 unless all are SERVING.
    Status {
        #[command(flatten)]
        dial: Dial,
        /// Donors to ask: names in --config (default: all), or control
        /// addresses without it.
        donors: Vec<String>,
        /// Also print each donor's tables (file, progress, error) and all
        /// its counters (service-time percentiles, errors by kind).
        #[arg(long)]
        detail: bool,
    },
    /// Start a donor's drain, as SIGTERM does: clients get Goodbye, then it exits.
    Drain {
        #[command(flatten)]
        dial: Dial,
        /// The donor: its name in --config, or its control address without it.
        donor: String,
    },
    /// Load another version of a table on a donor and switch to it (watch `status`).
    Swap {
        #[command(flatten)]
        dial: Dial,
        /// The donor: its name in --config, or its control address without it.
        donor: String,
        /// The table's id.
        #[arg(long)]
        table: u32,
        /// The new version's file as the donor sees it (under its table directory).
        #[arg(long)]
        file: String,
        /// The digest the file must have (64 hex digits; `memory-donor inspect` prints it).
        #[arg(long)]
        digest: String,
        /// Unload the old version first (the table is not served meanwhile).
        #[arg(long)]
        in_place: bool,
    },
}

/// Why an operator command failed.
#[derive(Debug, Error)]
pub enum OpsError {
    /// The config is invalid or unreadable.
    #[error("{0}")]
    Config(#[from] ConfigError),
    /// The command names something the config does not have, or cannot be run as asked.
    #[error("{0}")]
    Usage(String),
    /// The operator's certificate or key cannot be used.
    #[error("{0}")]
    Tls(String),
    /// The donor's control plane could not be reached.
    #[error("{donor}: cannot reach its control plane at {addr}: {message}")]
    Connect {
        donor: String,
        addr: SocketAddr,
        message: String,
    },
    /// The donor refused the call.
    #[error("{donor} refused: {message}")]
    Refused { donor: String, message: String },
    /// The call failed for another reason.
    #[error("{donor}: {rpc} failed: {code}: {message}")]
    Failed {
        donor: String,
        rpc: &'static str,
        code: String,
        message: String,
    },
}

impl OpsError {
    fn exit_code(&self) -> ExitCode {
        match self {
            Self::Config(_) | Self::Usage(_) | Self::Tls(_) => ExitCode::from(2),
            _ => ExitCode::from(1),
        }
    }
}

/// An error and every error under it, on one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut next = e.source();
    while let Some(e) = next {
        let more = e.to_string();
        if !s.contains(&more) {
            let _ = write!(s, ": {more}");
        }
        next = e.source();
    }
    s
}

/// What a failed call says, by its code.
fn call_error(donor: &str, rpc: &'static str, s: &tonic::Status) -> OpsError {
    let message = if s.message().is_empty() {
        chain(s)
    } else {
        s.message().to_string()
    };
    match s.code() {
        Code::PermissionDenied | Code::Unauthenticated => OpsError::Refused {
            donor: donor.to_string(),
            message,
        },
        code => OpsError::Failed {
            donor: donor.to_string(),
            rpc,
            code: format!("{code:?}"),
            message,
        },
    }
}

/// The identity to act as: `asked`, or the only operator; none without a PKI.
pub fn operator(config: &Config, asked: Option<&str>) -> Result<Option<String>, OpsError> {
    let Some(tls) = &config.tls else {
        return Ok(None);
    };
    if let Some(a) = asked {
        return Ok(Some(a.to_string()));
    }
    match tls.operators.as_slice() {
        [one] => Ok(Some(one.clone())),
        [] => Err(OpsError::Usage(format!(
            "{}: [rack.tls] names no operators: add one to `operators` and give it a \
             certificate from the rack CA, then pass --as NAME",
            config.path.display()
        ))),
        many => Err(OpsError::Usage(format!(
            "{}: several operators ({}): choose one with --as",
            config.path.display(),
            many.join(", ")
        ))),
    }
}

/// A donor to dial: its name (or its address, without a config) and its
/// control address.
#[derive(Debug, Clone)]
struct Target {
    name: String,
    addr: SocketAddr,
}

/// Dials donors' control planes as one operator (or in plaintext).
#[derive(Debug)]
struct Dialer {
    /// The rack config; without one, donors are named by their addresses.
    config: Option<Config>,
    material: Option<Material>,
}

impl Dialer {
    fn new(dial: &Dial) -> Result<Self, OpsError> {
        let Some(path) = &dial.config else {
            return Ok(Self {
                config: None,
                material: None,
            });
        };
        let config = Config::load(path)?;
        let material = match operator(&config, dial.operator.as_deref())? {
            None => {
                if dial.operator.is_some() {
                    eprintln!(
                        "note: {} has no [rack.tls]: --as is ignored and control planes are \
                         dialled in plaintext (Drain and SwapTable work only on the donor's own host)",
                        config.path.display()
                    );
                }
                None
            }
            Some(name) => {
                let files = config.tls_files(&name).ok_or_else(|| {
                    OpsError::Usage(format!("{name}: the rack has no PKI ([rack.tls])"))
                })?;
                let m = Material::load(&files).map_err(|e| {
                    OpsError::Tls(format!("the certificate of operator {name}: {e}"))
                })?;
                Some(m)
            }
        };
        Ok(Self {
            config: Some(config),
            material,
        })
    }

    /// The donor `arg` names: one of the config's, or an address.
    fn target(&self, arg: &str) -> Result<Target, OpsError> {
        let Some(config) = &self.config else {
            return address(arg).map(|addr| Target {
                name: arg.to_string(),
                addr,
            });
        };
        let donor = config.donor(arg).ok_or_else(|| {
            let names: Vec<&str> = config.donors.iter().map(|d| d.name.as_str()).collect();
            OpsError::Usage(format!(
                "{}: no donor named {arg:?} (donors: {})",
                config.path.display(),
                names.join(", ")
            ))
        })?;
        let addr = donor.control_endpoint().ok_or_else(|| {
            OpsError::Usage(format!(
                "{}: no control plane (set `control` in its [[donor]] entry)",
                donor.name
            ))
        })?;
        Ok(Target {
            name: donor.name.clone(),
            addr,
        })
    }

    /// Every donor `status` asks when none is named.
    fn all(&self) -> Result<Vec<String>, OpsError> {
        let Some(config) = &self.config else {
            return Err(OpsError::Usage(
                "name the donors to ask: their control addresses (HOST:PORT), or their \
                 names with --config FILE"
                    .into(),
            ));
        };
        let all: Vec<String> = config
            .donors
            .iter()
            .filter(|d| d.control_endpoint().is_some())
            .map(|d| d.name.clone())
            .collect();
        if all.is_empty() {
            return Err(OpsError::Usage(format!(
                "{}: no donor has a control plane (`control` in its [[donor]] entry)",
                config.path.display()
            )));
        }
        Ok(all)
    }

    async fn channel(&self, target: &Target) -> Result<Channel, OpsError> {
        let connect = |message: String| OpsError::Connect {
            donor: target.name.clone(),
            addr: target.addr,
            message,
        };
        let scheme = if self.material.is_some() {
            "https"
        } else {
            "http"
        };
        let mut ep = Endpoint::from_shared(format!("{scheme}://{}", target.addr))
            .map_err(|e| connect(chain(&e)))?
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(CALL_TIMEOUT);
        if let Some(m) = &self.material {
            ep = ep
                .tls_config(m.grpc_client(&target.name))
                .map_err(|e| connect(chain(&e)))?;
        }
        ep.connect().await.map_err(|e| connect(chain(&e)))
    }
}

/// A control address given on the command line (HOST:PORT).
fn address(arg: &str) -> Result<SocketAddr, OpsError> {
    let usage = |why: String| {
        OpsError::Usage(format!(
            "{arg:?} is not a control address (HOST:PORT): {why}; to name donors, pass --config FILE"
        ))
    };
    arg.to_socket_addrs()
        .map_err(|e| usage(e.to_string()))?
        .next()
        .ok_or_else(|| usage("it resolves to no address".into()))
}

/// One donor's answers to `status`.
#[derive(Debug, Clone, PartialEq)]
pub struct DonorReport {
    /// Its name.
    pub donor: String,
    /// Its control address.
    pub addr: SocketAddr,
    /// `SERVING`, `NOT_SERVING`, ...
    pub health: String,
    /// Its tables and draining flag.
    pub tables: ListTablesResponse,
    /// Its counters.
    pub stats: StatsResponse,
}

impl DonorReport {
    fn serving(&self) -> bool {
        self.health == "SERVING"
    }
}

async fn donor_report(dialer: &Dialer, target: &Target) -> Result<DonorReport, OpsError> {
    let name = target.name.as_str();
    let ch = dialer.channel(target).await?;
    let health = HealthClient::new(ch.clone())
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .map_err(|s| call_error(name, "health", &s))?
        .into_inner();
    let health = ServingStatus::try_from(health.status)
        .map_or("UNKNOWN", |s| s.as_str_name())
        .to_string();
    let mut c = DonorControlClient::new(ch);
    let tables = c
        .list_tables(ListTablesRequest {})
        .await
        .map_err(|s| call_error(name, "ListTables", &s))?
        .into_inner();
    let stats = c
        .stats(StatsRequest {})
        .await
        .map_err(|s| call_error(name, "Stats", &s))?
        .into_inner();
    Ok(DonorReport {
        donor: name.to_string(),
        addr: target.addr,
        health,
        tables,
        stats,
    })
}

fn uptime(s: f64) -> String {
    let s = s.max(0.0) as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    }
}

/// The `status` table: one line per donor (an error in place of a failed one).
pub fn render(states: &[(String, Result<DonorReport, String>)]) -> String {
    let head = [
        "DONOR", "CONTROL", "HEALTH", "TABLES", "LOOKUPS", "P99_US", "CONNS", "UPTIME",
    ];
    let mut rows: Vec<Vec<String>> = vec![head.iter().map(ToString::to_string).collect()];
    let mut failed = Vec::new();
    for (name, s) in states {
        let s = match s {
            Ok(s) => s,
            Err(e) => {
                failed.push(format!("{name}: {e}"));
                continue;
            }
        };
        let tables: Vec<String> = s
            .tables
            .tables
            .iter()
            .map(|t| {
                let digest: String = t.digest.chars().take(12).collect();
                format!(
                    "{}:{}:{}",
                    t.id,
                    t.state().label(),
                    if digest.is_empty() { "-" } else { &digest }
                )
            })
            .collect();
        let health = if s.tables.draining {
            format!("{} (draining)", s.health)
        } else {
            s.health.clone()
        };
        rows.push(vec![
            s.donor.clone(),
            s.addr.to_string(),
            health,
            tables.join(" "),
            s.stats.lookups.to_string(),
            s.stats
                .service_time
                .map_or("-".into(), |t| format!("{:.1}", t.p99_us)),
            s.stats
                .connections
                .map_or("-".into(), |c| c.open.to_string()),
            uptime(s.stats.uptime_seconds),
        ]);
    }
    let mut widths = vec![0; head.len()];
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    for r in &rows {
        let mut line = String::new();
        for (c, w) in r.iter().zip(&widths) {
            let _ = write!(line, "{c:<w$}  ");
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    for f in failed {
        out.push_str(&f);
        out.push('\n');
    }
    out
}

/// One donor in full: each table with its file, progress and error, then
/// every counter (`status --detail`).
pub fn render_detail(s: &DonorReport) -> String {
    let mut out = format!("{} ({}): {}", s.donor, s.addr, s.health);
    if s.tables.draining {
        out.push_str(" (draining)");
    }
    out.push('\n');
    for t in &s.tables.tables {
        let pct = if t.bytes_total == 0 {
            0.0
        } else {
            t.bytes_done as f64 * 100.0 / t.bytes_total as f64
        };
        let digest = if t.digest.is_empty() { "-" } else { &t.digest };
        let _ = write!(
            out,
            "  table {} layer {} rows {} digest {digest} {} {pct:.1}% {}",
            t.id,
            t.layer,
            t.rows,
            t.state().label(),
            t.path
        );
        if !t.error.is_empty() {
            let _ = write!(out, ": {}", t.error);
        }
        out.push('\n');
    }
    let st = &s.stats;
    let _ = writeln!(
        out,
        "  lookups {} rows {} bytes {}",
        st.lookups, st.rows, st.bytes
    );
    if let Some(n) = st.connections {
        let _ = writeln!(
            out,
            "  connections open {} accepted {} refused {}",
            n.open, n.accepted, n.refused
        );
    }
    if let Some(t) = st.service_time {
        let _ = writeln!(
            out,
            "  service time us: p50 {:.1} p90 {:.1} p99 {:.1} p99.9 {:.1} max {:.1} ({} samples)",
            t.p50_us, t.p90_us, t.p99_us, t.p999_us, t.max_us, t.count
        );
    }
    for e in &st.errors {
        let _ = writeln!(out, "  errors {} ({}): {}", e.name, e.code, e.count);
    }
    let _ = writeln!(out, "  uptime {}", uptime(st.uptime_seconds));
    out
}

async fn status(dial: &Dial, names: &[String], detail: bool) -> Result<bool, OpsError> {
    let dialer = std::sync::Arc::new(Dialer::new(dial)?);
    let donors: Vec<String> = if names.is_empty() {
        dialer.all()?
    } else {
        for n in names {
            dialer.target(n)?;
        }
        names.to_vec()
    };
    // Every donor at once: one that does not answer costs its timeout once.
    let mut set = tokio::task::JoinSet::new();
    for (i, name) in donors.iter().enumerate() {
        let (dialer, name) = (std::sync::Arc::clone(&dialer), name.clone());
        set.spawn(async move {
            let r = match dialer.target(&name) {
                Ok(t) => donor_report(&dialer, &t).await,
                Err(e) => Err(e),
            };
            (i, r)
        });
    }
    let mut states: Vec<(String, Result<DonorReport, String>)> = donors
        .iter()
        .map(|n| (n.clone(), Err("no answer".to_string())))
        .collect();
    while let Some(done) = set.join_next().await {
        if let Ok((i, r)) = done {
            states[i].1 = r.map_err(|e| match e {
                // The table shows the donor's name already.
                OpsError::Refused { message, .. } => format!("refused: {message}"),
                e => e.to_string(),
            });
        }
    }
    print!("{}", render(&states));
    if detail {
        for s in states.iter().filter_map(|(_, s)| s.as_ref().ok()) {
            print!("\n{}", render_detail(s));
        }
    }
    Ok(states
        .iter()
        .all(|(_, s)| s.as_ref().is_ok_and(DonorReport::serving)))
}

async fn drain(dial: &Dial, name: &str) -> Result<(), OpsError> {
    let dialer = Dialer::new(dial)?;
    let target = dialer.target(name)?;
    let ch = dialer.channel(&target).await?;
    let d = DonorControlClient::new(ch)
        .drain(DrainRequest {})
        .await
        .map_err(|s| call_error(name, "Drain", &s))?
        .into_inner();
    if d.started {
        println!("{name}: draining (clients get {} ms)", d.grace_ms);
    } else {
        println!("{name}: a drain was already under way");
    }
    Ok(())
}

async fn swap(
    dial: &Dial,
    name: &str,
    table: u32,
    file: &str,
    digest: &str,
    in_place: bool,
) -> Result<(), OpsError> {
    let digest: TableDigest = digest
        .parse()
        .map_err(|e| OpsError::Usage(format!("--digest {digest:?}: {e}")))?;
    let dialer = Dialer::new(dial)?;
    let target = dialer.target(name)?;
    let ch = dialer.channel(&target).await?;
    let r = DonorControlClient::new(ch)
        .swap_table(SwapTableRequest {
            table_id: table,
            path: file.to_string(),
            expected_digest: digest.to_hex(),
            in_place,
        })
        .await
        .map_err(|s| call_error(name, "SwapTable", &s))?
        .into_inner();
    println!(
        "{name}: swapping table {table}{}: {} -> {} ({} bytes); `engram-cluster status` shows \
         the new digest once switched",
        if r.in_place { " in place" } else { "" },
        r.old_digest,
        r.new_digest,
        r.bytes
    );
    Ok(())
}

/// Run an operator command; failures are printed on stderr.
pub fn run(cmd: OpsCmd) -> ExitCode {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("starting the runtime: {e}");
            return ExitCode::from(2);
        }
    };
    let result = rt.block_on(async {
        match &cmd {
            OpsCmd::Status {
                dial,
                donors,
                detail,
            } => status(dial, donors, *detail).await,
            OpsCmd::Drain { dial, donor } => drain(dial, donor).await.map(|()| true),
            OpsCmd::Swap {
                dial,
                donor,
                table,
                file,
                digest,
                in_place,
            } => swap(dial, donor, *table, file, digest, *in_place)
                .await
                .map(|()| true),
        }
    });
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("{e}");
            e.exit_code()
        }
    }
}

#[cfg(test)]
mod tests;
