//! Frame payloads: a borrowed view for decoding and an encoder for each kind.
//! All integers are little-endian; `PROTOCOL.md` gives every byte.

use thiserror::Error;

use crate::digest::TableDigest;
use crate::encoding::RowEncoding;
use crate::frame::PROTOCOL_VERSION_V1;
use crate::frame::WELCOME_HEAD_LEN;
use crate::frame::{Cursor, ErrorCode, FrameError, FrameHeader, FrameKind, HEADER_LEN, Limits};
pub use crate::frame::{
    MAX_CREDENTIAL, MAX_HELLO_PAYLOAD, MAX_NAME, MAX_WELCOME_TABLES, MAX_WELCOME_TABLES_V2,
    TABLE_INFO_LEN, TABLE_INFO_LEN_V2,
};
use crate::row::ROW_BYTES;

/// First four bytes of every Hello payload.
pub const HELLO_MAGIC: [u8; 4] = *b"ENGR";
/// Longest Error message, in bytes.
pub const MAX_MESSAGE: usize = 1024;
/// `table_id` of an Error that concerns no table.
pub const NO_TABLE: u32 = u32::MAX;
/// Bytes per section header in Lookup.
pub const LOOKUP_SECTION_LEN: usize = 16;
/// Bytes per section entry in Rows.
pub const ROWS_SECTION_LEN: usize = 12;
/// Bytes before the sections in Lookup (count, reserved).
pub const LOOKUP_HEAD_LEN: usize = 8;
/// Bytes before the sections in Rows (checksum, count, reserved).
pub const ROWS_HEAD_LEN: usize = 16;

/// A value that cannot be put on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("cannot encode frame: {0}")]
pub struct EncodeError(pub &'static str);

/// The checksum carried by Rows: XXH3-64 (seed 0) of the payload after the checksum field.
///
/// A lookup's answer is summed once by the donor and once by the client,
/// each time by a thread that was idle a moment before, whose core then
/// runs its first 256-bit (AVX2) instructions slowly: summing a 24-row
/// answer that way took 585 to 595 ns, 16 bytes at a time (SSE2, the
/// x86-64 baseline) 345 to 365 ns (`engram-bench checksum`;
/// docs/benchmarks.md, "The checksum of a small answer"). From
/// [`WIDE_SUM_FROM`] bytes on the wider vectors win. xxh3 is the same
/// function either way; only the instructions differ.
///
/// A thread that kept the wide units awake since its last sum
/// ([`keep_wide_units_warm`], a polling reader) sums any length with them:
/// 220 ns for a 24-row answer, 435 ns for a 48-row one.
pub fn payload_checksum(bytes: &[u8]) -> u64 {
    let warm = WIDE_WARM.take();
    if bytes.len() < WIDE_SUM_FROM && !warm {
        xxhash_rust::xxh3::xxh3_64(bytes)
    } else {
        twox_hash::XxHash3_64::oneshot(bytes)
    }
}

/// Whether this thread's next [`payload_checksum`] takes the wide units
/// because [`keep_wide_units_warm`] ran since its last one (never where
/// AVX2 is absent). Leaves the mark as it is.
pub fn wide_units_marked() -> bool {
    WIDE_WARM.get()
}

thread_local! {
    /// This thread ran 256-bit instructions since its last
    /// [`payload_checksum`] ([`keep_wide_units_warm`]).
    static WIDE_WARM: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Run two 256-bit instructions, where the CPU has AVX2, so that this
/// thread's next [`payload_checksum`] finds the wide vector units awake
/// and sums with them at any length. For a loop that spins waiting for an
/// answer, once a turn (a few ns); for a thread that slept, once when its
/// bytes arrive, ahead of the work before the sum: the units take under
/// 0.5 us to wake here (`engram-bench checksum`, "woken" rows). Nothing
/// where AVX2 is absent. A sum long after the last call (the spinning gave
/// way to a sleep) still takes the wide units, cold: correct, a few
/// hundred ns slower.
pub fn keep_wide_units_warm() {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        unsafe { wide_turn() };
        WIDE_WARM.set(true);
    }
}

/// Arithmetic on two ymm registers, then `vzeroupper` (no penalty for
/// the SSE code after). A zeroing idiom alone would not do: the CPU
/// handles it without the vector units.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline(never)]
fn wide_turn() {
    // SAFETY: register-only arithmetic on scratch registers: no memory,
    // no stack, no flags.
    unsafe {
        std::arch::asm!(
            "vpcmpeqd ymm1, ymm1, ymm1",
            "vpaddq ymm0, ymm1, ymm1",
            "vpmuludq ymm0, ymm0, ymm1",
            "vzeroupper",
            // ymm0 and ymm1, and vzeroupper touches every vector register.
            clobber_abi("C"),
            options(nomem, nostack, preserves_flags),
        );
    }
}

/// Payloads from this long on are summed with the widest vectors the CPU
/// has ([`payload_checksum`]); both ways cost the same near 20 KiB.
pub const WIDE_SUM_FROM: usize = 16 << 10;

/// [`payload_checksum`] of the concatenation of `parts` (a Rows payload
/// whose rows were read into a buffer of their own).
pub fn payload_checksum_of_parts(parts: &[&[u8]]) -> u64 {
    use std::hash::Hasher;
    use twox_hash::xxhash3_64::{RawHasher, SecretBuffer};
    // The default secret by reference: nothing allocated.
    let mut h = RawHasher::new(SecretBuffer::default());
    for p in parts {
        h.write(p);
    }
    h.finish()
}

fn check_len(len: usize, max: usize, what: &'static str) -> Result<(), EncodeError> {
    if len > max {
        Err(EncodeError(what))
    } else {
        Ok(())
    }
}

fn payload_len(len: usize) -> Result<u32, EncodeError> {
    u32::try_from(len).map_err(|_| EncodeError("payload longer than 4 GiB"))
}

/// Client -> donor: protocol version, node name, credentials (where the link is not TLS).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello<'a> {
    /// Protocol version the client speaks.
    pub version: u16,
    /// The node's name (UTF-8, at most 255 bytes).
    pub node: &'a str,
    /// Opaque credential (at most 1024 bytes; empty when none).
    pub credential: &'a [u8],
}

