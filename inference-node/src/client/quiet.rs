//! A TCP socket that is in the runtime's reactor only while one of its
//! sides waits on it.
//!
//! A socket registered with an epoll instance carries that registration on
//! its wait queue, and every arrival of data then runs epoll's callback
//! (locks, the ready list, a wake-up) on the path that hands the answer to
//! the reader. A busy-polling client never needs it: it reads the socket
//! itself. Measured in `engram-bench floor` (docs/benchmarks.md, "A socket
//! outside the reactor"), the registration cost a polling client about
//! 1.4 us a lookup on loopback.
//!
//! So a polling connection's halves keep the socket out of the runtime's
//! epoll. Each side has a private epoll instance of its own, which the
//! runtime watches (registered once, at connect). A side that must wait
//! (its busy-poll window ran out, or the send buffer is full) adds the
//! socket to its own instance, whose readiness then wakes it through the
//! runtime; the reader takes the socket out again before its next
//! busy-poll, unless its last wait needed it too (a donor slower than the
//! window keeps it in). Adding and removing are system calls, not
//! allocations, so the steady state allocates nothing either way.

use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::wire::ReadHalf;

/// Split a connected, non-blocking TCP socket into halves kept out of the
/// runtime's reactor until a side waits. Needs a runtime with IO enabled.
pub(super) fn split(sock: TcpStream) -> io::Result<(QuietRead, QuietWrite)> {
    sock.set_nonblocking(true)?;
    let fd = sock.as_raw_fd();
    let sock = Arc::new(sock);
    let read = QuietRead {
        wait: SideWait::new(fd, libc::EPOLLIN | libc::EPOLLRDHUP)?,
        sock: sock.clone(),
    };
    let write = QuietWrite {
        wait: SideWait::new(fd, libc::EPOLLOUT)?,
        sock,
    };
    Ok((read, write))
}

/// One side's way to wait for the socket: a private epoll instance that
/// holds the socket only while the side waits (or may soon again).
#[derive(Debug)]
struct SideWait {
    /// The private epoll instance, watched by the runtime.
    ep: AsyncFd<OwnedFd>,
    sock: RawFd,
    events: i32,
    /// The socket is in `ep`.
    added: bool,
    /// The side's last wait needed `ep` (it returned Pending).
    slept: bool,
}

impl SideWait {
    fn new(sock: RawFd, events: i32) -> io::Result<Self> {
        // SAFETY: epoll_create1 takes no pointers; a non-negative result is
        // a new descriptor that nothing else owns.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if ep < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `ep` was just created and is owned by nothing else.
        let ep = unsafe { OwnedFd::from_raw_fd(ep) };
        // SAFETY: the OwnedFd keeps `ep` open, and names it, for as long
        // as the AsyncFd owns it.
        let ep = unsafe { AsyncFd::register_with_interest(ep, tokio::io::Interest::READABLE) }?;
        Ok(Self {
            ep,
            sock,
            events,
            added: false,
            slept: false,
        })
    }

