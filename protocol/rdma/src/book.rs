//! The donor's side: its region book. Each resident table version is
//! registered twice (its rows, and its check words computed at publish) and
//! gets a new generation; publishing a table again (a swap) registers the
//! new version first, then deregisters the old one, so a node still
//! holding the old key gets a remote access error, never rows of another
//! version. Regions and queue-pair tokens are handed out only through
//! [`RegionBook::grant`], which the donor calls for a RegionQuery on an
//! authenticated connection; its listener admits a queue pair only with an
//! unexpired, unused token.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use engram_protocol::messages::Region;
use engram_protocol::{ROW_BYTES, TableDigest};
use engram_sync::Mutex;

use crate::check::{CHECK_BYTES, seed, table_checks};
use crate::verbs::{DeviceSpec, Listener, Memory, Provider, Registration, VerbsError};

/// How long a queue-pair token admits a connect.
pub const TOKEN_TTL: Duration = Duration::from_secs(10);
/// Most tokens outstanding: beyond it, the oldest of the identity holding
/// the most is dropped.
pub const MAX_TOKENS: usize = 1024;
/// Tokens one identity may hold at once: beyond it, its own oldest is
/// dropped (one client never evicts another's).
pub const MAX_TOKENS_PER_OWNER: usize = 64;
/// Queue pairs the book tracks for one identity: beyond it, its own oldest
/// is disconnected.
pub const MAX_QPS_PER_OWNER: usize = 64;
/// Queue pairs tracked in all: beyond it, the oldest of the identity
/// holding the most is disconnected.
pub const MAX_QPS: usize = 1024;

/// A token granted and not yet used.
#[derive(Debug)]
struct Token {
    bytes: [u8; 16],
    owner: Arc<str>,
    expires: Instant,
}

/// A queue pair admitted with a token: its listener key and the identity
/// its token was granted to.
#[derive(Debug)]
struct Qp {
    key: u64,
    owner: Arc<str>,
}

/// Remove one entry to make room: the oldest of `owner` when it holds
/// `per_owner` already, else (when `all` are held) the oldest of the owner
/// holding the most. Returns what was removed.
fn make_room<T>(
    list: &mut Vec<T>,
    owner_of: impl Fn(&T) -> &str,
    owner: &str,
    per_owner: usize,
    all: usize,
) -> Option<T> {
    let mine = list.iter().filter(|x| owner_of(x) == owner).count();
    if mine >= per_owner {
        let i = list.iter().position(|x| owner_of(x) == owner)?;
        return Some(list.remove(i));
    }
    if list.len() < all {
        return None;
    }
    let mut counts: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for x in list.iter() {
        *counts.entry(owner_of(x)).or_default() += 1;
    }
    let (most, _) = counts.into_iter().max_by_key(|(_, n)| *n)?;
    let most = most.to_owned();
    let i = list.iter().position(|x| owner_of(x) == most)?;
    Some(list.remove(i))
}

#[derive(Debug)]
struct Entry {
    table: u32,
    rows: u64,
    digest: TableDigest,
    generation: u64,
    rows_reg: Box<dyn Registration>,
    checks_reg: Box<dyn Registration>,
}

/// What publishing a table cost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Published {
    /// The registration's generation.
    pub generation: u64,
    /// Bytes registered (rows and check words).
    pub registered: u64,
    /// Time to compute the check words.
    pub checks: Duration,
    /// Time to register both regions.
    pub register: Duration,
}

/// Why a table could not be published.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PublishError {
    /// The memory is not `rows` rows.
    #[error("table {table}: {len} bytes of memory for {rows} rows")]
    Size {
        /// The table.
        table: u32,
        /// Bytes given.
        len: usize,
        /// Rows declared.
        rows: u64,
    },
    /// Registration failed.
    #[error("table {table}: registering its memory: {source}")]
    Verbs {
        /// The table.
        table: u32,
        /// Why.
        source: VerbsError,
    },
}

