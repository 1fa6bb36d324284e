//! The donor through the least client the protocol allows: one blocking
//! TCP socket, Hello then Lookup frames written whole, each answer read
//! into one reused buffer (polling like the floor's client, or not),
//! decoded with its checksum checked and its rows copied out, as any
//! client must (the rows checked against the generator on every 16th
//! lookup, outside the timing, as the other series do). Against the project's client on the same donor it splits
//! what the donor adds to the gathering floor from what the client adds.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use engram_protocol::messages::{Hello, LookupSection, encode_lookup};
use engram_protocol::synthetic::{SplitMix64, first_mismatch};
use engram_protocol::{
    Frame, FrameHeader, HEADER_LEN, Limits, PROTOCOL_VERSION, ROW_BYTES, TableDigest, decode,
};

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
            if have >= HEADER_LEN
                && let Some(h) = FrameHeader::peek(&self.buf[..have], &self.limits)?
            {
                let len = h.frame_len();
                if len > self.buf.len() {
                    bail!("a {len}-byte frame does not fit the buffer");
                }
                if have >= len {
                    return Ok(len);
                }
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
        self.s.write_all(&self.req)?;
        let len = self.read_frame(self.poll)?;
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
