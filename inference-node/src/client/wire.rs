//! The client's connection layer: socket <-> frames for one donor.
//!
//! Writes are cancel-safe: a frame's unsent tail stays in `WriteState` and
//! the next writer finishes it before its own, so a request dropped halfway
//! through a write (a lost hedge, a deadline) never leaves the stream
//! unframed. Reads are done by whichever waiting request holds the read side
//! (`lead`); `tokio`'s `read_buf` is cancel-safe and bytes read stay in the
//! shared buffer.

use std::os::fd::RawFd;
use std::pin::{Pin, pin};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use cluster_config::records::{Opened, Records, record_len};
use engram_protocol::messages::{
    ROWS_HEAD_LEN, ROWS_SECTION_LEN, keep_wide_units_warm, payload_checksum_of_parts,
};
use engram_protocol::session::client::{self, ClientSession, Incoming};
use engram_protocol::{FrameHeader, FrameKind, HEADER_LEN, Limits};
use engram_sync::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
/// The byte stream under a connection: a TCP socket's halves, or a QUIC stream's.
pub(super) trait ReadHalf:
    tokio::io::AsyncRead + Unpin + Send + Sync + std::fmt::Debug
{
    /// Before a busy-poll: stop watching the socket through the runtime
    /// when nobody needs that (a half kept out of the reactor,
    /// [`super::quiet`]); nothing for the others.
    fn quiet(&mut self) {}
}
impl ReadHalf for tokio::net::tcp::OwnedReadHalf {}
impl ReadHalf for quinn::RecvStream {}
/// See [`ReadHalf`].
pub(super) trait WriteHalf:
    tokio::io::AsyncWrite + Unpin + Send + Sync + std::fmt::Debug
{
}
impl<T: tokio::io::AsyncWrite + Unpin + Send + Sync + std::fmt::Debug> WriteHalf for T {}

use super::ClientError;

pub(super) type Reply = Result<Bytes, ClientError>;

/// A request waiting for its answer: the answer once a reader handed it
/// over, and whom to wake then. Kept in the session's in-flight list
/// ([`Session`]), whose storage is reused from request to request (nothing
/// allocated per request).
#[derive(Debug, Default)]
pub(super) struct Waiter {
    reply: Option<Reply>,
    waker: Option<Waker>,
}

/// The protocol's state of the connection (engram-protocol's client
/// session, no IO) with each in-flight request's waiter.
pub(super) type Session = ClientSession<Waiter>;

/// Hand `reply` to request `id` and wake it; dropped when nobody waits
/// for it any more (a cancelled request: a lost hedge).
fn answer(s: &mut Session, id: u64, reply: Reply) -> Option<Waker> {
    let w = s.slot(id)?;
    w.reply = Some(reply);
    w.waker.take()
}

/// Request `id`'s answer if it came; else wake `cx` when it does.
pub(super) fn poll_reply(s: &mut Session, id: u64, cx: &mut Context<'_>) -> Poll<Reply> {
    let Some(w) = s.slot(id) else {
        return Poll::Ready(Err(ClientError::Disconnected("connection closed".into())));
    };
    if let Some(r) = w.reply.take() {
        return Poll::Ready(r);
    }
    match &mut w.waker {
        Some(k) if k.will_wake(cx.waker()) => {}
        k => *k = Some(cx.waker().clone()),
    }
    Poll::Pending
}

/// Request `id`'s answer if it came.
pub(super) fn take_reply(s: &mut Session, id: u64) -> Option<Reply> {
    s.slot(id)?.reply.take()
}

/// A TLS session's records (sealed and opened in place, with the keys
/// rustls handed over after its handshake), shared by the read and write
/// sides. Each side locks it only while a record is opened or sealed
/// (never across an await), so a reader waiting for the donor never holds
/// up a writer.
pub(super) type TlsRecords = std::sync::Arc<Mutex<Records>>;

fn lock(s: &TlsRecords) -> engram_sync::MutexGuard<'_, Records> {
    s.lock()
}

