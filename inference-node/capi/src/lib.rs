//! libengram_rack: the node's Engram memory (`inference_node::embed`) for C
//! inference engines. The header `include/engram_rack.h` is generated from
//! this file by cbindgen (the `header_is_current` test regenerates and
//! compares it).
//!
//! Conventions, for every function:
//! - The return value is an `engram_status` (`ENGRAM_OK` is 0). On an error
//!   the calling thread's last-error message says what went wrong
//!   (`engram_last_error`), with the same words as the node's CLI.
//! - Pointers the caller passes are borrowed for the call only; a NULL
//!   where one is required is `ENGRAM_BAD_INPUT`, never a crash. Lengths are
//!   element counts and are checked against what the call needs.
//! - Handles (`engram_memory`, `engram_ticket`) are owned by the caller
//!   from the call that made them until their `_free`; both may be used
//!   from any thread at once. A ticket stays valid after its memory is
//!   closed or freed (its waits then report what its fetches came to).
//! - A panic inside the library is caught and reported as
//!   `ENGRAM_INTERNAL`; none crosses into C.

#![warn(missing_docs)]
#![allow(non_camel_case_types)] // C's names for C's types

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::time::Duration;

use inference_node::embed::{
    self, CONTEXT, EmbedError, EmbeddedNode, MetricsAt, NodeTables, OpenOptions, RowLayout,
    Segment, Ticket,
};

mod tables;
pub use tables::*;

/// What a call came to.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum engram_status {
    /// Success.
    ENGRAM_OK = 0,
    /// An argument is wrong: a NULL pointer, a size, a token id, a layer.
    ENGRAM_BAD_INPUT = 1,
    /// The config cannot be read or lacks what the memory needs.
    ENGRAM_CONFIG = 2,
    /// The memory could not be built (a copy, a certificate, no usable source).
    ENGRAM_SETUP = 3,
    /// Every source failed and the table's policy is `fail`.
    ENGRAM_NO_SOURCE = 4,
    /// The caller's deadline passed first; the ticket stays valid.
    ENGRAM_TIMEOUT = 5,
    /// The memory is closed.
    ENGRAM_CLOSED = 6,
    /// Something failed that should not (a thread could not start, a panic).
    ENGRAM_INTERNAL = 7,
}

use engram_status::*;

/// A context slot with no token: the positions start their sequence.
pub const ENGRAM_NO_TOKEN: i64 = -2;
/// The row id `engram_addresses` gives a DEAD position.
pub const ENGRAM_NO_ROW: u64 = 0xFFFF_FFFF_FFFF_FFFF;
/// Rows per position per layer.
pub const ENGRAM_COLUMNS: usize = 24;
/// Bytes of one stored row.
pub const ENGRAM_ROW_BYTES: usize = 264;
/// Values of one dequantized row.
pub const ENGRAM_ROW_VALUES: usize = 256;
/// Bytes of one position's rows of one layer (24 x 264).
pub const ENGRAM_POSITION_BYTES: usize = 6336;

// The header carries literals (cbindgen writes no paths): they must be the library's.
const _: () = assert!(ENGRAM_NO_TOKEN == embed::NO_TOKEN);
const _: () = assert!(ENGRAM_NO_ROW == embed::NO_ROW);
const _: () = assert!(ENGRAM_POSITION_BYTES == embed::POSITION_BYTES);
const _: () = assert!(ENGRAM_POSITION_BYTES == ENGRAM_COLUMNS * ENGRAM_ROW_BYTES);
/// Wait without a deadline of the caller's (the table's own bound it).
pub const ENGRAM_NO_DEADLINE: i64 = -1;
/// `engram_open_ex` flag: serve no /metrics (even where the config says).
pub const ENGRAM_METRICS_OFF: u32 = 1;

/// A node's Engram memory. Opaque.
#[derive(Debug)]
pub struct engram_memory {
    inner: EmbeddedNode,
}

/// Both layers' rows of one prefetch, on their way. Opaque.
#[derive(Debug)]
pub struct engram_ticket {
    inner: Ticket,
}

/// A table's memory as this process maps it, held open. Opaque; its
/// fields are read with `engram_view_info`.
#[derive(Debug)]
pub struct engram_view {
    inner: embed::TableView,
}