/// A donor's registered tables and outstanding tokens.
#[derive(Debug)]
pub struct RegionBook {
    provider: Arc<dyn Provider>,
    spec: DeviceSpec,
    entries: Mutex<Vec<Entry>>,
    tokens: Mutex<Vec<Token>>,
    qps: Mutex<Vec<Qp>>,
    next_qp: AtomicU64,
    generation: AtomicU64,
    listener: Mutex<Option<Box<dyn Listener>>>,
}

/// 16 bytes from the kernel's random source.
fn random16() -> [u8; 16] {
    let mut b = [0u8; 16];
    let mut at = 0;
    while at < b.len() {
        // SAFETY: the pointer and length describe the unfilled tail of `b`.
        let n = unsafe { libc::getrandom(b[at..].as_mut_ptr().cast(), b.len() - at, 0) };
        if n <= 0 {
            // getrandom(2) does not fail once the pool is initialized;
            // never hand out a predictable token: fall back to the clock
            // mixed through the hash as a last resort.
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let h = twox_hash::XxHash3_128::oneshot(&t.to_le_bytes());
            return h.to_le_bytes();
        }
        at += n as usize;
    }
    b
}

impl RegionBook {
    /// A book registering on `spec`'s device through `provider`.
    pub fn new(provider: Arc<dyn Provider>, spec: DeviceSpec) -> Arc<Self> {
        // Generations start from a random point: a restarted donor never
        // repeats its predecessor's.
        let start = u64::from_le_bytes(random16()[..8].try_into().unwrap_or([1; 8])) >> 16;
        Arc::new(Self {
            provider,
            spec,
            entries: Mutex::new(Vec::new()),
            tokens: Mutex::new(Vec::new()),
            qps: Mutex::new(Vec::new()),
            next_qp: AtomicU64::new(1),
            generation: AtomicU64::new(start.max(1)),
            listener: Mutex::new(None),
        })
    }