/// The read side: whichever request holds it reads frames for everyone.
#[derive(Debug)]
pub(super) struct ReadState {
    pub r: Box<dyn ReadHalf>,
    /// The TCP socket, for busy-polling (none over QUIC).
    pub fd: Option<RawFd>,
    /// Whole plaintext frames are split off here.
    pub buf: BytesMut,
    /// Over TLS: the session, and ciphertext read but not yet decrypted.
    pub tls: Option<TlsRecords>,
    pub cipher: BytesMut,
    /// Over TLS: the donor's close_notify was read (after what came before
    /// it is taken).
    pub peer_closed: bool,
    /// Row bytes of an answer still on the socket whose reader stopped
    /// halfway through reading them into its own buffer (its request was
    /// cancelled): discarded before the next frame.
    pub skip: usize,
    /// The read half keeps its socket out of the runtime's reactor
    /// ([`super::quiet`]): a look at what arrived reads the socket itself,
    /// so that it does not put the socket back in.
    pub quiet: bool,
    /// Wakes a reader sleeping on the socket by its lookup's deadline
    /// ([`super::deadline::watch`]); made at its first such sleep.
    clock: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The clock as [`next_frame`] last read it, no later than the read
    /// that completed the frame it returned: when the session last read
    /// (an earlier time only makes the idle check look sooner). A
    /// polling reader reads the clock anyway; this saves another read.
    pub seen: Instant,
}

impl ReadState {
    /// A read side over `r`, through `tls` when given.
    pub fn new(r: Box<dyn ReadHalf>, fd: Option<RawFd>, tls: Option<TlsRecords>) -> Self {
        Self {
            r,
            fd,
            quiet: false,
            clock: None,
            seen: Instant::now(),
            buf: BytesMut::with_capacity(64 << 10),
            tls,
            cipher: BytesMut::new(),
            peer_closed: false,
            skip: 0,
        }
    }

    /// Drop what is left of an answer nobody reads any more.
    fn settle(&mut self) {
        let n = self.skip.min(self.buf.len());
        bytes::Buf::advance(&mut self.buf, n);
        self.skip -= n;
    }

    /// One non-blocking read from the socket: into the frame buffer, or
    /// over TLS into the ciphertext buffer, as much as the socket has (one
    /// `recv` for a whole answer),
    /// whose records [`ReadState::decrypt`] then opens.
    fn recv_now(&mut self, fd: RawFd) -> std::io::Result<usize> {
        let (_, into) = self.stream_and_target();
        recv_now(fd, into)
    }

    /// The stream, and the buffer its bytes go to (the frame buffer, or
    /// the ciphertext buffer over TLS) with room to read ([`make_room`]).
    fn stream_and_target(&mut self) -> (&mut Box<dyn ReadHalf>, &mut BytesMut) {
        let into = if self.tls.is_some() {
            &mut self.cipher
        } else {
            &mut self.buf
        };
        make_room(into);
        (&mut self.r, into)
    }

    /// One look at the socket itself, never a wait, into the buffer
    /// [`Self::stream_and_target`] names: None when nothing has arrived.
    fn look(&mut self, fd: RawFd) -> Option<std::io::Result<usize>> {
        match self.recv_now(fd) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => None,
            r => Some(r),
        }
    }

    /// Over TLS: open the whole records buffered, in place, and move their
    /// plaintext into the frame buffer. True when anything moved (call
    /// again before reading the socket).
    fn decrypt(&mut self) -> Result<bool, ClientError> {
        let Some(tls) = &self.tls else {
            return Ok(false);
        };
        let tls_err = |e: &dyn std::fmt::Display| ClientError::Disconnected(format!("TLS: {e}"));
        let closed = || ClientError::Disconnected("donor closed the connection".into());
        if self.peer_closed {
            return Err(closed());
        }
        let mut moved = false;
        while let Some(len) = record_len(&self.cipher).map_err(|e| tls_err(&e))? {
            if self.cipher.len() < len {
                // Room for the rest of the record, in one read.
                self.cipher.reserve(len - self.cipher.len());
                break;
            }
            let opened = lock(tls).open(&mut self.cipher[..len]);
            match opened.map_err(|e| tls_err(&e))? {
                Opened::Data(r) => {
                    self.buf.extend_from_slice(&self.cipher[r.clone()]);
                    moved |= !r.is_empty();
                }
                Opened::Nothing => {}
                Opened::Closed => {
                    self.peer_closed = true;
                    bytes::Buf::advance(&mut self.cipher, len);
                    return if moved { Ok(true) } else { Err(closed()) };
                }
            }
            bytes::Buf::advance(&mut self.cipher, len);
        }
        Ok(moved)
    }
}

