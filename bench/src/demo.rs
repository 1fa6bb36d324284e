//! `engram-bench demo`: the README's first command, a rack on loopback.
//! Generates a table pair (layers 1 and 14, reused on later runs), writes a
//! rack config with two donors serving both tables and an SSD copy, runs a
//! reference node on local RAM, then runs the real node at 100 tokens/s
//! over the built-in text while the primary donor is killed with SIGKILL
//! at a third of the run and restarted at two thirds. Prints a per-second
//! timeline from the node's trace (and writes it as PNG and SVG), the
//! node's summary, and checks that every position fused exactly what the
//! reference fused. Every process it starts is gone when it ends.

use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use engram_bench::plot::{Panel, Series, Timeline};
use engram_protocol::ROW_BYTES;
use inference_node::model::StepRecord;
use inference_node::model::summary::{Second, Seconds};
use rack_harness::drill::node::read_trace;
use rack_harness::drill::report::checksums;

use crate::rack::{self, Child, NodeSpec, RackSpec, TablePair};
use crate::realtext::{NodeText, RealTextArgs};

/// Settings of the demo.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Work directory: tables (reused while their digest matches), config, traces, charts.
    #[arg(long, default_value = "target/demo-rack")]
    dir: PathBuf,
    /// Length of the run at the token rate (donor-a is killed at 1/3, restarted at 2/3).
    #[arg(long, default_value_t = 30)]
    seconds: u64,
    /// Token rate of the node.
    #[arg(long, default_value_t = 100.0)]
    tokens_per_second: f64,
    /// Hashing base of the tables (20000: about 480k rows, 127 MB per table).
    #[arg(long, default_value_t = 20_000)]
    hash_base: u64,
    /// Both donors also listen on a host socket, and node "rack" (on the
    /// same host) maps their tables: the kill of donor-a costs nothing,
    /// no failover (the run fails on one).
    #[arg(long)]
    host_local: bool,
    /// The model the rack serves: DeepSeek V4.1's two tables, or
    /// Qwen3.8-Flash-Next's (Qwen4Exp) one PLE table of FP8 rows, fused
    /// by its PLE layer (docs/models.md).
    #[arg(long, value_enum, default_value_t = rack::ModelKind::DeepseekV41)]
    model: rack::ModelKind,
    /// The node's --warm-us (how long before each step it wakes the path
    /// to the step's rows; 0: off); default: the node's.
    #[arg(long, value_name = "US")]
    warm_us: Option<u64>,
    #[command(flatten)]
    real: RealTextArgs,
}

/// Rate of the reference run on local RAM: only its outputs matter.
const REFERENCE_RATE: f64 = 5000.0;
const SOURCES: [&str; 3] = ["donor-a", "donor-b", "ssd"];

/// Run the demo; every process it started is gone when this returns.
pub fn run(args: &DemoArgs) -> Result<()> {
    if args.seconds < 3 {
        bail!(
            "--seconds {} is too short to kill and restart a donor (3 or more)",
            args.seconds
        );
    }
    if !(args.tokens_per_second.is_finite() && args.tokens_per_second > 0.0) {
        bail!(
            "--tokens-per-second {} is not a rate",
            args.tokens_per_second
        );
    }
    rack::kill_children_on_interrupt()?;
    let mut pids = Vec::new();
    let res = demo(args, &mut pids);
    // Every guard has dropped by now: each child is killed and reaped.
    let left: Vec<String> = pids
        .iter()
        .filter(|(pid, prog, _)| !rack::gone(*pid, prog))
        .map(|(pid, _, name)| format!("{name} ({pid})"))
        .collect();
    let list: Vec<String> = pids.iter().map(|(p, _, _)| p.to_string()).collect();
    println!("processes started (pids): {}", list.join(" "));
    if left.is_empty() {
        println!("none of them is left running");
    } else {
        println!("still running: {}", left.join(", "));
    }
    res?;
    rack::check_interrupted()?;
    if !left.is_empty() {
        bail!("processes were left behind");
    }
    Ok(())
}

