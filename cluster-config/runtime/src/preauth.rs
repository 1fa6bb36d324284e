//! Connections before authentication, bounded apart from the served ones.
//!
//! A connection is *pre-auth* from accept until it has proved who it is
//! (for a donor's data plane: a TLS client certificate the donor admits,
//! or an accepted Hello on plain TCP; for a control plane: a completed
//! TLS handshake; for `/metrics`: a complete request head). Only then does
//! it take one of its plane's served slots. Pre-auth connections have
//! their own budget, per source address and in all, and a full budget
//! never refuses a newcomer: it evicts the oldest pre-auth connection (of
//! the same source first), whose socket is shut down. A stranger's
//! half-open connections therefore cost at most the budget's total and no
//! served slot, and a peer that authenticates in a millisecond or two gets
//! in through any flood that does not open the whole budget in that time.
//! The handshake deadline shrinks as the budget fills
//! ([`PreAuth::deadline`]).
//!
//! Connections are charged to their TCP peer's address, which the
//! three-way handshake proved: the peer answered the SYN-ACK sent there. A
//! stranger who forges a node's address gets no connection (its SYNs are
//! answered at that address, and go no further than the kernel's SYN
//! queue), so it can never fill the node's share. A transport without
//! that proof (QUIC's Initials) must validate the address before charging
//! it: the donor's QUIC budget does so with Retries.

use std::net::{IpAddr, Shutdown, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use engram_sync::Mutex;

/// The shortest handshake deadline, however full the budget.
pub const MIN_DEADLINE: Duration = Duration::from_millis(250);

#[derive(Debug)]
struct Entry {
    key: u64,
    ip: IpAddr,
    /// A handle on the socket, to shut it down on eviction.
    stream: TcpStream,
}

#[derive(Debug, Default)]
struct Inner {
    next: u64,
    /// Oldest first.
    live: Vec<Entry>,
}

/// The pre-auth budget of one listener (or of several that share it).
#[derive(Debug)]
pub struct PreAuth {
    inner: Mutex<Inner>,
    per_source: usize,
    total: usize,
}

/// A pre-auth connection's place in the budget; dropping it frees the place.
#[derive(Debug)]
pub struct Ticket {
    owner: Arc<PreAuth>,
    key: u64,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut inner = self.owner.lock();
        inner.live.retain(|e| e.key != self.key);
    }
}

impl PreAuth {
    /// A budget of `per_source` per address and `total` in all (both at least 1).
    pub fn new(per_source: usize, total: usize) -> Arc<Self> {
        Arc::new(Self {
            inner: Mutex::new(Inner::default()),
            per_source: per_source.max(1),
            total: total.max(1),
        })
    }

