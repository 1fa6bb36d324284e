//! The protocol's floor: the least server PROTOCOL.md allows, in the
//! floor server's process. It answers Hello with a Welcome, and each
//! Lookup as the protocol requires and nothing more: the frame decoded
//! and bounded, each section's table and digest checked, its rows
//! range-checked and prefetched, then copied into a Rows frame with its
//! checksum, written whole. No sessions, counters, logs, locks or
//! timeouts; anything unexpected closes the connection. The least
//! protocol client ([`super::raw::RawDonorConn`]) against it, set beside
//! the same client against the donor, splits what the protocol itself
//! costs over the gathering floor from what the donor adds.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use engram_protocol::messages::{RowsSection, TableInfo, Welcome, begin_rows, finish_rows};
use engram_protocol::{Frame, FrameHeader, HEADER_LEN, Limits, PROTOCOL_VERSION, decode};
use engram_store::resident::ResidentTable;

/// Accept connections on `listener`, one thread each, until the process ends.
pub(super) fn serve(listener: TcpListener, tables: Arc<Vec<ResidentTable>>, poll: Duration) {
    for stream in listener.incoming() {
        let Ok(s) = stream else { continue };
        if s.set_nodelay(true).is_err() {
            continue;
        }
        let tables = Arc::clone(&tables);
        let named = std::thread::Builder::new().name("proto-floor".into());
        // A thread that cannot start drops its connection only.
        let _ = named.spawn(move || {
            // Any error ends this connection only.
            let _ = Conn::new(s, &tables, poll).run();
        });
    }
}

/// One connection of the protocol's floor.
struct Conn<'a> {
    s: TcpStream,
    tables: &'a [ResidentTable],
    limits: Limits,
    poll: Duration,
    buf: Vec<u8>,
    have: usize,
    out: Vec<u8>,
    sections: Vec<RowsSection>,
}

/// Rows prefetched before the first is copied, and ahead of each copy.
const PREFETCH_AHEAD: usize = 64;

impl<'a> Conn<'a> {
    fn new(s: TcpStream, tables: &'a [ResidentTable], poll: Duration) -> Self {
        let limits = Limits::default();
        Self {
            s,
            tables,
            // Room for any request the series send (48 row ids) and more.
            buf: vec![0; HEADER_LEN + (limits.max_payload as usize).min(1 << 20)],
            limits,
            poll,
            have: 0,
            out: Vec::with_capacity(64 << 10),
            sections: Vec::with_capacity(2),
        }
    }

    /// Answer frames until the peer closes or breaks the protocol.
    fn run(&mut self) -> anyhow::Result<()> {
        loop {
            let len = self.next_frame()?;
            self.out.clear();
            self.answer(len)?;
            self.s.write_all(&self.out)?;
            self.buf.copy_within(len..self.have, 0);
            self.have -= len;
        }
    }

    /// Read until a whole frame is at the front of the buffer; its length.
    fn next_frame(&mut self) -> anyhow::Result<usize> {
        loop {
            if let Some(h) = FrameHeader::peek(&self.buf[..self.have], &self.limits)? {
                let len = h.frame_len();
                anyhow::ensure!(len <= self.buf.len(), "a {len}-byte frame");
                if self.have >= len {
                    return Ok(len);
                }
            }
            super::spin_until_readable(&self.s, self.poll);
            let n = self.s.read(&mut self.buf[self.have..])?;
            anyhow::ensure!(n > 0, "the client closed the connection");
            self.have += n;
        }
    }

    /// The answer to the frame of `len` bytes at the front of the buffer, into `out`.
    fn answer(&mut self, len: usize) -> anyhow::Result<()> {
        let Some(d) = decode(&self.buf[..len], &self.limits)? else {
            anyhow::bail!("an incomplete frame");
        };
        let id = d.header.request_id;
        let tables = self.tables;
        match d.frame {
            Frame::Hello(_) => {
                let infos: Vec<TableInfo> = tables.iter().map(|t| t.info()).collect();
                Welcome {
                    version: PROTOCOL_VERSION,
                    donor: "protocol-floor",
                    max_rows: self.limits.max_rows,
                    max_payload: self.limits.max_payload,
                    tables: &infos,
                }
                .encode(&mut self.out, id)?;
            }
            Frame::Lookup(l) => {
                self.sections.clear();
                for s in l.sections() {
                    let t = tables
                        .iter()
                        .find(|t| t.id == s.table_id && t.digest_prefix == s.digest_prefix)
                        .ok_or_else(|| anyhow::anyhow!("an unknown table or version"))?;
                    for (i, r) in s.rows.iter().enumerate() {
                        anyhow::ensure!(r < t.rows, "a row out of range");
                        if i < PREFETCH_AHEAD {
                            t.prefetch(r);
                        }
                    }
                    self.sections.push(RowsSection {
                        table_id: s.table_id,
                        status: None,
                        row_count: s.rows.len() as u32,
                        row_bytes: 0,
                    });
                }
                let start = begin_rows(&mut self.out, id, &self.sections)?;
                for s in l.sections() {
                    let Some(t) = tables.iter().find(|t| t.id == s.table_id) else {
                        anyhow::bail!("an unknown table");
                    };
                    let mut ahead = s.rows.iter().skip(PREFETCH_AHEAD);
                    for r in s.rows.iter() {
                        if let Some(a) = ahead.next() {
                            t.prefetch(a);
                        }
                        let row = t.row(r).ok_or_else(|| anyhow::anyhow!("a row"))?;
                        row.extend_into(&mut self.out);
                    }
                }
                finish_rows(&mut self.out, start)?;
            }
            _ => anyhow::bail!("a frame the protocol's floor does not answer"),
        }
        Ok(())
    }
}