/// `(pid, program, name)` of each process started.
type Started = Vec<(u32, &'static str, String)>;

/// How long a donor or the node may take to say it is ready.
const READY_TIMEOUT: Duration = Duration::from_secs(120);

/// The demo's steps, printed as numbered lines; the run fails at the end
/// unless every output matched the reference.
fn demo(args: &DemoArgs, pids: &mut Started) -> Result<()> {
    let t_all = Instant::now();
    let dir = rack::work_dir(&args.dir)?;
    let tables = tables(args, &dir)?;
    if args.model == rack::ModelKind::Qwen4Exp && args.real.real_text {
        bail!(
            "--real-text runs DeepSeek V4.1's tokenizer: a Qwen4Exp rack decodes the built-in text's ids"
        );
    }
    let text = args.real.node_text(&dir)?;
    println!("   {}", args.real.describe(text.as_ref()));
    let config = rack_config(&dir, &tables, args.host_local, text.as_ref())?;
    let mut demo = Demo {
        args,
        tokens: (args.seconds as f64 * args.tokens_per_second).round() as u64,
        dir,
        config,
        text,
        pids,
    };
    let (donor_a, donor_b) = demo.start_donors_and_reference()?;
    let run = demo.paced_run(donor_a)?;
    let steps = read_trace(&demo.trace("rack"))?;
    let (svg, png) = demo.timeline(&steps, &run)?;
    demo.print_summary(&steps, run.restarted);
    let outputs = demo.compare_outputs(&steps)?;
    println!("8. timeline: {} and {}", png.display(), svg.display());
    let (killed, restarted) = (run.killed, run.restarted);
    stop_donors(donor_b, run.donor_a, t_all)?;
    check(run.status, &run.node_log, &steps, &outputs, demo.tokens)?;
    if args.host_local {
        check_host_local(&steps, killed, restarted)?;
    }
    Ok(())
}

/// With `--host-local`: donor-a's mapping served through its death, so no
/// step failed over and every step was donor-a's.
fn check_host_local(steps: &[StepRecord], killed: f64, restarted: f64) -> Result<()> {
    let failovers: u64 = steps
        .iter()
        .flat_map(|s| &s.tables)
        .map(|t| u64::from(t.failovers))
        .sum();
    let dead = steps
        .iter()
        .filter(|s| (killed..restarted).contains(&(s.start_us / 1e6)))
        .count();
    let elsewhere = steps
        .iter()
        .filter(|s| {
            s.tables
                .iter()
                .any(|t| t.source.as_deref() != Some("donor-a"))
        })
        .count();
    println!(
        "   host-local: {dead} steps while donor-a was dead, all from its mapping; {failovers} failovers, {elsewhere} steps served by another source"
    );
    if failovers > 0 || elsewhere > 0 {
        bail!(
            "with --host-local donor-a's mapping should serve every step: {failovers} failovers, {elsewhere} steps elsewhere"
        );
    }
    Ok(())
}

/// Generate the table pair, or reuse the one in `dir` while its digests match.
fn tables(args: &DemoArgs, dir: &Path) -> Result<TablePair> {
    let t = Instant::now();
    let tables = rack::model_tables(dir, args.hash_base, args.model)?;
    let how = if tables.reused {
        "already there (digests match), reused"
    } else {
        "generated"
    };
    match args.model {
        rack::ModelKind::DeepseekV41 => {
            let mb = tables.tables[0].rows as f64 * ROW_BYTES as f64 / 1e6;
            println!(
                "1. tables (hash base {}): layer 1 and layer 14, {} and {} rows ({mb:.0} MB each), {how} in {:.1} s",
                args.hash_base,
                tables.tables[0].rows,
                tables.tables[1].rows,
                rack::since(t),
            );
        }
        rack::ModelKind::Qwen4Exp => {
            let e = rack::QWEN_ENCODING;
            let mb = tables.tables[0].rows as f64 * e.row_bytes() as f64 / 1e6;
            println!(
                "1. table (Qwen4Exp, ngram_vocab_size_base {}): the PLE layer's, {} rows of {} ({} bytes, table scale {}; {mb:.0} MB), {how} in {:.1} s",
                args.hash_base,
                tables.tables[0].rows,
                e.name(),
                e.row_bytes(),
                rack::QWEN_SCALE,
                rack::since(t),
            );
        }
    }
    Ok(tables)
}

/// Write the rack config (two donors, node "rack" over them and its SSD
/// copy, node "ref" on local RAM) and return its path.
fn rack_config(
    dir: &Path,
    tables: &TablePair,
    host_local: bool,
    text: Option<&NodeText>,
) -> Result<PathBuf> {
    let spec = RackSpec {
        donors: &["donor-a", "donor-b"],
        nodes: vec![
            NodeSpec {
                name: "rack",
                sources: &SOURCES,
                ssd_ioprio: None,
            },
            NodeSpec {
                name: "ref",
                sources: &["local"],
                ssd_ioprio: None,
            },
        ],
        probe_interval_ms: 500,
        trust_copies: false,
        transport: cluster_config::Transport::Tls,
        host_sockets: if host_local {
            &["donor-a", "donor-b"]
        } else {
            &[]
        },
        tokenizer: text.map(|t| t.tokenizer.clone()),
    };
    let rk = rack::write_config(dir, tables, &spec)?;
    let which = match tables.model {
        rack::ModelKind::DeepseekV41 => "both tables",
        rack::ModelKind::Qwen4Exp => "the PLE table",
    };
    println!("2. rack config {}:", rk.config.display());
    println!(
        "   its PKI in {}: a CA and a certificate per donor and node (engram-cluster pki init, pki issue); data and control planes over TLS",
        dir.join("pki").display()
    );
    for d in &rk.donors {
        println!(
            "   {} serves {} on {} (control plane {})",
            d.name, which, d.listen, d.control
        );
    }
    if host_local {
        println!(
            "   both donors also listen on a host socket ({} and {}): node \"rack\", on the same host, maps their tables (one copy for the host; no request per lookup)",
            rack::host_socket(dir, "donor-a").display(),
            rack::host_socket(dir, "donor-b").display()
        );
    }
    println!(
        "   node \"rack\" routes {which} to donor-a, then donor-b, then its SSD copy; probes every 500 ms"
    );
    println!("   node \"ref\" reads {which} into its own RAM (the reference)");
    Ok(rk.config)
}

/// What the steps after the config share.
struct Demo<'a> {
    args: &'a DemoArgs,
    /// Tokens each node runs.
    tokens: u64,
    /// The work directory.
    dir: PathBuf,
    /// The rack config.
    config: PathBuf,
    /// The real text the nodes decode (`--real-text`).
    text: Option<NodeText>,
    pids: &'a mut Started,
}

