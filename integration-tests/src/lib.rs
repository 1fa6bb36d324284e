//! Harness for engram-rack's end-to-end tests: the real binaries, started as
//! processes on loopback addresses, waited on through their `ready` line
//! (never a sleep), and killed when a test ends, however it ends.
//!
//! The binaries are the ones cargo built next to the test executable
//! (`target/<profile>/`); build them first with `cargo build --workspace`
//! in the same profile (the README's test command does).

#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use engram_protocol::TableDigest;

/// Path of a workspace binary built in the same profile as the running
/// executable: beside it (`target/<profile>/engram-bench`) or one level up
/// (`target/<profile>/deps/<test>`).
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("executable path");
    let here = exe.parent().expect("executable directory");
    for dir in [Some(here), here.parent()].into_iter().flatten() {
        let path = dir.join(name);
        if path.is_file() {
            return path;
        }
    }
    panic!(
        "{name} is missing next to {}: build the binaries first (cargo build --workspace, same profile)",
        exe.display()
    );
}

/// Generate a synthetic table with the real `memory-donor gen`.
pub fn gen_table(
    dir: &Path,
    name: &str,
    layer: u32,
    rows: u64,
    seed: u64,
) -> Result<(PathBuf, TableDigest)> {
    let path = dir.join(name);
    let out = Command::new(bin("memory-donor"))
        .args([
            "gen",
            "--layer",
            &layer.to_string(),
            "--rows",
            &rows.to_string(),
            "--seed",
            &seed.to_string(),
        ])
        .arg("--out")
        .arg(&path)
        .output()
        .context("running memory-donor gen")?;
    if !out.status.success() {
        bail!(
            "memory-donor gen failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let digest = text
        .split_whitespace()
        .last()
        .context("gen printed no digest")?
        .parse()?;
    Ok((path, digest))
}

/// A running service process that announces `ready listen=ADDR[,ADDR]` on
/// stderr; killed on drop.
#[derive(Debug)]
pub struct DonorProcess {
    child: Child,
    /// The first address it listens on.
    pub addr: SocketAddr,
    /// Every address it listens on.
    pub addrs: Vec<SocketAddr>,
    log: Arc<Mutex<Vec<String>>>,
}

impl DonorProcess {
    /// Start `memory-donor serve ARGS` and wait (at most 60 s) for its `ready` line.
    pub fn start(args: &[&str]) -> Result<Self> {
        let mut cmd = Command::new(bin("memory-donor"));
        cmd.arg("serve").args(args).env("RUST_LOG", "info");
        Self::spawn(cmd)
    }

    /// Start any command that prints a `ready listen=` line on stderr, and wait for it.
    pub fn spawn(mut cmd: Command) -> Result<Self> {
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {cmd:?}"))?;
        let stderr = child.stderr.take().context("no stderr")?;
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        let log2 = Arc::clone(&log);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("ready listen=").nth(1) {
                    let addrs = rest
                        .split_whitespace()
                        .next()
                        .unwrap_or_default()
                        .to_string();
                    let _ = tx.send(addrs);
                }
                log2.lock().unwrap().push(line);
            }
        });
        let addrs = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(a) => a,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                bail!(
                    "donor never became ready; its log:\n{}",
                    log.lock().unwrap().join("\n")
                );
            }
        };
        let addrs: Vec<SocketAddr> = addrs
            .split(',')
            .map(str::parse)
            .collect::<Result<_, _>>()
            .context("parsing the ready line")?;
        Ok(Self {
            child,
            addr: addrs[0],
            addrs,
            log,
        })
    }

    /// Send a signal (`libc::SIGTERM`, `libc::SIGKILL`, ...).
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) with our own child's pid has no memory effects.
        unsafe {
            libc::kill(self.child.id() as i32, sig);
        }
    }

    /// Wait for the process to exit; `None` if it is still running after `timeout`.
    pub fn wait(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let end = Instant::now() + timeout;
        while Instant::now() < end {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    /// The log so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }
}

impl Drop for DonorProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
