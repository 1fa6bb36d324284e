//! The donor's serving loop, beside the data plane: it carries out orders
//! (a SIGHUP reload, a control-plane table swap), proves the serving path
//! works before each systemd watchdog ping (`watchdog::SelfProbe`), keeps
//! systemd's status line current, and returns when a drain is requested.
//!
//! Test-only: `ENGRAM_TEST_STALL_AFTER_MS=N` makes the donor, N ms after
//! it is ready, take the tables' write lock and never release it, as a
//! swap that deadlocked would: lookups (and the watchdog probe) hang while
//! the process, its runtime and its control plane stay up. The
//! integration tests use it to show that the watchdog pings stop. Never
//! set it in production.

use std::sync::Arc;
use std::time::Duration;

use daemon_runtime::logging::{LogLevel, RateLimit};
use daemon_runtime::notify::Notifier;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::orders::{Order, Reply, SwapError, SwapRequest};
use crate::reload::{self, ReloadSource, ServedTable};
use crate::server::Shared;
use crate::spec::ServeSpec;
use crate::status::DonorState;
use crate::swap::{self, SwapContext};
use crate::watchdog::SelfProbe;

/// What the serving loop uses besides the spec.
#[derive(Debug)]
pub struct LoopServices {
    /// systemd notifications (a no-op outside systemd).
    pub notifier: Arc<Notifier>,
    /// Changes the log level on reload.
    pub log_level: LogLevel,
    /// The config to re-read on SIGHUP (none: started from flags).
    pub reload: Option<ReloadSource>,
    /// systemd's fd store (tables kept for the next start).
    pub fd_store: Arc<crate::fdstore::FdStore>,
}

/// How often the status line is refreshed when there is no watchdog.
const STATUS_EVERY: Duration = Duration::from_secs(5);

/// The environment variable of the test-only stall (see the module docs).
pub const TEST_STALL_ENV: &str = "ENGRAM_TEST_STALL_AFTER_MS";

struct ServingLoop {
    spec: ServeSpec,
    shared: Arc<Shared>,
    status: Arc<DonorState>,
    ops: LoopServices,
    probe: Option<SelfProbe>,
    swapping: Option<JoinHandle<()>>,
    shown: String,
}

async fn next_order(rx: &mut Option<mpsc::Receiver<Order>>) -> Option<Order> {
    match rx {
        Some(r) => r.recv().await,
        None => std::future::pending().await,
    }
}

/// Run until a drain is requested; then say STOPPING=1.
pub async fn run(
    spec: ServeSpec,
    shared: Arc<Shared>,
    status: Arc<DonorState>,
    probe_addr: Option<cluster_config::Endpoint>,
    ops: LoopServices,
) {
    let watchdog = ops.notifier.watchdog();
    // sd_watchdog_enabled(3): ping at half the timeout.
    let period = watchdog.map_or(STATUS_EVERY, |w| (w / 2).max(Duration::from_millis(1)));
    let probe = probe_addr.filter(|_| watchdog.is_some()).map(|e| {
        let tls = (e.transport == cluster_config::Transport::Tls)
            .then(|| shared.tls().cloned())
            .flatten();
        SelfProbe::new(
            e.addr,
            &spec.server.name,
            spec.server.credential.clone(),
            tls,
        )
    });
    let mut orders = status.take_orders();
    let mut lp = ServingLoop {
        spec,
        shared,
        status,
        ops,
        probe,
        swapping: None,
        shown: String::new(),
    };
    test_stall(&lp.shared);
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = lp.status.drain_requested() => break,
            Some(order) = next_order(&mut orders) => match order {
                Order::Reload => lp.reload(),
                Order::Swap(req, reply) => lp.start_swap(req, reply),
            },
            _ = tick.tick() => lp.tick(period).await,
        }
    }
    let open = lp.shared.open_connections();
    if let Err(e) = lp
        .ops
        .notifier
        .stopping(&format!("draining: {open} connections"))
    {
        tracing::debug!(error = %e, "sd_notify STOPPING=1");
    }
}

impl ServingLoop {
    fn status_line(&self) -> String {
        // From the status, not the tables' lock: this loop must never wait on it.
        format!(
            "serving {} tables, {} connections",
            self.status.tables.len(),
            self.shared.open_connections()
        )
    }