/// What `engram_view_info` says of a view. `data[0..len)` is
/// read-only memory, valid until the view is freed. When `packed` is 1,
/// row r starts at `r * 264`; when `planar` is 1 (a host-local donor whose
/// tables are laid out for engines' host-table kernels), row r's 256
/// values start at `r * 256` and its 8 scale bytes at `scales_at + r * 8`;
/// when both are 0 (a `local` copy served from its file's pages), 15 rows
/// share each 4 KiB page: row r starts at `(r / 15) * 4096 + (r % 15) * 264`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct engram_table_info {
    /// The first byte of the table's memory.
    pub data: *const u8,
    /// Bytes at `data`.
    pub len: usize,
    /// Rows in the table.
    pub rows: u64,
    /// The table id.
    pub table: u32,
    /// The Engram layer (1 or 14).
    pub layer: u32,
    /// The donor's generation of this memory; 0 for the node's own copy.
    pub generation: u64,
    /// The table's version (its BLAKE3 digest).
    pub digest: [u8; 32],
    /// 1 when every process on the host maps this same memory (a
    /// host-local donor's); 0 for this process's own copy.
    pub shared: u8,
    /// 1 when rows are back to back; 0 for 15 rows per 4 KiB page or planar.
    pub packed: u8,
    /// 1 when the rows are planar (values, then scales at `scales_at`).
    pub planar: u8,
    /// Where a planar table's scale bytes start in `data`; 0 otherwise.
    pub scales_at: u64,
    /// Bytes per row: 264, or an encoded table's (a Qwen4Exp table's 160,
    /// 320 or 90), whose rows lie back to back (`packed` is 1).
    pub row_bytes: u64,
}

/// One sequence's part of a batch: `len` positions, after `context`, the
/// raw ids of the three tokens before them in their sequence, oldest first
/// (`ENGRAM_NO_TOKEN` where the sequence has none: only leading slots; -1
/// is a DEAD token).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct engram_segment {
    /// Positions in this segment.
    pub len: usize,
    /// Raw ids of the three tokens before the segment, oldest first.
    pub context: [i64; 3],
}

/// How a layer's rows were served.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct engram_served {
    /// The Engram layer (1 or 14).
    pub layer: u32,
    /// The table id.
    pub table: u32,
    /// The first source that answered, NUL-terminated ("zeros" by policy;
    /// empty when every position was DEAD). Truncated to fit.
    pub source: [c_char; 64],
    /// Sources that answered (more than one: a wide fetch was split).
    pub sources: u32,
    /// Hedges sent.
    pub hedges: u32,
    /// Failovers.
    pub failovers: u32,
    /// Messages sent.
    pub messages: u32,
    /// 1 when an answer came after the table's deadline.
    pub late: u8,
    /// 1 when the rows are zeros by the table's `zeros` policy.
    pub zeros: u8,
    /// Distinct rows fetched.
    pub rows: u64,
    /// From the prefetch to the last row's arrival, in nanoseconds.
    pub elapsed_ns: u64,
}

/// One layer's counters since the memory opened.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct engram_layer_stats {
    /// The Engram layer (1 or 14).
    pub layer: u32,
    /// The table id.
    pub table: u32,
    /// Prefetches whose fetch of this layer ended.
    pub prefetches: u64,
    /// Distinct rows fetched.
    pub rows: u64,
    /// Messages sent.
    pub messages: u64,
    /// Hedges sent.
    pub hedges: u64,
    /// Failovers.
    pub failovers: u64,
    /// Fetches answered after the table's deadline.
    pub late: u64,
    /// Fetches answered with zeros by policy.
    pub zeros: u64,
    /// Fetches that failed (policy `fail`).
    pub failed: u64,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_error(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

fn fail(e: EmbedError) -> engram_status {
    set_error(&e.to_string());
    match e {
        EmbedError::Config(_) => ENGRAM_CONFIG,
        EmbedError::Setup(_) => ENGRAM_SETUP,
        EmbedError::BadInput(_) => ENGRAM_BAD_INPUT,
        EmbedError::NoSource(_) => ENGRAM_NO_SOURCE,
        EmbedError::Timeout(_) => ENGRAM_TIMEOUT,
        EmbedError::Closed => ENGRAM_CLOSED,
        EmbedError::Internal(_) => ENGRAM_INTERNAL,
    }
}

fn bad(msg: &str) -> engram_status {
    set_error(msg);
    ENGRAM_BAD_INPUT
}

/// Run `f`, turning a panic into `ENGRAM_INTERNAL`.
fn guard(f: impl FnOnce() -> engram_status) -> engram_status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(s) => s,
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            set_error(&format!("internal error (a bug; please report it): {what}"));
            ENGRAM_INTERNAL
        }
    }
}