    fn ctl(&self, op: i32) -> io::Result<()> {
        let mut ev = libc::epoll_event {
            events: (self.events | libc::EPOLLET) as u32,
            u64: 0,
        };
        // SAFETY: both descriptors are open (the socket is owned by the
        // halves holding this); `ev` outlives the call.
        let r = unsafe { libc::epoll_ctl(self.ep.as_raw_fd(), op, self.sock, &mut ev) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Ready when the socket may have become ready for this side (try
    /// the system call again); Pending, with `cx` woken by the runtime,
    /// when it has not.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.added {
            // An already ready socket is reported at once (edge-triggered
            // adds report the present state).
            self.ctl(libc::EPOLL_CTL_ADD)?;
            self.added = true;
        }
        loop {
            if self.take_events()? {
                return Poll::Ready(Ok(()));
            }
            match self.ep.poll_read_ready(cx) {
                Poll::Pending => {
                    self.slept = true;
                    return Poll::Pending;
                }
                // The runtime saw the instance become readable: look again
                // (what came after this look wakes the runtime again).
                Poll::Ready(Ok(mut g)) => g.clear_ready(),
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            }
        }
    }

    /// Take what the private instance reported; true if anything.
    fn take_events(&self) -> io::Result<bool> {
        let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 2];
        loop {
            // SAFETY: `evs` has room for the 2 events asked for.
            let n = unsafe { libc::epoll_wait(self.ep.as_raw_fd(), evs.as_mut_ptr(), 2, 0) };
            if n >= 0 {
                return Ok(n > 0);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    /// Take the socket out of the private instance (nobody waits on it).
    fn remove(&mut self) {
        if self.added {
            // It cannot fail for a socket that is in the instance; if it
            // did, the socket stays in, which costs speed, not correctness.
            self.added = self.ctl(libc::EPOLL_CTL_DEL).is_err();
        }
    }
}

/// The read half of [`split`].
#[derive(Debug)]
pub(super) struct QuietRead {
    wait: SideWait,
    sock: Arc<TcpStream>,
}

impl AsyncRead for QuietRead {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            // SAFETY: recv writes at most `spare.len()` bytes into `spare`
            // and nothing else; only the bytes it wrote are marked filled.
            let n = unsafe {
                let spare = buf.unfilled_mut();
                libc::recv(
                    this.sock.as_raw_fd(),
                    spare.as_mut_ptr().cast(),
                    spare.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n >= 0 {
                let n = n as usize;
                // SAFETY: recv initialized the first `n` unfilled bytes.
                unsafe { buf.assume_init(n) };
                buf.advance(n);
                return Poll::Ready(Ok(()));
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock => ready!(this.wait.poll_ready(cx))?,
                io::ErrorKind::Interrupted => {}
                _ => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl ReadHalf for QuietRead {
    fn quiet(&mut self) {
        let w = &mut self.wait;
        if !std::mem::take(&mut w.slept) {
            w.remove();
        }
    }
}

/// The write half of [`split`]: its socket is in its private instance
/// only while a write waits for room.
#[derive(Debug)]
pub(super) struct QuietWrite {
    wait: SideWait,
    sock: Arc<TcpStream>,
}

impl AsyncWrite for QuietWrite {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        loop {
            // SAFETY: send reads at most `data.len()` bytes from `data`.
            let n = unsafe {
                libc::send(
                    this.sock.as_raw_fd(),
                    data.as_ptr().cast(),
                    data.len(),
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            };
            if n >= 0 {
                // Room again: nobody waits for it now.
                this.wait.remove();
                return Poll::Ready(Ok(n as usize));
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock => ready!(this.wait.poll_ready(cx))?,
                io::ErrorKind::Interrupted => {}
                _ => return Poll::Ready(Err(e)),
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.sock.shutdown(std::net::Shutdown::Write))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    }

    /// A connected pair over loopback: ours and the peer's.
    fn pair() -> (TcpStream, TcpStream) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let ours = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (peer, _) = l.accept().expect("accept");
        (ours, peer)
    }

    /// How many descriptors epoll instance `ep` watches, as the kernel
    /// lists them.
    fn watched(w: &SideWait) -> usize {
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", w.ep.as_raw_fd()))
            .expect("fdinfo");
        info.lines().filter(|l| l.starts_with("tfd:")).count()
    }

    async fn within<F: Future>(f: F) -> F::Output {
        tokio::time::timeout(Duration::from_secs(10), f)
            .await
            .expect("done in time")
    }

    #[test]
    fn a_read_that_waits_is_woken_and_the_socket_leaves_the_reactor_after() {
        rt().block_on(async {
            let (ours, mut peer) = pair();
            let (mut r, _w) = split(ours).expect("split");
            assert_eq!(
                watched(&r.wait),
                0,
                "out of any instance until a read waits"
            );
            let mut buf = [0u8; 16];
            // The read finds nothing and waits; the peer then writes.
            let (n, ()) = within(async {
                tokio::join!(r.read(&mut buf), async {
                    tokio::task::yield_now().await;
                    peer.write_all(b"hello").expect("write");
                })
            })
            .await;
            assert_eq!(&buf[..n.expect("read")], b"hello");
            assert!(r.wait.slept, "the read had to wait");
            assert_eq!(watched(&r.wait), 1, "a read that waited put the socket in");

            // Its wait needed the instance: the next busy-poll keeps it.
            r.quiet();
            assert_eq!(watched(&r.wait), 1);
            // A read that finds its bytes there does not wait...
            peer.write_all(b"again").expect("write");
            let n = within(r.read(&mut buf)).await.expect("read");
            assert_eq!(&buf[..n], b"again");
            // ...so the one after it busy-polls with the socket out.
            r.quiet();
            assert_eq!(watched(&r.wait), 0, "out again once no wait needs it");

            // The peer's close is an end of stream, found by waiting too.
            drop(peer);
            assert_eq!(within(r.read(&mut buf)).await.expect("read"), 0);
        });
    }

    #[test]
    fn a_write_that_finds_no_room_waits_for_it() {
        rt().block_on(async {
            let (ours, mut peer) = pair();
            let (_r, mut w) = split(ours).expect("split");
            let chunk = vec![7u8; 64 << 10];
            let mut sent = 0;
            // Nobody reads yet: fill the socket's buffers.
            while let Some(n) = futures_util::FutureExt::now_or_never(w.write(&chunk)) {
                sent += n.expect("write");
            }
            assert_eq!(watched(&w.wait), 1, "a write that found no room waits");
            let drain = std::thread::spawn(move || {
                let (mut got, mut buf) = (0, vec![0u8; 1 << 20]);
                loop {
                    match peer.read(&mut buf).expect("read") {
                        0 => return got,
                        n => got += n,
                    }
                }
            });
            within(w.write_all(&chunk)).await.expect("write");
            sent += chunk.len();
            assert_eq!(watched(&w.wait), 0, "room again: out of the instance");
            within(w.shutdown()).await.expect("shutdown");
            assert_eq!(
                drain.join().expect("drain"),
                sent,
                "every byte arrived once"
            );
        });
    }
}