    async fn tick(&mut self, period: Duration) {
        if let Some(probe) = self.probe.as_mut() {
            static PROBE_FAILED: RateLimit = RateLimit::new(1);
            match probe.check(period).await {
                Ok(()) => {
                    if let Err(e) = self.ops.notifier.watchdog_ping() {
                        tracing::debug!(error = %e, "sd_notify WATCHDOG=1");
                    }
                }
                Err(e) => {
                    if let Some(suppressed) = PROBE_FAILED.allow() {
                        tracing::warn!(
                            error = %e,
                            suppressed,
                            "watchdog: the serving path did not answer its own probe; not pinging systemd"
                        );
                    }
                }
            }
        }
        if self.ops.notifier.is_enabled() {
            let line = self.status_line();
            if line != self.shown {
                let _ = self.ops.notifier.status(&line);
                self.shown = line;
            }
        }
    }

    fn swap_context(&self) -> SwapContext {
        SwapContext {
            shared: Arc::clone(&self.shared),
            status: Arc::clone(&self.status),
            notifier: Arc::clone(&self.ops.notifier),
            trust_digest: self.spec.trust_digest,
            mlock: self.spec.mlock,
            budget: self.spec.ram_budget,
            fd_store: Arc::clone(&self.ops.fd_store),
            map_files: self.spec.map_files,
            host_shared: self.spec.host.is_some(),
            serves_rdma: self.spec.rdma.is_some(),
            numa_node: self.spec.numa_node,
            load_threads: self.spec.load_threads,
            planar: self.spec.host_layout == cluster_config::KeptLayout::Planar,
        }
    }

    fn swap_busy(&self) -> bool {
        self.swapping.as_ref().is_some_and(|h| !h.is_finished())
    }

    /// A swap the control plane asked for: only a file beneath the table
    /// directories (of the config as last reloaded), opened and checked off
    /// this loop; `reply` gets the verdict once it is known.
    fn start_swap(&mut self, req: SwapRequest, reply: Reply) {
        if self.status.is_drain_requested() {
            let _ = reply.send(Err(SwapError::NotServing));
            return;
        }
        if self.swap_busy() {
            let _ = reply.send(Err(SwapError::Busy));
            return;
        }
        let cx = self.swap_context();
        let dirs = self.spec.table_dirs.clone();
        self.swapping = Some(tokio::spawn(async move {
            match swap::prepare_off_loop(&cx, req, Some(dirs)).await {
                Ok(prepared) => {
                    let _ = reply.send(Ok(prepared.accepted()));
                    // Failures are logged and shown in ListTables by `run` itself.
                    let _ = swap::run(cx, prepared).await;
                }
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            }
        }));
    }

    fn served(&self) -> Vec<ServedTable> {
        self.shared
            .tables()
            .iter()
            .map(|t| ServedTable {
                id: t.id,
                digest: t.digest,
                path: self
                    .status
                    .tables
                    .iter()
                    .find(|s| s.view().id == t.id)
                    .map(|s| s.path())
                    .unwrap_or_default(),
            })
            .collect()
    }

    fn reload(&mut self) {
        let _ = self.ops.notifier.reloading();
        self.apply_reload();
        let _ = self.ops.notifier.ready(&self.status_line());
    }

