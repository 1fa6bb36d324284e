//! `engram-bench engines`: the embeddable memory from the engines' languages
//! against the Rust API, on one donor process in one run. A step is what an
//! engine does per token: a prefetch of one token (after its three
//! predecessors) and the waits for both layers' rows into its own buffers,
//! timed from the prefetch to the second wait's return. Rust
//! (`inference_node::embed`), C (`libengram_rack`, a program compiled
//! here) and Python (`engram_rack`), each in a process of its own, take turns, `--repeat`
//! rounds in rotating order; the table shows each one's median p50 and p99
//! over the rounds and its ratio to Rust's. Then the paced loop: the node's
//! own (`inference-node run`) and the Python example
//! (`inference-node/python/examples/paced.py`) at each rate, interleaved,
//! measured tokens/s compared. A benchmark: it reports misses of the
//! targets, it does not fail on them.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use inference_node::embed::{EmbeddedNode, MetricsAt, OpenOptions, POSITION_BYTES, Segment};
use rack_harness::bin;
use serde::Serialize;

use crate::rack::{self, Child, RackSpec};
use crate::stats::{median, print_table};

/// Settings of `engram-bench engines`.
#[derive(Debug, Clone, clap::Args)]
pub struct EnginesArgs {
    /// Timed steps per language per round.
    #[arg(long, default_value_t = 10_000)]
    steps: usize,
    /// Untimed steps before them.
    #[arg(long, default_value_t = 2_000)]
    warmup: usize,
    /// Rounds; the table shows medians over them (on a small VM a
    /// process's step times depend on where the scheduler puts its threads
    /// beside the donor's, so many short rounds).
    #[arg(long, default_value_t = 15)]
    repeat: usize,
    /// Fix the placement: the donor on the last CPU, every client process
    /// (its thread and the memory's I/O thread) on CPU 0, with `taskset`.
    #[arg(long)]
    pin: bool,
    /// Token rates of the paced comparison.
    #[arg(long, value_delimiter = ',', default_value = "100,400")]
    rates: Vec<f64>,
    /// Length of each paced run.
    #[arg(long, default_value_t = 4.0)]
    seconds_per_point: f64,
    /// Paced runs per rate and loop (tokens/s are steady: fewer than the step rounds).
    #[arg(long, default_value_t = 3)]
    paced_repeat: usize,
    /// Where the config, the compiled C program, the package and engines.json go.
    #[arg(long, default_value = "target/bench-engines")]
    out: PathBuf,
    /// Print engines.json on stdout instead of the tables.
    #[arg(long)]
    json: bool,
    /// Hashing base of the tables.
    #[arg(long, default_value_t = 20_000)]
    hash_base: u64,
    /// Instead: engine processes' memory (Pss), 1 and 4 of them, reading
    /// the tables through table views from a donor's host socket (one
    /// copy) or from their own local copies (`engines-pss.json`).
    #[arg(long)]
    pss: bool,
    /// The donor's transport: TLS, the rack's default (with the run's own
    /// PKI), or `tcp`, `quic`.
    #[arg(long, default_value = "tls", value_parser = rack::stream_transport)]
    transport: cluster_config::Transport,
}

/// p50 <= 1.2x Rust's, p99 <= 1.3x.
const P50_TARGET: f64 = 1.2;
const P99_TARGET: f64 = 1.3;
/// Paced tokens/s within 2% of the node's own.
const PACED_TARGET: f64 = 0.02;

/// One language's step latencies in one round.
#[derive(Debug, Clone, Copy, Serialize, serde::Deserialize)]
struct Lat {
    p50_us: f64,
    p99_us: f64,
    mean_us: f64,
}

#[derive(Debug, Clone, Serialize)]
struct Language {
    language: String,
    p50_us: f64,
    p99_us: f64,
    mean_us: f64,
    p50_over_rust: f64,
    p99_over_rust: f64,
    within_target: bool,
    rounds: Vec<Lat>,
}

#[derive(Debug, Clone, Serialize)]
struct Paced {
    rate: f64,
    node_tokens_per_second: f64,
    python_tokens_per_second: f64,
    python_over_node: f64,
    within_target: bool,
    node_runs: Vec<f64>,
    python_runs: Vec<f64>,
}

#[derive(Debug, Clone, Serialize)]
struct Report {
    transport: String,
    steps: usize,
    repeat: usize,
    pinned: bool,
    target: String,
    languages: Vec<Language>,
    paced: Vec<Paced>,
    missed: usize,
}

