//! The systemd notification protocol (`sd_notify(3)`), without libsystemd:
//! `KEY=VALUE` lines in one datagram to the unix socket named by
//! `$NOTIFY_SOCKET` (a path, or `@name` for the abstract namespace), and the
//! watchdog interval from `$WATCHDOG_USEC` (for this process only when
//! `$WATCHDOG_PID` names it or is unset).
//!
//! What it is: both daemons' way to say READY=1, STATUS=..., WATCHDOG=1,
//! RELOADING=1, STOPPING=1 and EXTEND_TIMEOUT_USEC=... . What it is not: the
//! policy of when to say them; that lives with each daemon's serving loop
//! (a watchdog ping must prove the serving path works, so no timer here).
//!
//! Without `$NOTIFY_SOCKET` (not under systemd, or `Type=simple`) every call
//! is a no-op, so the daemons call it unconditionally.

use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::time::Duration;

/// Largest notification sent (systemd reads far more; ours are short).
const MAX_MESSAGE: usize = 4096;

/// Where notifications go, if anywhere.
#[derive(Debug)]
pub struct Notifier {
    target: Option<Target>,
    watchdog: Option<Duration>,
}

#[derive(Debug)]
struct Target {
    socket: UnixDatagram,
    addr: std::os::unix::net::SocketAddr,
    shown: String,
}

/// Why the notification socket could not be used.
#[derive(Debug, thiserror::Error)]
pub enum NotifyError {
    /// `$NOTIFY_SOCKET` is not a usable socket name.
    #[error("NOTIFY_SOCKET={0:?} is not a socket path or @abstract name")]
    BadAddress(String),
    /// Sending failed.
    #[error("notifying {target}: {source}")]
    Send {
        target: String,
        source: std::io::Error,
    },
}

impl Notifier {
    /// A notifier that sends nothing.
    pub fn disabled() -> Self {
        Self {
            target: None,
            watchdog: None,
        }
    }

    /// From the environment: `$NOTIFY_SOCKET`, `$WATCHDOG_USEC`, `$WATCHDOG_PID`.
    pub fn from_env() -> Result<Self, NotifyError> {
        let socket = std::env::var("NOTIFY_SOCKET").ok();
        let usec = std::env::var("WATCHDOG_USEC").ok();
        let pid = std::env::var("WATCHDOG_PID").ok();
        Self::from_values(
            socket.as_deref(),
            usec.as_deref(),
            pid.as_deref(),
            std::process::id(),
        )
    }

    /// From the values of those variables, for process `me`.
    pub fn from_values(
        socket: Option<&str>,
        watchdog_usec: Option<&str>,
        watchdog_pid: Option<&str>,
        me: u32,
    ) -> Result<Self, NotifyError> {
        let watchdog = watchdog_interval(watchdog_usec, watchdog_pid, me);
        let Some(name) = socket.filter(|s| !s.is_empty()) else {
            return Ok(Self {
                target: None,
                watchdog,
            });
        };
        let addr = socket_addr(name)?;
        let socket = UnixDatagram::unbound().map_err(|source| NotifyError::Send {
            target: name.to_string(),
            source,
        })?;
        // A notification must never stall the serving path.
        let _ = socket.set_nonblocking(true);
        Ok(Self {
            target: Some(Target {
                socket,
                addr,
                shown: name.to_string(),
            }),
            watchdog,
        })
    }

    /// True when notifications go somewhere.
    pub fn is_enabled(&self) -> bool {
        self.target.is_some()
    }

    /// The watchdog timeout systemd enforces on this process, if any.
    /// Ping at most every half of it (`sd_watchdog_enabled(3)`).
    pub fn watchdog(&self) -> Option<Duration> {
        self.watchdog
    }

    /// Send `state` (newline-separated `KEY=VALUE` lines); a no-op when disabled.
    pub fn notify(&self, state: &str) -> Result<(), NotifyError> {
        let Some(t) = &self.target else {
            return Ok(());
        };
        let bytes = &state.as_bytes()[..state.len().min(MAX_MESSAGE)];
        t.socket
            .send_to_addr(bytes, &t.addr)
            .map(|_| ())
            .map_err(|source| NotifyError::Send {
                target: t.shown.clone(),
                source,
            })
    }

    /// `READY=1` with a status line.
    pub fn ready(&self, status: &str) -> Result<(), NotifyError> {
        self.notify(&format!("READY=1\nSTATUS={}", one_line(status)))
    }

    /// `STATUS=...` (one line).
    pub fn status(&self, status: &str) -> Result<(), NotifyError> {
        self.notify(&format!("STATUS={}", one_line(status)))
    }

    /// `WATCHDOG=1`: the serving path was just seen working.
    pub fn watchdog_ping(&self) -> Result<(), NotifyError> {
        self.notify("WATCHDOG=1")
    }

