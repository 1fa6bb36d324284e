//! The loop's rows from the node's routers: each fetch runs as a task on
//! the node's tokio runtime (so hedges, failovers and answers progress
//! while the loop's thread computes), and its end is timed there, when the
//! last row arrived, not when the loop looked.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, TryRecvError, sync_channel};
use std::time::{Duration, Instant};

use engram_protocol::ROW_BYTES;
use tokio::runtime::Handle;

use super::{Fetch, Fetcher};
use crate::router::Router;

/// How long a wait spins before it blocks (a blocked thread takes tens of
/// microseconds to wake).
const SPIN: Duration = Duration::from_micros(30);

/// Fetches through one router per slot.
#[derive(Debug)]
pub struct RouterFetcher {
    handle: Handle,
    routers: [Arc<Router>; 2],
    origin: Instant,
    chunk_rows: usize,
}

impl RouterFetcher {
    /// Fetch through `routers` (layer 1's, layer 14's) on `handle`, timing on
    /// a clock whose zero is `origin`; a fetch of more than `chunk_rows`
    /// rows is cut into messages of at most that many, sent together.
    pub fn new(
        handle: Handle,
        routers: [Arc<Router>; 2],
        origin: Instant,
        chunk_rows: usize,
    ) -> Self {
        Self {
            handle,
            routers,
            origin,
            chunk_rows: chunk_rows.max(1),
        }
    }
}

/// Merge one message's outcome into the fetch's.
fn merge(f: &mut Fetch, res: Result<crate::router::Fetched, crate::router::RouterError>) {
    f.messages += 1;
    match res {
        Ok(x) => {
            let name = x.source.unwrap_or_else(|| {
                f.zeros = true;
                "zeros".into()
            });
            if !f.sources.contains(&name) {
                f.sources.push(name);
            }
            f.hedges += x.hedges;
            f.failovers += x.failovers;
            f.late |= x.late;
        }
        Err(e) => {
            if f.error.is_none() {
                f.error = Some(e.to_string());
            }
        }
    }
}

/// Fetch `rows` of one table through `router`: one message when they fit in
/// `chunk` rows, else messages of at most `chunk` rows sent together. The
/// rows come back in the order asked (`rows.len() * 264` bytes); `ready` is
/// left for the caller to stamp on its own clock.
pub async fn fetch_rows(router: &Router, rows: &[u64], chunk: usize) -> Fetch {
    let chunk = chunk.max(1);
    let mut f = Fetch {
        bytes: vec![0; rows.len() * ROW_BYTES],
        ..Fetch::default()
    };
    if rows.len() <= chunk {
        let res = router.fetch(rows, &mut f.bytes).await;
        merge(&mut f, res);
    } else {
        let mut bytes = std::mem::take(&mut f.bytes);
        let results = {
            let futs = rows
                .chunks(chunk)
                .zip(bytes.chunks_mut(chunk * ROW_BYTES))
                .map(|(r, out)| router.fetch(r, out));
            futures_util::future::join_all(futs).await
        };
        f.bytes = bytes;
        for res in results {
            merge(&mut f, res);
        }
    }
    f
}

impl Fetcher for RouterFetcher {
    type Pending = Receiver<Fetch>;

    fn start(&mut self, slot: usize, rows: Vec<u64>) -> Receiver<Fetch> {
        let (tx, rx) = sync_channel(1);
        let router = self.routers[slot].clone();
        let origin = self.origin;
        let chunk = self.chunk_rows;
        self.handle.spawn(async move {
            let mut f = fetch_rows(&router, &rows, chunk).await;
            f.ready = origin.elapsed();
            // The loop may have stopped; nothing to tell it then.
            let _ = tx.send(f);
        });
        rx
    }

    fn wait(&mut self, rx: Receiver<Fetch>) -> Fetch {
        let spin_until = Instant::now() + SPIN;
        loop {
            match rx.try_recv() {
                Ok(f) => return f,
                Err(TryRecvError::Empty) if Instant::now() < spin_until => {
                    std::hint::spin_loop();
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return lost(self.origin),
            }
        }
        rx.recv().unwrap_or_else(|_| lost(self.origin))
    }
}

/// The fetch task ended without an answer (the runtime is shutting down).
fn lost(origin: Instant) -> Fetch {
    Fetch {
        ready: origin.elapsed(),
        error: Some("the fetch task ended without an answer (shutting down)".into()),
        ..Fetch::default()
    }
}