/// Arguments of the Rust side's process.
#[derive(Debug, Clone, clap::Args)]
pub struct RustSideArgs {
    config: PathBuf,
    node: String,
    steps: usize,
    warmup: usize,
}

/// The Rust side, in a process of its own as the C and Python sides are:
/// prints its step latencies as one JSON object.
pub fn rust_side(a: &RustSideArgs) -> Result<()> {
    let lat = rust_round(&a.config, &a.node, a.steps.max(1), a.warmup)?;
    println!("{}", serde_json::to_string(&lat)?);
    Ok(())
}

/// The Rust side: steps through the embedded API in this process.
fn rust_round(config: &Path, node: &str, steps: usize, warmup: usize) -> Result<Lat> {
    let mem = EmbeddedNode::open_with(
        config,
        node,
        &OpenOptions {
            metrics: MetricsAt::Off,
        },
    )?;
    let mut rows = [vec![0u8; POSITION_BYTES], vec![0u8; POSITION_BYTES]];
    let mut hist: Vec<i64> = Vec::new();
    let mut lat = Vec::with_capacity(steps);
    for i in 0..warmup + steps {
        let token = ((i * 7919 + 17) % 99_092) as i64;
        let t0 = Instant::now();
        let t = mem.prefetch(&[token], &[Segment::after(1, &hist)])?;
        t.wait(1, &mut rows[0], None)?;
        t.wait(14, &mut rows[1], None)?;
        let us = t0.elapsed().as_secs_f64() * 1e6;
        if i >= warmup {
            lat.push(us);
        }
        hist.push(token);
        if hist.len() > 3 {
            hist.remove(0);
        }
    }
    mem.close(Duration::from_secs(1));
    let mean = lat.iter().sum::<f64>() / lat.len() as f64;
    lat.sort_by(f64::total_cmp);
    Ok(Lat {
        p50_us: lat[lat.len() / 2],
        p99_us: lat[(lat.len() as f64 * 0.99) as usize],
        mean_us: mean,
    })
}

