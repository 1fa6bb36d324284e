//! A storm of TLS and QUIC handshakes at a donor that never become
//! sessions: half-open TLS (the first half of a real ClientHello, then
//! silence, reopened as the donor closes it), complete TLS handshakes with
//! no client certificate or one from another CA, junk UDP datagrams at the
//! QUIC port, half-open QUIC (a real Initial, never answered) and QUIC
//! handshakes with no client certificate. Bounded: one thread per kind,
//! every socket with timeouts, all stopped and joined by
//! [`HandshakeStorm::stop`]. And the drill that aims it at a donor while
//! the node is served over TLS.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use cluster_config::Config;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use self::forged::{ForgedDial, forged_then_dial};
use self::quic::{quic_half_open, quic_intruders, quic_junk};
use super::scaffold::{FAULT_AT, Opts, SECONDS, finish, max_open_during_fault};
use super::{Env, Outcome, Plan, Rack, Report};
use crate::sample;

/// The handshake storm's name and what it does.
pub(super) const NAME: &str = "storm-handshakes";
pub(super) const ABOUT: &str = "1,000 half-open TLS handshakes, 1,000 spoofed QUIC Initials, 1,000 more forged from the node's own address, refused handshakes, junk datagrams and 200 silent control connections at the primary (node over TLS, a QUIC dial from the node's address, an operator's status)";

mod forged;
mod quic;
mod verdict;

/// Half-open TLS connections held at once (far past the donor's pre-auth
/// budget), from [`TLS_SOURCES`] loopback addresses.
const TLS_HELD: usize = 1000;
const TLS_SOURCES: u32 = 40;
/// Half-open TLS connections opened at most per round of the storm's loop
/// (every 5 ms) until the first [`TLS_HELD`] are open, and reopened at
/// most per round after that.
const TLS_BURST: usize = 50;
const TLS_REOPEN: usize = 4;
/// QUIC Initials sent at once from [`SPOOFED_SOURCES`] addresses, as a
/// spoofing attacker would (no answer is read).
const SPOOFED_INITIALS: usize = 1000;
const SPOOFED_SOURCES: u8 = 40;
/// Silent connections to the control plane held through the storm, from
/// [`CONTROL_SOURCES`] addresses.
const CONTROL_SILENT: u32 = 200;
const CONTROL_SOURCES: u32 = 20;
/// Socket timeouts, and the pause between two attempts of one thread.
const TIMEOUT: Duration = Duration::from_millis(200);
const PAUSE: Duration = Duration::from_millis(2);
/// How long a TLS intruder waits for the donor's verdict before it counts
/// itself let in.
const INTRUDER_VERDICT: Duration = Duration::from_secs(1);
/// Slack over the hello timeout for a donor closing a half-open handshake
/// on a loaded machine (this storm's polling included).
const CLOSE_ALLOWANCE: Duration = Duration::from_millis(250);