impl<'a> Hello<'a> {
    pub(crate) fn parse(p: &'a [u8]) -> Result<Self, FrameError> {
        let mut c = Cursor::new(p, FrameKind::Hello);
        if c.array::<4>()? != HELLO_MAGIC {
            return Err(c.malformed("bad magic (not an engram-rack client)"));
        }
        let version = c.u16()?;
        c.zero_u16()?;
        let name_len = usize::from(c.u16()?);
        let cred_len = usize::from(c.u16()?);
        if name_len > MAX_NAME || cred_len > MAX_CREDENTIAL {
            return Err(c.malformed("name or credential too long"));
        }
        let node = c.utf8(name_len)?;
        let credential = c.bytes(cred_len)?;
        c.end()?;
        Ok(Self {
            version,
            node,
            credential,
        })
    }

    /// Append this Hello as a frame.
    pub fn encode(&self, out: &mut Vec<u8>, request_id: u64) -> Result<(), EncodeError> {
        check_len(self.node.len(), MAX_NAME, "node name longer than 255 bytes")?;
        check_len(
            self.credential.len(),
            MAX_CREDENTIAL,
            "credential longer than 1024 bytes",
        )?;
        let len = 12 + self.node.len() + self.credential.len();
        FrameHeader::write(out, FrameKind::Hello, request_id, payload_len(len)?);
        out.extend_from_slice(&HELLO_MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&(self.node.len() as u16).to_le_bytes());
        out.extend_from_slice(&(self.credential.len() as u16).to_le_bytes());
        out.extend_from_slice(self.node.as_bytes());
        out.extend_from_slice(self.credential);
        Ok(())
    }
}

/// One table a donor serves, as announced in Welcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableInfo {
    /// Table id (the cluster config's id).
    pub table_id: u32,
    /// Model layer.
    pub layer: u32,
    /// Row count.
    pub rows: u64,
    /// Full digest (the version).
    pub digest: TableDigest,
    /// How its rows are encoded (V4.1's in a version-1 Welcome).
    pub encoding: RowEncoding,
    /// The table's F32 scale, as its bits, for an encoding with one.
    pub tensor_scale: Option<u32>,
}

impl TableInfo {
    /// A table of V4.1's 264-byte rows.
    pub fn v41(table_id: u32, layer: u32, rows: u64, digest: TableDigest) -> Self {
        Self {
            table_id,
            layer,
            rows,
            digest,
            encoding: RowEncoding::V41,
            tensor_scale: None,
        }
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.encoding.row_bytes()
    }

    /// An entry of a Welcome of `version` (48 bytes in version 1, 64 from
    /// version 2 on); `None` when it does not parse or names an encoding
    /// this build does not know.
    fn read(b: &[u8], version: u16) -> Option<Self> {
        let table_id = u32::from_le_bytes(b.get(0..4)?.try_into().ok()?);
        let layer = u32::from_le_bytes(b.get(4..8)?.try_into().ok()?);
        let rows = u64::from_le_bytes(b.get(8..16)?.try_into().ok()?);
        let digest = TableDigest(b.get(16..48)?.try_into().ok()?);
        let mut t = Self::v41(table_id, layer, rows, digest);
        if version <= PROTOCOL_VERSION_V1 {
            return Some(t);
        }
        let u16_at = |i: usize| Some(u16::from_le_bytes(b.get(i..i + 2)?.try_into().ok()?));
        let u32_at = |i: usize| Some(u32::from_le_bytes(b.get(i..i + 4)?.try_into().ok()?));
        t.encoding = RowEncoding::from_wire(u16_at(48)?, u16_at(50)?)?;
        let (row_bytes, scale, reserved) = (u32_at(52)?, u32_at(56)?, u32_at(60)?);
        if row_bytes as usize != t.encoding.row_bytes() || reserved != 0 {
            return None;
        }
        t.tensor_scale = if t.encoding.has_tensor_scale() {
            Some(scale)
        } else if scale == 0 {
            None
        } else {
            return None;
        };
        Some(t)
    }