/// What the paced run leaves for the report and the checks.
struct PacedRun {
    /// donor-a as restarted.
    donor_a: Child,
    /// Seconds into the node's loop when donor-a was killed.
    killed: f64,
    /// Seconds into the node's loop when donor-a was restarted.
    restarted: f64,
    /// How the node exited.
    status: ExitStatus,
    node_log: String,
}

/// How many positions the run fused, and how many of them as the reference did.
struct Outputs {
    reference: usize,
    run: usize,
    same: usize,
}

impl Demo<'_> {
    /// The trace node `node` writes.
    fn trace(&self, node: &str) -> PathBuf {
        self.dir.join(format!("{node}.jsonl"))
    }

    /// The file node `node`'s stdout (its summary) goes to.
    fn summary_file(&self, node: &str) -> PathBuf {
        self.dir.join(format!("{node}-summary.txt"))
    }

    /// The arguments of node `node`: the demo's tokens at `rate`, its trace.
    fn node_args(&self, node: &str, rate: f64, quiet: bool) -> Vec<String> {
        let mut args = vec![
            "--tokens".to_string(),
            self.tokens.to_string(),
            "--tokens-per-second".into(),
            rate.to_string(),
        ];
        if quiet {
            args.push("--quiet".into());
        }
        if let Some(us) = self.args.warm_us {
            args.extend(["--warm-us".into(), us.to_string()]);
        }
        args.extend(["--trace".into(), self.trace(node).display().to_string()]);
        if let Some(t) = &self.text {
            args.extend(t.args());
        }
        args
    }

    /// Start donor `name` (listed as `label`).
    fn launch_donor(&mut self, name: &str, extra: &[&str], label: &str) -> Result<Child> {
        let donor = Child::launch_donor(&self.config, name, extra)?;
        self.pids.push((donor.pid(), "memory-donor", label.into()));
        Ok(donor)
    }

    /// Start node `node` with `args`.
    fn start_node(&mut self, node: &str, args: &[String]) -> Result<Child> {
        let child = rack::start_node(&self.config, node, args, &self.summary_file(node))?;
        self.pids
            .push((child.pid(), "inference-node", format!("node {node}")));
        Ok(child)
    }

    /// Start both donors, run the reference while they load, and wait until
    /// they are ready; returns donor-a and donor-b.
    fn start_donors_and_reference(&mut self) -> Result<(Child, Child)> {
        // The donors load while the reference runs.
        let t = Instant::now();
        let donor_a = self.launch_donor("donor-a", &[], "donor-a")?;
        let donor_b = self.launch_donor("donor-b", &[], "donor-b")?;
        self.run_reference()?;
        for d in [&donor_a, &donor_b] {
            d.wait_ready(READY_TIMEOUT)?;
        }
        println!(
            "4. donor-a (pid {}) and donor-b (pid {}) loaded their tables, verified their digests and are ready ({:.1} s after start)",
            donor_a.pid(),
            donor_b.pid(),
            rack::since(t)
        );
        Ok((donor_a, donor_b))
    }

    /// Run node "ref" on local RAM to its end: the outputs the run must match.
    fn run_reference(&mut self) -> Result<()> {
        let ref_args = self.node_args("ref", REFERENCE_RATE, true);
        let t_ref = Instant::now();
        let mut reference = self.start_node("ref", &ref_args)?;
        expect_success(&mut reference, Duration::from_secs(300))?;
        drop(reference);
        println!(
            "3. reference: node \"ref\" fused {} positions from local RAM in {:.1} s",
            self.tokens,
            rack::since(t_ref)
        );
        Ok(())
    }

    /// Run node "rack" at the token rate while donor-a is killed at a third
    /// of the run and restarted at two thirds, and wait for the node's end.
    fn paced_run(&mut self, donor_a: Child) -> Result<PacedRun> {
        // The run, with donor-a killed and restarted on the node's own clock.
        let (mut node, origin) = self.start_rack_node()?;
        let seconds = self.args.seconds;
        let kill_at = (seconds as f64 / 3.0).round() as u64;
        let restart_at = (2.0 * seconds as f64 / 3.0).round() as u64;
        let killed = kill_donor_a(&node, donor_a, kill_at, origin)?;
        let (donor_a, restarted) = self.restart_donor_a(&node, restart_at, origin)?;
        let status = node.wait_exit(Duration::from_secs(seconds * 4 + 60))?;
        let node_log = node.log();
        drop(node);
        Ok(PacedRun {
            donor_a,
            killed,
            restarted,
            status,
            node_log,
        })
    }

    /// Start node "rack" and wait until its loop runs; returns it and when
    /// its loop started (the origin of the kill and restart times).
    fn start_rack_node(&mut self) -> Result<(Child, Instant)> {
        let node_args = self.node_args("rack", self.args.tokens_per_second, false);
        let node = self.start_node("rack", &node_args)?;
        node.wait_line(READY_TIMEOUT, |l| l.starts_with("running ").then_some(()))
            .context("the node did not start its loop")?;
        let origin = Instant::now();
        println!(
            "5. node \"rack\" runs {} tokens at {} tokens/s (pid {})",
            self.tokens,
            self.args.tokens_per_second,
            node.pid()
        );
        Ok((node, origin))
    }

    /// Restart donor-a once `node` is `at` seconds into its loop and wait
    /// until it is ready; returns it and the restart's time from `origin`.
    fn restart_donor_a(&mut self, node: &Child, at: u64, origin: Instant) -> Result<(Child, f64)> {
        wait_second(node, at)?;
        let restarted = rack::since(origin);
        // A restart of files it verified a minute ago: the digest is trusted.
        let donor_a = self.launch_donor("donor-a", &["--trust-digest"], "donor-a (restarted)")?;
        println!(
            "   t={restarted:>5.1} s  restart donor-a (pid {}, --trust-digest)",
            donor_a.pid()
        );
        donor_a.wait_ready(READY_TIMEOUT)?;
        println!("   t={:>5.1} s  donor-a ready again", rack::since(origin));
        Ok((donor_a, restarted))
    }

    /// Print the per-second timeline and write it as SVG and PNG; returns their paths.
    fn timeline(&self, steps: &[StepRecord], run: &PacedRun) -> Result<(PathBuf, PathBuf)> {
        let seconds = per_second(steps);
        println!();
        print!("{}", timeline_table(&seconds));
        let timeline = timeline_chart(
            &seconds,
            self.args.tokens_per_second,
            run.killed,
            run.restarted,
        );
        timeline
            .write_both(&self.dir.join("timeline"))
            .with_context(|| format!("writing the timeline into {}", self.dir.display()))
    }

    /// Print node "rack"'s summary and when donor-a served again after its restart.
    fn print_summary(&self, steps: &[StepRecord], restarted: f64) {
        let back = first_use_after(steps, "donor-a", restarted);
        println!();
        println!("6. the node's summary:");
        let summary = std::fs::read_to_string(self.summary_file("rack")).unwrap_or_default();
        for l in summary.lines() {
            println!("   {l}");
        }
        if let Some(b) = back {
            println!(
                "   donor-a served again from t={b:.1} s ({:.1} s after its restart)",
                b - restarted
            );
        } else {
            println!("   donor-a did not serve again before the run ended");
        }
    }

    /// Compare what the run fused with what the reference fused.
    fn compare_outputs(&self, steps: &[StepRecord]) -> Result<Outputs> {
        // Same outputs as local RAM, position by position.
        let reference = checksums(&read_trace(&self.trace("ref"))?);
        let got = checksums(steps);
        let same = reference
            .iter()
            .filter(|(k, v)| got.get(*k).is_some_and(|g| g == *v))
            .count();
        println!(
            "7. outputs identical to local RAM: {same}/{} positions",
            reference.len()
        );
        Ok(Outputs {
            reference: reference.len(),
            run: got.len(),
            same,
        })
    }
}