/// The write side: the frame being written and how much of it went out.
#[derive(Debug)]
pub(super) struct WriteState {
    pub w: Box<dyn WriteHalf>,
    pub out: Vec<u8>,
    pub written: usize,
    /// Over TLS: the session `out` is sealed with.
    pub tls: Option<TlsRecords>,
    /// Over TLS: the plaintext of the frame being sealed (the buffers
    /// trade places, so neither is allocated again).
    pub plain: Vec<u8>,
}

impl WriteState {
    /// Over TLS, replace the plaintext frame in `out` by its records (and
    /// whatever else the session has to send). Done before the first byte
    /// goes out, under the writer's lock, so records leave in order.
    pub fn seal(&mut self) -> Result<(), ClientError> {
        let Some(tls) = &self.tls else {
            return Ok(());
        };
        std::mem::swap(&mut self.out, &mut self.plain);
        self.out.clear();
        lock(tls)
            .seal(&self.plain, &mut self.out)
            .map_err(|e| ClientError::Disconnected(format!("TLS: {e}")))
    }

    /// Write what is left of `out`; progress survives cancellation.
    pub async fn finish(&mut self) -> std::io::Result<()> {
        while self.written < self.out.len() {
            let n = self.w.write(&self.out[self.written..]).await?;
            if n == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            self.written += n;
        }
        Ok(())
    }
}

/// Room in `buf` to read a whole answer in one `recv`, as a reader with a
/// plain 64 KiB buffer has: an empty buffer starts again at the front of
/// its storage (nothing to copy; possible once the frames split off it
/// are dropped), and any buffer keeps at least 4 KiB free. Without the
/// first, each answer is read after the last one in the storage, and the
/// one that meets its end takes two reads (`engram-bench floor`: one in
/// seven 24-row answers).
fn make_room(buf: &mut BytesMut) {
    const ROOM: usize = 64 << 10;
    if buf.is_empty() && buf.capacity() < ROOM {
        // False while a frame split off it is still held: the reserve
        // below makes room then.
        let _reclaimed = buf.try_reclaim(ROOM);
    }
    if buf.capacity() - buf.len() < 4096 {
        buf.reserve(ROOM);
    }
}

/// Split the next whole frame off the buffer, if one is there.
fn split_frame(buf: &mut BytesMut, limits: &Limits) -> Result<Option<Bytes>, ClientError> {
    match FrameHeader::peek(buf, limits) {
        Err(e) => Err(ClientError::Protocol(e.to_string())),
        Ok(Some(h)) if buf.len() >= h.frame_len() => Ok(Some(buf.split_to(h.frame_len()).freeze())),
        Ok(Some(h)) => {
            buf.reserve(h.frame_len() - buf.len());
            Ok(None)
        }
        Ok(None) => {
            buf.reserve(HEADER_LEN);
            Ok(None)
        }
    }
}