    /// Append its entry for a Welcome of `version`.
    fn write(&self, out: &mut Vec<u8>, version: u16) {
        out.extend_from_slice(&self.table_id.to_le_bytes());
        out.extend_from_slice(&self.layer.to_le_bytes());
        out.extend_from_slice(&self.rows.to_le_bytes());
        out.extend_from_slice(&self.digest.0);
        if version <= PROTOCOL_VERSION_V1 {
            return;
        }
        let (kind, values) = self.encoding.wire_code();
        out.extend_from_slice(&kind.to_le_bytes());
        out.extend_from_slice(&values.to_le_bytes());
        out.extend_from_slice(&(self.row_bytes() as u32).to_le_bytes());
        out.extend_from_slice(&self.tensor_scale.unwrap_or(0).to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
    }
}

/// Bytes per Welcome table entry in `version`.
fn table_info_len(version: u16) -> usize {
    if version <= PROTOCOL_VERSION_V1 {
        TABLE_INFO_LEN
    } else {
        TABLE_INFO_LEN_V2
    }
}

/// Most tables a Welcome of `version` lists.
fn max_welcome_tables(version: u16) -> usize {
    if version <= PROTOCOL_VERSION_V1 {
        MAX_WELCOME_TABLES
    } else {
        MAX_WELCOME_TABLES_V2
    }
}

/// Donor -> client, the answer to Hello.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Welcome<'a> {
    /// Protocol version the donor speaks.
    pub version: u16,
    /// The donor's name.
    pub donor: &'a str,
    /// The donor's cap on rows per Lookup.
    pub max_rows: u32,
    /// The donor's cap on frame payloads.
    pub max_payload: u32,
    /// Tables served.
    pub tables: &'a [TableInfo],
}

impl Welcome<'_> {
    /// Append this Welcome as a frame (a version-1 Welcome lists tables
    /// of V4.1's rows only).
    pub fn encode(&self, out: &mut Vec<u8>, request_id: u64) -> Result<(), EncodeError> {
        check_len(
            self.donor.len(),
            MAX_NAME,
            "donor name longer than 255 bytes",
        )?;
        check_len(
            self.tables.len(),
            max_welcome_tables(self.version),
            "more tables than a Welcome lists (1,024; 768 in version 2)",
        )?;
        if self.version <= PROTOCOL_VERSION_V1
            && self.tables.iter().any(|t| t.encoding != RowEncoding::V41)
        {
            return Err(EncodeError(
                "a version-1 Welcome lists tables of V4.1's rows only",
            ));
        }
        let entry = table_info_len(self.version);
        let len = WELCOME_HEAD_LEN + self.donor.len() + entry * self.tables.len();
        FrameHeader::write(out, FrameKind::Welcome, request_id, payload_len(len)?);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.donor.len() as u16).to_le_bytes());
        out.extend_from_slice(&(self.tables.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.max_rows.to_le_bytes());
        out.extend_from_slice(&self.max_payload.to_le_bytes());
        out.extend_from_slice(self.donor.as_bytes());
        for t in self.tables {
            t.write(out, self.version);
        }
        Ok(())
    }
}

/// A decoded Welcome, borrowing its table list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WelcomeRef<'a> {
    /// Protocol version the donor speaks.
    pub version: u16,
    /// The donor's name.
    pub donor: &'a str,
    /// The donor's cap on rows per Lookup.
    pub max_rows: u32,
    /// The donor's cap on frame payloads.
    pub max_payload: u32,
    tables: &'a [u8],
}

impl<'a> WelcomeRef<'a> {
    pub(crate) fn parse(p: &'a [u8]) -> Result<Self, FrameError> {
        let mut c = Cursor::new(p, FrameKind::Welcome);
        let version = c.u16()?;
        let name_len = usize::from(c.u16()?);
        let n_tables = c.u32()? as usize;
        let max_rows = c.u32()?;
        let max_payload = c.u32()?;
        if name_len > MAX_NAME || n_tables > max_welcome_tables(version) {
            return Err(c.malformed("name too long or too many tables"));
        }
        let donor = c.utf8(name_len)?;
        let entry = table_info_len(version);
        let tables = c.bytes(n_tables * entry)?;
        if tables
            .chunks_exact(entry)
            .any(|t| TableInfo::read(t, version).is_none())
        {
            return Err(c.malformed("a table entry with an unknown encoding"));
        }
        c.end()?;
        Ok(Self {
            version,
            donor,
            max_rows,
            max_payload,
            tables,
        })
    }