    /// `STOPPING=1` with a status line.
    pub fn stopping(&self, status: &str) -> Result<(), NotifyError> {
        self.notify(&format!("STOPPING=1\nSTATUS={}", one_line(status)))
    }

    /// `RELOADING=1` (with `MONOTONIC_USEC`, as systemd 253+ wants).
    pub fn reloading(&self) -> Result<(), NotifyError> {
        self.notify(&format!("RELOADING=1\nMONOTONIC_USEC={}", monotonic_usec()))
    }

    /// `EXTEND_TIMEOUT_USEC`: a start (or stop) that is making progress gets
    /// `by` more time from now, however long `TimeoutStartSec=` is.
    pub fn extend_timeout(&self, by: Duration, status: &str) -> Result<(), NotifyError> {
        self.notify(&format!(
            "EXTEND_TIMEOUT_USEC={}\nSTATUS={}",
            by.as_micros(),
            one_line(status)
        ))
    }
}

/// A status value on one line (a newline would start another key).
fn one_line(s: &str) -> String {
    s.replace(['\n', '\r'], " ")
}

fn socket_addr(name: &str) -> Result<std::os::unix::net::SocketAddr, NotifyError> {
    let bad = || NotifyError::BadAddress(name.to_string());
    if let Some(abs) = name.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt;
        return std::os::unix::net::SocketAddr::from_abstract_name(abs.as_bytes())
            .map_err(|_| bad());
    }
    if !name.starts_with('/') {
        return Err(bad());
    }
    std::os::unix::net::SocketAddr::from_pathname(PathBuf::from(name)).map_err(|_| bad())
}

fn watchdog_interval(usec: Option<&str>, pid: Option<&str>, me: u32) -> Option<Duration> {
    let usec: u64 = usec?.trim().parse().ok().filter(|&u| u > 0)?;
    if let Some(pid) = pid.filter(|p| !p.trim().is_empty())
        && pid.trim().parse::<u32>().ok() != Some(me)
    {
        return None;
    }
    Some(Duration::from_micros(usec))
}

fn monotonic_usec() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only into the struct we pass.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) } != 0 {
        return 0;
    }
    (ts.tv_sec.max(0) as u64) * 1_000_000 + (ts.tv_nsec.max(0) as u64) / 1000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watchdog_applies_to_this_process_only() {
        let w = |u, p| watchdog_interval(u, p, 42);
        assert_eq!(w(Some("30000000"), None), Some(Duration::from_secs(30)));
        assert_eq!(
            w(Some("500000"), Some("42")),
            Some(Duration::from_millis(500))
        );
        assert_eq!(w(Some("500000"), Some("43")), None);
        assert_eq!(w(Some("0"), None), None);
        assert_eq!(w(Some("x"), None), None);
        assert_eq!(w(None, Some("42")), None);
    }

    #[test]
    fn sends_to_a_path_and_to_an_abstract_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("notify.sock");
        let rx = UnixDatagram::bind(&path).expect("bind");
        let n = Notifier::from_values(path.to_str(), Some("1000000"), None, 1).expect("notifier");
        assert!(n.is_enabled());
        assert_eq!(n.watchdog(), Some(Duration::from_secs(1)));
        n.ready("serving 2 tables,\n3 connections").expect("send");
        let mut buf = [0u8; 256];
        let len = rx.recv(&mut buf).expect("recv");
        assert_eq!(
            &buf[..len],
            b"READY=1\nSTATUS=serving 2 tables, 3 connections"
        );

        use std::os::linux::net::SocketAddrExt;
        let name = format!("engram-notify-test-{}", std::process::id());
        let addr =
            std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).expect("abstract");
        let rx = UnixDatagram::bind_addr(&addr).expect("bind abstract");
        let n = Notifier::from_values(Some(&format!("@{name}")), None, None, 1).expect("notifier");
        n.watchdog_ping().expect("send");
        let len = rx.recv(&mut buf).expect("recv");
        assert_eq!(&buf[..len], b"WATCHDOG=1");
    }

    #[test]
    fn without_a_socket_nothing_is_sent_and_bad_names_are_refused() {
        let n = Notifier::from_values(None, None, None, 1).expect("disabled");
        assert!(!n.is_enabled());
        n.ready("x").expect("no-op");
        assert!(Notifier::from_values(Some("relative/path"), None, None, 1).is_err());
        let dir = tempfile::tempdir().expect("tempdir");
        let gone = dir.path().join("nobody-listens");
        let n = Notifier::from_values(gone.to_str(), None, None, 1).expect("notifier");
        assert!(n.status("x").is_err(), "no listener: an error, not a panic");
    }
}
