//! Linux network namespaces joined to the root namespace by veth pairs, for multi-host tests.
//!
//! Each [`NetNs`] gets a /30 out of 198.18.0.0/15 (RFC 2544 benchmarking range, 32768 slots):
//! slot `s` is `198.18.0.0 + 4*s`, `.1` is the host side, `.2` the namespace side. A slot is
//! claimed atomically by creating the host-side veth `engvSSSS` (`SSSS` = slot in hex), so
//! concurrent creators (threads or processes) probe onward on "File exists". Namespaces are
//! named `engram-PID-SEQ-TAG`; the host veth's ifalias holds that name. [`NetNs::remove_stale`]
//! deletes both when PID is no longer alive. [`NetNs::add_link`] joins a namespace to the root
//! namespace by one more veth pair, with a slot (and /30) of its own claimed the same way: two
//! networks between the same hosts, say a Thunderbolt link beside Ethernet. Everything needs
//! root (CAP_NET_ADMIN + CAP_SYS_ADMIN).

use anyhow::{Context, Result, bail};
use std::ffi::OsStr;
use std::fs::File;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

const NS_PREFIX: &str = "engram-";
const HOST_PREFIX: &str = "engv";
const NETNS_DIR: &str = "/run/netns";
const SLOTS: u32 = 1 << 15;
const NO_SLOT: u32 = u32::MAX;
const BASE: u32 = u32::from_be_bytes([198, 18, 0, 0]);
static SEQ: AtomicU32 = AtomicU32::new(0);
static STALE_ONCE: std::sync::Once = std::sync::Once::new();

/// A network namespace with a veth link to the root namespace; dropping it deletes both.
#[derive(Debug)]
pub struct NetNs {
    name: String,
    slot: u32, // NO_SLOT until the veth pair exists
    more: Vec<Veth>,
    fd: Arc<File>,
}

/// Links a namespace may have beside its first: each is a /30 slot.
const MAX_MORE_LINKS: usize = 8;

/// One veth pair between a namespace and the root namespace, and its /30.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Veth {
    slot: u32,
}

impl Veth {
    /// The address of the namespace end.
    pub fn addr(&self) -> Ipv4Addr {
        Ipv4Addr::from(BASE + 4 * self.slot + 2)
    }

    /// The address of the root-namespace end.
    pub fn host_addr(&self) -> Ipv4Addr {
        Ipv4Addr::from(BASE + 4 * self.slot + 1)
    }

    /// The name of the root-namespace end.
    pub fn host_if(&self) -> String {
        format!("{HOST_PREFIX}{:04x}", self.slot)
    }

    fn peer_if(&self) -> String {
        format!("engp{:04x}", self.slot)
    }

    /// Takes the root-namespace end down (a pulled cable: the namespace end
    /// loses its carrier, the root namespace its route to the /30) or up.
    pub fn set_host_up(&self, up: bool) -> Result<()> {
        let state = if up { "up" } else { "down" };
        ip(&format!("link set {} {state}", self.host_if())).map(drop)
    }
}

fn tc_bin() -> &'static str {
    ["/usr/sbin/tc", "/sbin/tc", "/usr/bin/tc", "/bin/tc"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .unwrap_or("tc")
}

fn ip_bin() -> &'static str {
    ["/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .unwrap_or("ip")
}

