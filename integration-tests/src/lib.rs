//! The rack harness: engram-rack's real binaries, started as processes on
//! loopback addresses (or in network namespaces it makes), waited on
//! through their `ready` line (never a sleep), and killed when a test
//! ends, however it ends. The end-to-end tests beside it and engram-bench
//! both run racks with it, and write their rack configs with [`rack_toml`].
//!
//! The binaries are the ones cargo built next to the test executable
//! (`target/<profile>/`); build them first with `cargo build --workspace`
//! in the same profile (the README's test command does).

#![warn(missing_docs)]
#![allow(clippy::unwrap_used)]

pub mod drill;
pub mod forge;
pub mod load;
pub mod netns;
pub mod pki;
pub mod prometheus;
pub mod proxy;
pub mod rack_toml;
pub mod realtext;
pub mod ring_engine;
pub mod secure;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use engram_protocol::TableDigest;
use engram_protocol::hashing::{HashParams, Preset};
use engram_sync::{Condvar, Mutex};
use rack_toml::{DonorEntry, ModelSection, NodeEntry, RackToml, RouteEntry, TableEntry};

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

/// A two-worker tokio runtime, for tests that drive the async client.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// A blocking data-plane connection that has said Hello as `node` (the
/// Welcome is left unread), with a 5 s read timeout: for tests that send
/// what the client never would.
pub fn hello_stream(addr: SocketAddr, node: &str) -> std::net::TcpStream {
    hello_stream_at(addr, node, engram_protocol::PROTOCOL_VERSION)
}

/// [`hello_stream`] saying protocol `version`.
pub fn hello_stream_at(addr: SocketAddr, node: &str, version: u16) -> std::net::TcpStream {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut hello = Vec::new();
    engram_protocol::Hello {
        version,
        node,
        credential: b"",
    }
    .encode(&mut hello, 1)
    .expect("hello");
    s.write_all(&hello).expect("write hello");
    s
}

/// Generate a synthetic table with the real `memory-donor gen`.
pub fn gen_table(
    dir: &Path,
    name: &str,
    layer: u32,
    rows: u64,
    seed: u64,
) -> Result<(PathBuf, TableDigest)> {
    gen_with(dir, name, layer, &["--rows", &rows.to_string()], seed)
}

/// Generate a synthetic table sized by a hashing base (`gen --hash-base`):
/// exactly the rows the model loop addresses with `[model] hash_base`.
pub fn gen_hashed_table(
    dir: &Path,
    name: &str,
    layer: u32,
    base: u64,
    seed: u64,
) -> Result<(PathBuf, TableDigest)> {
    gen_with(dir, name, layer, &["--hash-base", &base.to_string()], seed)
}

/// Generate a synthetic table of rows in `encoding` (`gen --encoding`;
/// FP8's table scale 0.0123): every row is
/// `engram_protocol::synthetic::synthetic_encoded_row(encoding, seed, layer, row)`.
pub fn gen_encoded_table(
    dir: &Path,
    name: &str,
    layer: u32,
    encoding: engram_protocol::encoding::RowEncoding,
    rows: u64,
    seed: u64,
) -> Result<(PathBuf, TableDigest)> {
    let (rows, name_of) = (rows.to_string(), encoding.name());
    let mut size = vec!["--rows", &rows, "--encoding", &name_of];
    if encoding.has_tensor_scale() {
        size.extend(["--tensor-scale", "0.0123"]);
    }
    gen_with(dir, name, layer, &size, seed)
}