    fn lock(&self) -> engram_sync::MutexGuard<'_, Inner> {
        self.inner.lock()
    }

    /// Admit a connection from `ip` (`stream`: a handle on its socket).
    /// Returns its ticket and how many older pre-auth connections were
    /// evicted (shut down) to make room: 0 or 1.
    pub fn admit(self: &Arc<Self>, ip: IpAddr, stream: TcpStream) -> (Ticket, usize) {
        let mut inner = self.lock();
        let from_source = inner.live.iter().filter(|e| e.ip == ip).count();
        let evict = if from_source >= self.per_source {
            inner.live.iter().position(|e| e.ip == ip)
        } else if inner.live.len() >= self.total {
            Some(0)
        } else {
            None
        };
        let evicted = evict.map(|i| inner.live.remove(i));
        let key = inner.next;
        inner.next += 1;
        inner.live.push(Entry { key, ip, stream });
        drop(inner);
        let n = usize::from(evicted.is_some());
        if let Some(e) = evicted {
            // Its thread's next read fails and it ends; its ticket finds
            // nothing left to remove.
            let _ = e.stream.shutdown(Shutdown::Both);
        }
        (
            Ticket {
                owner: Arc::clone(self),
                key,
            },
            n,
        )
    }

    /// [`PreAuth::admit`] for a tokio socket: keeps a std handle on it for
    /// eviction and gives the socket back. `None` when the socket cannot be
    /// duplicated (the caller drops the connection).
    pub fn admit_async(
        self: &Arc<Self>,
        ip: IpAddr,
        stream: tokio::net::TcpStream,
    ) -> Option<(tokio::net::TcpStream, Ticket, usize)> {
        let std = stream.into_std().ok()?;
        let handle = std.try_clone().ok()?;
        let stream = tokio::net::TcpStream::from_std(std).ok()?;
        let (ticket, evicted) = self.admit(ip, handle);
        Some((stream, ticket, evicted))
    }

    /// Pre-auth connections now.
    pub fn live(&self) -> usize {
        self.lock().live.len()
    }

    /// The handshake deadline for a connection admitted now: `full` while
    /// the budget is at most half used, then shrinking in proportion to
    /// what is left, to [`MIN_DEADLINE`] when it is full.
    pub fn deadline(&self, full: Duration) -> Duration {
        let used = self.live();
        let half = self.total / 2;
        if used <= half || full <= MIN_DEADLINE {
            return full;
        }
        let left = self.total.saturating_sub(used) as f64 / (self.total - half).max(1) as f64;
        full.mul_f64(left.clamp(0.0, 1.0)).max(MIN_DEADLINE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;

    fn pair(l: &TcpListener) -> (TcpStream, TcpStream) {
        let c = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (s, _) = l.accept().expect("accept");
        (c, s)
    }

    #[test]
    fn a_full_budget_evicts_the_oldest_of_the_source_then_of_all() {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let budget = PreAuth::new(2, 3);
        let a: IpAddr = "10.0.0.1".parse().expect("ip");
        let b: IpAddr = "10.0.0.2".parse().expect("ip");
        let mut clients = Vec::new();
        let mut tickets = Vec::new();
        for ip in [a, a] {
            let (c, s) = pair(&l);
            let (t, evicted) = budget.admit(ip, s);
            assert_eq!(evicted, 0);
            clients.push(c);
            tickets.push(t);
        }
        // A third from `a`: the oldest of `a` goes (its peer sees the close).
        let (c, s) = pair(&l);
        let (t, evicted) = budget.admit(a, s);
        assert_eq!((evicted, budget.live()), (1, 2));
        let mut buf = [0u8; 1];
        assert_eq!(clients[0].read(&mut buf).expect("closed"), 0);
        clients.push(c);
        tickets.push(t);
        // `b` fits (3 in all), then a fourth from `b` evicts the oldest of all.
        let (_cb, s) = pair(&l);
        let (_tb, evicted) = budget.admit(b, s);
        assert_eq!((evicted, budget.live()), (0, 3));
        let (_cb2, s) = pair(&l);
        let (_t, evicted) = budget.admit(b, s);
        assert_eq!((evicted, budget.live()), (1, 3));
        assert_eq!(clients[1].read(&mut buf).expect("closed"), 0);
        // Tickets free their places, evicted or not.
        drop(tickets);
        assert_eq!(budget.live(), 2);
    }

    #[test]
    fn the_deadline_shrinks_as_the_budget_fills() {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let budget = PreAuth::new(100, 10);
        let full = Duration::from_secs(5);
        assert_eq!(budget.deadline(full), full);
        let mut keep = Vec::new();
        for i in 0..10u8 {
            let (c, s) = pair(&l);
            keep.push((c, budget.admit(IpAddr::from([10, 0, 0, i]), s).0));
        }
        assert_eq!(budget.deadline(full), MIN_DEADLINE);
        keep.truncate(8);
        assert_eq!(budget.deadline(full), full.mul_f64(0.4));
        keep.truncate(5);
        assert_eq!(budget.deadline(full), full);
    }
}
