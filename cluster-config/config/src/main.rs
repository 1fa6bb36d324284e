//! `engram-cluster`: check a rack config before deploying it, plan its
//! RAM and timing, and make its PKI.

mod ops;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};
use cluster_config::pki::{self, CaFiles, Severity};
use cluster_config::plan::{Latencies, Plan};
use cluster_config::{Config, SourceRef};

#[derive(Parser)]
#[command(
    name = "engram-cluster",
    version,
    about = "Check and plan an engram-rack cluster config"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Validate a config: every problem is printed as FILE:LINE:COLUMN: KEY:
    /// MESSAGE. With [rack.tls] and its CA present (or `ca` set), also
    /// check every host's certificate: errors exit 2, warnings do not.
    Check {
        /// The rack config (TOML).
        file: PathBuf,
    },
    /// Per donor: RAM for its tables plus headroom against `ram_gib` (exit
    /// code 1 when one does not fit); per node: each table's window and the
    /// predicted slowdown from assumed source latencies (seed 000's model).
    Plan {
        /// The rack config (TOML).
        file: PathBuf,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Assumed fetch latencies in microseconds, over the defaults
        /// local=5,donor=100,ssd=400; a donor's name sets that donor's.
        #[arg(long, value_name = "NAME=US,...")]
        latency_us: Vec<String>,
    },
    /// Operate donors through their control planes: status, drain, swap.
    #[command(flatten)]
    Ops(ops::OpsCmd),
    /// The rack PKI: a CA, and a certificate for each donor, node and operator.
    Pki {
        #[command(subcommand)]
        cmd: PkiCmd,
    },
    /// Write this command's man pages and shell completions into DIR (the packages ship them).
    #[command(hide = true)]
    Manuals {
        /// Where `man/` and `completions/` go.
        dir: PathBuf,
    },
}

#[derive(Subcommand)]
enum PkiCmd {
    /// Create the rack CA: ca.pem, and ca.key (mode 0600), which stays here.
    Init {
        /// Write DIR/ca.pem and DIR/ca.key.
        #[arg(long, required_unless_present = "config", conflicts_with = "config")]
        dir: Option<PathBuf>,
        /// Write where the config's [rack.tls] says (its `ca`, default DIR/ca.pem).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Days the CA is valid.
        #[arg(long, default_value_t = pki::DEFAULT_CA_DAYS, value_parser = days())]
        days: u32,
        /// Replace an existing CA (every host must then be issued again).
        #[arg(long)]
        force: bool,
    },
    /// Issue a certificate and key to every donor, node and operator of
    /// the config; hosts whose files exist keep them unless --force.
    Issue {
        /// The rack config (TOML) with [rack.tls].
        #[arg(long)]
        config: PathBuf,
        /// Days each certificate is valid.
        #[arg(long, default_value_t = pki::DEFAULT_DAYS, value_parser = days())]
        days: u32,
        /// Replace existing certificates and keys (rotation).
        #[arg(long)]
        force: bool,
    },
}

fn days() -> clap::builder::RangedI64ValueParser<u32> {
    clap::value_parser!(u32).range(1..=i64::from(pki::MAX_DAYS))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Check { file } => check(&file),
        Cmd::Plan {
            file,
            json,
            latency_us,
        } => plan(&file, json, &latency_us),
        Cmd::Ops(cmd) => ops::run(cmd),
        Cmd::Pki { cmd } => match cmd {
            PkiCmd::Init {
                dir,
                config,
                days,
                force,
            } => pki_init(dir.as_deref(), config.as_deref(), days, force),
            PkiCmd::Issue {
                config,
                days,
                force,
            } => pki_issue(&config, days, force),
        },
        Cmd::Manuals { dir } => match cluster_config::manuals::write(Cli::command(), &dir) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("{}: {e}", dir.display());
                ExitCode::FAILURE
            }
        },
    }
}

fn load(file: &Path) -> Result<Config, ExitCode> {
    Config::load(file).map_err(|e| {
        eprintln!("{e}");
        ExitCode::from(2)
    })
}