/// Run `f`, turning a panic into `fallback` (and the message into the
/// thread's last error): for the entry points that return no status.
fn guard_or<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    let mut out = None;
    let status = guard(|| {
        out = Some(f());
        ENGRAM_OK
    });
    match (status, out) {
        (ENGRAM_OK, Some(v)) => v,
        _ => fallback,
    }
}

/// Whether `len` items of `T` fit a slice (at most `isize::MAX` bytes).
fn fits<T>(len: usize, what: &str) -> Result<(), engram_status> {
    if len > isize::MAX as usize / size_of::<T>().max(1) {
        return Err(bad(&format!(
            "{what}: a length of {len} is past any buffer"
        )));
    }
    Ok(())
}

/// `ptr[..len]`, NULL allowed only when `len` is 0.
///
/// # Safety
/// A non-NULL `ptr` must point to `len` readable `T`.
unsafe fn borrow<'a, T>(ptr: *const T, len: usize, what: &str) -> Result<&'a [T], engram_status> {
    if len == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(bad(&format!("{what} is NULL with a length of {len}")));
    }
    fits::<T>(len, what)?;
    // SAFETY: the caller promises `len` readable T at `ptr`.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// `ptr[..len]` for writing.
///
/// # Safety
/// A non-NULL `ptr` must point to `len` writable `T` nothing else uses.
unsafe fn borrow_mut<'a, T>(
    ptr: *mut T,
    len: usize,
    what: &str,
) -> Result<&'a mut [T], engram_status> {
    if len == 0 {
        return Ok(&mut []);
    }
    if ptr.is_null() {
        return Err(bad(&format!("{what} is NULL with a length of {len}")));
    }
    fits::<T>(len, what)?;
    // SAFETY: the caller promises `len` writable T at `ptr`, used by no one else.
    Ok(unsafe { std::slice::from_raw_parts_mut(ptr, len) })
}

/// # Safety
/// A non-NULL `s` must be a NUL-terminated string.
unsafe fn text<'a>(s: *const c_char, what: &str) -> Result<&'a str, engram_status> {
    if s.is_null() {
        return Err(bad(&format!("{what} is NULL")));
    }
    // SAFETY: the caller promises a NUL-terminated string.
    unsafe { CStr::from_ptr(s) }
        .to_str()
        .map_err(|_| bad(&format!("{what} is not UTF-8")))
}

macro_rules! tri {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(s) => return s,
        }
    };
}

/// The message of the calling thread's last error (empty when none). The
/// pointer stays valid until the thread's next call into the library.
#[unsafe(no_mangle)]
pub extern "C" fn engram_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// A static name for a status ("ENGRAM_TIMEOUT", ...).
#[unsafe(no_mangle)]
pub extern "C" fn engram_status_name(status: engram_status) -> *const c_char {
    let s: &'static CStr = match status {
        ENGRAM_OK => c"ENGRAM_OK",
        ENGRAM_BAD_INPUT => c"ENGRAM_BAD_INPUT",
        ENGRAM_CONFIG => c"ENGRAM_CONFIG",
        ENGRAM_SETUP => c"ENGRAM_SETUP",
        ENGRAM_NO_SOURCE => c"ENGRAM_NO_SOURCE",
        ENGRAM_TIMEOUT => c"ENGRAM_TIMEOUT",
        ENGRAM_CLOSED => c"ENGRAM_CLOSED",
        ENGRAM_INTERNAL => c"ENGRAM_INTERNAL",
    };
    s.as_ptr()
}

/// The library's version, NUL-terminated, static.
#[unsafe(no_mangle)]
pub extern "C" fn engram_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// Open node `node` of the cluster config at path `config`, serving
/// /metrics at the node's configured address. On success `*out` owns a new
/// memory (free it with `engram_free`).
///
/// # Safety
/// `config` and `node` are NUL-terminated strings; `out` points to writable
/// storage for one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_open(
    config: *const c_char,
    node: *const c_char,
    out: *mut *mut engram_memory,
) -> engram_status {
    // SAFETY: forwarded from the caller's promise.
    unsafe { engram_open_ex(config, node, 0, out) }
}