    fn apply_reload(&mut self) {
        let Some(src) = &self.ops.reload else {
            tracing::warn!("SIGHUP: started without --config, so there is nothing to re-read");
            return;
        };
        let new = match src.read() {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(
                    config = %src.path.display(),
                    "reload: the config was rejected; the running config stays"
                );
                // One journal entry per diagnostic (FILE:LINE:COLUMN: KEY: MESSAGE).
                for line in e.to_string().lines() {
                    tracing::error!(config = %src.path.display(), "reload: {line}");
                }
                return;
            }
        };
        let plan = reload::plan(&self.spec, new, &self.served());
        let mut not_applied = plan.restart.clone();
        not_applied.extend(self.shared.set_config(plan.spec.server.clone()).0);
        self.status
            .set_drain_timeout(plan.spec.server.drain_timeout);
        if let Some(level) = &plan.spec.log_level
            && let Err(e) = self.ops.log_level.set(level)
        {
            tracing::warn!(level = %level, error = %e, "reload: log level not changed");
        }
        if let Some(p) = self.probe.as_mut() {
            p.set_credential(plan.spec.server.credential.clone());
        }
        self.reload_tls(&plan.spec, &mut not_applied);
        for what in &not_applied {
            tracing::warn!("reload: {what}: needs a restart; not applied");
        }
        self.spec = plan.spec;
        let server = self.shared.config();
        tracing::info!(
            config = %src.path.display(),
            hello_timeout_ms = server.hello_timeout.as_millis() as u64,
            idle_timeout_ms = server.idle_timeout.as_millis() as u64,
            write_timeout_ms = server.write_timeout.as_millis() as u64,
            drain_timeout_ms = server.drain_timeout.as_millis() as u64,
            busy_poll_us = server.busy_poll.as_micros() as u64,
            max_connections = server.max_connections,
            swaps = plan.swaps.len(),
            "reload: config applied"
        );
        if plan.swaps.is_empty() {
            return;
        }
        if self.swap_busy() {
            tracing::warn!("reload: a swap is under way; reload again once it is done");
            return;
        }
        self.reload_swaps(plan.swaps);
    }

    /// A reload's TLS: new certificate and key for new connections, and
    /// the open sessions checked against the new CA and access rules.
    /// Adding or removing `[rack.tls]` needs a restart (`not_applied`).
    fn reload_tls(&self, spec: &ServeSpec, not_applied: &mut Vec<String>) {
        match (self.status.tls.get(), &spec.tls) {
            (Some(tls), Some((files, access))) => match tls.reload(files, access.clone()) {
                Ok(m) => {
                    self.shared.refresh_quic();
                    tracing::info!(
                    identity = %m.identity,
                    cert = %files.cert.display(),
                    "reload: TLS certificate and key loaded; new connections use them"
                    );
                }
                Err(e) => tracing::error!(
                    error = %e,
                    "reload: the new TLS certificate or key was refused; the old ones stay"
                ),
            },
            (None, Some(_)) => not_applied.push("[rack.tls] added".into()),
            (Some(_), None) => not_applied.push("[rack.tls] removed".into()),
            (None, None) => {}
        }
        if self.status.tls.get().is_some() {
            // Open sessions face the new CA and access rules now, not at
            // the next periodic check.
            let sh = Arc::clone(&self.shared);
            tokio::task::spawn_blocking(move || {
                let cut = sh.recheck_sessions();
                if cut > 0 {
                    tracing::warn!(cut, "reload: sessions no longer admitted were closed");
                }
            });
        }
    }

    /// A reload's swaps, one at a time: each RAM check sees the previous
    /// swap's result.
    fn reload_swaps(&mut self, swaps: Vec<SwapRequest>) {
        let cx = self.swap_context();
        self.swapping = Some(tokio::spawn(async move {
            for req in swaps {
                let table = req.table;
                match swap::prepare_off_loop(&cx, req, None).await {
                    Ok(p) => {
                        let _ = swap::run(cx.clone(), p).await;
                    }
                    Err(e) => {
                        tracing::error!(table, "reload: swap refused: {e}");
                        if let Some(s) = cx.status.tables.iter().find(|s| s.view().id == table) {
                            s.note_error(format!("swap refused: {e}"));
                        }
                    }
                }
            }
        }));
    }
}

/// The test-only stall (see the module docs).
fn test_stall(shared: &Arc<Shared>) {
    let Some(ms) = std::env::var(TEST_STALL_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
    else {
        return;
    };
    let shared = Arc::clone(shared);
    let spawned = std::thread::Builder::new()
        .name("test-stall".into())
        .spawn(move || {
            std::thread::sleep(Duration::from_millis(ms));
            let _held = shared.tables_mut();
            tracing::warn!(
                "{TEST_STALL_ENV}: the tables' write lock is now held forever; lookups hang (test only)"
            );
            loop {
                std::thread::park();
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "{TEST_STALL_ENV}: cannot start the stall thread");
    }
}
