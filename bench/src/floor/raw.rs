//! The donor through the least client the protocol allows: one blocking
//! TCP socket, Hello then Lookup frames written whole, each answer read
//! into one reused buffer (polling like the floor's client, or not),
//! decoded with its checksum checked and its rows copied out, as any
//! client must (the rows checked against the generator on every 16th
//! lookup, outside the timing, as the other series do). Against the project's client on the same donor it splits
//! what the donor adds to the gathering floor from what the client adds.
//!
//! In the runtime ([`RawDonorConn::in_runtime`]) it does the same through
//! the bench's async runtime, the one the project's client runs on: the
//! request written and the answer read by the runtime's socket, which
//! sleeps in its reactor. Against the blocking one it is what waiting in
//! a reactor costs any client that watches several sockets and timers at
//! once; against the project's client, what the client adds beyond that.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use engram_protocol::messages::{Hello, LookupSection, encode_lookup};
use engram_protocol::synthetic::{SplitMix64, first_mismatch};
use engram_protocol::{
    Frame, FrameHeader, HEADER_LEN, Limits, PROTOCOL_VERSION, ROW_BYTES, TableDigest, decode,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{SEED, TABLES};

/// One connection to the donor, speaking the protocol without the
/// project's client.
pub(super) struct RawDonorConn {
    s: TcpStream,
    limits: Limits,
    /// Poll with non-blocking reads for up to this long before blocking.
    poll: Duration,
    pinned: Vec<(u32, u64)>,
    ids: Vec<Vec<u64>>,
    rows_per_table: u64,
    rng: SplitMix64,
    req: Vec<u8>,
    buf: Vec<u8>,
    out: Vec<u8>,
    next_id: u64,
    /// The socket registered with the runtime, for [`Self::one_in_runtime`].
    runtime: Option<tokio::net::TcpStream>,
}

impl RawDonorConn {
    /// Connect and say Hello; lookups of `sections` tables of 24 rows.
    pub(super) fn connect(
        addr: SocketAddr,
        digests: &[(u32, TableDigest)],
        sections: usize,
        rows_per_table: u64,
        seed: u64,
        poll: Duration,
    ) -> Result<Self> {
        let s = TcpStream::connect(addr).context("connecting to the donor")?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut c = Self {
            s,
            limits: Limits::default(),
            poll,
            pinned: digests
                .iter()
                .take(sections)
                .map(|(id, d)| (*id, d.prefix()))
                .collect(),
            ids: vec![vec![0; 24]; sections],
            rows_per_table,
            rng: SplitMix64::new(seed),
            req: Vec::with_capacity(4096),
            buf: vec![0; 64 << 10],
            out: vec![0; sections * 24 * ROW_BYTES],
            next_id: 1,
            runtime: None,
        };
        Hello {
            version: PROTOCOL_VERSION,
            node: "engram-bench-raw",
            credential: &[],
        }
        .encode(&mut c.req, 0)?;
        c.s.write_all(&c.req)?;
        let len = c.read_frame(Duration::ZERO)?;
        match decode(&c.buf[..len], &c.limits)? {
            Some(d) if matches!(d.frame, Frame::Welcome(_)) => Ok(c),
            _ => bail!("the donor did not answer Hello with Welcome"),
        }
    }

    /// Read one whole frame into the front of `buf`; its length.
    fn read_frame(&mut self, poll: Duration) -> Result<usize> {
        let t = Instant::now();
        let mut have = 0;
        loop {
            if let Some(len) = whole(&self.buf, have, &self.limits)? {
                return Ok(len);
            }
            let rest = &mut self.buf[have..];
            let n = if t.elapsed() < poll {
                let n = super::recv_now(&self.s, rest);
                if n < 0 {
                    std::hint::spin_loop();
                    continue;
                }
                n as usize
            } else {
                self.s.read(rest)?
            };
            if n == 0 {
                bail!("the donor closed the connection");
            }
            have += n;
        }
    }

    /// One timed lookup of random rows (ids drawn outside the timing),
    /// its answer checked against the generator outside the timing.
    pub(super) fn one(&mut self, pace: &mut super::pace::Pacer) -> Result<Duration> {
        let (id, t) = self.begin(pace)?;
        self.s.write_all(&self.req)?;
        let len = self.read_frame(self.poll)?;
        self.end(id, len, t, pace)
    }

    /// Register the socket with `rt` for [`Self::one_in_runtime`] (after
    /// Hello, which was read blocking).
    pub(super) fn in_runtime(mut self, rt: &tokio::runtime::Runtime) -> Result<Self> {
        self.runtime = Some(super::in_runtime(&self.s, rt)?);
        Ok(self)
    }

    /// [`Self::one`] through the runtime's socket, on the runtime.
    pub(super) async fn one_in_runtime(
        &mut self,
        pace: &mut super::pace::Pacer,
    ) -> Result<Duration> {
        let (id, t) = self.begin(pace)?;
        let s = self
            .runtime
            .as_mut()
            .context("the connection is not in the runtime")?;
        s.write_all(&self.req).await?;
        let mut have = 0;
        let len = loop {
            if let Some(len) = whole(&self.buf, have, &self.limits)? {
                break len;
            }
            match s.read(&mut self.buf[have..]).await? {
                0 => bail!("the donor closed the connection"),
                n => have += n,
            }
        };
        self.end(id, len, t, pace)
    }

    /// Draw the next lookup's rows, start its timing and write its request
    /// into `req`: its id and start.
    fn begin(&mut self, pace: &mut super::pace::Pacer) -> Result<(u64, Instant)> {
        for v in &mut self.ids {
            v.iter_mut()
                .for_each(|r| *r = self.rng.below(self.rows_per_table));
        }
        let id = self.next_id;
        self.next_id += 1;
        let t = pace.start();
        self.req.clear();
        // On the stack: one or two sections, nothing allocated.
        let n = self.ids.len().min(2);
        let section = |i: usize| {
            let i = i.min(n - 1);
            LookupSection {
                table_id: self.pinned[i].0,
                digest_prefix: self.pinned[i].1,
                rows: &self.ids[i],
            }
        };
        let sections = [section(0), section(1)];
        encode_lookup(&mut self.req, id, &sections[..n])?;
        Ok((id, t))
    }

    /// Take lookup `id`'s answer, the first `len` bytes of `buf`, as any
    /// client must (decoded, checksum checked, rows copied out), end its
    /// timing, and check its rows on every 16th lookup.
    fn end(
        &mut self,
        id: u64,
        len: usize,
        t: Instant,
        pace: &mut super::pace::Pacer,
    ) -> Result<Duration> {
        let Some(d) = decode(&self.buf[..len], &self.limits)? else {
            bail!("an incomplete answer");
        };
        let Frame::Rows(rows) = d.frame else {
            bail!("the donor did not answer with Rows");
        };
        if d.header.request_id != id {
            bail!("an answer to another request");
        }
        let mut at = 0;
        for (s, data) in rows.sections() {
            if s.status.is_some() || at + data.len() > self.out.len() {
                bail!("the donor refused a section or sent too many rows");
            }
            self.out[at..at + data.len()].copy_from_slice(data);
            at += data.len();
        }
        let took = pace.took(t);
        if !id.is_multiple_of(super::CHECK_EVERY) {
            return Ok(took);
        }
        for (s, ids) in self.ids.iter().enumerate() {
            let bytes = &self.out[s * 24 * ROW_BYTES..][..24 * ROW_BYTES];
            if let Some(r) = first_mismatch(SEED, TABLES[s].0, ids, bytes) {
                bail!("the donor returned a wrong row: row {r}");
            }
        }
        Ok(took)
    }
}

/// The length of the whole frame at the front of `buf`'s first `have`
/// bytes, once they hold it all; an error when it cannot fit `buf`.
fn whole(buf: &[u8], have: usize, limits: &Limits) -> Result<Option<usize>> {
    if have < HEADER_LEN {
        return Ok(None);
    }
    let Some(h) = FrameHeader::peek(&buf[..have], limits)? else {
        return Ok(None);
    };
    let len = h.frame_len();
    if len > buf.len() {
        bail!("a {len}-byte frame does not fit the buffer");
    }
    Ok((have >= len).then_some(len))
}