/// One non-blocking `recv` straight from the socket. (tokio's `try_read`
/// answers from its cached readiness, which only its reactor updates, so it
/// cannot see data arrive while we spin.)
fn recv_now(fd: RawFd, buf: &mut BytesMut) -> std::io::Result<usize> {
    let spare = buf.spare_capacity_mut();
    // SAFETY: recv writes at most `spare.len()` bytes into the spare capacity
    // it is given, and returns how many; only those are marked initialized.
    let n = unsafe {
        libc::recv(
            fd,
            spare.as_mut_ptr().cast(),
            spare.len(),
            libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the first `n` spare bytes were just written by recv.
    unsafe { buf.set_len(buf.len() + n as usize) };
    Ok(n as usize)
}

fn read_result(n: std::io::Result<usize>) -> Result<(), ClientError> {
    match n {
        Ok(0) => Err(ClientError::Disconnected(
            "donor closed the connection".into(),
        )),
        Ok(_) => Ok(()),
        Err(e) => Err(ClientError::Disconnected(e.to_string())),
    }
}

/// How long a polling reader keeps the runtime thread before yielding.
const YIELD_EVERY: Duration = Duration::from_micros(4);

/// What the reader found next.
pub(super) enum Next {
    /// A whole frame.
    Frame(Bytes),
    /// The start of the reader's own large Rows answer, whose rows it reads
    /// into its own buffer ([`Direct`]).
    Own,
}

/// Where the reader puts the rows of the answer to its own Lookup, when
/// it is large ([`DIRECT_MIN_BYTES`]) and every section is served: read
/// from the socket straight into `dest`, not through the frame buffer.
pub(super) struct Direct<'d> {
    pub dest: &'d mut [u8],
    pub sections: usize,
}

/// Answers with fewer row bytes than this go through the frame buffer: a
/// small answer arrives in one read, and a read of its own would cost more
/// than the copy it saves.
pub(super) const DIRECT_MIN_BYTES: usize = 64 << 10;

impl Direct<'_> {
    /// The payload of a Rows answer that serves every section.
    fn payload_len(&self) -> usize {
        client::rows_payload_len(self.sections, self.dest.len())
    }
}

/// A request's answer: a whole frame, or the head of a Rows frame
/// (header, checksum, count, sections) whose rows were read straight into
/// the request's buffer and checked there.
pub(super) enum Answer {
    Frame(Bytes),
    Placed(Bytes),
}

/// Read the next whole frame; with `own`, stop at the start of the
/// reader's own large Rows answer instead ([`Next::Own`]). With
/// `busy_poll`, first poll the socket without sleeping for up to that
/// long: waking a sleeping thread is most of a round trip. The poller
/// yields between attempts so other tasks on the runtime (the other
/// table's fetch, hedge timers) keep running.
pub(super) async fn next_frame(
    rd: &mut ReadState,
    limits: &Limits,
    busy_poll: Duration,
    own: Option<(u64, usize)>,
) -> Result<Next, ClientError> {
    let start = Instant::now();
    rd.seen = start;
    let mut poll_until = (!busy_poll.is_zero()).then(|| start + busy_poll);
    if poll_until.is_some() {
        rd.r.quiet();
    }
    let mut next_yield = start + YIELD_EVERY;
    loop {
        rd.settle();
        if let Some((id, payload)) = own
            && rd.tls.is_none()
            && let Ok(Some(h)) = FrameHeader::peek(&rd.buf, limits)
            && h.kind == FrameKind::Rows
            && h.request_id == id
            && h.payload_len as usize == payload
            && rd.buf.len() < h.frame_len()
        {
            return Ok(Next::Own);
        }
        if let Some(frame) = split_frame(&mut rd.buf, limits)? {
            return Ok(Next::Frame(frame));
        }
        if rd.decrypt()? {
            continue;
        }
        let n = match (poll_until, rd.fd) {
            (Some(until), Some(fd)) => match rd.recv_now(fd) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    // The answer's checksum then runs on awake wide units.
                    keep_wide_units_warm();
                    let now = Instant::now();
                    rd.seen = now;
                    if now >= until {
                        poll_until = None;
                    }
                    if now >= next_yield {
                        super::deadline::busy_yield().await;
                        next_yield = Instant::now() + YIELD_EVERY;
                    } else {
                        std::hint::spin_loop();
                    }
                    continue;
                }
                r => r,
            },
            // A stream without a socket of its own (QUIC): its packets are
            // taken in by the runtime's driver, which runs between our
            // yields; poll the stream once after each.
            (Some(until), None) => {
                let (r, into) = rd.stream_and_target();
                match futures_util::FutureExt::now_or_never(r.read_buf(into)) {
                    Some(n) => n,
                    None => {
                        let now = Instant::now();
                        rd.seen = now;
                        if now >= until {
                            poll_until = None;
                        }
                        super::deadline::busy_yield().await;
                        continue;
                    }
                }
            }
            _ => {
                let ReadState {
                    r,
                    buf,
                    cipher,
                    tls,
                    clock,
                    ..
                } = rd;
                let into = if tls.is_some() { cipher } else { buf };
                make_room(into);
                let mut read = pin!(r.read_buf(into));
                let mut slept = false;
                let n = std::future::poll_fn(|cx| {
                    if slept {
                        // Woken, most likely by the answer: wake the wide
                        // units before the read copies it in, so that its
                        // checksum finds them awake (docs/benchmarks.md,
                        // "The units woken when a request comes").
                        keep_wide_units_warm();
                    }
                    let p = read.as_mut().poll(cx);
                    if p.is_pending() {
                        slept = true;
                        super::deadline::watch(clock, cx);
                    }
                    p
                })
                .await;
                if slept {
                    rd.seen = Instant::now();
                }
                n
            }
        };
        read_result(n)?;
    }
}

