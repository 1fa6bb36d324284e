//! Fault-injecting TCP proxy for the node <-> donor frame protocol (16-byte LE header + payload).
//!
//! It parses frames in both directions and, on demand, delays, corrupts or truncates Rows
//! frames, drops connections on Lookup, refuses or cuts connections. Std threads only.

use anyhow::Context;
use engram_protocol::{FrameKind, HEADER_LEN};
use engram_sync::Mutex;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, mpsc};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Default largest accepted frame, header included, in bytes.
pub const DEFAULT_MAX_FRAME: usize = 64 * 1024 * 1024 + HEADER_LEN;
const KIND_LOOKUP: u8 = FrameKind::Lookup as u8;
const KIND_ROWS: u8 = FrameKind::Rows as u8;
const POLL: Duration = Duration::from_millis(5);

/// Faults to inject; `Faults::default()` forwards everything unchanged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// Extra delay for every server->client frame (order and pipelining are kept).
    pub delay: Duration,
    /// Flip the payload byte at offset len/2 of every Rows frame.
    pub corrupt_rows: bool,
    /// Forward only the header and half the payload of the next Rows frame, then close.
    pub truncate_rows: bool,
    /// Close the connection both ways instead of forwarding a Lookup frame.
    pub drop_on_lookup: bool,
    /// Accept new connections and close them at once.
    pub refuse: bool,
}

/// Counters since the proxy started; `open` is the number of connections open now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProxyStats {
    /// Connections accepted (refused ones included).
    pub accepted: u64,
    /// Connections currently proxied.
    pub open: u64,
    /// Server->client frames handed to the client (truncated ones included).
    pub frames_down: u64,
    /// Rows frames corrupted.
    pub corrupted: u64,
    /// Rows frames truncated.
    pub truncated: u64,
    /// Connections closed on a Lookup frame.
    pub dropped: u64,
}

struct Shared {
    upstream: SocketAddr,
    faults: Mutex<Faults>,
    stats: Mutex<ProxyStats>,
    max_frame: AtomicUsize,
    stop: AtomicBool,
    conns: Mutex<Vec<Arc<Conn>>>,
}

impl Shared {
    fn faults(&self) -> Faults {
        *self.faults.lock()
    }

    fn bump(&self, f: impl FnOnce(&mut ProxyStats)) {
        f(&mut self.stats.lock());
    }
}

/// Both sockets of one proxied connection.
struct Conn {
    client: TcpStream,
    server: TcpStream,
    closed: AtomicBool,
}

impl Conn {
    /// Shuts both sockets down both ways; every thread blocked on them wakes up.
    fn close(&self) {
        self.closed.store(true, SeqCst);
        let _ = self.client.shutdown(Shutdown::Both);
        let _ = self.server.shutdown(Shutdown::Both);
    }
}

/// A running proxy; dropping it stops accepting and closes every connection it holds.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultProxy")
            .field("addr", &self.addr)
            .field("faults", &self.faults())
            .finish_non_exhaustive()
    }
}

impl FaultProxy {
    /// Listens on `listen` (port 0 allowed) and forwards each connection to `upstream`.
    pub fn start(listen: SocketAddr, upstream: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind(listen).with_context(|| format!("bind {listen}"))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            faults: Mutex::default(),
            stats: Mutex::default(),
            max_frame: AtomicUsize::new(DEFAULT_MAX_FRAME),
            stop: AtomicBool::new(false),
            conns: Mutex::default(),
        });
        let s = Arc::clone(&shared);
        let acceptor = Some(thread::Builder::new().spawn(move || accept_loop(&listener, &s))?);
        Ok(Self {
            addr,
            shared,
            acceptor,
        })
    }

    /// Address the proxy listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Replaces the faults; open connections apply them from their next frame.
    pub fn set(&self, faults: Faults) {
        *self.shared.faults.lock() = faults;
    }

    /// Faults currently in force.
    pub fn faults(&self) -> Faults {
        self.shared.faults()
    }

    /// Sets the largest frame (header included) accepted; a bigger one closes its connection.
    pub fn set_max_frame(&self, bytes: usize) {
        self.shared.max_frame.store(bytes, SeqCst);
    }

    /// Snapshot of the counters.
    pub fn stats(&self) -> ProxyStats {
        let open = self.shared.conns.lock().len() as u64;
        ProxyStats {
            open,
            ..*self.shared.stats.lock()
        }
    }

    /// Closes every open connection now, both sides.
    pub fn cut_all(&self) {
        self.shared.conns.lock().iter().for_each(|c| c.close());
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, SeqCst);
        self.cut_all();
        if let Some(h) = self.acceptor.take() {
            let _ = h.join();
        }
    }
}