/// Run a helper that prints one JSON object on stdout.
fn json_of<T: serde::de::DeserializeOwned>(mut cmd: Command, what: &str) -> Result<T> {
    let out = cmd.output().with_context(|| format!("running {what}"))?;
    if !out.status.success() {
        bail!("{what} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    serde_json::from_slice(&out.stdout)
        .with_context(|| format!("{what} printed: {}", String::from_utf8_lossy(&out.stdout)))
}

/// Compile the C side against the library built beside this binary.
fn compile_c(out: &Path) -> Result<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let lib_dir = bin("libengram_rack.so")
        .parent()
        .context("library directory")?
        .to_path_buf();
    let prog = out.join("lookup_bench");
    let status = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-std=c11", "-D_DEFAULT_SOURCE", "-O2"])
        .arg("-I")
        .arg(root.join("inference-node/capi/include"))
        .arg(root.join("bench/engines/lookup_bench.c"))
        .arg("-o")
        .arg(&prog)
        .arg(format!("-L{}", lib_dir.display()))
        .arg("-lengram_rack")
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .status()
        .context("running the C compiler (cc)")?;
    if !status.success() {
        bail!("cc could not compile bench/engines/lookup_bench.c");
    }
    Ok(prog)
}

/// Run it.
pub fn run(args: &EnginesArgs) -> Result<()> {
    check_args(args)?;
    rack::kill_children_on_interrupt()?;
    let out = &rack::work_dir(&args.out)?;
    if args.pss {
        return crate::engines_pss::run(out, args.hash_base, args.json);
    }
    let tables = rack::table_pair(out, args.hash_base)?;
    let spec = RackSpec {
        transport: args.transport,
        host_sockets: &[],
        ..RackSpec::one_donor()
    };
    let rk = rack::write_config(out, &tables, &spec)?;
    let config = &rk.config;
    let donor = Child::launch_donor(config, "donor-a", &[])?;
    donor.wait_ready(Duration::from_secs(120))?;
    let pin = pin_donor(&donor, args.pin)?;
    let clients = Clients::new(out, config, pin)?;
    let languages = step_rounds(args, &clients)?;
    let paced = paced_rounds(args, &clients, out)?;
    drop(donor);

    let missed = languages.iter().filter(|l| !l.within_target).count()
        + paced.iter().filter(|p| !p.within_target).count();
    let report = Report {
        transport: args.transport.to_string(),
        steps: args.steps,
        repeat: args.repeat,
        pinned: pin,
        target: format!(
            "step p50 <= {P50_TARGET}x and p99 <= {P99_TARGET}x Rust's; paced Python tokens/s within {}% of the node's",
            PACED_TARGET * 100.0
        ),
        languages,
        paced,
        missed,
    };
    let json = serde_json::to_string_pretty(&report)?;
    std::fs::write(out.join("engines.json"), &json)?;
    if args.json {
        println!("{json}");
    } else {
        print_report(args, &report, out);
    }
    Ok(())
}

fn check_args(args: &EnginesArgs) -> Result<()> {
    if args.steps < 100 || args.repeat == 0 || args.paced_repeat == 0 {
        bail!("--steps must be at least 100, --repeat and --paced-repeat at least 1");
    }
    if args
        .rates
        .iter()
        .any(|r| !(r.is_finite() && *r > 0.0 && *r <= 10_000.0))
    {
        bail!("--rates must be token rates (0 < rate <= 10000)");
    }
    Ok(())
}

/// With `asked` and two CPUs or more, pin the donor to the last CPU (the
/// clients then run on CPU 0); whether it was pinned.
fn pin_donor(donor: &Child, asked: bool) -> Result<bool> {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let pin = asked && cpus >= 2;
    if asked && !pin {
        eprintln!("--pin needs two CPUs or more; running unpinned");
    }
    if pin {
        let st = Command::new("taskset")
            .args([
                "-a",
                "-cp",
                &(cpus - 1).to_string(),
                &donor.pid().to_string(),
            ])
            .stdout(std::process::Stdio::null())
            .status()
            .context("running taskset (util-linux)")?;
        if !st.success() {
            bail!("taskset could not pin the donor");
        }
    }
    Ok(pin)
}

/// How the client processes are started: pinned to CPU 0 with `--pin`,
/// the C program built, the Python package importable.
struct Clients {
    pin: bool,
    c_prog: PathBuf,
    pkg: PathBuf,
    root: PathBuf,
    config: String,
    config_path: PathBuf,
}

impl Clients {
    fn new(out: &Path, config: &Path, pin: bool) -> Result<Self> {
        let c_prog = compile_c(out)?;
        let pkg = out.join("python");
        rack_harness::python_package(&pkg)?;
        Ok(Self {
            pin,
            c_prog,
            pkg,
            root: Path::new(env!("CARGO_MANIFEST_DIR")).join(".."),
            config: config.display().to_string(),
            config_path: config.to_path_buf(),
        })
    }

    /// A client process running `program`.
    fn command(&self, program: &Path) -> Command {
        if self.pin {
            let mut c = Command::new("taskset");
            c.args(["-c", "0"]).arg(program);
            c
        } else {
            Command::new(program)
        }
    }

    /// A client process running the repository's Python `script`.
    fn python(&self, script: &str) -> Command {
        let mut cmd = self.command(Path::new("python3"));
        cmd.arg(self.root.join(script)).env("PYTHONPATH", &self.pkg);
        cmd
    }
}

/// The step benchmark in each language, `--repeat` rounds in a rotating
/// order; medians against Rust's.
fn step_rounds(args: &EnginesArgs, cl: &Clients) -> Result<Vec<Language>> {
    let (steps, warmup) = (args.steps.to_string(), args.warmup.to_string());
    let config = &cl.config;
    let names = ["Rust", "C", "Python"];
    let mut rounds: [Vec<Lat>; 3] = Default::default();
    for r in 0..args.repeat {
        for k in 0..3 {
            let lang = (r + k) % 3;
            eprintln!("round {}/{}: {}", r + 1, args.repeat, names[lang]);
            let lat = match lang {
                0 => {
                    let mut cmd = cl.command(&std::env::current_exe()?);
                    cmd.args(["engines-rust-side", config, "donor", &steps, &warmup]);
                    json_of(cmd, "the Rust benchmark")?
                }
                1 => {
                    let mut cmd = cl.command(&cl.c_prog);
                    cmd.args([config, "donor", &steps, &warmup]);
                    json_of(cmd, "the C benchmark")?
                }
                _ => {
                    let mut cmd = cl.python("bench/engines/lookup_bench.py");
                    cmd.args([config, "donor", &steps, &warmup]);
                    json_of(cmd, "the Python benchmark")?
                }
            };
            rounds[lang].push(lat);
        }
    }
    let med = |v: &[Lat], f: fn(&Lat) -> f64| median(v.iter().map(f).collect());
    let rust = (med(&rounds[0], |l| l.p50_us), med(&rounds[0], |l| l.p99_us));
    Ok(names
        .iter()
        .zip(&rounds)
        .map(|(name, rs)| {
            let (p50, p99) = (med(rs, |l| l.p50_us), med(rs, |l| l.p99_us));
            Language {
                language: (*name).into(),
                p50_us: p50,
                p99_us: p99,
                mean_us: med(rs, |l| l.mean_us),
                p50_over_rust: p50 / rust.0,
                p99_over_rust: p99 / rust.1,
                within_target: p50 / rust.0 <= P50_TARGET && p99 / rust.1 <= P99_TARGET,
                rounds: rs.clone(),
            }
        })
        .collect())
}

/// The paced loop at each rate: the node's own and the Python example's
/// tokens/s, `--paced-repeat` runs each.
fn paced_rounds(args: &EnginesArgs, cl: &Clients, out: &Path) -> Result<Vec<Paced>> {
    let mut paced = Vec::new();
    for &rate in &args.rates {
        let tokens = ((rate * args.seconds_per_point).round() as u64).max(10);
        let (mut node_runs, mut python_runs) = (Vec::new(), Vec::new());
        for r in 0..args.paced_repeat {
            eprintln!(
                "paced {rate} tokens/s, round {}/{}",
                r + 1,
                args.paced_repeat
            );
            let stdout = out.join("node-summary.json");
            rack::run_node(
                &cl.config_path,
                "donor",
                &[
                    "--tokens".into(),
                    tokens.to_string(),
                    "--tokens-per-second".into(),
                    rate.to_string(),
                    "--json".into(),
                    "--quiet".into(),
                ],
                &stdout,
                Duration::from_secs(600),
            )?;
            let s: serde_json::Value = serde_json::from_slice(&std::fs::read(&stdout)?)?;
            node_runs.push(s["tokens_per_second"].as_f64().context("node tokens/s")?);
            let mut cmd = cl.python("inference-node/python/examples/paced.py");
            cmd.args([
                &cl.config,
                "donor",
                "--rate",
                &rate.to_string(),
                "--tokens",
                &tokens.to_string(),
                "--json",
            ]);
            let p: serde_json::Value = json_of(cmd, "the paced Python example")?;
            python_runs.push(p["tokens_per_second"].as_f64().context("python tokens/s")?);
        }
        let (n, p) = (median(node_runs.clone()), median(python_runs.clone()));
        paced.push(Paced {
            rate,
            node_tokens_per_second: n,
            python_tokens_per_second: p,
            python_over_node: p / n,
            within_target: (p / n - 1.0).abs() <= PACED_TARGET,
            node_runs,
            python_runs,
        });
    }
    Ok(paced)
}

fn print_report(args: &EnginesArgs, report: &Report, out: &Path) {
    println!(
        "One step (prefetch of one token, waits for both layers' rows) from a donor over {}, {} steps x {} rounds{}, medians:",
        args.transport,
        args.steps,
        args.repeat,
        if report.pinned {
            ", pinned (donor: last CPU, clients: CPU 0)"
        } else {
            ""
        }
    );
    print_table(
        &[
            "language",
            "p50 us",
            "p99 us",
            "p50 / Rust",
            "p99 / Rust",
            "target",
        ],
        &report
            .languages
            .iter()
            .map(|l| {
                vec![
                    l.language.clone(),
                    format!("{:.1}", l.p50_us),
                    format!("{:.1}", l.p99_us),
                    format!("{:.2}x", l.p50_over_rust),
                    format!("{:.2}x", l.p99_over_rust),
                    if l.within_target { "met" } else { "MISSED" }.into(),
                ]
            })
            .collect::<Vec<_>>(),
    );
    println!(
        "\nPaced loop, tokens/s (medians of {} runs):",
        args.paced_repeat
    );
    print_table(
        &["rate", "node", "Python example", "Python / node", "target"],
        &report
            .paced
            .iter()
            .map(|p| {
                vec![
                    format!("{}", p.rate),
                    format!("{:.2}", p.node_tokens_per_second),
                    format!("{:.2}", p.python_tokens_per_second),
                    format!("{:.4}", p.python_over_node),
                    if p.within_target { "met" } else { "MISSED" }.into(),
                ]
            })
            .collect::<Vec<_>>(),
    );
    println!(
        "\n{} of the targets missed; engines.json is in {}",
        report.missed,
        out.display()
    );
}