    /// The tables announced, in order.
    pub fn tables(&self) -> impl Iterator<Item = TableInfo> + 'a {
        let version = self.version;
        self.tables
            .chunks_exact(table_info_len(version))
            .filter_map(move |t| TableInfo::read(t, version))
    }

    /// Number of tables announced.
    pub fn table_count(&self) -> usize {
        self.tables.len() / table_info_len(self.version)
    }

    /// The announced table with this id, if any.
    pub fn table(&self, table_id: u32) -> Option<TableInfo> {
        self.tables().find(|t| t.table_id == table_id)
    }
}

/// One section of a Lookup to encode: rows of one table at one version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LookupSection<'a> {
    /// Table id.
    pub table_id: u32,
    /// First 8 bytes of the pinned digest, little-endian.
    pub digest_prefix: u64,
    /// Row ids, answered in this order.
    pub rows: &'a [u64],
}

/// Append a Lookup frame with these sections.
pub fn encode_lookup(
    out: &mut Vec<u8>,
    request_id: u64,
    sections: &[LookupSection<'_>],
) -> Result<(), EncodeError> {
    if sections.is_empty() {
        return Err(EncodeError("a lookup needs at least one section"));
    }
    let mut len = LOOKUP_HEAD_LEN;
    for s in sections {
        if s.rows.is_empty() {
            return Err(EncodeError("a lookup section needs at least one row"));
        }
        u32::try_from(s.rows.len()).map_err(|_| EncodeError("too many rows in one section"))?;
        len += LOOKUP_SECTION_LEN + 8 * s.rows.len();
    }
    let count = u32::try_from(sections.len()).map_err(|_| EncodeError("too many sections"))?;
    FrameHeader::write(out, FrameKind::Lookup, request_id, payload_len(len)?);
    out.extend_from_slice(&count.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    for s in sections {
        out.extend_from_slice(&s.table_id.to_le_bytes());
        out.extend_from_slice(&(s.rows.len() as u32).to_le_bytes());
        out.extend_from_slice(&s.digest_prefix.to_le_bytes());
        for r in s.rows {
            out.extend_from_slice(&r.to_le_bytes());
        }
    }
    Ok(())
}

/// A decoded Lookup; its structure and bounds were checked when parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LookupRef<'a> {
    section_count: u32,
    total_rows: u64,
    body: &'a [u8],
}

/// One section of a decoded Lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LookupSectionRef<'a> {
    /// Table id.
    pub table_id: u32,
    /// First 8 bytes of the client's pinned digest, little-endian.
    pub digest_prefix: u64,
    /// Row ids.
    pub rows: RowIds<'a>,
}

/// Row ids of a section, read in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowIds<'a>(&'a [u8]);

impl<'a> RowIds<'a> {
    /// Number of row ids.
    pub fn len(&self) -> usize {
        self.0.len() / 8
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The row ids in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = u64> + 'a {
        self.0.chunks_exact(8).map(|c| {
            let mut a = [0u8; 8];
            a.copy_from_slice(c);
            u64::from_le_bytes(a)
        })
    }
}

impl<'a> LookupRef<'a> {
    pub(crate) fn parse(p: &'a [u8], limits: &Limits) -> Result<Self, FrameError> {
        let mut c = Cursor::new(p, FrameKind::Lookup);
        let section_count = c.u32()?;
        c.zero_u32()?;
        if section_count == 0 {
            return Err(c.malformed("no sections"));
        }
        if section_count > limits.max_sections {
            return Err(FrameError::TooManySections {
                sections: section_count,
                max: limits.max_sections,
            });
        }
        let body = p.get(LOOKUP_HEAD_LEN..).unwrap_or_default();
        let mut total_rows = 0u64;
        for _ in 0..section_count {
            let _table = c.u32()?;
            let n = u64::from(c.u32()?);
            let _prefix = c.u64()?;
            if n == 0 {
                return Err(c.malformed("empty section"));
            }
            total_rows += n;
            if total_rows > u64::from(limits.max_rows) {
                return Err(FrameError::TooManyRows {
                    rows: total_rows,
                    max: limits.max_rows,
                });
            }
            // n <= max_rows <= 2^32, so n * 8 cannot overflow.
            c.bytes(n as usize * 8)?;
        }
        c.end()?;
        Ok(Self {
            section_count,
            total_rows,
            body,
        })
    }

    /// Number of sections.
    pub fn section_count(&self) -> u32 {
        self.section_count
    }

    /// Rows in all sections together.
    pub fn total_rows(&self) -> u64 {
        self.total_rows
    }