/// Kill donor-a (SIGKILL) once `node` is `at` seconds into its loop;
/// returns the kill's time from `origin`.
fn kill_donor_a(node: &Child, mut donor_a: Child, at: u64, origin: Instant) -> Result<f64> {
    wait_second(node, at)?;
    donor_a.signal(libc::SIGKILL);
    let killed = rack::since(origin);
    let st = donor_a.wait_exit(Duration::from_secs(10))?;
    drop(donor_a);
    println!("   t={killed:>5.1} s  kill -9 donor-a ({st})");
    Ok(killed)
}

/// Stop both donors with SIGTERM and wait for them.
fn stop_donors(donor_b: Child, donor_a: Child, t_all: Instant) -> Result<()> {
    for d in [&donor_b, &donor_a] {
        d.signal(libc::SIGTERM);
    }
    let mut stopped = true;
    for mut d in [donor_b, donor_a] {
        stopped &= d.wait_exit(Duration::from_secs(10))?.success();
    }
    println!(
        "9. donors stopped with SIGTERM{}; {:.1} s in all",
        if stopped { " (clean exits)" } else { "" },
        rack::since(t_all)
    );
    Ok(())
}

/// Fail unless the node succeeded, every step had usable rows, and every
/// one of the `tokens` positions fused what the reference fused.
fn check(
    status: ExitStatus,
    node_log: &str,
    steps: &[StepRecord],
    outputs: &Outputs,
    tokens: u64,
) -> Result<()> {
    if !status.success() {
        bail!("the node failed ({status}):\n{node_log}");
    }
    let failed = steps
        .iter()
        .filter(|s| s.tables.iter().any(|t| t.error.is_some()))
        .count();
    if failed > 0 {
        bail!("{failed} steps had a table with no usable rows");
    }
    let Outputs {
        reference,
        run,
        same,
    } = *outputs;
    if reference as u64 != tokens || run != reference || same != reference {
        bail!(
            "outputs differ from local RAM: {same} of {reference} positions identical ({run} in the run, {tokens} asked)"
        );
    }
    Ok(())
}

