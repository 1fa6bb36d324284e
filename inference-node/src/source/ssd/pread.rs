//! The pread engine: a pool of threads, each reading the pages handed to
//! it with `pread` into its own aligned page. A batch is queued whole; free
//! threads take the next read, so with as many threads as rows every read
//! is in flight at once, and with 4 threads for 24 rows each thread reads
//! about 6 in turn.
//!
//! Every job carries its batch's generation, and a batch waits for every
//! job it queued, so an answer can never be taken for another batch's.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::mpsc;

use cluster_config::SsdIoprio;
use engram_sync::Mutex;

use super::ioprio;
use super::pages::{PAGE, PageError, PageRead, Pages};

/// One row's bytes: inline for every encoding's rows up to 320 bytes (no
/// allocation a read), on the heap beyond.
type RowBuf = smallvec::SmallVec<[u8; 320]>;

type Answer = (u64, usize, Result<RowBuf, PageError>);

/// A pool of pread threads over one file.
#[derive(Debug)]
pub struct PreadPool {
    jobs: Option<mpsc::Sender<Job>>,
    done_rx: mpsc::Receiver<Answer>,
    threads: Vec<std::thread::JoinHandle<()>>,
    tids: Vec<libc::pid_t>,
    generation: u64,
}

struct Job {
    generation: u64,
    index: usize,
    read: PageRead,
}

impl PreadPool {
    /// Start `threads` readers of `file`, each reading at `prio` (the
    /// caller checked it is permitted).
    pub fn new(file: Arc<File>, threads: usize, prio: SsdIoprio) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let (done_tx, done_rx) = mpsc::channel();
        let (tid_tx, tid_rx) = mpsc::channel();
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let rx = rx.clone();
            let done = done_tx.clone();
            let file = file.clone();
            let tid_tx = tid_tx.clone();
            let h = std::thread::Builder::new()
                .name(format!("ssd-pread-{i}"))
                .spawn(move || {
                    if let Err(e) = ioprio::set_current_thread(prio) {
                        tracing::warn!(error = %e, ioprio = %prio, "a pread thread could not set its I/O priority");
                    }
                    let _ = tid_tx.send(ioprio::current_tid());
                    reader_thread(&file, &rx, &done);
                })?;
            handles.push(h);
        }
        drop(tid_tx);
        let tids = tid_rx.iter().take(handles.len()).collect();
        Ok(Self {
            jobs: Some(tx),
            done_rx,
            threads: handles,
            tids,
            generation: 0,
        })
    }

    /// The pool's thread ids.
    pub fn thread_ids(&self) -> &[libc::pid_t] {
        &self.tids
    }

    /// Read every page of `plan`, each row into its place in `out`; the
    /// first failure is returned once every read has come back.
    pub(crate) fn read(&mut self, plan: &[PageRead], out: &mut [u8]) -> Result<(), PageError> {
        let gone = || PageError::Io(std::io::Error::other("the pread pool is gone"));
        let jobs = self.jobs.as_ref().ok_or_else(gone)?;
        self.generation += 1;
        let generation = self.generation;
        let mut queued = 0;
        for (index, &read) in plan.iter().enumerate() {
            if jobs
                .send(Job {
                    generation,
                    index,
                    read,
                })
                .is_err()
            {
                break;
            }
            queued += 1;
        }
        let mut first_err = (queued < plan.len()).then(gone);
        let mut answered = 0;
        while answered < queued {
            let Ok((g, i, res)) = self.done_rx.recv() else {
                return Err(first_err.unwrap_or_else(gone));
            };
            if g != generation || i >= queued {
                continue;
            }
            answered += 1;
            match res {
                Ok(row) => {
                    let len = row.len();
                    match out.get_mut(i * len..(i + 1) * len) {
                        Some(dst) => dst.copy_from_slice(&row),
                        None => {
                            first_err = first_err.or(Some(PageError::Io(std::io::Error::other(
                                "output buffer size",
                            ))))
                        }
                    }
                }
                Err(e) => first_err = first_err.or(Some(e)),
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

fn reader_thread(file: &File, jobs: &Mutex<mpsc::Receiver<Job>>, done: &mpsc::Sender<Answer>) {
    let mut page = Pages::new(1);
    loop {
        let Ok(job) = jobs.lock().recv() else {
            return;
        };
        let buf = page.page_mut(0);
        let res = read_page(file, buf, job.read.offset).and_then(|n| {
            let mut row = RowBuf::from_elem(0, job.read.len);
            job.read.take_row(buf, n, &mut row).map(|()| row)
        });
        if done.send((job.generation, job.index, res)).is_err() {
            return;
        }
    }
}

/// One page at `offset` into `buf`; the bytes read (short at the end of a file).
pub(crate) fn read_page(file: &File, buf: &mut [u8], offset: u64) -> Result<usize, PageError> {
    debug_assert_eq!(buf.len(), PAGE);
    loop {
        match file.read_at(buf, offset) {
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(PageError::Io(e)),
        }
    }
}

impl Drop for PreadPool {
    fn drop(&mut self) {
        self.jobs = None;
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}
