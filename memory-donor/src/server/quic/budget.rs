//! QUIC handshakes in progress: which Initial gets a place, which a
//! stateless Retry.
//!
//! A QUIC Initial's source address can be forged, so a place charged to an
//! address the sender may not own must never keep that address's owner
//! out. Handshakes are therefore counted in two classes:
//!
//! - *Unvalidated* (no address-validation token): a place only while
//!   fewer than [`Limits::retry_above`] handshakes are in progress in all
//!   and fewer than [`Limits::per_source`] unvalidated ones from the same
//!   address; past either, a stateless Retry, never a refusal. Only a
//!   client that receives at the address can come back with the token.
//! - *Validated* (a Retry's token, or a NEW_TOKEN one, proved the
//!   address): counted against that address's own validated places only.
//!   It always gets a place unless every place is held by validated
//!   handshakes from sources holding at least as many as its own: at its
//!   address's limit the address's own oldest validated handshake goes; at
//!   the total the oldest unvalidated one goes, else the oldest of the
//!   busiest source.
//!
//! An evicted handshake is told through its [`Place`] and ends; nobody
//! else's handshake or session is touched. No IO: the accept loop acts on
//! the [`Verdict`].

use std::net::IpAddr;
use std::sync::Arc;

use engram_sync::Mutex;
use tokio::sync::Notify;

/// The bounds of a [`Handshakes`] budget.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Handshakes in progress at once, both classes together.
    pub total: usize,
    /// Handshakes in progress from one address, in each class.
    pub per_source: usize,
    /// Handshakes in progress past which an unvalidated Initial gets a Retry.
    pub retry_above: usize,
}

#[derive(Debug)]
struct Entry {
    key: u64,
    ip: IpAddr,
    validated: bool,
    evict: Arc<Notify>,
}

#[derive(Debug, Default)]
struct Inner {
    next: u64,
    /// Oldest first.
    live: Vec<Entry>,
}

impl Inner {
    fn count(&self, ip: IpAddr, validated: bool) -> usize {
        self.live
            .iter()
            .filter(|e| e.ip == ip && e.validated == validated)
            .count()
    }

    fn oldest(&self, f: impl Fn(&Entry) -> bool) -> Option<usize> {
        self.live.iter().position(f)
    }

    /// The validated source holding the most places, and how many; of
    /// sources holding as many, the one with the oldest handshake.
    fn busiest_validated(&self) -> Option<(IpAddr, usize)> {
        let mut counts: Vec<(IpAddr, usize)> = Vec::new();
        for e in self.live.iter().filter(|e| e.validated) {
            match counts.iter_mut().find(|(ip, _)| *ip == e.ip) {
                Some((_, n)) => *n += 1,
                None => counts.push((e.ip, 1)),
            }
        }
        counts.into_iter().fold(None, |best, c| match best {
            Some(b) if b.1 >= c.1 => Some(b),
            _ => Some(c),
        })
    }

    /// Which place a validated newcomer from `ip` takes over, if it must
    /// take one: `Err` when none may be taken.
    fn victim(&self, ip: IpAddr, limits: &Limits) -> Result<Option<usize>, ()> {
        let own = self.count(ip, true);
        if own >= limits.per_source {
            return Ok(self.oldest(|e| e.validated && e.ip == ip));
        }
        if self.live.len() < limits.total {
            return Ok(None);
        }
        if let Some(i) = self.oldest(|e| !e.validated) {
            return Ok(Some(i));
        }
        match self.busiest_validated() {
            Some((busiest, n)) if n > own => Ok(self.oldest(|e| e.validated && e.ip == busiest)),
            _ => Err(()),
        }
    }
}

/// What to do with an Initial.
#[derive(Debug)]
pub enum Verdict {
    /// Go on with the handshake in this place.
    Admit(Place),
    /// Send a stateless Retry: the address is not validated and a limit is
    /// reached. Nothing is kept.
    Retry,
    /// Refuse: every place is held by validated handshakes of sources
    /// holding at least as many as this one.
    Refuse,
}

/// The QUIC handshakes in progress of one endpoint.
#[derive(Debug)]
pub struct Handshakes {
    inner: Mutex<Inner>,
    limits: Limits,
}

/// A handshake's place; dropping it frees the place.
#[derive(Debug)]
pub struct Place {
    owner: Arc<Handshakes>,
    key: u64,
    evict: Arc<Notify>,
    /// Whether another handshake was evicted to make this place.
    pub evicted_another: bool,
}

impl Place {
    /// Resolves once the place is taken over by a validated newcomer.
    pub async fn evicted(&self) {
        self.evict.notified().await;
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.owner.inner.lock().live.retain(|e| e.key != self.key);
    }
}

impl Handshakes {
    /// An empty budget with `limits` (each at least 1).
    pub fn new(limits: Limits) -> Arc<Self> {
        let limits = Limits {
            total: limits.total.max(1),
            per_source: limits.per_source.max(1),
            retry_above: limits.retry_above.max(1),
        };
        Arc::new(Self {
            inner: Mutex::new(Inner::default()),
            limits,
        })
    }