fn expect_success(c: &mut Child, timeout: Duration) -> Result<ExitStatus> {
    let st = c.wait_exit(timeout)?;
    if !st.success() {
        bail!("{} failed ({st}):\n{}", c.name(), c.log());
    }
    Ok(st)
}

/// Wait until the node's status line for second `at - 1` (so `at` seconds
/// into its loop have passed).
fn wait_second(node: &Child, at: u64) -> Result<()> {
    let want = at.saturating_sub(1);
    node.wait_line(Duration::from_secs(at * 4 + 60), |l| {
        let s = l.strip_prefix("t=")?.trim_start();
        let n: u64 = s.split('s').next()?.parse().ok()?;
        (n >= want).then_some(())
    })
    .with_context(|| format!("waiting for second {at} of the node's run"))
}

/// Cut the steps into seconds.
fn per_second(steps: &[StepRecord]) -> Vec<Second> {
    let mut s = Seconds::default();
    let mut out = Vec::new();
    for r in steps {
        out.extend(s.add(r));
    }
    out.extend(s.finish());
    out
}

/// When (seconds into the run) `source` first served a table after `from`.
fn first_use_after(steps: &[StepRecord], source: &str, from: f64) -> Option<f64> {
    steps
        .iter()
        .filter(|s| s.start_us / 1e6 >= from)
        .find(|s| s.tables.iter().any(|t| t.source.as_deref() == Some(source)))
        .map(|s| s.start_us / 1e6)
}