/// `engram_open` with flags (`ENGRAM_METRICS_OFF`).
///
/// # Safety
/// As `engram_open`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_open_ex(
    config: *const c_char,
    node: *const c_char,
    flags: u32,
    out: *mut *mut engram_memory,
) -> engram_status {
    guard(|| {
        if out.is_null() {
            return bad("out is NULL");
        }
        // SAFETY: the caller's promise.
        let (config, node) = tri!(unsafe { text(config, "config") }.and_then(|c| {
            // SAFETY: the caller's promise.
            Ok((c, unsafe { text(node, "node") }?))
        }));
        let opts = tri!(open_options(flags));
        match EmbeddedNode::open_with(Path::new(config), node, &opts) {
            Ok(m) => {
                // SAFETY: `out` is writable (the caller's promise), checked non-NULL.
                unsafe { *out = Box::into_raw(Box::new(engram_memory { inner: m })) };
                ENGRAM_OK
            }
            Err(e) => fail(e),
        }
    })
}

/// What `flags` ask of an open (`ENGRAM_METRICS_OFF`), or a bad flag.
fn open_options(flags: u32) -> Result<OpenOptions, engram_status> {
    if flags & !ENGRAM_METRICS_OFF != 0 {
        return Err(bad(&format!("unknown flags {flags:#x}")));
    }
    Ok(OpenOptions {
        metrics: if flags & ENGRAM_METRICS_OFF != 0 {
            MetricsAt::Off
        } else {
            MetricsAt::Config
        },
    })
}

/// Hand a view to the caller through `out` (checked non-NULL).
///
/// # Safety
/// `out` points to writable storage for one pointer.
unsafe fn give_view(
    view: Result<embed::TableView, EmbedError>,
    out: *mut *mut engram_view,
) -> engram_status {
    match view {
        Ok(v) => {
            // SAFETY: `out` is writable (the caller's promise).
            unsafe { *out = Box::into_raw(Box::new(engram_view { inner: v })) };
            ENGRAM_OK
        }
        Err(e) => fail(e),
    }
}

/// Rows `rows[..rows_len]` dequantized by `f` into `out[..out_len]`.
///
/// # Safety
/// The arrays hold the lengths given.
unsafe fn dequantize_with<T>(
    rows: *const u8,
    rows_len: usize,
    out: *mut T,
    out_len: usize,
    f: impl FnOnce(&[u8], &mut [T]) -> Result<(), EmbedError>,
) -> engram_status {
    // SAFETY: the caller's promises.
    let r = tri!(unsafe { borrow(rows, rows_len, "rows") });
    // SAFETY: as above.
    let o = tri!(unsafe { borrow_mut(out, out_len, "out") });
    match f(r, o) {
        Ok(()) => ENGRAM_OK,
        Err(e) => fail(e),
    }
}

/// Close: refuse new calls, let fetches in flight end (at most `drain_ms`),
/// then stop the probes, the metrics server and the I/O thread. The handle
/// stays valid (calls on it return `ENGRAM_CLOSED`) until `engram_free`.
///
/// # Safety
/// `mem` is NULL or a memory from `engram_open` not yet freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_close(mem: *mut engram_memory, drain_ms: u64) -> engram_status {
    guard(|| {
        // SAFETY: the caller's promise.
        let Some(m) = (unsafe { mem.as_ref() }) else {
            return bad("mem is NULL");
        };
        m.inner
            .close(Duration::from_millis(drain_ms.min(3_600_000)));
        ENGRAM_OK
    })
}

/// Free a memory (closing it first, with a 2 s drain, if it is open).
/// NULL is a no-op.
///
/// # Safety
/// `mem` is NULL or a memory from `engram_open` not yet freed; no other
/// thread uses it during or after this call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_free(mem: *mut engram_memory) {
    let _ = guard(|| {
        if !mem.is_null() {
            // SAFETY: made by Box::into_raw in engram_open_ex, freed once.
            drop(unsafe { Box::from_raw(mem) });
        }
        ENGRAM_OK
    });
}

