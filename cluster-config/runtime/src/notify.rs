//! The systemd notification protocol (`sd_notify(3)`) through the
//! `sd-notify` crate: READY=1, STATUS=..., WATCHDOG=1, RELOADING=1 (with
//! MONOTONIC_USEC), STOPPING=1, EXTEND_TIMEOUT_USEC=..., and FDSTORE=1 /
//! FDSTOREREMOVE=1 (systemd's file descriptor store), and the
//! watchdog interval systemd enforces on this process.
//!
//! What it is: both daemons' way to say those things. What it is not: the
//! policy of when to say them; that lives with each daemon's serving loop
//! (a watchdog ping must prove the serving path works, so no timer here).
//!
//! Without `$NOTIFY_SOCKET` (not under systemd, or `Type=simple`) every call
//! is a no-op, so the daemons call it unconditionally.

use std::time::Duration;

use sd_notify::NotifyState;

/// Where notifications go, if anywhere.
#[derive(Debug)]
pub struct Notifier {
    enabled: bool,
    watchdog: Option<Duration>,
}

/// Why a notification could not be sent.
#[derive(Debug, thiserror::Error)]
pub enum NotifyError {
    /// `$NOTIFY_SOCKET` is not a usable socket name.
    #[error("NOTIFY_SOCKET={0:?} is not a socket path or @abstract name")]
    BadAddress(String),
    /// Sending failed.
    #[error("notifying systemd: {0}")]
    Send(#[from] std::io::Error),
}

impl Notifier {
    /// A notifier that sends nothing.
    pub fn disabled() -> Self {
        Self {
            enabled: false,
            watchdog: None,
        }
    }

    /// From the environment: `$NOTIFY_SOCKET` (checked to be a socket path
    /// or an abstract name), and `$WATCHDOG_USEC` where `$WATCHDOG_PID` is
    /// unset or this process.
    pub fn from_env() -> Result<Self, NotifyError> {
        let socket = std::env::var("NOTIFY_SOCKET").unwrap_or_default();
        if !socket.is_empty() && !socket.starts_with('/') && !socket.starts_with('@') {
            return Err(NotifyError::BadAddress(socket));
        }
        Ok(Self {
            enabled: !socket.is_empty(),
            watchdog: sd_notify::watchdog_enabled().filter(|d| !d.is_zero()),
        })
    }

    /// True when notifications go somewhere.
    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// The watchdog timeout systemd enforces on this process, if any.
    /// Ping at most every half of it (`sd_watchdog_enabled(3)`).
    pub fn watchdog(&self) -> Option<Duration> {
        self.watchdog
    }

    fn send(&self, states: &[NotifyState<'_>]) -> Result<(), NotifyError> {
        if !self.enabled {
            return Ok(());
        }
        Ok(sd_notify::notify(states)?)
    }

    /// `READY=1` with a status line.
    pub fn ready(&self, status: &str) -> Result<(), NotifyError> {
        let status = one_line(status);
        self.send(&[NotifyState::Ready, NotifyState::Status(&status)])
    }

    /// `STATUS=...` (one line).
    pub fn status(&self, status: &str) -> Result<(), NotifyError> {
        self.send(&[NotifyState::Status(&one_line(status))])
    }

    /// `WATCHDOG=1`: the serving path was just seen working.
    pub fn watchdog_ping(&self) -> Result<(), NotifyError> {
        self.send(&[NotifyState::Watchdog])
    }

    /// `STOPPING=1` with a status line.
    pub fn stopping(&self, status: &str) -> Result<(), NotifyError> {
        let status = one_line(status);
        self.send(&[NotifyState::Stopping, NotifyState::Status(&status)])
    }

    /// `RELOADING=1` with `MONOTONIC_USEC`, as systemd 253+ wants.
    pub fn reloading(&self) -> Result<(), NotifyError> {
        if !self.enabled {
            return Ok(());
        }
        self.send(&[NotifyState::Reloading, NotifyState::monotonic_usec_now()?])
    }

    /// `FDSTORE=1` with `FDNAME=name` (and `FDPOLL=0`: a memfd is never
    /// "hung up"): systemd keeps a duplicate of `fd` for the next process
    /// of this service, if its unit allows (`FileDescriptorStoreMax=`).
    pub fn store_fd(&self, name: &str, fd: std::os::fd::BorrowedFd<'_>) -> Result<(), NotifyError> {
        if !self.enabled {
            return Ok(());
        }
        Ok(sd_notify::notify_with_fds(
            &[
                NotifyState::FdStore,
                NotifyState::FdName(name),
                NotifyState::Custom("FDPOLL=0"),
            ],
            &[fd],
        )?)
    }

    /// `FDSTOREREMOVE=1` with `FDNAME=name`: systemd closes every
    /// descriptor it keeps under that name.
    pub fn remove_fds(&self, name: &str) -> Result<(), NotifyError> {
        self.send(&[NotifyState::FdStoreRemove, NotifyState::FdName(name)])
    }

    /// `EXTEND_TIMEOUT_USEC`: a start (or stop) that is making progress gets
    /// `by` more time from now, however long `TimeoutStartSec=` is.
    pub fn extend_timeout(&self, by: Duration, status: &str) -> Result<(), NotifyError> {
        let usec = u32::try_from(by.as_micros()).unwrap_or(u32::MAX);
        let status = one_line(status);
        self.send(&[
            NotifyState::ExtendTimeoutUsec(usec),
            NotifyState::Status(&status),
        ])
    }
}

/// A status value on one line (a newline would start another key).
fn one_line(s: &str) -> String {
    s.replace(['\n', '\r'], " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_disabled_notifier_sends_nothing_and_says_so() {
        let n = Notifier::disabled();
        assert!(!n.is_enabled());
        assert_eq!(n.watchdog(), None);
        n.ready("x").expect("no-op");
        n.reloading().expect("no-op");
        n.extend_timeout(Duration::from_secs(3600 * 2), "x")
            .expect("no-op");
    }

    #[test]
    fn status_lines_stay_on_one_line() {
        assert_eq!(one_line("a\nb\r\nc"), "a b  c");
    }
}