/// The connection's shared state.
#[derive(Debug)]
pub(super) struct Inner {
    pub writer: tokio::sync::Mutex<WriteState>,
    pub reader: tokio::sync::Mutex<ReadState>,
    pub session: Mutex<Session>,
    /// The session's limits once welcomed (they do not change after).
    pub limits: Limits,
    /// The session's pins once welcomed ([`ClientSession::pins`]): a
    /// lookup's sections are built without the session's lock.
    pub pins: Vec<(u32, u64)>,
    pub busy_poll: Duration,
    /// The socket, for a synchronous half-close (owned by the halves above).
    pub fd: Option<RawFd>,
    /// Over QUIC: the connection (closed once drained) and its endpoint.
    pub quic: Option<(quinn::Endpoint, quinn::Connection)>,
}

impl Inner {
    pub fn session(&self) -> engram_sync::MutexGuard<'_, Session> {
        self.session.lock()
    }

    /// Fail every waiting request and refuse new ones.
    pub fn close(&self, why: &ClientError) {
        self.session().close(why.clone(), |w, why| {
            if w.reply.is_none() {
                w.reply = Some(Err(why.clone()));
            }
            if let Some(k) = w.waker.take() {
                k.wake();
            }
        });
    }

    /// Request `id` is done (answered, failed, dropped): after a Goodbye,
    /// once nothing is in flight, close our side so the donor's drain does
    /// not wait for us.
    pub fn finish(&self, id: u64) {
        let drained = self.session().finish(id);
        if drained {
            self.half_close();
        }
    }

    /// [`Self::finish`] with no request of ours: nothing in flight after a Goodbye.
    pub fn close_if_drained(&self) {
        let drained = self.session().close_if_drained();
        if drained {
            self.half_close();
        }
    }

    fn half_close(&self) {
        if let Some(fd) = self.fd {
            // SAFETY: shutdown(2) on our own socket; the fd stays open (owned by the halves).
            unsafe { libc::shutdown(fd, libc::SHUT_WR) };
        }
        if let Some((_, conn)) = &self.quic {
            conn.close(quinn::VarInt::from_u32(0), b"drained");
        }
    }

    /// Handle a frame read by the current reader: return it if it answers
    /// `own`, hand it to the request it answers, or act on it (the
    /// session decides which, and what breaks the protocol).
    /// The reader's own answer is its request's end: the session
    /// notes it (and the read, at `at`) under the same lock.
    fn dispatch(&self, frame: Bytes, own: u64, at: Instant) -> Result<Option<Bytes>, ClientError> {
        let mut s = self.session();
        match s.receive(&frame)? {
            Incoming::Answer(id) if id == own => {
                s.read_at(at);
                let drained = s.finish(id);
                drop(s);
                if drained {
                    self.half_close();
                }
                Ok(Some(frame))
            }
            Incoming::Answer(id) => {
                let waker = answer(&mut s, id, Ok(frame));
                drop(s);
                if let Some(k) = waker {
                    k.wake();
                }
                Ok(None)
            }
            // No waiter: the request was cancelled (a lost hedge); drop the answer.
            Incoming::Stale => Ok(None),
            Incoming::Goodbye => {
                tracing::debug!("donor said Goodbye");
                Ok(None)
            }
        }
    }

    /// Read frames for everyone until the one answering `own` arrives;
    /// its rows straight into `direct`'s buffer when it is large.
    pub async fn lead(
        &self,
        rd: &mut ReadState,
        guard: &mut PendingGuard<'_>,
        mut direct: Option<Direct<'_>>,
    ) -> Result<Answer, ClientError> {
        let own = guard.id;
        let expect = direct
            .as_ref()
            .filter(|d| d.dest.len() >= DIRECT_MIN_BYTES)
            .map(|d| (own, d.payload_len()));
        loop {
            let step = match next_frame(rd, &self.limits, self.busy_poll, expect).await {
                Ok(Next::Frame(frame)) => match self.dispatch(frame, own, rd.seen) {
                    Ok(Some(f)) => {
                        // `dispatch` finished the request.
                        guard.done = true;
                        Ok(Some(Answer::Frame(f)))
                    }
                    r => r.map(|_| None),
                },
                Ok(Next::Own) => match direct.as_mut() {
                    // The session learns of the answer from its header.
                    Some(d) => {
                        let taken = {
                            let mut s = self.session();
                            s.read_at(rd.seen);
                            s.receive(&rd.buf[..HEADER_LEN])
                        };
                        match taken {
                            Ok(_) => read_rows_into(rd, d).await.map(|h| Some(Answer::Placed(h))),
                            Err(e) => Err(e),
                        }
                    }
                    None => Err(ClientError::Protocol("no buffer for the answer".into())),
                },
                Err(e) => Err(e),
            };
            match step {
                // The session noted the read when it took the answer.
                Ok(Some(answer)) => return Ok(answer),
                Ok(None) => {}
                Err(e @ ClientError::Corrupt(_)) => return Err(e),
                Err(e) => {
                    self.close(&e);
                    return Err(e);
                }
            }
        }
    }

    /// True when nothing was read for a while: what the donor sent since (a
    /// Goodbye, the end of the connection) is waiting unread. Back-to-back
    /// requests skip the check; their readers see such frames anyway.
    pub fn idle(&self) -> bool {
        self.session().idle(Instant::now())
    }

    /// While nobody reads, take in what the donor sent meanwhile. Costs no
    /// system call unless the reactor saw the socket become readable; a
    /// socket kept out of the reactor is read once.
    pub fn poll_idle(&self, rd: &mut ReadState) -> Result<(), ClientError> {
        let step = (|| -> Result<(), ClientError> {
            let mut ended = Ok(());
            loop {
                // One look at what has arrived, never a wait.
                let got = match rd.fd {
                    Some(fd) if rd.quiet => rd.look(fd),
                    _ => {
                        let (r, into) = rd.stream_and_target();
                        futures_util::FutureExt::now_or_never(r.read_buf(into))
                    }
                };
                match got {
                    None => break,
                    Some(n) => {
                        ended = read_result(n);
                        if ended.is_err() {
                            break;
                        }
                    }
                }
            }
            while rd.decrypt()? {}
            rd.settle();
            // What came before the end is taken in first: a Goodbye followed
            // by the close is a drain, not just a lost connection.
            let at = Instant::now();
            while let Some(frame) = split_frame(&mut rd.buf, &self.limits)? {
                self.dispatch(frame, 0, at)?;
            }
            ended
        })();
        if let Err(e) = &step {
            self.close(e);
        }
        step
    }
}

