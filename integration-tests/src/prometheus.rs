//! A real Prometheus (Debian's `prometheus` package) for the monitoring
//! tests: started on a loopback port with its data in a directory the test
//! owns, scraping the rack's `/metrics` addresses every second and
//! evaluating the rules of `systemd/monitoring/` every second, killed when
//! the test ends. Queries go through its HTTP API (HTTP/1.0, so each answer
//! ends with its connection).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::{Process, exchange, free_port};

/// Where Debian's package puts the server.
pub const PROMETHEUS: &str = "/usr/bin/prometheus";
/// Where it puts the rules' test tool.
pub const PROMTOOL: &str = "/usr/bin/promtool";

/// `systemd/monitoring/` in the source tree.
pub fn monitoring_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../systemd/monitoring")
}

/// A running Prometheus.
#[derive(Debug)]
pub struct Prometheus {
    /// Its HTTP API.
    pub addr: SocketAddr,
    _process: Process,
}

impl Prometheus {
    /// Start Prometheus in `dir` scraping `jobs` (a job's name and its
    /// targets) every second, with `rules` (a rules file's text) evaluated
    /// every second, and wait (at most 30 s) until it is ready.
    pub fn start(dir: &Path, jobs: &[(&str, Vec<SocketAddr>)], rules: &str) -> Result<Self> {
        std::fs::write(dir.join("rules.yml"), rules)?;
        let mut config = String::from(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n  evaluation_interval: 1s\n\
             rule_files:\n  - rules.yml\nscrape_configs:\n",
        );
        for (job, targets) in jobs {
            let targets: Vec<String> = targets.iter().map(|t| format!("\"{t}\"")).collect();
            config.push_str(&format!(
                "  - job_name: {job}\n    static_configs:\n      - targets: [{}]\n",
                targets.join(", ")
            ));
        }
        let config_file = dir.join("prometheus.yml");
        std::fs::write(&config_file, config)?;
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
        let mut cmd = Command::new(PROMETHEUS);
        cmd.arg(format!("--config.file={}", config_file.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--log.level=warn");
        let prometheus = Self {
            addr,
            _process: Process::spawn(cmd)?,
        };
        prometheus.wait_ready(Duration::from_secs(30))?;
        Ok(prometheus)
    }

    fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let end = Instant::now() + timeout;
        loop {
            match self.get("/-/ready") {
                Ok((200, _)) => return Ok(()),
                _ if Instant::now() >= end => bail!("Prometheus not ready within {timeout:?}"),
                // Its ready endpoint is the signal; between asks it starts up.
                _ => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// `GET path`: the status code and the body.
    fn get(&self, path: &str) -> Result<(u16, String)> {
        let request = format!("GET {path} HTTP/1.0\r\nHost: prometheus\r\n\r\n");
        let answer = exchange(self.addr, request.as_bytes())?;
        let (head, body) = answer.split_once("\r\n\r\n").context("no HTTP head")?;
        let code = head
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .context("no status code")?;
        Ok((code, body.to_string()))
    }

    /// The series an instant query answers now (`data.result`).
    pub fn query(&self, expr: &str) -> Result<Vec<Value>> {
        let (code, body) = self.get(&format!("/api/v1/query?query={}", url_encode(expr)))?;
        let v: Value = serde_json::from_str(&body).with_context(|| format!("{code}: {body}"))?;
        if v["status"] != "success" {
            bail!("{expr}: {body}");
        }
        Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
    }

    /// The labels of each firing alert named `name` (`/api/v1/alerts`).
    pub fn firing(&self, name: &str) -> Result<Vec<Value>> {
        let (code, body) = self.get("/api/v1/alerts")?;
        let v: Value = serde_json::from_str(&body).with_context(|| format!("{code}: {body}"))?;
        let alerts = v["data"]["alerts"].as_array().cloned().unwrap_or_default();
        Ok(alerts
            .into_iter()
            .filter(|a| a["labels"]["alertname"] == name && a["state"] == "firing")
            .map(|a| a["labels"].clone())
            .collect())
    }

    /// Ask `f` again (every 250 ms, Prometheus's own evaluations set the
    /// pace) until it says yes, for at most `timeout`.
    pub fn wait_for(
        &self,
        timeout: Duration,
        what: &str,
        mut f: impl FnMut(&Self) -> Result<bool>,
    ) -> Result<()> {
        let end = Instant::now() + timeout;
        loop {
            if f(self)? {
                return Ok(());
            }
            if Instant::now() >= end {
                bail!("timed out after {timeout:?} waiting for {what}");
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

/// Every dashboard query of `systemd/monitoring/engram-rack.dashboard.json`
/// (each panel's targets' `expr`), with its panel's title.
pub fn dashboard_queries() -> Result<Vec<(String, String)>> {
    let text = std::fs::read_to_string(monitoring_dir().join("engram-rack.dashboard.json"))?;
    let dash: Value = serde_json::from_str(&text)?;
    let mut out = Vec::new();
    for panel in dash["panels"].as_array().context("no panels")? {
        for target in panel["targets"].as_array().into_iter().flatten() {
            if let Some(expr) = target["expr"].as_str() {
                let title = panel["title"].as_str().unwrap_or_default();
                out.push((title.to_string(), expr.to_string()));
            }
        }
    }
    Ok(out)
}

/// A query string's value, percent-encoded (everything but RFC 3986's
/// unreserved characters).
fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