/// Table ids of layers 1 and 14 into `tables[0]`, `tables[1]`.
///
/// # Safety
/// `mem` as for `engram_close`; `tables` points to two writable u32.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_tables(
    mem: *const engram_memory,
    tables: *mut u32,
) -> engram_status {
    guard(|| {
        // SAFETY: the caller's promise.
        let Some(m) = (unsafe { mem.as_ref() }) else {
            return bad("mem is NULL");
        };
        // SAFETY: two writable u32 (the caller's promise).
        let out = tri!(unsafe { borrow_mut(tables, 2, "tables") });
        match m.inner.tables() {
            Ok(t) => {
                out.copy_from_slice(&t);
                ENGRAM_OK
            }
            Err(e) => fail(e),
        }
    })
}

/// The segments of a call: NULL means one segment starting its sequence.
///
/// # Safety
/// A non-NULL `segs` points to `n_segs` readable segments.
unsafe fn segments(
    segs: *const engram_segment,
    n_segs: usize,
    n_ids: usize,
) -> Result<Vec<Segment>, engram_status> {
    if segs.is_null() && n_segs == 0 {
        return Ok(vec![Segment::start(n_ids)]);
    }
    if n_segs > embed::MAX_SEGMENTS {
        return Err(bad(&format!(
            "{n_segs} segments is more than the {} a batch holds",
            embed::MAX_SEGMENTS
        )));
    }
    // SAFETY: the caller's promise.
    let s = unsafe { borrow(segs, n_segs, "segments") }?;
    Ok(s.iter()
        .map(|s| {
            let mut context = [embed::NO_TOKEN; CONTEXT];
            context.copy_from_slice(&s.context);
            Segment {
                len: s.len,
                context,
            }
        })
        .collect())
}

/// Row ids of `n_ids` raw token ids cut into `segs` (NULL and 0: one
/// sequence from its start), without fetching, into `out` (`out_len` must
/// be `n_ids * 48`): position after position, layer 1's 24 then layer 14's,
/// `ENGRAM_NO_ROW` for a DEAD position.
///
/// # Safety
/// `mem` as for `engram_close`; the arrays hold the lengths given.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_addresses(
    mem: *const engram_memory,
    ids: *const i64,
    n_ids: usize,
    segs: *const engram_segment,
    n_segs: usize,
    out: *mut u64,
    out_len: usize,
) -> engram_status {
    guard(|| {
        // SAFETY: the caller's promise.
        let Some(m) = (unsafe { mem.as_ref() }) else {
            return bad("mem is NULL");
        };
        // SAFETY: the caller's promises on each array.
        let ids = tri!(unsafe { borrow(ids, n_ids, "ids") });
        // SAFETY: as above.
        let segs = tri!(unsafe { segments(segs, n_segs, n_ids) });
        // SAFETY: as above.
        let out = tri!(unsafe { borrow_mut(out, out_len, "out") });
        match m.inner.addresses(ids, &segs, out) {
            Ok(()) => ENGRAM_OK,
            Err(e) => fail(e),
        }
    })
}

/// The next prefetch comes in about `lead_us` microseconds: wake the path
/// to its rows now, as the node's own loop does before each step (each
/// table's first donor is pinged; the memory's I/O thread polls until the
/// fetches that follow have ended, or the lead plus a millisecond).
/// Returns at once.
///
/// # Safety
/// `mem` as for `engram_close`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_warm(mem: *const engram_memory, lead_us: u64) -> engram_status {
    guard(|| {
        // SAFETY: the caller's promise.
        let Some(m) = (unsafe { mem.as_ref() }) else {
            return bad("mem is NULL");
        };
        if lead_us > 1_000_000 {
            return bad("lead_us: at most 1000000 (one second)");
        }
        match m.inner.warm(Duration::from_micros(lead_us)) {
            Ok(()) => ENGRAM_OK,
            Err(e) => fail(e),
        }
    })
}

/// Start both tables' fetches for `n_ids` raw token ids cut into `segs`
/// (NULL and 0: one sequence from its start), one message per table, and
/// return at once. On success `*out` owns a new ticket (free it with
/// `engram_ticket_free`).
///
/// # Safety
/// `mem` as for `engram_close`; the arrays hold the lengths given; `out`
/// points to writable storage for one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_prefetch(
    mem: *const engram_memory,
    ids: *const i64,
    n_ids: usize,
    segs: *const engram_segment,
    n_segs: usize,
    out: *mut *mut engram_ticket,
) -> engram_status {
    guard(|| {
        // SAFETY: the caller's promise.
        let Some(m) = (unsafe { mem.as_ref() }) else {
            return bad("mem is NULL");
        };
        if out.is_null() {
            return bad("out is NULL");
        }
        // SAFETY: the caller's promises on each array.
        let ids = tri!(unsafe { borrow(ids, n_ids, "ids") });
        // SAFETY: as above.
        let segs = tri!(unsafe { segments(segs, n_segs, n_ids) });
        match m.inner.prefetch(ids, &segs) {
            Ok(t) => {
                // SAFETY: `out` is writable (the caller's promise), checked non-NULL.
                unsafe { *out = Box::into_raw(Box::new(engram_ticket { inner: t })) };
                ENGRAM_OK
            }
            Err(e) => fail(e),
        }
    })
}