/// Read the rest of the reader's own Rows answer, whose header is at the
/// front of the frame buffer: its head (checksum, count, sections) into
/// the frame buffer, its rows from the socket straight into `d.dest`
/// (those already read copied over), then the checksum over both. Cancel-
/// safe: rows not read yet when the reader stops are skipped by the next.
async fn read_rows_into(rd: &mut ReadState, d: &mut Direct<'_>) -> Result<Bytes, ClientError> {
    let head_len = HEADER_LEN + ROWS_HEAD_LEN + ROWS_SECTION_LEN * d.sections;
    while rd.buf.len() < head_len {
        let (r, into) = rd.stream_and_target();
        read_result(r.read_buf(into).await)?;
    }
    let head = rd.buf.split_to(head_len).freeze();
    let dest = &mut *d.dest;
    let mut filled = rd.buf.len().min(dest.len());
    dest[..filled].copy_from_slice(&rd.buf[..filled]);
    bytes::Buf::advance(&mut rd.buf, filled);
    rd.skip = dest.len() - filled;
    while filled < dest.len() {
        let n = match rd.r.read(&mut dest[filled..]).await {
            Ok(0) => {
                return Err(ClientError::Disconnected(
                    "donor closed the connection".into(),
                ));
            }
            Ok(n) => n,
            Err(e) => return Err(ClientError::Disconnected(e.to_string())),
        };
        filled += n;
        rd.skip -= n;
    }
    let sum = head
        .get(HEADER_LEN..HEADER_LEN + 8)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(u64::from_le_bytes)
        .unwrap_or_default();
    let actual = payload_checksum_of_parts(&[&head[HEADER_LEN + 8..], dest]);
    if actual != sum {
        return Err(ClientError::Corrupt(format!(
            "Rows checksum mismatch: the frame says {sum:016x}, the payload hashes to {actual:016x}"
        )));
    }
    Ok(head)
}