    /// Its provider's name.
    pub fn provider_name(&self) -> &'static str {
        self.provider.name()
    }

    /// Accept queue pairs at `addr` (replacing any listener it had).
    pub fn listen(self: &Arc<Self>, addr: std::net::SocketAddr) -> Result<(), VerbsError> {
        let weak: Weak<Self> = Arc::downgrade(self);
        let admit = Arc::new(move |private: &[u8]| {
            weak.upgrade()
                .and_then(|b| b.admit(private, Instant::now()))
        });
        let mut l = self.listener.lock();
        *l = None;
        *l = Some(self.provider.listen(addr, &self.spec, admit)?);
        Ok(())
    }

    /// Stop accepting queue pairs.
    pub fn stop_listening(&self) {
        *self.listener.lock() = None;
    }

    /// Register `memory` (the rows of table `table` at version `digest`)
    /// and its check words; the table's previous registration, if any, is
    /// deregistered once the new one is in place.
    pub fn publish(
        &self,
        table: u32,
        rows: u64,
        digest: TableDigest,
        memory: Arc<dyn Memory>,
    ) -> Result<Published, PublishError> {
        self.publish_with(table, rows, digest, memory, None)
    }

    /// [`RegionBook::publish`] with the check words given (computed
    /// before, or kept from a previous process: `check::table_checks` of
    /// exactly these rows, 8 bytes a row), or computed here when `None`.
    pub fn publish_with(
        &self,
        table: u32,
        rows: u64,
        digest: TableDigest,
        memory: Arc<dyn Memory>,
        checks: Option<Arc<dyn Memory>>,
    ) -> Result<Published, PublishError> {
        let len = memory.bytes().len();
        if len as u64 != rows.saturating_mul(ROW_BYTES as u64) {
            return Err(PublishError::Size { table, len, rows });
        }
        if let Some(c) = &checks
            && c.bytes().len() as u64 != rows.saturating_mul(CHECK_BYTES as u64)
        {
            return Err(PublishError::Size {
                table,
                len: c.bytes().len(),
                rows,
            });
        }
        let t0 = Instant::now();
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        if checks.is_none() && rows >= 1 << 22 {
            // A minute or so for a full-size table: say what is going on.
            tracing::info!(
                table,
                rows,
                threads,
                "rdma: computing the check words (8 bytes a row) before registering"
            );
        }
        let checks = checks.unwrap_or_else(|| {
            Arc::new(table_checks(seed(&digest), memory.bytes(), threads)) as Arc<dyn Memory>
        });
        let t1 = Instant::now();
        let verbs = |source| PublishError::Verbs { table, source };
        let rows_reg = self.provider.register(&self.spec, memory).map_err(verbs)?;
        let checks_reg = self.provider.register(&self.spec, checks).map_err(verbs)?;
        let t2 = Instant::now();
        let generation = self.generation.fetch_add(1, Ordering::Relaxed);
        let old = {
            let mut e = self.entries.lock();
            let old = e
                .iter()
                .position(|x| x.table == table)
                .map(|i| e.swap_remove(i));
            e.push(Entry {
                table,
                rows,
                digest,
                generation,
                rows_reg,
                checks_reg,
            });
            old
        };
        // Deregistered here, after the new version is in place.
        drop(old);
        Ok(Published {
            generation,
            registered: len as u64 + rows * CHECK_BYTES as u64,
            checks: t1 - t0,
            register: t2 - t1,
        })
    }

    /// Deregister table `table` (it is no longer served).
    pub fn retire(&self, table: u32) {
        let old = {
            let mut e = self.entries.lock();
            e.iter()
                .position(|x| x.table == table)
                .map(|i| e.swap_remove(i))
        };
        drop(old);
    }

    /// True when `table` is registered at version `digest`.
    pub fn holds(&self, table: u32, digest: &TableDigest) -> bool {
        self.entries
            .lock()
            .iter()
            .any(|x| x.table == table && x.digest == *digest)
    }

    /// Deregister the tables `keep` does not list at all; a table listed at
    /// another version stays registered until its new version is published
    /// (which replaces it). Returns the tables it dropped.
    pub fn retain_or_stale(&self, keep: &[(u32, TableDigest)]) -> Vec<u32> {
        let ids: Vec<(u32, TableDigest)> = self
            .entries
            .lock()
            .iter()
            .filter(|x| keep.iter().any(|k| k.0 == x.table))
            .map(|x| (x.table, x.digest))
            .collect();
        self.retain(&ids)
    }

    /// Keep only the tables `keep` says, at the versions it gives:
    /// everything else is deregistered. Returns the tables it dropped.
    pub fn retain(&self, keep: &[(u32, TableDigest)]) -> Vec<u32> {
        let gone: Vec<Entry> = {
            let mut e = self.entries.lock();
            let (stay, gone): (Vec<Entry>, Vec<Entry>) = e
                .drain(..)
                .partition(|x| keep.contains(&(x.table, x.digest)));
            *e = stay;
            gone
        };
        gone.iter().map(|x| x.table).collect()
    }

    /// The region of `table` with a fresh queue-pair token granted to
    /// `owner` (the identity the asking client proved), or `None` when the
    /// table is not registered.
    pub fn grant(&self, table: u32, owner: &str) -> Option<Region> {
        let region = {
            let e = self.entries.lock();
            let x = e.iter().find(|x| x.table == table)?;
            let (r, c) = (x.rows_reg.remote(), x.checks_reg.remote());
            Region {
                table_id: table,
                rows: x.rows,
                digest: x.digest,
                generation: x.generation,
                rows_addr: r.addr,
                rows_rkey: r.rkey,
                checks_rkey: c.rkey,
                checks_addr: c.addr,
                token: random16(),
            }
        };
        let now = Instant::now();
        let mut t = self.tokens.lock();
        t.retain(|x| x.expires > now);
        make_room(
            &mut t,
            |x| &x.owner,
            owner,
            MAX_TOKENS_PER_OWNER,
            MAX_TOKENS,
        );
        t.push(Token {
            bytes: region.token,
            owner: owner.into(),
            expires: now + TOKEN_TTL,
        });
        Some(region)
    }

    /// Whether a queue pair presenting `private` may connect: an unexpired
    /// token this book granted, used once. `Some(key)`: admitted, and
    /// tracked under `key` as its token's owner's (whose oldest queue pair
    /// is disconnected when the owner is at [`MAX_QPS_PER_OWNER`]).
    pub fn admit(&self, private: &[u8], now: Instant) -> Option<u64> {
        if private.len() < 16 {
            return None;
        }
        let presented = &private[..16];
        let owner = {
            let mut t = self.tokens.lock();
            t.retain(|x| x.expires > now);
            let i = t.iter().position(|x| {
                // Constant time in the token's bytes.
                x.bytes
                    .iter()
                    .zip(presented)
                    .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                    == 0
            })?;
            t.swap_remove(i).owner
        };
        let key = self.next_qp.fetch_add(1, Ordering::Relaxed);
        let evicted = {
            let mut q = self.qps.lock();
            let evicted = make_room(&mut q, |x| &x.owner, &owner, MAX_QPS_PER_OWNER, MAX_QPS);
            q.push(Qp { key, owner });
            evicted
        };
        if let Some(old) = evicted {
            self.disconnect(&[old.key]);
        }
        Some(key)
    }

    /// The identities holding tokens or queue pairs.
    pub fn owners(&self) -> Vec<Arc<str>> {
        let mut out: Vec<Arc<str>> = self
            .qps
            .lock()
            .iter()
            .map(|x| Arc::clone(&x.owner))
            .chain(self.tokens.lock().iter().map(|x| Arc::clone(&x.owner)))
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// Cut `owner` off: its tokens are dropped and its queue pairs
    /// disconnected. Returns how many queue pairs it held.
    pub fn revoke(&self, owner: &str) -> usize {
        self.tokens.lock().retain(|x| &*x.owner != owner);
        let keys: Vec<u64> = {
            let mut q = self.qps.lock();
            let keys = q
                .iter()
                .filter(|x| &*x.owner == owner)
                .map(|x| x.key)
                .collect();
            q.retain(|x| &*x.owner != owner);
            keys
        };
        self.disconnect(&keys);
        keys.len()
    }

    fn disconnect(&self, keys: &[u64]) {
        if keys.is_empty() {
            return;
        }
        if let Some(l) = self.listener.lock().as_ref() {
            l.disconnect(keys);
        }
    }

    /// Tables registered, with their generations.
    pub fn tables(&self) -> Vec<(u32, u64)> {
        self.entries
            .lock()
            .iter()
            .map(|x| (x.table, x.generation))
            .collect()
    }

    /// Bytes registered (pinned) now.
    pub fn registered_bytes(&self) -> u64 {
        self.entries
            .lock()
            .iter()
            .map(|x| x.rows_reg.remote().len + x.checks_reg.remote().len)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::FakeProvider;

    #[test]
    fn tokens_admit_once_and_expire() {
        let p = FakeProvider::new();
        let book = RegionBook::new(Arc::new(p), DeviceSpec::default());
        let rows = vec![7u8; 3 * ROW_BYTES];
        let d = TableDigest([4; 32]);
        assert!(book.publish(0, 3, d, Arc::new(rows)).is_ok());
        let Some(g) = book.grant(0, "node-1") else {
            panic!("no grant")
        };
        assert_eq!((g.rows, g.digest), (3, d));
        assert!(book.grant(9, "node-1").is_none());
        let now = Instant::now();
        assert!(book.admit(&[0; 16], now).is_none());
        assert!(book.admit(&g.token[..8], now).is_none());
        assert!(book.admit(&g.token, now).is_some());
        assert!(book.admit(&g.token, now).is_none(), "a token admits once");
        let Some(g2) = book.grant(0, "node-1") else {
            panic!("no grant")
        };
        assert!(
            book.admit(&g2.token, now + TOKEN_TTL + Duration::from_millis(1))
                .is_none()
        );
    }

    /// A connection request names no address the book keys anything by:
    /// only a token granted over an authenticated session admits. Forged
    /// requests (from a node's address or any other) are refused and
    /// leave nothing behind, and the node's own token still admits.
    #[test]
    fn requests_without_a_granted_token_leave_no_state() {
        let book = RegionBook::new(Arc::new(FakeProvider::new()), DeviceSpec::default());
        let d = TableDigest([5; 32]);
        assert!(
            book.publish(0, 1, d, Arc::new(vec![0u8; ROW_BYTES]))
                .is_ok()
        );
        let Some(mine) = book.grant(0, "node-1") else {
            panic!("no grant")
        };
        let now = Instant::now();
        for i in 0..1000u32 {
            let mut forged = [0u8; 16];
            forged[..4].copy_from_slice(&i.to_le_bytes());
            forged[4..].copy_from_slice(&mine.token[4..]);
            if forged != mine.token {
                assert!(book.admit(&forged, now).is_none());
            }
        }
        assert_eq!(book.qps.lock().len(), 0);
        assert_eq!(book.tokens.lock().len(), 1);
        assert!(book.admit(&mine.token, now).is_some());
    }

    #[test]
    fn publishing_again_revokes_the_old_version() {
        let p = FakeProvider::new();
        let fabric = Arc::clone(p.fabric());
        let book = RegionBook::new(Arc::new(p), DeviceSpec::default());
        let d1 = TableDigest([1; 32]);
        let d2 = TableDigest([2; 32]);
        assert!(
            book.publish(0, 2, d1, Arc::new(vec![1u8; 2 * ROW_BYTES]))
                .is_ok()
        );
        let Some(old) = book.grant(0, "node-1") else {
            panic!("no grant")
        };
        assert_eq!(fabric.regions(), 2);
        assert!(
            book.publish(0, 2, d2, Arc::new(vec![2u8; 2 * ROW_BYTES]))
                .is_ok()
        );
        assert_eq!(fabric.regions(), 2);
        let Some(new) = book.grant(0, "node-1") else {
            panic!("no grant")
        };
        assert!(new.generation > old.generation);
        assert_ne!(new.rows_rkey, old.rows_rkey);
        assert!(!fabric.revoke(old.rows_rkey), "the old key is gone");
        assert_eq!(book.registered_bytes(), 2 * 264 + 2 * 8);
        assert_eq!(book.retain(&[(0, d1)]), vec![0]);
        assert_eq!(fabric.regions(), 0);
        assert!(matches!(
            book.publish(1, 5, d1, Arc::new(vec![0u8; 10])),
            Err(PublishError::Size { .. })
        ));
    }

    #[test]
    fn one_identity_never_evicts_anothers_tokens_and_revocation_takes_its_own() {
        let p = FakeProvider::new();
        let book = RegionBook::new(Arc::new(p), DeviceSpec::default());
        assert!(
            book.publish(0, 1, TableDigest([3; 32]), Arc::new(vec![0u8; ROW_BYTES]))
                .is_ok()
        );
        let now = Instant::now();
        let Some(mine) = book.grant(0, "node-1") else {
            panic!("no grant")
        };
        // A flood of grants to another identity drops only its own oldest.
        let flood: Vec<_> = (0..MAX_TOKENS_PER_OWNER * 3)
            .filter_map(|_| book.grant(0, "node-2"))
            .collect();
        assert!(
            book.admit(&flood[0].token, now).is_none(),
            "its own oldest went"
        );
        let Some(last) = flood.last() else {
            panic!("no flood")
        };
        assert!(book.admit(&last.token, now).is_some());
        let Some(a) = book.admit(&mine.token, now) else {
            panic!("node-1's token was evicted by node-2's grants")
        };
        assert_eq!(book.owners().len(), 2);
        // Revoking node-1 drops its queue pair and its tokens, nobody else's.
        let Some(pending) = book.grant(0, "node-1") else {
            panic!("no grant")
        };
        assert_eq!(book.revoke("node-1"), 1);
        assert!(book.admit(&pending.token, now).is_none());
        assert_eq!(book.owners(), vec![Arc::<str>::from("node-2")]);
        assert!(a > 0);
    }
}