    /// The sections in order.
    pub fn sections(&self) -> impl Iterator<Item = LookupSectionRef<'a>> + 'a {
        let mut rest = self.body;
        std::iter::from_fn(move || {
            let head = rest.get(..LOOKUP_SECTION_LEN)?;
            let table_id = u32::from_le_bytes(head[0..4].try_into().ok()?);
            let n = u32::from_le_bytes(head[4..8].try_into().ok()?) as usize;
            let digest_prefix = u64::from_le_bytes(head[8..16].try_into().ok()?);
            let rows = rest.get(LOOKUP_SECTION_LEN..LOOKUP_SECTION_LEN + 8 * n)?;
            rest = rest.get(LOOKUP_SECTION_LEN + 8 * n..)?;
            Some(LookupSectionRef {
                table_id,
                digest_prefix,
                rows: RowIds(rows),
            })
        })
    }
}

/// One section's entry in a Rows answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowsSection {
    /// Table id, as requested.
    pub table_id: u32,
    /// `None` when served, else why not.
    pub status: Option<ErrorCode>,
    /// Rows included for this section: the requested count when served, else 0.
    pub row_count: u32,
    /// Bytes per row of a served section; 0 for V4.1's 264 (the wire's
    /// form: always 0 on a version-1 connection, and for a failed section).
    pub row_bytes: u16,
}

impl RowsSection {
    /// Bytes per row of this section's rows.
    pub fn row_size(&self) -> usize {
        match self.row_bytes {
            0 => ROW_BYTES,
            n => usize::from(n),
        }
    }
}

/// Where an in-progress Rows frame starts in the output buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowsStart {
    start: usize,
    frame_len: usize,
}

impl RowsStart {
    /// Offset of the frame in the buffer (truncate to it to abandon the frame).
    pub fn offset(&self) -> usize {
        self.start
    }
}

/// Start a Rows frame: header, checksum placeholder and the section table.
/// Append exactly the served rows' bytes next, then call [`finish_rows`].
pub fn begin_rows(
    out: &mut Vec<u8>,
    request_id: u64,
    sections: &[RowsSection],
) -> Result<RowsStart, EncodeError> {
    if sections.is_empty() {
        return Err(EncodeError("a rows answer needs at least one section"));
    }
    let count = u32::try_from(sections.len()).map_err(|_| EncodeError("too many sections"))?;
    let mut bytes = 0usize;
    for s in sections {
        if s.status.is_some() && (s.row_count != 0 || s.row_bytes != 0) {
            return Err(EncodeError("a failed section carries no rows"));
        }
        bytes += s.row_count as usize * s.row_size();
    }
    let len = ROWS_HEAD_LEN + ROWS_SECTION_LEN * sections.len() + bytes;
    let start = out.len();
    out.reserve(HEADER_LEN + len);
    FrameHeader::write(out, FrameKind::Rows, request_id, payload_len(len)?);
    out.extend_from_slice(&0u64.to_le_bytes());
    out.extend_from_slice(&count.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    for s in sections {
        out.extend_from_slice(&s.table_id.to_le_bytes());
        out.extend_from_slice(&s.status.map_or(0, ErrorCode::to_u16).to_le_bytes());
        out.extend_from_slice(&s.row_bytes.to_le_bytes());
        out.extend_from_slice(&s.row_count.to_le_bytes());
    }
    Ok(RowsStart {
        start,
        frame_len: HEADER_LEN + len,
    })
}

/// Finish a Rows frame: check its length and write the checksum.
pub fn finish_rows(out: &mut [u8], start: RowsStart) -> Result<(), EncodeError> {
    let Some(frame) = out.get_mut(start.start..) else {
        return Err(EncodeError("rows frame start is past the buffer"));
    };
    if frame.len() != start.frame_len {
        return Err(EncodeError(
            "row bytes appended do not match the section table",
        ));
    }
    let sum = payload_checksum(&frame[HEADER_LEN + 8..]);
    frame[HEADER_LEN..HEADER_LEN + 8].copy_from_slice(&sum.to_le_bytes());
    Ok(())
}

/// A decoded Rows answer whose checksum and structure were verified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowsRef<'a> {
    section_count: u32,
    total_rows: u64,
    sections: &'a [u8],
    data: &'a [u8],
}

