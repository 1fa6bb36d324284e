//! `memory-donor ctl`: call a running donor's plaintext control plane
//! (health, ListTables, Stats, Drain, SwapTable) and print the answer, for
//! operators and scripts on the donor's host (Drain and SwapTable are
//! answered only from loopback there). A rack with a PKI serves its
//! control plane over TLS: use `engram-cluster status|drain|swap` with an
//! operator's certificate.

use std::time::Duration;

use anyhow::{Context, Result};
use engram_protocol::control::donor_control_client::DonorControlClient;
use engram_protocol::control::{
    DrainRequest, ListTablesRequest, SERVICE_NAME, StatsRequest, SwapTableRequest,
};
use tonic::transport::{Channel, Endpoint};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

/// What to ask.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum CtlCmd {
    /// Health of the donor and of DonorControl (exit code 1 unless SERVING).
    Health,
    /// Tables, their versions and load state.
    Tables,
    /// Data-plane counters and service time.
    Stats,
    /// Start a drain (as SIGTERM does).
    Drain,
    /// Load another version of a table and switch to it (watch `tables`).
    Swap {
        /// The table's id.
        #[arg(long)]
        table: u32,
        /// The new version's file, as the donor sees it.
        #[arg(long)]
        path: String,
        /// The digest the file must have (64 hex digits; `memory-donor inspect` prints it).
        #[arg(long)]
        digest: String,
        /// Unload the old version first (the table is not served meanwhile).
        #[arg(long)]
        in_place: bool,
    },
}

async fn channel(addr: &str) -> Result<Channel> {
    let uri = if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    };
    Endpoint::from_shared(uri.clone())
        .with_context(|| format!("{uri} is not an address"))?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(10))
        .connect()
        .await
        .with_context(|| format!("connecting to {uri}"))
}

/// Run `cmd` against the control plane at `addr`; false when unhealthy.
pub async fn run(addr: &str, cmd: CtlCmd) -> Result<bool> {
    let ch = channel(addr).await?;
    let mut c = DonorControlClient::new(ch.clone());
    match cmd {
        CtlCmd::Health => return health(ch).await,
        CtlCmd::Tables => tables(&mut c).await?,
        CtlCmd::Stats => stats(&mut c).await?,
        CtlCmd::Swap {
            table,
            path,
            digest,
            in_place,
        } => {
            let r = c
                .swap_table(SwapTableRequest {
                    table_id: table,
                    path,
                    expected_digest: digest,
                    in_place,
                })
                .await
                .map_err(|s| anyhow::anyhow!("swap refused: {}: {}", s.code(), s.message()))?
                .into_inner();
            println!(
                "swapping table {table}{}: {} -> {} ({} bytes); `tables` shows the new digest once switched",
                if r.in_place { " in place" } else { "" },
                r.old_digest,
                r.new_digest,
                r.bytes
            );
        }
        CtlCmd::Drain => {
            let d = c.drain(DrainRequest {}).await?.into_inner();
            if d.started {
                println!("draining (clients get {} ms)", d.grace_ms);
            } else {
                println!("a drain was already under way");
            }
        }
    }
    Ok(true)
}

/// Each service's health; whether all are serving.
async fn health(ch: Channel) -> Result<bool> {
    let mut h = HealthClient::new(ch);
    let mut healthy = true;
    for service in ["", SERVICE_NAME] {
        let r = h
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await?
            .into_inner();
        let status = r.status().as_str_name();
        healthy &= status == "SERVING";
        let shown = if service.is_empty() {
            "(donor)"
        } else {
            service
        };
        println!("{shown}: {status}");
    }
    Ok(healthy)
}

async fn tables(c: &mut DonorControlClient<Channel>) -> Result<()> {
    let r = c.list_tables(ListTablesRequest {}).await?.into_inner();
    println!(
        "donor {}{}",
        r.donor,
        if r.draining { " (draining)" } else { "" }
    );
    for t in &r.tables {
        let pct = if t.bytes_total == 0 {
            0.0
        } else {
            t.bytes_done as f64 * 100.0 / t.bytes_total as f64
        };
        println!(
            "table {} layer {} rows {} digest {} {} {pct:.1}% {}{}",
            t.id,
            t.layer,
            t.rows,
            if t.digest.is_empty() { "-" } else { &t.digest },
            t.state().as_str_name().trim_start_matches("LOAD_STATE_"),
            t.path,
            if t.error.is_empty() {
                String::new()
            } else {
                format!(": {}", t.error)
            }
        );
    }
    Ok(())
}

async fn stats(c: &mut DonorControlClient<Channel>) -> Result<()> {
    let s = c.stats(StatsRequest {}).await?.into_inner();
    println!("lookups {} rows {} bytes {}", s.lookups, s.rows, s.bytes);
    if let Some(n) = s.connections {
        println!(
            "connections open {} accepted {} refused {}",
            n.open, n.accepted, n.refused
        );
    }
    if let Some(t) = s.service_time {
        println!(
            "service time us: p50 {:.1} p90 {:.1} p99 {:.1} p99.9 {:.1} max {:.1} ({} samples)",
            t.p50_us, t.p90_us, t.p99_us, t.p999_us, t.max_us, t.count
        );
    }
    for e in &s.errors {
        println!("errors {} ({}): {}", e.name, e.code, e.count);
    }
    println!("uptime {:.0} s", s.uptime_seconds);
    Ok(())
}
