//! Locks that do not poison: std's `Mutex`, `RwLock` and `Condvar`, whose
//! `lock`, `read`, `write` and `wait` hand back the guard directly.
//!
//! Why not poisoning: every lock in engram-rack guards state its writers
//! never leave half-made across a call that can panic (counters, maps
//! replaced whole, queues pushed and popped in one step). A panic while
//! one is held is a bug the panic hook has already reported; refusing the
//! lock afterwards would only turn one reported panic into a second one in
//! another thread. std's own answer, `std::sync::nonpoison`, is unstable
//! in Rust 1.95: these wrappers have its shape, so moving to it is a
//! change of import. `parking_lot` was measured and not taken: it
//! allocates the first time a thread blocks on it, which the steady-state
//! allocation test counts (tokio's blocking threads come and go).
//!
//! Each wrapper costs nothing over std's lock: the poison flag is read and
//! ignored.

#![warn(missing_docs)]

use std::sync::{self, PoisonError, TryLockError};
use std::time::Duration;

pub use std::sync::{MutexGuard, RwLockReadGuard, RwLockWriteGuard, WaitTimeoutResult};

/// A mutual-exclusion lock that does not poison.
#[derive(Debug, Default)]
pub struct Mutex<T: ?Sized>(sync::Mutex<T>);

impl<T> Mutex<T> {
    /// A lock holding `value`.
    pub const fn new(value: T) -> Self {
        Self(sync::Mutex::new(value))
    }

    /// The value, the lock consumed.
    pub fn into_inner(self) -> T {
        self.0.into_inner().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<T: ?Sized> Mutex<T> {
    /// Wait for the lock and hold it until the guard drops.
    pub fn lock(&self) -> MutexGuard<'_, T> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The lock if it is free now; `None` if another thread holds it.
    pub fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
        match self.0.try_lock() {
            Ok(g) => Some(g),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    /// The value, through a unique borrow (no locking needed).
    pub fn get_mut(&mut self) -> &mut T {
        self.0.get_mut().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A reader-writer lock that does not poison.
#[derive(Debug, Default)]
pub struct RwLock<T: ?Sized>(sync::RwLock<T>);

impl<T> RwLock<T> {
    /// A lock holding `value`.
    pub const fn new(value: T) -> Self {
        Self(sync::RwLock::new(value))
    }

    /// The value, the lock consumed.
    pub fn into_inner(self) -> T {
        self.0.into_inner().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<T: ?Sized> RwLock<T> {
    /// Shared access until the guard drops.
    pub fn read(&self) -> RwLockReadGuard<'_, T> {
        self.0.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Exclusive access until the guard drops.
    pub fn write(&self) -> RwLockWriteGuard<'_, T> {
        self.0.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// The value, through a unique borrow (no locking needed).
    pub fn get_mut(&mut self) -> &mut T {
        self.0.get_mut().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A condition variable for [`Mutex`]'s guards that does not poison.
#[derive(Debug, Default)]
pub struct Condvar(sync::Condvar);

impl Condvar {
    /// A condition variable no one waits on.
    pub const fn new() -> Self {
        Self(sync::Condvar::new())
    }

    /// Release `guard`'s lock until woken (or spuriously), then hold it again.
    pub fn wait<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        self.0.wait(guard).unwrap_or_else(PoisonError::into_inner)
    }

    /// As [`Condvar::wait`], for at most `timeout`; says whether it timed out.
    pub fn wait_timeout<'a, T>(
        &self,
        guard: MutexGuard<'a, T>,
        timeout: Duration,
    ) -> (MutexGuard<'a, T>, WaitTimeoutResult) {
        self.0
            .wait_timeout(guard, timeout)
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Wake one waiter.
    pub fn notify_one(&self) {
        self.0.notify_one();
    }

    /// Wake every waiter.
    pub fn notify_all(&self) {
        self.0.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    /// A panic while a lock is held leaves it usable, with what the
    /// panicking thread wrote.
    #[test]
    fn a_panic_under_a_lock_does_not_poison_it() {
        let m = Arc::new(Mutex::new(1));
        let rw = Arc::new(RwLock::new(1));
        let (m2, rw2) = (Arc::clone(&m), Arc::clone(&rw));
        let r = std::thread::spawn(move || {
            let mut g = m2.lock();
            let mut w = rw2.write();
            *g = 2;
            *w = 2;
            panic!("a reported panic");
        })
        .join();
        assert!(r.is_err());
        assert_eq!(*m.lock(), 2);
        assert_eq!(m.try_lock().map(|g| *g), Some(2));
        assert_eq!(*rw.read(), 2);
        *rw.write() = 3;
        let m = Arc::into_inner(m).expect("one owner");
        assert_eq!(m.into_inner(), 2);
        let mut rw = Arc::into_inner(rw).expect("one owner");
        *rw.get_mut() += 1;
        assert_eq!(rw.into_inner(), 4);
    }

    #[test]
    fn try_lock_says_when_the_lock_is_held() {
        let m = Mutex::new(0);
        let g = m.lock();
        assert!(m.try_lock().is_none());
        drop(g);
        assert!(m.try_lock().is_some());
    }

    #[test]
    fn a_waiter_is_woken_and_a_timeout_times_out() {
        let pair = Arc::new((Mutex::new(false), Condvar::new()));
        let p2 = Arc::clone(&pair);
        let t = std::thread::spawn(move || {
            *p2.0.lock() = true;
            p2.1.notify_all();
        });
        let mut ready = pair.0.lock();
        while !*ready {
            ready = pair.1.wait(ready);
        }
        drop(ready);
        t.join().expect("the notifier");
        let start = Instant::now();
        let (_g, r) = pair.1.wait_timeout(pair.0.lock(), Duration::from_millis(5));
        assert!(r.timed_out() || start.elapsed() < Duration::from_millis(5));
        pair.1.notify_one();
    }
}