/// Positions in a ticket's batch (0 for NULL).
///
/// # Safety
/// `t` is NULL or a ticket not yet freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_ticket_positions(t: *const engram_ticket) -> usize {
    guard_or(0, || {
        // SAFETY: the caller's promise.
        unsafe { t.as_ref() }.map_or(0, |t| t.inner.positions())
    })
}

/// Wait for `layer`'s rows (1 or 14), at most `timeout_us` microseconds
/// (`ENGRAM_NO_DEADLINE`: the table's own deadline and hard timeout bound
/// it), and write them into `out` (`out_len` must be positions x 24 x 264
/// bytes): position after position, 24 rows of 264 bytes in column order,
/// zeros for a DEAD position. `served` (may be NULL) says how. On
/// `ENGRAM_TIMEOUT` the ticket stays valid: wait again, or free it. A
/// ticket's layer may be waited for more than once, from any thread.
///
/// # Safety
/// `t` is a ticket not yet freed; `out` holds `out_len` writable bytes;
/// `served` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_wait(
    t: *const engram_ticket,
    layer: u32,
    out: *mut u8,
    out_len: usize,
    timeout_us: i64,
    served: *mut engram_served,
) -> engram_status {
    guard(|| {
        // SAFETY: the caller's promise.
        let Some(t) = (unsafe { t.as_ref() }) else {
            return bad("ticket is NULL");
        };
        let timeout = match timeout_us {
            ENGRAM_NO_DEADLINE => None,
            us if us >= 0 => Some(Duration::from_micros(us as u64)),
            us => {
                return bad(&format!(
                    "timeout {us} us is negative (ENGRAM_NO_DEADLINE is -1)"
                ));
            }
        };
        // SAFETY: the caller's promise.
        let out = tri!(unsafe { borrow_mut(out, out_len, "out") });
        match t.inner.wait(layer, out, timeout) {
            Ok(s) => {
                // SAFETY: NULL or writable (the caller's promise).
                if let Some(dst) = unsafe { served.as_mut() } {
                    *dst = served_of(&s);
                }
                ENGRAM_OK
            }
            Err(e) => fail(e),
        }
    })
}

/// What C is told of how rows were served.
fn served_of(s: &embed::Served) -> engram_served {
    let mut source = [0 as c_char; 64];
    let name = s.sources.first().map_or("", String::as_str);
    for (d, &b) in source.iter_mut().zip(name.as_bytes().iter().take(63)) {
        *d = b as c_char;
    }
    engram_served {
        layer: s.layer,
        table: s.table,
        source,
        sources: s.sources.len() as u32,
        hedges: s.hedges,
        failovers: s.failovers,
        messages: s.messages,
        late: u8::from(s.late),
        zeros: u8::from(s.zeros),
        rows: s.rows as u64,
        elapsed_ns: s.elapsed.as_nanos().min(u128::from(u64::MAX)) as u64,
    }
}

/// 1 when `layer`'s fetch has ended, 0 when not, -1 on a bad argument.
///
/// # Safety
/// `t` is NULL or a ticket not yet freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_ready(t: *const engram_ticket, layer: u32) -> i32 {
    guard_or(-1, || {
        // SAFETY: the caller's promise.
        let Some(t) = (unsafe { t.as_ref() }) else {
            set_error("ticket is NULL");
            return -1;
        };
        match t.inner.ready(layer) {
            Ok(r) => i32::from(r),
            Err(e) => {
                fail(e);
                -1
            }
        }
    })
}