/// [`HandshakeStats`], what the storm did and saw, and the atomic
/// `Counters` its threads count in, field for field.
macro_rules! stats {
    ($($(#[$doc:meta])* $field:ident,)*) => {
        /// What the storm did and saw.
        #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
        pub struct HandshakeStats {
            $($(#[$doc])* pub $field: u64,)*
        }

        #[derive(Debug, Default)]
        struct Counters {
            $($field: AtomicU64,)*
        }

        impl Counters {
            fn snapshot(&self) -> HandshakeStats {
                HandshakeStats {
                    $($field: self.$field.load(Ordering::Relaxed),)*
                }
            }
        }
    };
}

stats! {
    /// Half-open TLS handshakes opened, and the most held at once.
    tls_half_open,
    tls_held_max,
    /// Of those, closed by the donor, and left open past the bound.
    tls_closed,
    tls_unclosed,
    /// The longest and the total time the donor took to close one, microseconds.
    tls_close_max_us,
    tls_close_sum_us,
    /// Complete TLS handshakes without a rack certificate: attempted,
    /// refused by the donor, let in.
    tls_intruders,
    tls_refused,
    tls_admitted,
    /// Junk datagrams sent to the QUIC port.
    quic_junk,
    /// QUIC Initials sent from spoofed-looking sources, never answered.
    quic_spoofed,
    /// Half-open QUIC Initials sent.
    quic_initials,
    /// Of those retired: held by the donor, then closed (the longest,
    /// microseconds); refused at once; unanswered.
    quic_held,
    quic_close_max_us,
    quic_refused_at_once,
    quic_unanswered,
    /// QUIC handshakes without a client certificate: attempted, refused, let in.
    quic_intruders,
    quic_refused,
    quic_admitted,
    /// Of those, handshakes that got no answer in time (not let in).
    quic_no_verdict,
}

/// One thread of the storm: its loop, given the stop flag and the counters.
type Task = Box<dyn FnOnce(&AtomicBool, &Counters) + Send>;

fn add(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Client configurations that are not the rack's: no certificate, and a
/// certificate from another CA (both trust the rack CA, so the donor's
/// verdict is on them, not theirs on the donor).
#[derive(Debug, Clone)]
pub struct Intruders {
    no_cert: Arc<rustls::ClientConfig>,
    other_ca: Arc<rustls::ClientConfig>,
    /// The rack CA's certificate file (what a client would trust).
    ca: std::path::PathBuf,
}

impl Intruders {
    /// Another CA and a certificate for node `node` signed by it, made
    /// with `engram-cluster pki` from a copy of `config` in `dir`.
    pub fn make(config: &Path, node: &str, dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        let copy = dir.join("rack.toml");
        std::fs::copy(config, &copy).context("copying the rack config")?;
        crate::rack_pki(&copy).context("another CA")?;
        let ours = Config::load(config).context("the rack config")?;
        let ca = &ours.tls.as_ref().context("the rack has no [rack.tls]")?.ca;
        let theirs = Config::load(&copy).context("the copied config")?;
        let other = theirs.tls_files(node).context("no certificate files")?;
        let read = |p: &Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
        let chain: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(&read(&other.cert)?)
                .collect::<Result<_, _>>()
                .context("the other CA's certificate")?;
        let key = PrivateKeyDer::from_pem_slice(&read(&other.key)?).context("its key")?;
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(&read(ca)?) {
            roots.add(c.context("the rack CA")?)?;
        }
        let builder = || {
            rustls::ClientConfig::builder_with_provider(cluster_config::tls::provider())
                .with_protocol_versions(&[&rustls::version::TLS13])
                .map(|b| b.with_root_certificates(roots.clone()))
        };
        let alpn = |mut c: rustls::ClientConfig| {
            c.alpn_protocols = vec![cluster_config::tls::ALPN.to_vec()];
            Arc::new(c)
        };
        Ok(Self {
            no_cert: alpn(builder()?.with_no_client_auth()),
            other_ca: alpn(builder()?.with_client_auth_cert(chain, key)?),
            ca: ca.clone(),
        })
    }

    fn quic(&self) -> Result<quinn::ClientConfig> {
        let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(self.no_cert.clone())
            .context("a QUIC client configuration")?;
        Ok(quinn::ClientConfig::new(Arc::new(crypto)))
    }
}

/// A storm in progress.
#[derive(Debug)]
pub struct HandshakeStorm {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    counters: Arc<Counters>,
}

impl HandshakeStorm {
    /// Start it against a donor named `donor` listening on `tls` and
    /// `quic`, whose hello timeout is `hello`.
    pub fn start(
        donor: &str,
        tls: SocketAddr,
        quic: SocketAddr,
        hello: Duration,
        intruders: &Intruders,
    ) -> Result<Self> {
        let name = cluster_config::tls::server_name(donor)?;
        let stop = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(Counters::default());
        // The first half of a real ClientHello.
        let mut hello_bytes = Vec::new();
        rustls::ClientConnection::new(intruders.no_cert.clone(), name.clone())?
            .write_tls(&mut hello_bytes)?;
        hello_bytes.truncate(hello_bytes.len() / 2);
        let quic_config = intruders.quic()?;
        let mut threads = Vec::new();
        let mut spawn = |f: Task| {
            let (st, c) = (stop.clone(), counters.clone());
            threads.push(std::thread::spawn(move || f(&st, &c)));
        };
        // Held for the donor's hello timeout three times over (and a
        // second) before it counts as left open.
        let bound = hello * 3 + Duration::from_secs(1);
        spawn(Box::new(move |st: &AtomicBool, c: &Counters| {
            tls_half_open(tls, &hello_bytes, bound, st, c);
        }));
        let (configs, n) = (
            [intruders.no_cert.clone(), intruders.other_ca.clone()],
            name.clone(),
        );
        spawn(Box::new(move |st: &AtomicBool, c: &Counters| {
            tls_intruders(tls, &configs, &n, st, c)
        }));
        spawn(Box::new(move |st: &AtomicBool, c: &Counters| {
            quic_junk(quic, st, c)
        }));
        let ca = intruders.ca.clone();
        spawn(Box::new(move |_: &AtomicBool, c: &Counters| {
            let per = SPOOFED_INITIALS / usize::from(SPOOFED_SOURCES);
            let sent = crate::forge::quic_initials(quic, &ca, [127, 0, 8], SPOOFED_SOURCES, per);
            c.quic_spoofed.fetch_add(sent as u64, Ordering::Relaxed);
        }));
        let (cfg, d) = (quic_config.clone(), donor.to_string());
        // An Initial's fate is known once the donor could have closed it.
        let retire = hello + CLOSE_ALLOWANCE;
        spawn(Box::new(move |st: &AtomicBool, c: &Counters| {
            quic_half_open(quic, &cfg, &d, hello, retire, st, c);
        }));
        let d = donor.to_string();
        spawn(Box::new(move |st: &AtomicBool, c: &Counters| {
            quic_intruders(quic, quic_config, &d, st, c);
        }));
        Ok(Self {
            stop,
            threads,
            counters,
        })
    }

    /// Stop it, close everything and say what it did.
    pub fn stop(self) -> HandshakeStats {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            let _ = t.join();
        }
        self.counters.snapshot()
    }
}

fn connect(addr: SocketAddr) -> Option<TcpStream> {
    let s = TcpStream::connect_timeout(&addr, TIMEOUT).ok()?;
    s.set_read_timeout(Some(TIMEOUT)).ok()?;
    s.set_write_timeout(Some(TIMEOUT)).ok()?;
    Some(s)
}

/// Whether the peer has closed `s`, a non-blocking socket (end of stream
/// or reset); whatever it sent before is read and dropped.
fn closed(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 512];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break true,
            Ok(_) => continue,
            Err(e) if e.kind() == ErrorKind::WouldBlock => break false,
            Err(_) => break true,
        }
    }
}

/// Open [`TLS_HELD`] connections that sent half a ClientHello, from
/// [`TLS_SOURCES`] addresses, and hold them; time how long the donor takes
/// to close each (its handshake deadline, or its pre-auth budget evicting
/// the oldest), and reopen, at most [`TLS_REOPEN`] a round.
fn tls_half_open(addr: SocketAddr, hello: &[u8], bound: Duration, st: &AtomicBool, c: &Counters) {
    let mut held: Vec<(TcpStream, Instant)> = Vec::new();
    let mut opened: u32 = 0;
    while !st.load(Ordering::Relaxed) {
        held.retain_mut(|(s, at)| {
            let age = at.elapsed();
            if closed(s) {
                add(&c.tls_closed);
                c.tls_close_max_us.fetch_max(micros(age), Ordering::Relaxed);
                c.tls_close_sum_us.fetch_add(micros(age), Ordering::Relaxed);
                false
            } else if age > bound {
                add(&c.tls_unclosed);
                false
            } else {
                true
            }
        });
        let pace = if (opened as usize) < TLS_HELD {
            TLS_BURST
        } else {
            TLS_REOPEN
        };
        let room = pace.min(TLS_HELD - held.len());
        for _ in 0..room {
            if st.load(Ordering::Relaxed) {
                break;
            }
            let from = std::net::Ipv4Addr::new(127, 0, 7, 1 + (opened % TLS_SOURCES) as u8);
            opened = opened.wrapping_add(1);
            let Some(mut s) = crate::connect_from(from, addr) else {
                break;
            };
            let at = Instant::now();
            // Half a ClientHello fits a fresh socket's buffer at once.
            if s.write_all(hello).is_ok() && s.set_nonblocking(true).is_ok() {
                add(&c.tls_half_open);
                held.push((s, at));
            }
        }
        c.tls_held_max
            .fetch_max(held.len() as u64, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Complete TLS handshakes with each configuration in turn, then wait for
/// the donor's verdict on our certificate (it follows our Finished).
fn tls_intruders(
    addr: SocketAddr,
    configs: &[Arc<rustls::ClientConfig>; 2],
    name: &rustls::pki_types::ServerName<'static>,
    st: &AtomicBool,
    c: &Counters,
) {
    let mut k = 0;
    while !st.load(Ordering::Relaxed) {
        k += 1;
        if let Some(tcp) = connect(addr) {
            let Ok(conn) = rustls::ClientConnection::new(configs[k % 2].clone(), name.clone())
            else {
                return;
            };
            add(&c.tls_intruders);
            // The donor's verdict follows our Finished: on a loaded 2-core
            // machine it may take longer than a socket timeout of the storm.
            let _ = tcp.set_read_timeout(Some(INTRUDER_VERDICT));
            let mut tls = rustls::StreamOwned::new(conn, tcp);
            let verdict = (|| {
                while tls.conn.is_handshaking() {
                    tls.conn.complete_io(&mut tls.sock)?;
                }
                let mut buf = [0u8; 64];
                tls.read(&mut buf)
            })();
            match verdict {
                // Still open, or talking to us: let in.
                Ok(n) if n > 0 => add(&c.tls_admitted),
                Err(e) if matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock) => {
                    add(&c.tls_admitted);
                }
                // An alert, a reset or a close.
                _ => add(&c.tls_refused),
            }
        }
        std::thread::sleep(PAUSE);
    }
}

/// `engram_donor_refusals_total{plane=PLANE,reason=REASON}`.
fn refusals(metrics: &str, plane: &str, reason: &str) -> f64 {
    let series = format!("engram_donor_refusals_total{{plane=\"{plane}\",reason=\"{reason}\"}}");
    sample(metrics, &series).unwrap_or(0.0)
}

/// The kernel's count of connections dropped because a listener's accept
/// queue was full (`TcpExt: ListenOverflows` in /proc/net/netstat); 0 where
/// it cannot be read.
fn listen_overflows() -> u64 {
    let text = std::fs::read_to_string("/proc/net/netstat").unwrap_or_default();
    let mut lines = text.lines().filter(|l| l.starts_with("TcpExt:"));
    let (Some(names), Some(values)) = (lines.next(), lines.next()) else {
        return 0;
    };
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .find(|(n, _)| *n == "ListenOverflows")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0)
}

/// How late Linux retransmits a SYN-ACK whose handshake an overflowing
/// accept queue dropped: a connection the client sees open waits that
/// long before the donor can accept it.
const SYNACK_RETRY: Duration = Duration::from_secs(1);

/// What the operator's `engram-cluster status` during the storm got.
#[derive(Debug)]
struct Status {
    ok: bool,
    took: Duration,
    said: String,
}

/// `engram-cluster status` after `after`, as the operator, timed.
fn status_later(rack: &Rack, after: Duration) -> Result<JoinHandle<Status>> {
    let mut cmd = std::process::Command::new(crate::bin("engram-cluster"));
    cmd.args(["status", "--config"]).arg(&rack.config);
    Ok(std::thread::spawn(move || {
        std::thread::sleep(after);
        let t0 = Instant::now();
        match cmd.output() {
            Ok(out) => Status {
                ok: out.status.success(),
                took: t0.elapsed(),
                said: format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ),
            },
            Err(e) => Status {
                ok: false,
                took: t0.elapsed(),
                said: e.to_string(),
            },
        }
    }))
}

/// The drill: donors on TLS and QUIC, the node on TLS; the storm at
/// donor-a's TLS and QUIC addresses in the fault window.
pub(super) fn storm_handshakes(env: &Env, o: &Opts) -> Result<Report> {
    let plan = plan();
    let seen = Seen::storm(env, o, &plan)?;
    let mut r = Report::check(NAME, ABOUT, env, &plan, &seen.out)?;
    let node = NodeDuring::of(&r, seen.from, seen.to);
    seen.figures(&mut r, &plan, &node);
    seen.check(&plan, &node)?;
    Ok(r)
}

fn plan() -> Plan {
    let mut plan = Plan::new(NAME);
    plan.transport = cluster_config::Transport::Tls;
    plan.also_quic = true;
    plan.control = true;
    plan.hello_timeout_ms = 300;
    // Room for every handshake the storm holds: the bounds tested are the
    // handshakes' own (time, and QUIC's count).
    plan.max_connections = 128;
    // A donor slowed by the storm would show as a hedge won elsewhere.
    plan.hedge = "2ms";
    plan
}

/// What the storm did and what donor-a and the operator saw.
struct Seen {
    out: Outcome,
    /// The storm's start and end on the node's clock.
    from: f64,
    to: f64,
    s: HandshakeStats,
    /// Connections the host's accept queues dropped meanwhile.
    overflows: u64,
    silent_opened: usize,
    status: Status,
    open_max: f64,
    /// donor-a's data-plane refusals: handshake_timeout, handshake_failed,
    /// handshake_limit, preauth_evicted, quic_retry.
    refused: [f64; 5],
    control_evicted: f64,
    /// Initials forged from the node's address, and its QUIC dial through
    /// them; the Retry tokens donor-a validated.
    forged: ForgedDial,
    validated: f64,
}

/// The node's steps during the storm.
struct NodeDuring {
    steps: usize,
    by_a: usize,
    failovers: u64,
    worst_us: f64,
}

impl NodeDuring {
    fn of(r: &Report, from: f64, to: f64) -> Self {
        let during: Vec<_> = r.between(from, to).collect();
        let by_a = during
            .iter()
            .filter(|s| {
                s.tables
                    .iter()
                    .all(|t| t.source.as_deref() == Some("donor-a"))
            })
            .count();
        let steps = during.len();
        let failovers: u64 = during
            .iter()
            .flat_map(|s| &s.tables)
            .map(|t| u64::from(t.failovers))
            .sum();
        let worst_in = r.between(from, to).map(|s| s.stall_us).fold(0.0, f64::max);
        Self {
            steps,
            by_a,
            failovers,
            worst_us: worst_in,
        }
    }
}

impl Seen {
    /// Start the rack and the node, storm donor-a in the fault window.
    fn storm(env: &Env, o: &Opts, plan: &Plan) -> Result<Self> {
        let hello = Duration::from_millis(plan.hello_timeout_ms);
        let rack = Rack::start(env, plan.clone())?;
        let intruders = Intruders::make(&rack.config, "n", &rack.dir.join("intruder"))?;
        let mut run = rack.run_node(o.tokens(SECONDS), o.tokens_per_second)?;
        run.at_second(FAULT_AT)?;
        let (tls, quic) = (rack.listen("donor-a")?, rack.quic("donor-a")?);
        let control = rack.control("donor-a")?;
        let overflows_before = listen_overflows();
        let storm = HandshakeStorm::start("donor-a", tls, quic, hello, &intruders)?;
        let silent: Vec<TcpStream> = (0..CONTROL_SILENT)
            .filter_map(|i| {
                let from = std::net::Ipv4Addr::new(127, 0, 9, 1 + (i % CONTROL_SOURCES) as u8);
                crate::connect_from(from, control)
            })
            .collect();
        let status = status_later(&rack, Duration::from_millis(500))?;
        let config = rack.config.clone();
        let forged = std::thread::spawn(move || forged_then_dial(&config, "n", "donor-a", quic));
        let from = run.event(
            "handshake storm at donor-a: half-open TLS, TLS without a rack certificate, \
             QUIC junk, spoofed and half-open QUIC Initials, QUIC without a certificate, \
             silent control connections",
        );
        let open_max = max_open_during_fault(&rack, &mut run, o, "donor-a")?;
        let status = status
            .join()
            .map_err(|_| anyhow::anyhow!("the status thread panicked"))?;
        let forged = forged
            .join()
            .map_err(|_| anyhow::anyhow!("the forging thread panicked"))??;
        let s = storm.stop();
        let overflows = listen_overflows().saturating_sub(overflows_before);
        let silent_opened = silent.len();
        drop(silent);
        let to = run.event("storm over");
        let m = rack.donor_metrics("donor-a")?;
        let [timeouts, failed, limit, evicted, retried] = [
            "handshake_timeout",
            "handshake_failed",
            "handshake_limit",
            "preauth_evicted",
            "quic_retry",
        ]
        .map(|r| refusals(&m, "data", r));
        let control_evicted = refusals(&m, "control", "preauth_evicted");
        let validated = sample(&m, "engram_donor_quic_validated_total").unwrap_or(0.0);
        let out = finish(run, o, true)?;
        Ok(Self {
            out,
            from,
            to,
            s,
            overflows,
            silent_opened,
            status,
            open_max,
            refused: [timeouts, failed, limit, evicted, retried],
            control_evicted,
            forged,
            validated,
        })
    }
}