/// Runs `ip ARGS` (split on whitespace, no shell); errors name the command and its stderr.
fn ip(args: &str) -> Result<String> {
    let out = Command::new(ip_bin())
        .args(args.split_whitespace())
        .output()
        .with_context(|| format!("cannot run `ip {args}`"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        bail!("`ip {args}` failed ({}): {}", out.status, err.trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn pid_alive(pid: i32) -> bool {
    // SAFETY: kill with signal 0 only checks for existence/permission.
    pid > 0
        && (unsafe { libc::kill(pid, 0) } == 0
            || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM))
}

/// The creator pid encoded in one of our namespace names, if it is one.
fn creator_pid(ns_name: &str) -> Option<i32> {
    let rest = ns_name.strip_prefix(NS_PREFIX)?;
    rest.split('-').next()?.parse().ok()
}

impl NetNs {
    /// Ok when namespaces and veth pairs can be built here; otherwise an operator-readable reason.
    pub fn check() -> Result<(), String> {
        if Command::new(ip_bin()).arg("-V").output().is_err() {
            return Err("`ip` (iproute2) not found: install the iproute2 package".into());
        }
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let name = format!("{NS_PREFIX}{}-c{seq}", std::process::id());
        let trial = ip(&format!("netns add {name}"))
            .and_then(|_| ip(&format!("-n {name} link add t0 type veth peer name t1")));
        let _ = ip(&format!("netns del {name}"));
        trial.map(drop).map_err(|e| {
            format!("cannot create network namespaces with veth pairs (run as root, or with CAP_NET_ADMIN and CAP_SYS_ADMIN): {e:#}")
        })
    }

    /// Creates a namespace (lo up) linked to the root namespace by its own veth pair and /30.
    pub fn create(tag: &str) -> Result<NetNs> {
        STALE_ONCE.call_once(NetNs::remove_stale);
        let pid = std::process::id();
        let tag = tag.chars().filter(char::is_ascii_alphanumeric);
        let tag: String = tag.take(24).collect();
        let (mut name, mut seq) = (String::new(), 0);
        for _ in 0..100 {
            seq = SEQ.fetch_add(1, Ordering::Relaxed);
            name = format!("{NS_PREFIX}{pid}-{seq}-{tag}");
            match ip(&format!("netns add {name}")) {
                Ok(_) => break,
                Err(e) if format!("{e}").contains("exists") => name.clear(),
                Err(e) => return Err(e),
            }
        }
        anyhow::ensure!(!name.is_empty(), "no free namespace name for pid {pid}");
        let fd = File::open(format!("{NETNS_DIR}/{name}"));
        let fd = fd.with_context(|| format!("open {NETNS_DIR}/{name}"));
        let fd = Arc::new(fd.inspect_err(|_| drop(ip(&format!("netns del {name}"))))?);
        // From here on, dropping `ns` on an error deletes everything created so far.
        let mut ns = NetNs {
            name,
            slot: NO_SLOT,
            more: Vec::new(),
            fd,
        };
        ip(&format!("-n {} link set lo up", ns.name))?;
        ns.slot = ns.claim_slot(pid.wrapping_mul(2_654_435_761).wrapping_add(seq))?;
        ns.address(ns.link())?;
        ns.link_up()?;
        Ok(ns)
    }

    /// Creates a veth pair in the first free slot probing from `start`,
    /// its namespace end moved into this namespace; the slot.
    fn claim_slot(&self, start: u32) -> Result<u32> {
        let n = &self.name;
        for slot in (0..512u32).map(|i| start.wrapping_add(i) % SLOTS) {
            let v = Veth { slot };
            let (h, p) = (v.host_if(), v.peer_if());
            match ip(&format!("link add {h} type veth peer name {p} netns {n}")) {
                Ok(_) => return Ok(slot),
                Err(e) if format!("{e}").contains("File exists") => continue,
                Err(e) => return Err(e),
            }
        }
        bail!("no free 198.18.0.0/15 slot for namespace {n} after 512 tries")
    }

    /// Names the pair after the namespace (for [`NetNs::remove_stale`]),
    /// gives both ends their addresses and brings them up.
    fn address(&self, v: Veth) -> Result<()> {
        let (n, h, p) = (&self.name, v.host_if(), v.peer_if());
        ip(&format!("link set {h} alias {n}"))?;
        ip(&format!("addr add {}/30 dev {h}", v.host_addr()))?;
        ip(&format!("link set {h} up"))?;
        ip(&format!("-n {n} addr add {}/30 dev {p}", v.addr()))?;
        ip(&format!("-n {n} link set {p} up")).map(drop)
    }

    /// Joins the namespace to the root namespace by one more veth pair,
    /// with a /30 of its own (only that /30 is routed over it; the default
    /// route stays on the first link). Deleted with the namespace.
    pub fn add_link(&mut self) -> Result<Veth> {
        anyhow::ensure!(
            self.more.len() < MAX_MORE_LINKS,
            "namespace {} already has {} links",
            self.name,
            MAX_MORE_LINKS + 1
        );
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let start = std::process::id()
            .wrapping_mul(2_654_435_761)
            .wrapping_add(seq);
        let v = Veth {
            slot: self.claim_slot(start)?,
        };
        // Recorded first: dropping the namespace on an error deletes it.
        self.more.push(v);
        self.address(v)?;
        Ok(v)
    }

    /// The first link (the one [`NetNs::create`] made; the default route's).
    pub fn link(&self) -> Veth {
        Veth { slot: self.slot }
    }

    /// The links [`NetNs::add_link`] made, in order.
    pub fn more_links(&self) -> &[Veth] {
        &self.more
    }

    /// The namespace name (as shown by `ip netns list`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The address inside the namespace on its first link (servers bind here).
    pub fn addr(&self) -> Ipv4Addr {
        self.link().addr()
    }

    /// The address of the root-namespace end of the first veth pair.
    pub fn host_addr(&self) -> Ipv4Addr {
        self.link().host_addr()
    }

    /// The name of the root-namespace end of the first veth pair.
    pub fn host_if(&self) -> String {
        self.link().host_if()
    }

    fn peer_if(&self) -> String {
        self.link().peer_if()
    }

    /// A command running `program` in the namespace; it gets SIGKILL when the spawning *thread* exits.
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = Command::new(program);
        let fd = Arc::clone(&self.fd);
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: the closure only makes async-signal-safe syscalls, on an fd opened before fork.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) != 0
                    || libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != parent {
                    libc::_exit(1); // the parent died before PDEATHSIG was armed
                }
                Ok(())
            });
        }
        cmd
    }

    /// Limits the first link to `mbit` Mbit/s each way with a token bucket
    /// (`tc qdisc replace ... tbf`) on both ends, so that the link, not the
    /// host's CPUs, bounds what crosses it, as a cable does between hosts.
    /// The bucket holds 4 ms of traffic (at least 64 KiB).
    pub fn shape(&self, mbit: u32) -> Result<()> {
        anyhow::ensure!(mbit > 0, "a link rate must be above 0 Mbit/s");
        let burst = (u64::from(mbit) * 1_000_000 / 8 / 250).max(64 * 1024);
        let ends = [
            (None, self.host_if()),
            (Some(self.name.as_str()), self.peer_if()),
        ];
        for (ns, dev) in ends {
            let mut cmd = Command::new(tc_bin());
            if let Some(ns) = ns {
                cmd.args(["-n", ns]);
            }
            cmd.args(["qdisc", "replace", "dev", &dev, "root", "tbf"])
                .args(["rate", &format!("{mbit}mbit")])
                .args(["burst", &burst.to_string(), "latency", "50ms"]);
            let out = cmd.output().context("running tc (iproute2)")?;
            if !out.status.success() {
                bail!(
                    "tc could not shape {dev}: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
        }
        Ok(())
    }

    /// Partition: takes the link inside the namespace down, so traffic to/from it stops.
    pub fn link_down(&self) -> Result<()> {
        let (n, p) = (&self.name, self.peer_if());
        ip(&format!("-n {n} link set {p} down")).map(drop)
    }

    /// Heal: brings the link inside the namespace up again, restoring its default route.
    pub fn link_up(&self) -> Result<()> {
        let (n, p, h) = (&self.name, self.peer_if(), self.host_addr());
        ip(&format!("-n {n} link set {p} up"))?;
        // IPv4 drops gateway routes when a link goes down; put the default route back.
        ip(&format!("-n {n} route replace default via {h} dev {p}")).map(drop)
    }

    /// Deletes namespaces and host veths created by this module in processes that no longer exist.
    pub fn remove_stale() {
        let dead = |ns: &str| creator_pid(ns).is_some_and(|pid| !pid_alive(pid));
        let devs = std::fs::read_dir("/sys/class/net");
        for dev in devs.into_iter().flatten().flatten() {
            let alias = std::fs::read_to_string(dev.path().join("ifalias")).unwrap_or_default();
            let dev = dev.file_name().to_string_lossy().into_owned();
            if dev.starts_with(HOST_PREFIX) && dead(alias.trim()) {
                let _ = ip(&format!("link del {dev}"));
            }
        }
        for ns in std::fs::read_dir(NETNS_DIR).into_iter().flatten().flatten() {
            let ns = ns.file_name().to_string_lossy().into_owned();
            if dead(&ns) {
                let _ = ip(&format!("netns del {ns}"));
            }
        }
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        // Deleting the host end removes the pair at once, even if processes keep the namespace alive.
        for v in &self.more {
            let _ = ip(&format!("link del {}", v.host_if()));
        }
        if self.slot != NO_SLOT {
            let _ = ip(&format!("link del {}", self.host_if()));
        }
        if let Err(e) = ip(&format!("netns del {}", self.name)) {
            eprintln!("netns: cleanup of {} failed: {e:#}", self.name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
    use std::net::{SocketAddr, TcpStream};
    use std::os::unix::fs::MetadataExt;
    use std::process::{Child, Stdio};
    use std::time::Duration;

    const ECHO: &str = "import socket,sys,threading\n\
        s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n\
        s.bind((sys.argv[1],7000)); s.listen(16); print('ready',flush=True)\n\
        def echo(c):\n    while (d:=c.recv(4096)): c.sendall(d)\n\
        while True: threading.Thread(target=echo,args=(s.accept()[0],),daemon=True).start()\n";

    /// Kills and reaps the child on drop, so a failing test leaves no process behind.
    struct Kill(Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// Some when namespaces work; None (test skipped) otherwise, unless ENGRAM_REQUIRE_NETNS=1.
    fn usable() -> Option<()> {
        let Err(e) = NetNs::check() else {
            return Some(());
        };
        let required = std::env::var("ENGRAM_REQUIRE_NETNS").as_deref() == Ok("1");
        assert!(!required, "ENGRAM_REQUIRE_NETNS=1 but {e}");
        eprintln!("skipping: {e}");
        None
    }

    fn echo_server(ns: &NetNs) -> Kill {
        let mut cmd = ns.command("python3");
        cmd.args(["-c", ECHO, &ns.addr().to_string()]);
        cmd.stdout(Stdio::piped());
        let mut child = Kill(cmd.spawn().expect("spawn python3"));
        let mut line = String::new();
        let out = child.0.stdout.take().expect("stdout");
        BufReader::new(out).read_line(&mut line).expect("read");
        assert_eq!(line.trim(), "ready", "echo server did not start");
        child
    }

    fn connect(ns: &NetNs, ms: u64) -> std::io::Result<TcpStream> {
        let sa = SocketAddr::from((ns.addr(), 7000));
        TcpStream::connect_timeout(&sa, Duration::from_millis(ms))
    }

    fn roundtrip(s: &mut TcpStream, msg: &[u8], ms: u64) -> std::io::Result<Vec<u8>> {
        s.set_read_timeout(Some(Duration::from_millis(ms)))?;
        s.write_all(msg)?;
        let mut buf = vec![0; msg.len()];
        s.read_exact(&mut buf)?;
        Ok(buf)
    }

    #[test]
    fn unique_namespaces_have_their_address_inside() {
        let Some(()) = usable() else { return };
        let (a, b) = (NetNs::create("a").unwrap(), NetNs::create("b").unwrap());
        assert_ne!(a.name(), b.name());
        assert_ne!(a.addr(), b.addr());
        assert!(a.host_if().len() <= 15, "{}", a.host_if());
        assert_eq!(creator_pid(a.name()), Some(std::process::id() as i32));
        for ns in [&a, &b] {
            let out = ns.command(ip_bin()).args(["-o", "-4", "addr"]).output();
            let out = out.unwrap();
            let out = String::from_utf8_lossy(&out.stdout);
            assert!(out.contains(&format!("{}/30", ns.addr())), "{out}");
            assert!(!out.contains(&ns.host_addr().to_string()), "{out}");
        }
    }

    #[test]
    fn child_is_the_program_itself_inside_the_namespace() {
        let Some(()) = usable() else { return };
        let ns = NetNs::create("pid").unwrap();
        let child = Kill(ns.command("sleep").arg("10").spawn().unwrap());
        let pid = child.0.id();
        // `spawn` returns once the exec has begun (its close-on-exec pipe
        // closed); the kernel sets the new program's arguments a moment
        // later, and until then `cmdline` reads empty.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let cmdline = loop {
            let c = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
            if !c.is_empty() || std::time::Instant::now() > deadline {
                break c;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        assert!(cmdline.starts_with(b"sleep\0"), "{cmdline:?}");
        let link = std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap();
        let meta = std::fs::metadata(format!("{NETNS_DIR}/{}", ns.name())).unwrap();
        let ino = meta.ino();
        assert_eq!(link.to_string_lossy(), format!("net:[{ino}]"));
    }

    #[test]
    fn partition_and_heal() {
        let Some(()) = usable() else { return };
        if Command::new("python3").arg("-V").output().is_err() {
            return eprintln!("skipping: python3 not found");
        }
        let (a, b) = (NetNs::create("pa").unwrap(), NetNs::create("pb").unwrap());
        let (_sa, _sb) = (echo_server(&a), echo_server(&b));
        let mut est = connect(&a, 2000).unwrap();
        assert_eq!(roundtrip(&mut est, b"hello", 2000).unwrap(), b"hello");

        a.link_down().unwrap();
        let err = connect(&a, 300).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::TimedOut, "{err}");
        let err = roundtrip(&mut est, b"x", 300).unwrap_err();
        let stalled = [ErrorKind::WouldBlock, ErrorKind::TimedOut].contains(&err.kind());
        assert!(stalled, "{err}");
        let mut other = connect(&b, 2000).expect("b must stay reachable");
        assert_eq!(roundtrip(&mut other, b"b", 2000).unwrap(), b"b");

        a.link_up().unwrap();
        est.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 1];
        est.read_exact(&mut buf).unwrap(); // the stalled echo arrives after retransmission
        assert_eq!(&buf, b"x");
        let mut fresh = connect(&a, 2000).unwrap();
        assert_eq!(roundtrip(&mut fresh, b"again", 2000).unwrap(), b"again");
    }

    #[test]
    fn a_second_link_has_its_own_subnet_and_goes_with_the_namespace() {
        let Some(()) = usable() else { return };
        let mut ns = NetNs::create("two").unwrap();
        let (first, second) = (ns.link(), ns.add_link().unwrap());
        assert_ne!(first, second);
        assert_eq!(ns.more_links(), &[second]);
        assert!(second.host_if().len() <= 15, "{}", second.host_if());
        let out = ns.command(ip_bin()).args(["-o", "-4", "addr"]).output();
        let out = String::from_utf8_lossy(&out.unwrap().stdout).into_owned();
        for v in [first, second] {
            assert!(out.contains(&format!("{}/30", v.addr())), "{out}");
        }
        // Each /30 is reached over its own link, from its own host address.
        for v in [first, second] {
            let route = ip(&format!("route get {}", v.addr())).unwrap();
            let want = format!("dev {} src {}", v.host_if(), v.host_addr());
            assert!(route.contains(&want), "{route}");
        }
        second.set_host_up(false).unwrap();
        let route = ip(&format!("route get {}", second.addr())).unwrap_or_default();
        assert!(!route.contains(&second.host_if()), "{route}");
        second.set_host_up(true).unwrap();
        let ifs = [first.host_if(), second.host_if()];
        drop(ns);
        for i in ifs {
            assert!(!std::path::Path::new(&format!("/sys/class/net/{i}")).exists());
        }
    }

    #[test]
    fn drop_removes_namespace_and_host_link() {
        let Some(()) = usable() else { return };
        let ns = NetNs::create("drop").unwrap();
        let (name, host_if) = (ns.name().to_string(), ns.host_if());
        let listed = || ip("netns list").unwrap().contains(&name);
        assert!(listed());
        drop(ns);
        assert!(!listed());
        assert!(!std::path::Path::new(&format!("/sys/class/net/{host_if}")).exists());
    }

    #[test]
    fn remove_stale_spares_live_creators() {
        let Some(()) = usable() else { return };
        let mut gone = Command::new("true").spawn().unwrap();
        gone.wait().unwrap();
        let dead = format!("{NS_PREFIX}{}-0-stale", gone.id());
        let live = format!("{NS_PREFIX}{}-999999-live", std::process::id());
        let tail = format!("{:x}", 0x10000 + gone.id() % 0xffff); // 5 hex digits: no real slot
        let dead_if = format!("{HOST_PREFIX}{tail}");
        struct Cleanup(Vec<String>);
        impl Drop for Cleanup {
            fn drop(&mut self) {
                self.0.iter().for_each(|c| drop(ip(c)));
            }
        }
        let del = [("netns", &dead), ("netns", &live), ("link", &dead_if)];
        let _c = Cleanup(del.iter().map(|(w, n)| format!("{w} del {n}")).collect());
        ip(&format!("netns add {dead}")).unwrap();
        ip(&format!("netns add {live}")).unwrap();
        ip(&format!(
            "link add {dead_if} type veth peer name engs{tail}"
        ))
        .unwrap();
        ip(&format!("link set {dead_if} alias {dead}")).unwrap();
        NetNs::remove_stale();
        let listed = ip("netns list").unwrap();
        assert!(!listed.contains(&dead), "{listed}");
        assert!(listed.contains(&live), "{listed}");
        assert!(!std::path::Path::new(&format!("/sys/class/net/{dead_if}")).exists());
    }
}