/// Start fetches by row ids, for an engine that hashes on its own: `rows`
/// (`n_rows` of them) holds, position after position, columns
/// `col_lo..col_hi` of layer 1's then layer 14's row ids (`layer` 0), or
/// of layer `layer` (1 or 14) alone. A position whose ids are all
/// `ENGRAM_NO_ROW` is DEAD. Ids are checked against each table's size and
/// deduplicated; one message per table. On success `*out` owns a new
/// ticket whose waits take `positions x (col_hi - col_lo) x 264` bytes.
///
/// # Safety
/// `mem` as for `engram_close`; `rows` holds `n_rows` u64; `out` points
/// to writable storage for one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_prefetch_rows(
    mem: *const engram_memory,
    rows: *const u64,
    n_rows: usize,
    layer: u32,
    col_lo: u32,
    col_hi: u32,
    out: *mut *mut engram_ticket,
) -> engram_status {
    guard(|| {
        // SAFETY: the caller's promise.
        let Some(m) = (unsafe { mem.as_ref() }) else {
            return bad("mem is NULL");
        };
        if out.is_null() {
            return bad("out is NULL");
        }
        // SAFETY: `n_rows` readable u64 (the caller's promise).
        let rows = tri!(unsafe { borrow(rows, n_rows, "rows") });
        let layers = if layer == 0 {
            embed::RowLayers::Both
        } else {
            embed::RowLayers::One(layer)
        };
        match m
            .inner
            .prefetch_rows(rows, layers, col_lo as usize..col_hi as usize)
        {
            Ok(t) => {
                // SAFETY: `out` is writable (the caller's promise).
                unsafe { *out = Box::into_raw(Box::new(engram_ticket { inner: t })) };
                ENGRAM_OK
            }
            Err(e) => fail(e),
        }
    })
}

/// Layer `layer`'s whole table as this process maps it: a host-local
/// donor's memory, which every process on the host maps (one physical
/// copy), or else the node's own `local` copy. Waits up to `wait_ms` for
/// the donor's host socket to hand it over. On success `*out` owns a new
/// view (free it with `engram_view_free`); `ENGRAM_NO_SOURCE` when
/// no such memory holds the table. A swap on the donor leaves a view as
/// it was; a fresh call gives the new version.
///
/// # Safety
/// `mem` as for `engram_close`; `out` points to writable storage for one
/// pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_table_view(
    mem: *const engram_memory,
    layer: u32,
    wait_ms: u64,
    out: *mut *mut engram_view,
) -> engram_status {
    guard(|| {
        // SAFETY: the caller's promise.
        let Some(m) = (unsafe { mem.as_ref() }) else {
            return bad("mem is NULL");
        };
        if out.is_null() {
            return bad("out is NULL");
        }
        // SAFETY: `out` is writable (the caller's promise), checked non-NULL.
        unsafe {
            give_view(
                m.inner.table_view(layer, Duration::from_millis(wait_ms)),
                out,
            )
        }
    })
}

/// What `view` maps, into `*info`.
///
/// # Safety
/// `view` is NULL or a view not yet freed; `info` points to writable
/// storage for one `engram_table_info`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_view_info(
    view: *const engram_view,
    info: *mut engram_table_info,
) -> engram_status {
    guard(|| {
        // SAFETY: the caller's promise.
        let Some(v) = (unsafe { view.as_ref() }) else {
            return bad("view is NULL");
        };
        if info.is_null() {
            return bad("info is NULL");
        }
        let v = &v.inner;
        let bytes = v.bytes();
        let i = engram_table_info {
            data: bytes.as_ptr(),
            len: bytes.len(),
            rows: v.rows(),
            table: v.table(),
            layer: v.layer(),
            generation: v.generation().unwrap_or(0),
            digest: v.digest().0,
            shared: u8::from(v.shared()),
            packed: u8::from(v.packed()),
            planar: u8::from(matches!(v.layout(), RowLayout::Planar { .. })),
            scales_at: match v.layout() {
                RowLayout::Planar { scales_at } => scales_at as u64,
                _ => 0,
            },
            row_bytes: v.row_bytes() as u64,
        };
        // SAFETY: `info` is writable (the caller's promise).
        unsafe { info.write(i) };
        ENGRAM_OK
    })
}

/// Free a view: the memory stays mapped while another view (or the
/// node's own use) holds it. NULL is a no-op.
///
/// # Safety
/// `view` is NULL or a view not yet freed; no other thread uses it during
/// or after this call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_view_free(view: *mut engram_view) {
    guard_or((), || {
        if !view.is_null() {
            // SAFETY: made by Box::into_raw in engram_table_view, freed once.
            drop(unsafe { Box::from_raw(view) });
        }
    });
}