fn gen_with(
    dir: &Path,
    name: &str,
    layer: u32,
    size: &[&str],
    seed: u64,
) -> Result<(PathBuf, TableDigest)> {
    let path = dir.join(name);
    let out = Command::new(bin("memory-donor"))
        .args([
            "gen",
            "--layer",
            &layer.to_string(),
            "--seed",
            &seed.to_string(),
        ])
        .args(size)
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

/// A process's stderr lines so far, and whether it has closed.
#[derive(Debug, Default)]
struct Log {
    lines: Mutex<(Vec<String>, bool)>,
    grew: Condvar,
}

/// The processes started here and not yet reaped, by pid, and whether
/// [`stop_all_processes`] ran (no more may start then). Reaping a process
/// and taking it off the list happen under this lock, so a pid on it is
/// never one the kernel has handed to another process.
static LIVE: Mutex<(Vec<u32>, bool)> = Mutex::new((Vec::new(), false));

/// Kill (SIGKILL) every process started here that has not been reaped,
/// and refuse to start any more: what a command's interrupt handler does
/// so that none of its children outlive it. The waits on them then end,
/// and their owners' drops reap them.
pub fn stop_all_processes() {
    let mut live = LIVE.lock();
    live.1 = true;
    for &pid in &live.0 {
        // SAFETY: kill(2) on a child not yet reaped (see LIVE) has no
        // memory effects.
        unsafe {
            libc::kill(pid as i32, libc::SIGKILL);
        }
    }
}

/// A started process whose stderr is collected; killed on drop.
#[derive(Debug)]
pub struct Process {
    child: Child,
    log: Arc<Log>,
}

impl Process {
    /// Start `cmd`, collecting its stderr.
    pub fn spawn(cmd: Command) -> Result<Self> {
        Self::spawn_with_stdout(cmd, Stdio::null())
    }

    /// Start `cmd` with its stdout sent to `stdout` (a file, say),
    /// collecting its stderr.
    pub fn spawn_with_stdout(mut cmd: Command, stdout: Stdio) -> Result<Self> {
        let mut live = LIVE.lock();
        if live.1 {
            bail!("stopping: not starting {cmd:?}");
        }
        let mut child = cmd
            .stdout(stdout)
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {cmd:?}"))?;
        live.0.push(child.id());
        drop(live);
        let stderr = child.stderr.take().context("no stderr")?;
        let log = Arc::new(Log::default());
        let log2 = Arc::clone(&log);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                log2.lines.lock().0.push(line);
                log2.grew.notify_all();
            }
            log2.lines.lock().1 = true;
            log2.grew.notify_all();
        });
        Ok(Self { child, log })
    }

    /// Wait (at most `timeout`) for a log line `f` accepts, and return what it gives.
    pub fn wait_line<T>(
        &self,
        timeout: Duration,
        mut f: impl FnMut(&str) -> Option<T>,
    ) -> Result<T> {
        let end = Instant::now() + timeout;
        let mut seen = 0;
        let mut guard = self.log.lines.lock();
        loop {
            for line in &guard.0[seen..] {
                if let Some(t) = f(line) {
                    return Ok(t);
                }
            }
            seen = guard.0.len();
            let now = Instant::now();
            if guard.1 || now >= end {
                let why = if guard.1 { "exited" } else { "timed out" };
                bail!(
                    "{why} before the awaited line; log:\n{}",
                    guard.0.join("\n")
                );
            }
            guard = self.log.grew.wait_timeout(guard, end - now).0;
        }
    }

    /// Wait (at most `timeout`) until its stderr has closed and every line
    /// is collected (after it exited, the reader thread may still lag).
    pub fn wait_log_closed(&self, timeout: Duration) {
        let end = Instant::now() + timeout;
        let mut guard = self.log.lines.lock();
        while !guard.1 && Instant::now() < end {
            guard = self
                .log
                .grew
                .wait_timeout(guard, end.saturating_duration_since(Instant::now()))
                .0;
        }
    }

    /// The `ops control=ADDR metrics=ADDR` line (at most 60 s away).
    pub fn ops(&self) -> Result<OpsAddrs> {
        self.wait_line(Duration::from_secs(60), |l| {
            l.contains(" ops control=").then(|| OpsAddrs::parse(l))
        })
    }

    /// Wait (at most 60 s) for the `ready listen=` line.
    pub fn ready(self) -> Result<DonorProcess> {
        let addrs = self.wait_line(Duration::from_secs(60), |line| {
            let rest = line.split("ready listen=").nth(1)?;
            Some(
                rest.split_whitespace()
                    .next()
                    .unwrap_or_default()
                    .to_string(),
            )
        });
        let addrs = match addrs {
            Ok(a) => a,
            Err(e) => bail!("donor never became ready: {e}"),
        };
        // `IP:PORT` for TCP, `tls://IP:PORT` and `quic://IP:PORT` for the rest.
        let mut endpoints = Vec::new();
        let mut host_socket = None;
        for a in addrs.split(',') {
            if let Some(path) = a.strip_prefix("unix://") {
                host_socket = Some(PathBuf::from(path));
                continue;
            }
            let (transport, addr) = match a.split_once("://") {
                Some((t, rest)) => (
                    cluster_config::Transport::parse(t)
                        .with_context(|| format!("transport of {a:?} in the ready line"))?,
                    rest,
                ),
                None => (cluster_config::Transport::Tcp, a),
            };
            let addr: SocketAddr = addr.parse().context("parsing the ready line")?;
            endpoints.push(cluster_config::Endpoint::new(transport, addr));
        }
        let addrs: Vec<SocketAddr> = endpoints.iter().map(|e| e.addr).collect();
        Ok(DonorProcess {
            addr: addrs[0],
            addrs,
            endpoints,
            host_socket,
            process: self,
        })
    }

    /// Its process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Send a signal (`libc::SIGTERM`, `libc::SIGKILL`, ...).
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) with our own child's pid has no memory effects.
        unsafe {
            libc::kill(self.child.id() as i32, sig);
        }
    }

    /// Send SIGSTOP and wait (at most 10 s) until the kernel shows the
    /// process stopped: a signal is delivered asynchronously, and a request
    /// sent right after `kill` may otherwise still be answered.
    pub fn stop(&self) {
        self.signal(libc::SIGSTOP);
        let stat = format!("/proc/{}/stat", self.child.id());
        let end = Instant::now() + Duration::from_secs(10);
        while Instant::now() < end {
            let state = std::fs::read_to_string(&stat).unwrap_or_default();
            // "PID (comm) STATE ...": the state follows the last ')'.
            let s = state.rsplit(')').next().unwrap_or_default().trim_start();
            if s.starts_with('T') {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        panic!("the process did not stop");
    }

    /// Wait for the process to exit; `None` if it is still running after
    /// `timeout`. Once it has exited, its last log lines are read in too
    /// (for at most a second), so [`Process::log`] has all of them.
    pub fn wait(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let end = Instant::now() + timeout;
        while Instant::now() < end {
            if let Some(s) = self.try_reap() {
                self.wait_log_closed(Duration::from_secs(1));
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    /// The log so far.
    pub fn log(&self) -> String {
        self.log.lines.lock().0.join("\n")
    }
}

impl Process {
    /// Its exit status if it has exited (reaped, and off [`LIVE`]).
    fn try_reap(&mut self) -> Option<std::process::ExitStatus> {
        let mut live = LIVE.lock();
        let st = self.child.try_wait().ok().flatten()?;
        forget_pid(&mut live.0, self.child.id());
        Some(st)
    }
}

fn forget_pid(live: &mut Vec<u32>, pid: u32) {
    live.retain(|&p| p != pid);
}

impl Drop for Process {
    fn drop(&mut self) {
        let mut live = LIVE.lock();
        let _ = self.child.kill();
        let _ = self.child.wait();
        forget_pid(&mut live.0, self.child.id());
    }
}

/// Where a donor's control plane and metrics listen (from its `ops` line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpsAddrs {
    /// gRPC control plane.
    pub control: Option<SocketAddr>,
    /// Prometheus `/metrics`.
    pub metrics: Option<SocketAddr>,
}

impl OpsAddrs {
    fn parse(line: &str) -> Self {
        let field = |key: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(key))
                .and_then(|v| v.parse().ok())
        };
        Self {
            control: field("control="),
            metrics: field("metrics="),
        }
    }

    /// The control plane's URI for tonic clients.
    pub fn control_uri(&self) -> String {
        format!(
            "http://{}",
            self.control.expect("the donor runs a control plane")
        )
    }
}

/// A running service process that announced `ready listen=ADDR[,ADDR]` on
/// stderr; killed on drop. It derefs to its [`Process`].
#[derive(Debug)]
pub struct DonorProcess {
    process: Process,
    /// The first address it listens on.
    pub addr: SocketAddr,
    /// Every address it listens on.
    pub addrs: Vec<SocketAddr>,
    /// Every address it listens on, with its transport.
    pub endpoints: Vec<cluster_config::Endpoint>,
    /// Its host socket (`unix://PATH` in the ready line), if it has one.
    pub host_socket: Option<PathBuf>,
}

impl DonorProcess {
    /// The address it listens on for `transport`.
    pub fn endpoint(&self, transport: cluster_config::Transport) -> Option<SocketAddr> {
        self.endpoints
            .iter()
            .find(|e| e.transport == transport)
            .map(|e| e.addr)
    }
}

/// The rack PKI of `config` made as an operator would: `engram-cluster pki
/// init --config` then `pki issue --config` (certificates for every donor,
/// node and operator under its `[rack.tls]` directory).
pub fn rack_pki(config: &Path) -> Result<()> {
    pki_step(config, "init", false)?;
    pki_step(config, "issue", false)
}

/// `engram-cluster pki STEP --config CONFIG` (`init` or `issue`), with
/// `--force` (a new CA, or new certificates over the old).
pub fn pki_step(config: &Path, step: &str, force: bool) -> Result<()> {
    let mut cmd = Command::new(bin("engram-cluster"));
    cmd.args(["pki", step, "--config"]).arg(config);
    if force {
        cmd.arg("--force");
    }
    let out = cmd.output()?;
    if !out.status.success() {
        bail!(
            "engram-cluster pki {step} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

impl DonorProcess {
    /// Start `memory-donor serve ARGS` and wait (at most 60 s) for its `ready` line.
    pub fn start(args: &[&str]) -> Result<Self> {
        Self::launch(args)?.ready()
    }

    /// Start donor `name` of the config at `config`, as [`Self::start`].
    pub fn serving(config: &Path, name: &str) -> Result<Self> {
        Self::start(&["--config", &config.display().to_string(), "--name", name])
    }

    /// Start `memory-donor serve ARGS` without waiting for anything.
    pub fn launch(args: &[&str]) -> Result<Process> {
        let mut cmd = Command::new(bin("memory-donor"));
        cmd.arg("serve").args(args).env("RUST_LOG", "info");
        Process::spawn(cmd)
    }

    /// Start any command that prints a `ready listen=` line on stderr, and wait for it.
    pub fn spawn(cmd: Command) -> Result<Self> {
        Process::spawn(cmd)?.ready()
    }
}

impl std::ops::Deref for DonorProcess {
    type Target = Process;

    fn deref(&self) -> &Process {
        &self.process
    }
}

impl std::ops::DerefMut for DonorProcess {
    fn deref_mut(&mut self) -> &mut Process {
        &mut self.process
    }
}

/// `GET /metrics` over plain TCP; the whole response, head and body.
pub fn scrape(addr: SocketAddr) -> Result<String> {
    exchange(addr, b"GET /metrics HTTP/1.1\r\nHost: test\r\n\r\n")
}

/// Send `request` on a new connection and read until the server closes.
pub fn exchange(addr: SocketAddr, request: &[u8]) -> Result<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    // The server may close before reading everything (an oversized head).
    let _ = s.write_all(request);
    let mut out = Vec::new();
    match s.read_to_end(&mut out) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => return Err(e.into()),
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// The value of the sample `series` (name and labels exactly as exposed).
pub fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics.lines().find_map(|l| {
        let (name, value) = l.rsplit_once(' ')?;
        (name == series).then(|| value.parse().ok())?
    })
}

/// Notifications received, with their arrival times, and a signal for each.
type Notifications = (Mutex<Vec<(Instant, String)>>, Condvar);

/// A fake systemd: a notification socket (a unix datagram socket in a
/// directory the test owns) whose messages are collected with the time
/// they arrived, and a file descriptor store as systemd keeps one:
/// `FDSTORE=1` with `FDNAME=` keeps the descriptors a message carries,
/// `FDSTOREREMOVE=1` drops those of a name, and
/// [`NotifySocket::attach`] starts a process with them, as
/// systemd restarts a service (`LISTEN_FDS`, `LISTEN_FDNAMES`, `LISTEN_PID`).
#[derive(Debug)]
pub struct NotifySocket {
    /// The socket's path (give it to a daemon as `NOTIFY_SOCKET`).
    pub path: PathBuf,
    got: Arc<Notifications>,
    store: Arc<Mutex<Vec<(String, std::os::fd::OwnedFd)>>>,
}

/// One datagram and the descriptors it carried (`SCM_RIGHTS`).
fn recv_with_fds(
    sock: &std::os::unix::net::UnixDatagram,
    buf: &mut [u8],
) -> std::io::Result<(usize, Vec<std::os::fd::OwnedFd>)> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    const MAX_FDS: usize = 16;
    let mut control = [0u64; 64];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: zeroed msghdr is valid; we fill in our buffers below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = size_of_val(&control);
    // SAFETY: msg points at live buffers of the sizes it says.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote into `control`.
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !cmsg.is_null() {
        // SAFETY: cmsg is a header inside `control` (CMSG_FIRSTHDR/NXTHDR).
        let c = unsafe { &*cmsg };
        if c.cmsg_level == libc::SOL_SOCKET && c.cmsg_type == libc::SCM_RIGHTS {
            // SAFETY: as above; the data length is what the header says.
            let data = unsafe { libc::CMSG_DATA(cmsg) };
            let len = c.cmsg_len as usize - (data as usize - cmsg as usize);
            for i in 0..(len / 4).min(MAX_FDS) {
                // SAFETY: the kernel installed these descriptors for us.
                let fd = unsafe { data.cast::<i32>().add(i).read_unaligned() };
                // SAFETY: a new descriptor only we own.
                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
        // SAFETY: as above.
        cmsg = unsafe { libc::CMSG_NXTHDR(&msg, cmsg) };
    }
    Ok((n as usize, fds))
}

/// A `/bin/sh -c` script that sets `LISTEN_PID` to its own pid and execs
/// its arguments (`$0` the program), which then have that pid: how a test
/// starts a program under [`NotifySocket::attach`].
pub const EXEC_WITH_LISTEN_PID: &str = "LISTEN_PID=$$; export LISTEN_PID; exec \"$0\" \"$@\"";

impl NotifySocket {
    /// Bind `dir/notify.sock` and start collecting.
    pub fn bind(dir: &Path) -> Result<Self> {
        let path = dir.join("notify.sock");
        let sock = std::os::unix::net::UnixDatagram::bind(&path)?;
        let got: Arc<Notifications> = Arc::default();
        let store: Arc<Mutex<Vec<(String, std::os::fd::OwnedFd)>>> = Arc::default();
        let (got2, store2) = (Arc::clone(&got), Arc::clone(&store));
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 8192];
            while let Ok((n, fds)) = recv_with_fds(&sock, &mut buf) {
                let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
                let lines: Vec<&str> = msg.lines().collect();
                let name = lines
                    .iter()
                    .find_map(|l| l.strip_prefix("FDNAME="))
                    .unwrap_or("stored")
                    .to_string();
                if lines.contains(&"FDSTORE=1") {
                    let mut s = store2.lock();
                    s.extend(fds.into_iter().map(|f| (name.clone(), f)));
                } else if lines.contains(&"FDSTOREREMOVE=1") {
                    store2.lock().retain(|(n, _)| *n != name);
                }
                got2.0.lock().push((Instant::now(), msg));
                got2.1.notify_all();
            }
        });
        Ok(Self { path, got, store })
    }

    /// The names of the descriptors the store holds now, in order.
    pub fn stored(&self) -> Vec<String> {
        self.store.lock().iter().map(|(n, _)| n.clone()).collect()
    }

    /// Duplicates of the descriptors the store holds now, by name (what a
    /// restarted service would be handed).
    pub fn stored_files(&self) -> Result<Vec<(String, std::fs::File)>> {
        self.store
            .lock()
            .iter()
            .map(|(n, fd)| Ok((n.clone(), std::fs::File::from(fd.try_clone()?))))
            .collect()
    }

    /// Put a descriptor into the store as a service would have.
    pub fn store_fd(&self, name: &str, fd: std::os::fd::OwnedFd) {
        self.store.lock().push((name.to_string(), fd));
    }

    /// Empty the store (as `systemctl clean --what=fdstore` would).
    pub fn clear_store(&self) {
        self.store.lock().clear();
    }

    /// Set `cmd` up as systemd starts a service: this socket as
    /// `NOTIFY_SOCKET`, and the stored descriptors passed as descriptors
    /// 3, 4, ... with `LISTEN_FDS` and `LISTEN_FDNAMES`. `LISTEN_PID` must
    /// be the service's own pid: start it through [`EXEC_WITH_LISTEN_PID`].
    /// Drop the returned descriptors once the command is spawned.
    pub fn attach(&self, cmd: &mut Command) -> Result<Vec<std::os::fd::OwnedFd>> {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
        use std::os::unix::process::CommandExt;
        let store = self.store.lock();
        let mut fds: Vec<RawFd> = Vec::new();
        let mut held: Vec<OwnedFd> = Vec::new();
        let mut names = Vec::new();
        for (name, fd) in store.iter() {
            // A duplicate the child gets (above any descriptor it is
            // moved to); ours stays in the store.
            // SAFETY: dup of a descriptor we own.
            let d = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 100) };
            if d < 0 {
                bail!("dup: {}", std::io::Error::last_os_error());
            }
            // SAFETY: a new descriptor only we own.
            held.push(unsafe { OwnedFd::from_raw_fd(d) });
            fds.push(d);
            names.push(name.clone());
        }
        cmd.env("NOTIFY_SOCKET", &self.path)
            .env("LISTEN_FDS", fds.len().to_string())
            .env("LISTEN_FDNAMES", names.join(":"));
        // SAFETY: between fork and exec only dup2, which is
        // async-signal-safe.
        unsafe {
            cmd.pre_exec(move || {
                for (i, &fd) in fds.iter().enumerate() {
                    if libc::dup2(fd, 3 + i as RawFd) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        Ok(held)
    }

    /// Every message so far, with its arrival time.
    pub fn messages(&self) -> Vec<(Instant, String)> {
        self.got.0.lock().clone()
    }

    /// Wait (at most `timeout`) until the messages so far satisfy `f`.
    pub fn wait(
        &self,
        timeout: Duration,
        mut f: impl FnMut(&[(Instant, String)]) -> bool,
    ) -> Result<()> {
        let end = Instant::now() + timeout;
        let mut g = self.got.0.lock();
        loop {
            if f(&g) {
                return Ok(());
            }
            let now = Instant::now();
            if now >= end {
                let all: Vec<&str> = g.iter().map(|(_, m)| m.as_str()).collect();
                bail!("timed out; notifications so far:\n{}", all.join("\n---\n"));
            }
            g = self.got.1.wait_timeout(g, end - now).0;
        }
    }

    /// Wait for a message containing the line `line` (e.g. `READY=1`) and return its index.
    pub fn wait_line(&self, timeout: Duration, line: &str) -> Result<usize> {
        let mut at = 0;
        self.wait(timeout, |m| {
            match m.iter().position(|(_, s)| s.lines().any(|l| l == line)) {
                Some(i) => {
                    at = i;
                    true
                }
                None => false,
            }
        })?;
        Ok(at)
    }
}

impl Process {
    /// Start `memory-donor serve ARGS` under a fake systemd: `NOTIFY_SOCKET`
    /// is `notify`'s and whatever its fd store holds is passed in.
    pub fn launch_donor_under(notify: &NotifySocket, args: &[&str]) -> Result<Self> {
        let mut cmd = Command::new("/bin/sh");
        cmd.args(["-c", EXEC_WITH_LISTEN_PID])
            .arg(bin("memory-donor"))
            .arg("serve")
            .args(args)
            .env("RUST_LOG", "info");
        let held = notify.attach(&mut cmd)?;
        let p = Self::spawn(cmd);
        drop(held);
        p
    }

    /// Start `memory-donor serve ARGS` with extra environment variables.
    pub fn launch_donor_with_env(args: &[&str], env: &[(&str, &str)]) -> Result<Self> {
        let mut cmd = Command::new(bin("memory-donor"));
        cmd.arg("serve").args(args).env("RUST_LOG", "info");
        for (k, v) in env {
            cmd.env(k, v);
        }
        Self::spawn(cmd)
    }
}

/// Hashing base of [`model_rack`]'s tables.
pub const MODEL_BASE: u64 = 1000;
/// Generator seed of [`model_rack`]'s tables.
pub const MODEL_SEED: u64 = 11;

/// A port free on 127.0.0.1 now, and not handed out before in this
/// process: a config that takes several ports in a row gets distinct ones
/// (the kernel may hand a port just let go of out again at once), and so
/// do tests running side by side.
pub fn free_port() -> Result<u16> {
    free_port_on(std::net::Ipv4Addr::LOCALHOST)
}

/// [`free_port`] on `ip` (another loopback address), free for UDP too: a
/// donor may listen on both (TLS and QUIC on one port number).
pub fn free_port_on(ip: std::net::Ipv4Addr) -> Result<u16> {
    static GIVEN: Mutex<std::collections::BTreeSet<(std::net::Ipv4Addr, u16)>> =
        Mutex::new(std::collections::BTreeSet::new());
    for _ in 0..256 {
        let port = std::net::TcpListener::bind((ip, 0))
            .with_context(|| format!("binding {ip}:0 (is the address usable?)"))?
            .local_addr()?
            .port();
        if std::net::UdpSocket::bind((ip, port)).is_ok() && GIVEN.lock().insert((ip, port)) {
            return Ok(port);
        }
    }
    bail!("no port on {ip} free for TCP and UDP that this process has not handed out already")
}

/// True when python3 can import `modules`. Where it cannot, the test is
/// skipped with a note, unless ENGRAM_REQUIRE_PYTHON=1 (CI sets it, after
/// installing them), which makes a missing module a failure.
pub fn python_has(modules: &str) -> bool {
    let probe = Command::new("python3")
        .args(["-c", &format!("import {modules}")])
        .output();
    if probe.is_ok_and(|o| o.status.success()) {
        return true;
    }
    assert!(
        std::env::var("ENGRAM_REQUIRE_PYTHON").as_deref() != Ok("1"),
        "ENGRAM_REQUIRE_PYTHON=1 but python3 cannot import {modules}"
    );
    eprintln!("skipped: python3 cannot import {modules}");
    false
}

/// Lay out the `engram_rack` package in `dir` as its wheel does: the Python
/// half from the source tree beside the extension module cargo built in
/// this profile. Put `dir` on PYTHONPATH to import it.
pub fn python_package(dir: &Path) -> Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let pkg = dir.join("engram_rack");
    std::fs::create_dir_all(&pkg).with_context(|| format!("creating {}", pkg.display()))?;
    let src = root.join("inference-node/python/python/engram_rack");
    for f in std::fs::read_dir(&src).with_context(|| format!("reading {}", src.display()))? {
        let f = f?.path();
        if f.extension().is_some_and(|e| e == "py") {
            std::fs::copy(&f, pkg.join(f.file_name().context("file name")?))?;
        }
    }
    std::fs::copy(bin("lib_native.so"), pkg.join("_native.abi3.so"))
        .context("copying the extension module (cargo build --release --workspace builds it)")?;
    Ok(())
}

/// Two tables (layers 1 and 14), donor `d` serving both (frame cap 500
/// rows), donor `gone` that never runs, and three nodes: `n` (donor, then
/// SSD), `ref` (local RAM), `stranded` (only the absent donor). Tests that
/// change the rack take it from here; [`model_rack`] writes it as it is.
pub fn model_rack_config(dir: &Path) -> Result<RackToml> {
    let params = HashParams::new(Preset::from_base(MODEL_BASE)?)?;
    let (l1, d1) = gen_hashed_table(dir, "l1.etab", 1, MODEL_BASE, MODEL_SEED)?;
    let (l14, d14) = gen_hashed_table(dir, "l14.etab", 14, MODEL_BASE, MODEL_SEED)?;
    let [r1, r14] = [params.layers[0].rows, params.layers[1].rows];
    let node = |name: &str, sources: &[&str]| NodeEntry {
        tokens_per_second: Some(50.0),
        probe_interval_ms: Some(200),
        ..NodeEntry::new(
            name,
            vec![
                RouteEntry::new(1, sources.iter().copied()).ssd_path(&l1),
                RouteEntry::new(14, sources.iter().copied()).ssd_path(&l14),
            ],
        )
    };
    let mut rack = RackToml::new("t");
    rack.table = vec![
        TableEntry::new(1, &l1, r1, d1),
        TableEntry::new(14, &l14, r14, d14),
    ];
    rack.donor = vec![
        DonorEntry {
            max_rows: Some(500),
            ..DonorEntry::new("d", [format!("127.0.0.1:{}", free_port()?)], [1, 14])
        },
        DonorEntry::new("gone", [format!("127.0.0.1:{}", free_port()?)], [1, 14]),
    ];
    rack.node = vec![
        node("n", &["d", "ssd"]),
        node("ref", &["local"]),
        node("stranded", &["gone"]),
    ];
    rack.model = Some(ModelSection::synthetic(MODEL_BASE, 3, 8, 2));
    Ok(rack)
}

/// [`model_rack_config`] written to `dir/rack.toml`; returns its path.
pub fn model_rack(dir: &Path) -> Result<PathBuf> {
    let path = dir.join("rack.toml");
    model_rack_config(dir)?.write(&path)?;
    Ok(path)
}

/// The end-of-sequence id of [`qwen_rack_config`]'s model.
pub const QWEN_EOS: u32 = 7;

/// A Qwen4Exp rack (`[model] family = "qwen4exp"`, EOS [`QWEN_EOS`],
/// `hash_base` 1,000, a PLE layer of 4 streams of 16 channels, weights
/// seed 3): one PLE table of FP8 rows (table scale 0.0123) that its
/// hashing addresses, on donor `d` (loopback TCP); no node yet.
pub fn qwen_rack_config(dir: &Path) -> Result<RackToml> {
    use engram_protocol::encoding::RowEncoding;
    use engram_protocol::qwen4exp::{Qwen4ExpConfig, Qwen4ExpHashing};
    let fp8 = RowEncoding::Fp8PerTensor { values: 160 };
    let hashing = Qwen4ExpHashing::new(Qwen4ExpConfig {
        base: 1_000,
        ..Qwen4ExpConfig::qwen38_flash_next(u64::from(QWEN_EOS))
    })?;
    let rows = hashing.padded_rows;
    let (path, digest) = gen_encoded_table(dir, "ple.etab", 1, fp8, rows, 5)?;
    let mut toml = RackToml::new("q");
    toml.table = vec![TableEntry {
        encoding: Some(fp8.name()),
        tensor_scale: Some(0.0123),
        ..TableEntry::new(1, &path, rows, digest)
    }];
    toml.donor = vec![DonorEntry::new(
        "d",
        [format!("127.0.0.1:{}", free_port()?)],
        [1],
    )];
    toml.model = Some(ModelSection {
        family: Some("qwen4exp".into()),
        eos_token: Some(QWEN_EOS),
        hash_base: Some(1_000),
        hidden: Some(16),
        streams: Some(4),
        weights_seed: Some(3),
        ..ModelSection::default()
    });
    Ok(toml)
}

/// A TCP connection to `to` from the loopback address `from` (any of
/// 127.0.0.0/8, so a test can look like many hosts), or `None`.
pub fn connect_from(from: std::net::Ipv4Addr, to: SocketAddr) -> Option<std::net::TcpStream> {
    use std::os::fd::FromRawFd;
    let SocketAddr::V4(to) = to else {
        return None;
    };
    let len = size_of::<libc::sockaddr_in>() as libc::socklen_t;
    let (local, remote) = (
        forge::sockaddr_in(from, 0),
        forge::sockaddr_in(*to.ip(), to.port()),
    );
    // SAFETY: plain socket calls on a descriptor owned here and handed to
    // TcpStream once; every result is checked.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return None;
        }
        let s = std::net::TcpStream::from_raw_fd(fd);
        if libc::bind(fd, (&raw const local).cast(), len) != 0
            || libc::connect(fd, (&raw const remote).cast(), len) != 0
        {
            return None;
        }
        Some(s)
    }
}