fn check(file: &Path) -> ExitCode {
    let c = match load(file) {
        Ok(c) => c,
        Err(code) => return code,
    };
    println!(
        "ok: rack {:?}: {} tables, {} donors, {} nodes",
        c.rack,
        c.tables.len(),
        c.donors.len(),
        c.nodes.len()
    );
    for d in &c.donors {
        let ads: Vec<String> = d.advertise.iter().map(ToString::to_string).collect();
        println!(
            "  donor {}: tables {:?} at {}",
            d.name,
            d.tables,
            ads.join(", ")
        );
    }
    for n in &c.nodes {
        for r in &n.routes {
            let s: Vec<String> = r.sources.iter().map(SourceRef::to_string).collect();
            println!("  node {}: table {} <- {}", n.name, r.table, s.join(" -> "));
        }
    }
    if let Some(m) = &c.model {
        println!(
            "  model: hashing {}, hidden {} x {} streams, fusion {}",
            m.hashing, m.hidden, m.streams, m.fusion
        );
    }
    check_pki(&c)
}

/// The certificate half of `check`: skipped until the CA exists, unless
/// the config names the CA file itself.
fn check_pki(c: &Config) -> ExitCode {
    let Some(tls) = &c.tls else {
        return ExitCode::SUCCESS;
    };
    if !tls.ca.exists() && tls.ca == tls.dir.join("ca.pem") {
        println!(
            "  pki: no CA yet at {} (`engram-cluster pki init --config {}` makes it)",
            tls.ca.display(),
            c.path.display()
        );
        return ExitCode::SUCCESS;
    }
    let findings = pki::check(c);
    let errors = findings
        .iter()
        .filter(|f| f.severity == Severity::Error)
        .count();
    let count = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
    println!(
        "  pki: CA {}, {}: {}, {}",
        tls.ca.display(),
        count(pki::hosts(c).len(), "certificate"),
        count(errors, "error"),
        count(findings.len() - errors, "warning")
    );
    for f in &findings {
        eprintln!("{}: {f}", f.severity);
    }
    if errors > 0 {
        ExitCode::from(2)
    } else {
        ExitCode::SUCCESS
    }
}

fn pki_init(dir: Option<&Path>, config: Option<&Path>, days: u32, force: bool) -> ExitCode {
    let (ca, rack) = match (dir, config) {
        (Some(dir), _) => (CaFiles::in_dir(dir), None),
        (None, Some(file)) => {
            let c = match load(file) {
                Ok(c) => c,
                Err(code) => return code,
            };
            match CaFiles::of(&c) {
                Some(ca) => (ca, Some(c.rack)),
                None => return fail(pki::PkiError::NoTls(c.path)),
            }
        }
        // clap requires one of them.
        (None, None) => return ExitCode::from(2),
    };
    match pki::init(&ca, rack.as_deref(), days, force) {
        Ok(made) => {
            println!("{made}");
            println!(
                "  keep {} on this machine only; every host gets {}",
                ca.key.display(),
                ca.cert.display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => fail(e),
    }
}

fn pki_issue(file: &Path, days: u32, force: bool) -> ExitCode {
    let c = match load(file) {
        Ok(c) => c,
        Err(code) => return code,
    };
    match pki::issue(&c, days, force) {
        Ok(report) => {
            for r in &report {
                println!("{r}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => fail(e),
    }
}

fn fail(e: pki::PkiError) -> ExitCode {
    eprintln!("{e}");
    ExitCode::from(1)
}

fn plan(file: &Path, json: bool, latency_us: &[String]) -> ExitCode {
    let config = match load(file) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let mut lat = Latencies::default();
    for spec in latency_us {
        if let Err(e) = lat.apply(spec) {
            eprintln!("--latency-us: {e}");
            return ExitCode::from(2);
        }
    }
    let plan = Plan::new(&config, &lat);
    if json {
        match serde_json::to_string_pretty(&plan) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::from(2);
            }
        }
    } else {
        print!("{}", plan.render());
    }
    if plan.fits() {
        ExitCode::SUCCESS
    } else {
        for d in plan.donors.iter().filter(|d| !d.fits) {
            eprintln!(
                "donor {}: its tables and headroom need {:.2} GiB but ram_gib is {:.2}",
                d.name,
                d.need_bytes as f64 / cluster_config::GIB,
                d.ram_bytes as f64 / cluster_config::GIB
            );
        }
        ExitCode::from(1)
    }
}