/// Removes a request's entry if its future is dropped before the answer
/// came, and closes a drained connection once its last request is done.
pub(super) struct PendingGuard<'a> {
    pub inner: &'a Inner,
    pub id: u64,
    /// The session already finished the request (with its answer).
    pub done: bool,
}

impl<'a> PendingGuard<'a> {
    pub fn new(inner: &'a Inner, id: u64) -> Self {
        Self {
            inner,
            id,
            done: false,
        }
    }
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.inner.finish(self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader asleep on its socket wakes the wide units when it is woken,
    /// before it reads the answer in, so that the answer's sum finds them
    /// awake.
    #[test]
    fn a_reader_woken_by_its_answer_wakes_the_wide_units() {
        use engram_protocol::messages::{encode_ping, payload_checksum, wide_units_marked};
        use tokio::io::AsyncWriteExt;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let mut c = tokio::net::TcpStream::connect(l.local_addr().expect("addr"))
                .await
                .expect("connect");
            let (s, _) = l.accept().await.expect("accept");
            let (r, _w) = s.into_split();
            let mut rd = ReadState::new(Box::new(r), None, None);
            let _ = payload_checksum(b"takes any mark left on this thread");
            let answer = async {
                tokio::time::sleep(Duration::from_millis(20)).await;
                let mut pong = Vec::new();
                encode_ping(&mut pong, 3, true);
                c.write_all(&pong).await.expect("write");
            };
            let limits = Limits::default();
            let (got, ()) =
                tokio::join!(next_frame(&mut rd, &limits, Duration::ZERO, None), answer);
            assert!(matches!(got, Ok(Next::Frame(_))));
            #[cfg(target_arch = "x86_64")]
            assert_eq!(
                wide_units_marked(),
                std::arch::is_x86_feature_detected!("avx2")
            );
        });
    }

    #[test]
    fn an_empty_buffer_reads_at_the_front_of_its_storage() {
        let mut buf = BytesMut::with_capacity(64 << 10);
        // Answers of 6,380 bytes read and split off one after another walk
        // through the storage; each is dropped before the next read.
        for _ in 0..9 {
            make_room(&mut buf);
            buf.extend_from_slice(&[7u8; 6380]);
            drop(buf.split_to(6380).freeze());
        }
        make_room(&mut buf);
        assert_eq!(buf.capacity(), 64 << 10, "the whole storage is free again");
    }

    #[test]
    fn a_buffer_still_shared_keeps_room_to_read() {
        let mut buf = BytesMut::with_capacity(64 << 10);
        buf.extend_from_slice(&vec![1u8; (64 << 10) - 1000]);
        // A frame another request has not taken yet keeps the storage.
        let held = buf.split_to(buf.len()).freeze();
        make_room(&mut buf);
        assert!(buf.capacity() - buf.len() >= 4096);
        // Part of a frame in the buffer: kept, with room behind it.
        buf.extend_from_slice(&[2u8; 100]);
        make_room(&mut buf);
        assert_eq!(&buf[..], &[2u8; 100][..]);
        assert!(buf.capacity() - buf.len() >= 4096);
        assert_eq!(held.len(), (64 << 10) - 1000);
    }
}