/// Polls the non-blocking listener until the proxy stops, then joins every connection thread.
fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    let mut workers: Vec<JoinHandle<()>> = Vec::new();
    while !shared.stop.load(SeqCst) {
        let Ok((client, _)) = listener.accept() else {
            thread::sleep(POLL);
            continue;
        };
        shared.bump(|s| s.accepted += 1);
        if shared.faults().refuse {
            let _ = client.shutdown(Shutdown::Both);
            continue;
        }
        let s = Arc::clone(shared);
        workers.retain(|h| !h.is_finished());
        workers.extend(thread::Builder::new().spawn(move || serve(client, &s)).ok());
    }
    for h in workers {
        let _ = h.join();
    }
}

/// Connects upstream, registers the connection and runs it to its end.
fn serve(client: TcpStream, shared: &Arc<Shared>) {
    let timeout = Duration::from_secs(5);
    let Ok(server) = TcpStream::connect_timeout(&shared.upstream, timeout) else {
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    let conn = Arc::new(Conn {
        client,
        server,
        closed: AtomicBool::new(false),
    });
    {
        let mut conns = shared.conns.lock();
        if shared.stop.load(SeqCst) {
            return conn.close();
        }
        conns.push(Arc::clone(&conn));
    }
    let _ = run(&conn, shared);
    conn.close();
    shared.conns.lock().retain(|c| !Arc::ptr_eq(c, &conn));
}

/// Client->server on this thread; server->client on a reader and a (delaying) writer thread.
fn run(conn: &Arc<Conn>, shared: &Arc<Shared>) -> io::Result<()> {
    conn.client.set_nonblocking(false)?;
    conn.client.set_nodelay(true)?;
    conn.server.set_nodelay(true)?;
    let (tx, rx) = mpsc::channel();
    let (c, s) = (Arc::clone(conn), Arc::clone(shared));
    let down = thread::Builder::new().spawn(move || pump_down(&c, &s, &tx))?;
    let (c, s) = (Arc::clone(conn), Arc::clone(shared));
    let writer = thread::Builder::new().spawn(move || write_down(&c, &s, &rx))?;
    pump_up(conn, shared);
    let _ = (down.join(), writer.join());
    Ok(())
}

/// Reads from `src` into `buf` until it holds a whole frame, then splits that frame off and
/// returns it; `Ok(None)` at EOF. A header announcing more than `max_frame` is an error.
fn next_frame(mut src: &TcpStream, buf: &mut Vec<u8>, max: usize) -> io::Result<Option<Vec<u8>>> {
    let mut chunk = [0u8; 16 * 1024];
    loop {
        if buf.len() >= HEADER_LEN {
            let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
            let total = len.saturating_add(HEADER_LEN);
            if total > max {
                return Err(io::ErrorKind::InvalidData.into());
            }
            if buf.len() >= total {
                let rest = buf.split_off(total);
                return Ok(Some(std::mem::replace(buf, rest)));
            }
            buf.reserve(total - buf.len());
        }
        match src.read(&mut chunk) {
            Ok(0) => return Ok(None),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Client->server: forwards whole frames; closes on Lookup when `drop_on_lookup` is set.
fn pump_up(conn: &Conn, shared: &Shared) {
    let mut buf = Vec::new();
    loop {
        let frame = match next_frame(&conn.client, &mut buf, shared.max_frame.load(SeqCst)) {
            Ok(Some(frame)) => frame,
            Ok(None) => {
                // Client half-closed: pass that on and let the answers still flow back.
                let _ = conn.server.shutdown(Shutdown::Write);
                return;
            }
            Err(_) => return conn.close(),
        };
        if frame[4] == KIND_LOOKUP && shared.faults().drop_on_lookup {
            shared.bump(|s| s.dropped += 1);
            return conn.close();
        }
        if (&conn.server).write_all(&frame).is_err() {
            return conn.close();
        }
    }
}

/// Server->client: applies Rows faults and queues each frame with its due time.
fn pump_down(conn: &Conn, shared: &Shared, tx: &mpsc::Sender<(Instant, Vec<u8>, bool)>) {
    let mut buf = Vec::new();
    loop {
        let mut frame = match next_frame(&conn.server, &mut buf, shared.max_frame.load(SeqCst)) {
            Ok(Some(frame)) => frame,
            Ok(None) => return, // EOF: the writer flushes what is queued, then closes.
            Err(_) => return conn.close(),
        };
        let f = shared.faults();
        let due = Instant::now() + f.delay;
        let half = (frame.len() - HEADER_LEN) / 2;
        let last = frame[4] == KIND_ROWS && f.truncate_rows;
        if last {
            frame.truncate(HEADER_LEN + half);
            shared.bump(|s| s.truncated += 1);
        } else if frame[4] == KIND_ROWS && f.corrupt_rows && frame.len() > HEADER_LEN {
            frame[HEADER_LEN + half] ^= 0xFF;
            shared.bump(|s| s.corrupted += 1);
        }
        if tx.send((due, frame, last)).is_err() || last {
            return;
        }
    }
}

/// Writes queued frames in order, none before its due time; closes the connection when done.
fn write_down(conn: &Conn, shared: &Shared, rx: &mpsc::Receiver<(Instant, Vec<u8>, bool)>) {
    for (due, frame, last) in rx {
        while !conn.closed.load(SeqCst) && Instant::now() < due {
            thread::sleep(due.saturating_duration_since(Instant::now()).min(POLL));
        }
        if conn.closed.load(SeqCst) {
            break;
        }
        shared.bump(|s| s.frames_down += 1);
        if (&conn.client).write_all(&frame).is_err() || last {
            break;
        }
    }
    conn.close();
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROWS_LEN: usize = 6336;

    fn frame(kind: u8, id: u64, payload: &[u8]) -> Vec<u8> {
        let len = (payload.len() as u32).to_le_bytes();
        [&len[..], &[kind, 0, 0, 0], &id.to_le_bytes(), payload].concat()
    }

    fn rows(id: u64) -> Vec<u8> {
        (0..ROWS_LEN as u64).map(|i| (i * 31 + id) as u8).collect()
    }

    fn read_frame(s: &mut TcpStream) -> io::Result<(u8, u64, Vec<u8>)> {
        let mut h = [0u8; HEADER_LEN];
        s.read_exact(&mut h)?;
        let mut payload = vec![0; u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize];
        s.read_exact(&mut payload)?;
        let id = u64::from_le_bytes([h[8], h[9], h[10], h[11], h[12], h[13], h[14], h[15]]);
        Ok((h[4], id, payload))
    }

    /// Starts a donor (Hello->Welcome, Lookup->Rows, Ping->Pong; records kinds) and a proxy.
    fn setup() -> (FaultProxy, Arc<Mutex<Vec<u8>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let upstream = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let seen2 = Arc::clone(&seen);
        thread::spawn(move || {
            for mut s in listener.incoming().flatten() {
                let seen = Arc::clone(&seen2);
                thread::spawn(move || {
                    while let Ok((kind, id, _)) = read_frame(&mut s) {
                        seen.lock().push(kind);
                        let reply = match kind {
                            1 => frame(2, id, b""),
                            3 => frame(4, id, &rows(id)),
                            6 => frame(7, id, b""),
                            _ => continue,
                        };
                        // Split inside the header so the proxy sees partial frames.
                        let (a, b) = reply.split_at(10);
                        let _ = (s.write_all(a), s.flush(), s.write_all(b));
                    }
                });
            }
        });
        (
            FaultProxy::start("127.0.0.1:0".parse().unwrap(), upstream).unwrap(),
            seen,
        )
    }

    fn connect(p: &FaultProxy) -> TcpStream {
        let s = TcpStream::connect(p.addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.set_nodelay(true).unwrap();
        s
    }

    fn ping(s: &mut TcpStream, id: u64) {
        s.write_all(&frame(6, id, b"")).unwrap();
        assert_eq!(read_frame(s).unwrap().0, 7);
    }

    fn lookup(s: &mut TcpStream, id: u64) -> Vec<u8> {
        s.write_all(&frame(3, id, b"key")).unwrap();
        let (kind, got, payload) = read_frame(s).unwrap();
        assert_eq!((kind, got, payload.len()), (4, id, ROWS_LEN));
        payload
    }

    /// Asserts the peer closed (EOF or reset), not a timeout.
    fn assert_closed(s: &mut TcpStream) {
        let mut b = [0u8; 256];
        match s.read(&mut b) {
            Ok(0) => {}
            Ok(_) => assert_closed(s),
            Err(e) => assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "{e}"),
        }
    }

    fn wait_until(what: &str, f: impl Fn() -> bool) {
        let end = Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(Instant::now() < end, "timed out waiting for {what}");
            thread::sleep(Duration::from_millis(2));
        }
    }

    fn with(f: impl FnOnce(&mut Faults)) -> Faults {
        let mut faults = Faults::default();
        f(&mut faults);
        faults
    }

    #[test]
    fn pass_through_is_byte_identical() {
        let (p, _) = setup();
        let req: Vec<u8> = [1, 3, 6, 3]
            .into_iter()
            .flat_map(|k| frame(k, 7, b"x"))
            .collect();
        let n = 4 * HEADER_LEN + 2 * ROWS_LEN;
        let (mut direct, mut via) = (TcpStream::connect(p.shared.upstream).unwrap(), connect(&p));
        direct.write_all(&req).unwrap();
        req.chunks(5)
            .for_each(|piece| via.write_all(piece).unwrap());
        let (mut a, mut b) = (vec![0; n], vec![0; n]);
        direct.read_exact(&mut a).unwrap();
        via.read_exact(&mut b).unwrap();
        assert_eq!(a, b);
        assert_eq!(p.stats().frames_down, 4);
    }

    #[test]
    fn delay_keeps_order_and_pipelining() {
        let (p, _) = setup();
        let delay = Duration::from_millis(200);
        p.set(with(|f| f.delay = delay));
        let mut c = connect(&p);
        let req: Vec<u8> = (1..=5).flat_map(|id| frame(3, id, b"k")).collect();
        let t0 = Instant::now();
        c.write_all(&req).unwrap();
        for id in 1..=5 {
            let (kind, got, payload) = read_frame(&mut c).unwrap();
            assert!(t0.elapsed() >= delay);
            assert_eq!((kind, got, payload), (4, id, rows(id)));
        }
        let took = t0.elapsed();
        assert!(took < delay * 4, "delays were serialised: {took:?}");
    }

    #[test]
    fn corrupt_rows_flips_one_middle_byte() {
        let (p, _) = setup();
        p.set(with(|f| f.corrupt_rows = true));
        let mut c = connect(&p);
        for id in [1, 2] {
            let (got, want) = (lookup(&mut c, id), rows(id));
            let diff: Vec<usize> = (0..ROWS_LEN).filter(|&i| got[i] != want[i]).collect();
            assert_eq!(diff, vec![ROWS_LEN / 2]);
        }
        ping(&mut c, 3);
        assert_eq!(p.stats().corrupted, 2);
    }

    #[test]
    fn truncate_rows_sends_half_then_eof() {
        let (p, _) = setup();
        p.set(with(|f| f.truncate_rows = true));
        let mut c = connect(&p);
        ping(&mut c, 1);
        c.write_all(&frame(3, 9, b"k")).unwrap();
        let mut got = Vec::new();
        c.read_to_end(&mut got).unwrap();
        assert_eq!(got, frame(4, 9, &rows(9))[..HEADER_LEN + ROWS_LEN / 2]);
        assert_eq!(p.stats().truncated, 1);
        wait_until("connection closed", || p.stats().open == 0);
    }

    #[test]
    fn drop_on_lookup_closes_without_forwarding() {
        let (p, seen) = setup();
        p.set(with(|f| f.drop_on_lookup = true));
        let mut c = connect(&p);
        c.write_all(&frame(1, 0, b"hi")).unwrap();
        assert_eq!(read_frame(&mut c).unwrap().0, 2);
        c.write_all(&frame(3, 1, b"k")).unwrap();
        assert_closed(&mut c);
        wait_until("connection closed", || p.stats().open == 0);
        assert_eq!(*seen.lock(), vec![1]);
        assert_eq!(p.stats().dropped, 1);
    }

    #[test]
    fn refuse_closes_new_connections_only() {
        let (p, _) = setup();
        let mut old = connect(&p);
        ping(&mut old, 1);
        p.set(with(|f| f.refuse = true));
        assert_closed(&mut connect(&p));
        ping(&mut old, 2);
        p.set(Faults::default());
        ping(&mut connect(&p), 3);
        assert_eq!(p.stats().accepted, 3);
    }

    #[test]
    fn set_applies_to_open_connection() {
        let (p, _) = setup();
        let mut c = connect(&p);
        assert_eq!(lookup(&mut c, 1), rows(1));
        p.set(with(|f| f.corrupt_rows = true));
        assert!(p.faults().corrupt_rows);
        assert_ne!(lookup(&mut c, 2), rows(2));
        p.set(Faults::default());
        assert_eq!(lookup(&mut c, 3), rows(3));
    }

    #[test]
    fn cut_all_closes_every_connection() {
        let (p, _) = setup();
        let (mut a, mut b) = (connect(&p), connect(&p));
        ping(&mut a, 1);
        ping(&mut b, 2);
        assert_eq!(p.stats().open, 2);
        p.cut_all();
        assert_closed(&mut a);
        assert_closed(&mut b);
        wait_until("no open connections", || p.stats().open == 0);
        ping(&mut connect(&p), 3);
    }

    #[test]
    fn dropping_proxy_closes_clients() {
        let (p, _) = setup();
        let (addr, mut c) = (p.addr(), connect(&p));
        ping(&mut c, 1);
        p.set(with(|f| f.delay = Duration::from_secs(30)));
        c.write_all(&frame(6, 2, b"")).unwrap(); // a long-delayed frame must not hold the drop
        let t0 = Instant::now();
        drop(p);
        assert!(t0.elapsed() < Duration::from_secs(5));
        assert_closed(&mut c);
        assert!(TcpStream::connect(addr).is_err());
    }

    #[test]
    fn oversized_header_closes_only_that_connection() {
        let (p, _) = setup();
        let (mut good, mut bad) = (connect(&p), connect(&p));
        ping(&mut good, 1);
        let huge = [&u32::MAX.to_le_bytes()[..], &[3; 12]].concat();
        bad.write_all(&huge).unwrap();
        assert_closed(&mut bad);
        ping(&mut good, 3);
        p.set_max_frame(HEADER_LEN + 8);
        let mut bad = connect(&p);
        bad.write_all(&frame(6, 4, &[0; 9])).unwrap();
        assert_closed(&mut bad);
        ping(&mut good, 5);
        wait_until("bad connections closed", || p.stats().open == 1);
    }
}