/// The source columns: the route's order, then any other name seen.
fn source_columns(seconds: &[Second]) -> Vec<String> {
    let mut cols: Vec<String> = SOURCES.iter().map(|s| s.to_string()).collect();
    for s in seconds {
        for k in s.rows_by_source.keys() {
            if !cols.contains(k) {
                cols.push(k.clone());
            }
        }
    }
    cols
}

/// The timeline as a table, one line per second.
fn timeline_table(seconds: &[Second]) -> String {
    let cols = source_columns(seconds);
    let mut out = format!("{:>6} {:>9} {:>13}", "second", "tokens/s", "stall p99 us");
    for c in &cols {
        out += &format!(" {:>9}", c);
    }
    out += &format!(" {:>9}\n", "failovers");
    let last = seconds.len().saturating_sub(1);
    for (i, s) in seconds.iter().enumerate() {
        out += &format!("{:>6} {:>9} {:>13.0}", s.second, s.tokens, s.stall_p99_us);
        for c in &cols {
            out += &format!(" {:>9}", s.rows_by_source.get(c).copied().unwrap_or(0));
        }
        out += &format!(" {:>9}", s.failovers);
        if i == last {
            out += "  (partial second)";
        }
        out += "\n";
    }
    out += &format!(
        "{:>6} {:>9} {:>13} {:^w$} {:>9}\n",
        "",
        "",
        "",
        "rows served per second",
        "",
        w = cols.len() * 10 - 1
    );
    out
}

/// The timeline chart: tokens/s, stall p99, rows per source; events for
/// the kill and the restart. The last (partial) second is left out.
fn timeline_chart(seconds: &[Second], target: f64, killed: f64, restarted: f64) -> Timeline {
    let full = &seconds[..seconds.len().saturating_sub(1)];
    let mid = |s: &Second| s.second as f64 + 0.5;
    let series = |name: &str, f: &dyn Fn(&Second) -> f64| Series {
        name: name.to_string(),
        points: full.iter().map(|s| (mid(s), f(s))).collect(),
    };
    let rows = source_columns(seconds)
        .into_iter()
        .map(|c| {
            series(&c, &|s: &Second| {
                s.rows_by_source.get(&c).copied().unwrap_or(0) as f64
            })
        })
        .collect();
    Timeline {
        title: "engram-bench demo: node \"rack\", donor-a killed and restarted".into(),
        x_label: "time into the run (s)".into(),
        panels: vec![
            Panel {
                title: "token rate".into(),
                unit: "tokens/s".into(),
                series: vec![
                    series("measured", &|s: &Second| s.tokens as f64),
                    series("target", &|_| target),
                ],
            },
            Panel {
                title: "stall p99 per second".into(),
                unit: "us".into(),
                series: vec![series("stall p99", &|s: &Second| s.stall_p99_us)],
            },
            Panel {
                title: "rows per source".into(),
                unit: "rows/s".into(),
                series: rows,
            },
        ],
        events: vec![
            (killed, "kill -9 donor-a".into()),
            (restarted, "restart donor-a".into()),
        ],
    }
}