impl<'a> RowsRef<'a> {
    pub(crate) fn parse(p: &'a [u8], limits: &Limits) -> Result<Self, FrameError> {
        let mut c = Cursor::new(p, FrameKind::Rows);
        let expected = c.u64()?;
        let section_count = c.u32()?;
        c.zero_u32()?;
        if section_count == 0 {
            return Err(c.malformed("no sections"));
        }
        if section_count > limits.max_sections {
            return Err(FrameError::TooManySections {
                sections: section_count,
                max: limits.max_sections,
            });
        }
        let sections = c.bytes(section_count as usize * ROWS_SECTION_LEN)?;
        let mut total_rows = 0u64;
        let mut total_bytes = 0u64;
        for s in sections.chunks_exact(ROWS_SECTION_LEN) {
            let status = u16::from_le_bytes([s[4], s[5]]);
            let row_bytes = u16::from_le_bytes([s[6], s[7]]);
            let n = u64::from(u32::from_le_bytes([s[8], s[9], s[10], s[11]]));
            if status != 0 && (n != 0 || row_bytes != 0) {
                return Err(c.malformed("a failed section carries rows"));
            }
            total_rows += n;
            total_bytes += n * if row_bytes == 0 {
                ROW_BYTES as u64
            } else {
                u64::from(row_bytes)
            };
        }
        // Rows of any size: at most the bytes of `max_rows` V4.1 rows.
        if total_rows > u64::from(limits.max_rows)
            || total_bytes > u64::from(limits.max_rows) * ROW_BYTES as u64
        {
            return Err(FrameError::TooManyRows {
                rows: total_rows,
                max: limits.max_rows,
            });
        }
        if c.remaining() as u64 != total_bytes {
            return Err(c.malformed("row bytes do not match the section table"));
        }
        let data = c.rest();
        let actual = payload_checksum(&p[8..]);
        if actual != expected {
            return Err(FrameError::Checksum { expected, actual });
        }
        Ok(Self {
            section_count,
            total_rows,
            sections,
            data,
        })
    }

    /// Number of sections.
    pub fn section_count(&self) -> u32 {
        self.section_count
    }

    /// Rows in all served sections together.
    pub fn total_rows(&self) -> u64 {
        self.total_rows
    }

    /// All row bytes, served sections in order.
    pub fn data(&self) -> &'a [u8] {
        self.data
    }

    /// Each section with its row bytes (empty for a failed section).
    pub fn sections(&self) -> impl Iterator<Item = (RowsSection, &'a [u8])> + 'a {
        let mut data = self.data;
        self.sections.chunks_exact(ROWS_SECTION_LEN).map(move |s| {
            let table_id = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            let status = ErrorCode::from_u16(u16::from_le_bytes([s[4], s[5]]));
            let row_count = u32::from_le_bytes([s[8], s[9], s[10], s[11]]);
            let section = RowsSection {
                table_id,
                status,
                row_count,
                row_bytes: u16::from_le_bytes([s[6], s[7]]),
            };
            let n = (row_count as usize * section.row_size()).min(data.len());
            let (mine, rest) = data.split_at(n);
            data = rest;
            (section, mine)
        })
    }
}

/// A request-level typed error (donor -> client).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErrorFrame<'a> {
    /// What went wrong.
    pub code: ErrorCode,
    /// The table concerned, if any.
    pub table_id: Option<u32>,
    /// A number that helps: the offending row id, a cap, a version.
    pub detail: u64,
    /// Human-readable explanation (at most 1024 bytes).
    pub message: &'a str,
}

impl<'a> ErrorFrame<'a> {
    pub(crate) fn parse(p: &'a [u8]) -> Result<Self, FrameError> {
        let mut c = Cursor::new(p, FrameKind::Error);
        let code = c.u16()?;
        let msg_len = usize::from(c.u16()?);
        let table = c.u32()?;
        let detail = c.u64()?;
        if msg_len > MAX_MESSAGE {
            return Err(c.malformed("message too long"));
        }
        let message = c.utf8(msg_len)?;
        c.end()?;
        let code = ErrorCode::from_u16(code).ok_or_else(|| c.malformed("error code 0"))?;
        Ok(Self {
            code,
            table_id: (table != NO_TABLE).then_some(table),
            detail,
            message,
        })
    }

    /// Append this Error as a frame; a long message is cut at a character boundary.
    pub fn encode(&self, out: &mut Vec<u8>, request_id: u64) {
        let mut end = self.message.len().min(MAX_MESSAGE);
        while !self.message.is_char_boundary(end) {
            end -= 1;
        }
        let msg = &self.message.as_bytes()[..end];
        FrameHeader::write(out, FrameKind::Error, request_id, (16 + msg.len()) as u32);
        out.extend_from_slice(&self.code.to_u16().to_le_bytes());
        out.extend_from_slice(&(msg.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.table_id.unwrap_or(NO_TABLE).to_le_bytes());
        out.extend_from_slice(&self.detail.to_le_bytes());
        out.extend_from_slice(msg);
    }
}

/// Donor -> client: the donor is draining. Finish what is in flight, send nothing new.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Goodbye {
    /// How long the donor keeps answering in-flight requests, in milliseconds.
    pub grace_ms: u32,
}

impl Goodbye {
    pub(crate) fn parse(p: &[u8]) -> Result<Self, FrameError> {
        let mut c = Cursor::new(p, FrameKind::Goodbye);
        let grace_ms = c.u32()?;
        c.zero_u32()?;
        c.end()?;
        Ok(Self { grace_ms })
    }