    /// The verdict on an Initial from `ip`, whose address is `validated`
    /// or not; an admitted one holds its place until the [`Place`] drops.
    pub fn admit(self: &Arc<Self>, ip: IpAddr, validated: bool) -> Verdict {
        let limits = &self.limits;
        let mut inner = self.inner.lock();
        let victim = if validated {
            match inner.victim(ip, limits) {
                Ok(v) => v,
                Err(()) => return Verdict::Refuse,
            }
        } else {
            if inner.live.len() >= limits.retry_above.min(limits.total)
                || inner.count(ip, false) >= limits.per_source
            {
                return Verdict::Retry;
            }
            None
        };
        let evicted = victim.map(|i| inner.live.remove(i));
        let key = inner.next;
        inner.next += 1;
        let evict = Arc::new(Notify::new());
        inner.live.push(Entry {
            key,
            ip,
            validated,
            evict: Arc::clone(&evict),
        });
        drop(inner);
        let evicted_another = evicted.is_some();
        if let Some(e) = evicted {
            // Its task ends its handshake; its place is already gone.
            e.evict.notify_one();
        }
        Verdict::Admit(Place {
            owner: Arc::clone(self),
            key,
            evict,
            evicted_another,
        })
    }

    /// Handshakes in progress now: (unvalidated, validated).
    #[cfg(test)]
    pub fn live(&self) -> (usize, usize) {
        let inner = self.inner.lock();
        let validated = inner.live.iter().filter(|e| e.validated).count();
        (inner.live.len() - validated, validated)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::task::{Context, Poll, Waker};

    const LIMITS: Limits = Limits {
        total: 6,
        per_source: 2,
        retry_above: 4,
    };

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    fn place(v: Verdict) -> Place {
        match v {
            Verdict::Admit(p) => p,
            other => panic!("not admitted: {other:?}"),
        }
    }

    /// Whether `p` was told to go (the notice is taken: ask once).
    fn is_evicted(p: &Place) -> bool {
        let fut = std::pin::pin!(p.evicted());
        let mut cx = Context::from_waker(Waker::noop());
        matches!(fut.poll(&mut cx), Poll::Ready(()))
    }

    #[test]
    fn unvalidated_initials_past_a_limit_get_a_retry_never_a_refusal() {
        let b = Handshakes::new(LIMITS);
        let node = ip(1);
        let forged: Vec<Place> = (0..2).map(|_| place(b.admit(node, false))).collect();
        // The address's unvalidated places are full: a Retry, for the
        // forger and the node alike.
        for _ in 0..1000 {
            assert!(matches!(b.admit(node, false), Verdict::Retry));
        }
        let others: Vec<Place> = (2..4).map(|i| place(b.admit(ip(i), false))).collect();
        assert_eq!(b.live(), (4, 0));
        // Past `retry_above` in all, every unvalidated Initial is retried.
        assert!(matches!(b.admit(ip(9), false), Verdict::Retry));
        drop((forged, others));
        assert_eq!(b.live(), (0, 0));
    }

    #[test]
    fn a_validated_node_gets_a_place_past_every_forged_one() {
        let b = Handshakes::new(LIMITS);
        let node = ip(1);
        let forged: Vec<Place> = (0..2).map(|_| place(b.admit(node, false))).collect();
        // Its own validated class is empty: a place, nobody evicted.
        let first = place(b.admit(node, true));
        assert!(!first.evicted_another && !forged.iter().any(is_evicted));
        // Fill every place: validated handshakes from two other sources.
        let others: Vec<Place> = [2, 2, 3]
            .map(|i| place(b.admit(ip(i), true)))
            .into_iter()
            .collect();
        assert_eq!(b.live(), (2, 4));
        let _second = place(b.admit(node, true));
        assert_eq!(b.live(), (1, 5), "the oldest forged one made room");
        assert!(is_evicted(&forged[0]) && !is_evicted(&forged[1]));
        // At its own limit the node's newest takes over its own oldest.
        let third = place(b.admit(node, true));
        assert!(third.evicted_another && is_evicted(&first));
        assert!(!others.iter().any(is_evicted));
    }

    #[test]
    fn a_full_budget_of_validated_handshakes_makes_room_for_a_smaller_source() {
        let b = Handshakes::new(LIMITS);
        let held: Vec<Place> = (1..4)
            .flat_map(|i| [0, 1].map(|_| place(b.admit(ip(i), true))))
            .collect();
        assert_eq!(b.live(), (0, 6));
        // A source holding none takes the oldest place of the busiest
        // (ip 1, 2 and 3 hold two each: the oldest of ip 1's).
        let newcomer = place(b.admit(ip(7), true));
        assert!(newcomer.evicted_another && is_evicted(&held[0]));
        // Holding one, it still takes from a source holding two (ip 2).
        let _again = place(b.admit(ip(7), true));
        assert!(is_evicted(&held[2]));
        // At its own limit it takes over its own oldest, nobody else's.
        let _third = place(b.admit(ip(7), true));
        assert!(is_evicted(&newcomer));
        assert!(![1, 3, 4, 5].iter().any(|&i| is_evicted(&held[i])));
    }

    #[test]
    fn validated_sources_holding_as_many_as_the_newcomer_are_left_alone() {
        let limits = Limits {
            total: 4,
            per_source: 2,
            retry_above: 2,
        };
        let b = Handshakes::new(limits);
        let held: Vec<Place> = (1..5).map(|i| place(b.admit(ip(i), true))).collect();
        // Four sources hold one place each: a second from one of them
        // would hold more than any other, so it is refused.
        assert!(matches!(b.admit(ip(1), true), Verdict::Refuse));
        // A newcomer holding none is not refused: it takes the oldest.
        let _p = place(b.admit(ip(9), true));
        assert!(is_evicted(&held[0]));
        // Unvalidated Initials get their Retry whatever the budget holds.
        assert!(matches!(b.admit(ip(9), false), Verdict::Retry));
    }
}