/// Free a ticket (its fetches, if still running, end on their own). NULL
/// is a no-op.
///
/// # Safety
/// `t` is NULL or a ticket not yet freed; no other thread uses it during or
/// after this call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_ticket_free(t: *mut engram_ticket) {
    guard_or((), || {
        if !t.is_null() {
            // SAFETY: made by Box::into_raw in engram_prefetch, freed once.
            drop(unsafe { Box::from_raw(t) });
        }
    });
}

/// Dequantize `rows_len` bytes of rows (a multiple of 264) into `out`
/// (`out_len` must be rows x 256 floats): the values the node's fusion
/// reads, bit for bit.
///
/// # Safety
/// The arrays hold the lengths given.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_dequantize_f32(
    rows: *const u8,
    rows_len: usize,
    out: *mut f32,
    out_len: usize,
) -> engram_status {
    // SAFETY: the caller's promises.
    guard(|| unsafe { dequantize_with(rows, rows_len, out, out_len, embed::dequantize_f32) })
}

/// As `engram_dequantize_f32`, into bf16 bit patterns.
///
/// # Safety
/// The arrays hold the lengths given.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_dequantize_bf16(
    rows: *const u8,
    rows_len: usize,
    out: *mut u16,
    out_len: usize,
) -> engram_status {
    // SAFETY: the caller's promises.
    guard(|| unsafe { dequantize_with(rows, rows_len, out, out_len, embed::dequantize_bf16) })
}

/// Each layer's counters into `stats[0]` (layer 1) and `stats[1]` (layer 14).
///
/// # Safety
/// `mem` as for `engram_close`; `stats` points to two writable structs.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_stats(
    mem: *const engram_memory,
    stats: *mut engram_layer_stats,
) -> engram_status {
    guard(|| {
        // SAFETY: the caller's promise.
        let Some(m) = (unsafe { mem.as_ref() }) else {
            return bad("mem is NULL");
        };
        // SAFETY: two writable structs (the caller's promise).
        let out = tri!(unsafe { borrow_mut(stats, 2, "stats") });
        match m.inner.stats() {
            Ok(s) => {
                for (o, l) in out.iter_mut().zip(s) {
                    *o = engram_layer_stats {
                        layer: l.layer,
                        table: l.table,
                        prefetches: l.prefetches,
                        rows: l.rows,
                        messages: l.messages,
                        hedges: l.hedges,
                        failovers: l.failovers,
                        late: l.late,
                        zeros: l.zeros,
                        failed: l.failed,
                    };
                }
                ENGRAM_OK
            }
            Err(e) => fail(e),
        }
    })
}

/// The node's metrics in Prometheus text, NUL-terminated, into `buf`
/// (`cap` bytes). `*needed` (may be NULL) gets the bytes the text takes
/// with its NUL; when `cap` is smaller, nothing is written and the call
/// returns `ENGRAM_BAD_INPUT` (call again with a larger buffer). The text
/// grows while lookups run (a source's first answer adds its series), so
/// a buffer sized by one call may be short by the next: call again with
/// the new `*needed` until it fits, or leave room to spare.
///
/// # Safety
/// `mem` as for `engram_close`; `buf` holds `cap` writable bytes; `needed`
/// is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_metrics(
    mem: *const engram_memory,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> engram_status {
    guard(|| {
        // SAFETY: the caller's promise.
        let Some(m) = (unsafe { mem.as_ref() }) else {
            return bad("mem is NULL");
        };
        let text = match m.inner.metrics_text() {
            Ok(t) => t,
            Err(e) => return fail(e),
        };
        let want = text.len() + 1;
        // SAFETY: NULL or writable (the caller's promise).
        if let Some(n) = unsafe { needed.as_mut() } {
            *n = want;
        }
        if cap < want {
            return bad(&format!(
                "the metrics take {want} bytes; the buffer has {cap}"
            ));
        }
        // SAFETY: `cap` writable bytes at `buf` (the caller's promise).
        let out = tri!(unsafe { borrow_mut(buf.cast::<u8>(), cap, "buf") });
        out[..text.len()].copy_from_slice(text.as_bytes());
        out[text.len()] = 0;
        ENGRAM_OK
    })
}