    /// Append this Goodbye as a frame (request id 0: unsolicited).
    pub fn encode(&self, out: &mut Vec<u8>) {
        FrameHeader::write(out, FrameKind::Goodbye, 0, 8);
        out.extend_from_slice(&self.grace_ms.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
    }
}

/// Client -> donor: where is table `table_id`'s RDMA region? Answered with
/// a [`Region`], or an Error: `unauthorized` on a plaintext connection
/// (the region's key and the queue-pair token never travel in the clear),
/// `unknown_table`, or `unavailable` when the donor offers no RDMA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionQuery {
    /// The table.
    pub table_id: u32,
}

impl RegionQuery {
    /// Payload bytes.
    pub const LEN: usize = 8;

    pub(crate) fn parse(p: &[u8]) -> Result<Self, FrameError> {
        let mut c = Cursor::new(p, FrameKind::RegionQuery);
        let table_id = c.u32()?;
        c.zero_u32()?;
        c.end()?;
        Ok(Self { table_id })
    }

    /// Append this query as a frame.
    pub fn encode(&self, out: &mut Vec<u8>, request_id: u64) {
        FrameHeader::write(out, FrameKind::RegionQuery, request_id, Self::LEN as u32);
        out.extend_from_slice(&self.table_id.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
    }
}

/// Donor -> client: a table version's registered memory. Rows are 264
/// bytes back to back from `rows_addr`; row `r`'s check word (8 bytes LE)
/// is at `checks_addr + 8 * r`. `token` admits one queue pair to the
/// donor's RDMA listener within 10 s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// The table.
    pub table_id: u32,
    /// Its row count.
    pub rows: u64,
    /// The version the region holds.
    pub digest: TableDigest,
    /// Changes with every registration: a swap (or a restart) gives a new one.
    pub generation: u64,
    /// Remote address of row 0.
    pub rows_addr: u64,
    /// Key of the rows' region.
    pub rows_rkey: u32,
    /// Key of the check words' region.
    pub checks_rkey: u32,
    /// Remote address of row 0's check word.
    pub checks_addr: u64,
    /// Private data a queue pair presents to be accepted.
    pub token: [u8; 16],
}

impl Region {
    /// Payload bytes.
    pub const LEN: usize = 96;

    pub(crate) fn parse(p: &[u8]) -> Result<Self, FrameError> {
        let mut c = Cursor::new(p, FrameKind::Region);
        let table_id = c.u32()?;
        c.zero_u32()?;
        let rows = c.u64()?;
        let digest = TableDigest(c.array::<32>()?);
        let generation = c.u64()?;
        let rows_addr = c.u64()?;
        let rows_rkey = c.u32()?;
        let checks_rkey = c.u32()?;
        let checks_addr = c.u64()?;
        let token = c.array::<16>()?;
        c.end()?;
        Ok(Self {
            table_id,
            rows,
            digest,
            generation,
            rows_addr,
            rows_rkey,
            checks_rkey,
            checks_addr,
            token,
        })
    }

    /// Append this answer as a frame.
    pub fn encode(&self, out: &mut Vec<u8>, request_id: u64) {
        FrameHeader::write(out, FrameKind::Region, request_id, Self::LEN as u32);
        out.extend_from_slice(&self.table_id.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&self.rows.to_le_bytes());
        out.extend_from_slice(&self.digest.0);
        out.extend_from_slice(&self.generation.to_le_bytes());
        out.extend_from_slice(&self.rows_addr.to_le_bytes());
        out.extend_from_slice(&self.rows_rkey.to_le_bytes());
        out.extend_from_slice(&self.checks_rkey.to_le_bytes());
        out.extend_from_slice(&self.checks_addr.to_le_bytes());
        out.extend_from_slice(&self.token);
    }
}

/// Append a Ping or Pong frame.
pub fn encode_ping(out: &mut Vec<u8>, request_id: u64, pong: bool) {
    let kind = if pong {
        FrameKind::Pong
    } else {
        FrameKind::Ping
    };
    FrameHeader::write(out, kind, request_id, 0);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_warm_turn_lets_the_next_sum_take_the_wide_units_once() {
        #[cfg(target_arch = "x86_64")]
        let wide = std::arch::is_x86_feature_detected!("avx2");
        #[cfg(not(target_arch = "x86_64"))]
        let wide = false;
        assert!(!WIDE_WARM.get());
        keep_wide_units_warm();
        assert_eq!(WIDE_WARM.get(), wide);
        let short = [7u8; 100];
        assert_eq!(payload_checksum(&short), xxhash_rust::xxh3::xxh3_64(&short));
        assert!(!WIDE_WARM.get(), "the sum took the warm turn");
        keep_wide_units_warm();
        keep_wide_units_warm();
        let _ = payload_checksum(&[]);
        assert!(!WIDE_WARM.get());
    }

    fn welcome(version: u16, tables: &[TableInfo]) -> Result<Vec<u8>, EncodeError> {
        let mut out = Vec::new();
        Welcome {
            version,
            donor: "d",
            max_rows: 64,
            max_payload: 1 << 20,
            tables,
        }
        .encode(&mut out, 0)?;
        Ok(out)
    }

    fn parse_welcome(frame: &[u8]) -> Result<Vec<TableInfo>, FrameError> {
        let w = WelcomeRef::parse(&frame[HEADER_LEN..])?;
        Ok(w.tables().collect())
    }

    /// A version-2 Welcome carries each table's encoding and scale; a
    /// version-1 Welcome carries V4.1's tables only, as before.
    #[test]
    fn welcome_entries_carry_the_encoding_from_version_2() {
        let d = TableDigest([7; 32]);
        let qwen = TableInfo {
            encoding: RowEncoding::Fp8PerTensor { values: 160 },
            tensor_scale: Some(0.5f32.to_bits()),
            ..TableInfo::v41(3, 1, 320_001_536, d)
        };
        let tables = [TableInfo::v41(1, 1, 100, d), qwen];
        let v2 = welcome(2, &tables).expect("v2");
        assert_eq!(v2.len(), HEADER_LEN + 16 + 1 + 2 * TABLE_INFO_LEN_V2);
        assert_eq!(parse_welcome(&v2).expect("parses"), tables);
        // The entry's bytes: kind 2, 160 values, 160 bytes, the scale.
        let e = &v2[HEADER_LEN + 17 + TABLE_INFO_LEN_V2..];
        assert_eq!(&e[48..52], &[2, 0, 160, 0]);
        assert_eq!(&e[52..56], &160u32.to_le_bytes());
        assert_eq!(&e[56..60], &0.5f32.to_bits().to_le_bytes());
        assert!(welcome(1, &tables).is_err(), "version 1 lists V4.1 only");
        let v1 = welcome(1, &tables[..1]).expect("v1");
        assert_eq!(v1.len(), HEADER_LEN + 16 + 1 + TABLE_INFO_LEN);
        assert_eq!(parse_welcome(&v1).expect("parses"), tables[..1]);
        // An unknown encoding kind, a row size that is not the encoding's,
        // a scale on an encoding without one: malformed.
        let (first, second) = (HEADER_LEN + 17, HEADER_LEN + 17 + TABLE_INFO_LEN_V2);
        for (at, byte) in [(second + 48, 9u8), (second + 52, 161), (first + 56, 1)] {
            let mut bad = v2.clone();
            bad[at] = byte;
            assert!(parse_welcome(&bad).is_err(), "byte {at} = {byte}");
        }
        let too_many = vec![tables[0]; MAX_WELCOME_TABLES_V2 + 1];
        assert!(welcome(2, &too_many).is_err());
        assert!(welcome(1, &too_many).is_ok());
    }

    /// Rows of another size say so in their section entry (0 is V4.1's
    /// 264), and an answer holds at most `max_rows` x 264 bytes of rows.
    #[test]
    fn rows_sections_carry_their_row_size() {
        let sections = [
            RowsSection {
                table_id: 1,
                status: None,
                row_count: 2,
                row_bytes: 0,
            },
            RowsSection {
                table_id: 3,
                status: None,
                row_count: 3,
                row_bytes: 160,
            },
            RowsSection {
                table_id: 4,
                status: Some(ErrorCode::UnknownTable),
                row_count: 0,
                row_bytes: 0,
            },
        ];
        let mut out = Vec::new();
        let start = begin_rows(&mut out, 9, &sections).expect("begin");
        out.extend((0..2 * 264 + 3 * 160).map(|i| i as u8));
        finish_rows(&mut out, start).expect("finish");
        let limits = Limits::for_rows(64);
        let r = RowsRef::parse(&out[HEADER_LEN..], &limits).expect("parses");
        let got: Vec<_> = r.sections().collect();
        assert_eq!(got[0].1.len(), 2 * 264);
        assert_eq!(got[1].1.len(), 3 * 160);
        assert_eq!(got[1].0, sections[1]);
        assert_eq!(got[1].1[0], (2 * 264) as u8);
        assert!(got[2].1.is_empty());
        // 5 rows fit a cap of 5, but not in 4 x 264 bytes.
        assert!(RowsRef::parse(&out[HEADER_LEN..], &Limits::for_rows(5)).is_ok());
        assert!(matches!(
            RowsRef::parse(&out[HEADER_LEN..], &Limits::for_rows(4)),
            Err(FrameError::TooManyRows { .. })
        ));
        let failed_with_size = [RowsSection {
            row_bytes: 160,
            ..sections[2]
        }];
        assert!(begin_rows(&mut Vec::new(), 1, &failed_with_size).is_err());
    }
}
