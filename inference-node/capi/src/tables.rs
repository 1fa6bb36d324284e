//! A node's tables for an engine of any model family (`engram_node_tables`:
//! `inference_node::embed::NodeTables`): what each routed table is, rows
//! by id at the table's own row size, a host-local donor's table mapped.

use std::ffi::{CStr, c_char};
use std::path::Path;
use std::time::Duration;

use engram_protocol::encoding::RowEncoding;

use super::{
    NodeTables, bad, borrow, borrow_mut, dequantize_with, engram_served, engram_status,
    engram_view, fail, give_view, guard, guard_or, open_options, served_of, text,
};
use engram_status::*;

/// A node's tables, for an engine of any model family. Opaque.
#[derive(Debug)]
pub struct engram_node_tables {
    inner: NodeTables,
}

/// What one routed table is (`engram_node_tables_info`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct engram_table_desc {
    /// The table id.
    pub table: u32,
    /// The model layer.
    pub layer: u32,
    /// Rows in the table (ids at or past this are refused).
    pub rows: u64,
    /// Bytes per row.
    pub row_bytes: u32,
    /// Values per row, dequantized.
    pub values: u32,
    /// The rows' encoding, NUL-terminated (e.g. "fp8_per_tensorx160").
    pub encoding: [c_char; 32],
    /// 1 when the encoding has a table scale (`tensor_scale` is it).
    pub has_tensor_scale: u8,
    /// 1 when a lookup whose sources all failed gives zeros (policy
    /// `zeros`); 0 for `fail`.
    pub zeros_policy: u8,
    /// The table's F32 scale, for an encoding with one; 1.0 otherwise.
    pub tensor_scale: f32,
}

/// Open node `node` of the cluster config at `config` for an engine of
/// any model family (flags: `ENGRAM_METRICS_OFF`). On success `*out` owns
/// new tables (free them with `engram_node_tables_free`).
///
/// # Safety
/// `config` and `node` are NUL-terminated strings; `out` points to
/// writable storage for one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_node_tables_open(
    config: *const c_char,
    node: *const c_char,
    flags: u32,
    out: *mut *mut engram_node_tables,
) -> engram_status {
    guard(|| {
        if out.is_null() {
            return bad("out is NULL");
        }
        // SAFETY: the caller's promise.
        let config = match unsafe { text(config, "config") } {
            Ok(c) => c,
            Err(s) => return s,
        };
        // SAFETY: the caller's promise.
        let node = match unsafe { text(node, "node") } {
            Ok(n) => n,
            Err(s) => return s,
        };
        let opts = match open_options(flags) {
            Ok(o) => o,
            Err(s) => return s,
        };
        match NodeTables::open(Path::new(config), node, &opts) {
            Ok(t) => {
                // SAFETY: `out` is writable (the caller's promise), checked non-NULL.
                unsafe { *out = Box::into_raw(Box::new(engram_node_tables { inner: t })) };
                ENGRAM_OK
            }
            Err(e) => fail(e),
        }
    })
}

/// How many tables the node routes, into `*count`.
///
/// # Safety
/// `t` is NULL or tables not yet freed; `count` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_node_tables_count(
    t: *const engram_node_tables,
    count: *mut usize,
) -> engram_status {
    guard(|| {
        // SAFETY: the caller's promise.
        let Some(t) = (unsafe { t.as_ref() }) else {
            return bad("tables is NULL");
        };
        // SAFETY: one writable usize (the caller's promise).
        let out = match unsafe { borrow_mut(count, 1, "count") } {
            Ok(o) => o,
            Err(s) => return s,
        };
        match t.inner.tables() {
            Ok(all) => {
                out[0] = all.len();
                ENGRAM_OK
            }
            Err(e) => fail(e),
        }
    })
}

/// What the `index`-th routed table is (in the config's route order), into
/// `*desc`.
///
/// # Safety
/// `t` as for `engram_node_tables_count`; `desc` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_node_tables_info(
    t: *const engram_node_tables,
    index: usize,
    desc: *mut engram_table_desc,
) -> engram_status {
    guard(|| {
        // SAFETY: the caller's promise.
        let Some(t) = (unsafe { t.as_ref() }) else {
            return bad("tables is NULL");
        };
        if desc.is_null() {
            return bad("desc is NULL");
        }
        let all = match t.inner.tables() {
            Ok(a) => a,
            Err(e) => return fail(e),
        };
        let Some(i) = all.get(index) else {
            return bad(&format!(
                "table index {index}: the node routes {}",
                all.len()
            ));
        };
        let mut encoding = [0 as c_char; 32];
        for (d, &b) in encoding
            .iter_mut()
            .zip(i.encoding.name().as_bytes().iter().take(31))
        {
            *d = b as c_char;
        }
        let d = engram_table_desc {
            table: i.table,
            layer: i.layer,
            rows: i.rows,
            row_bytes: i.row_bytes as u32,
            values: i.encoding.values() as u32,
            encoding,
            has_tensor_scale: u8::from(i.encoding.has_tensor_scale()),
            zeros_policy: u8::from(i.policy == cluster_config::Policy::Zeros),
            tensor_scale: i.tensor_scale.unwrap_or(1.0),
        };
        // SAFETY: `desc` is writable (the caller's promise).
        unsafe { desc.write(d) };
        ENGRAM_OK
    })
}

/// Table `table`'s rows `ids[0..n_ids)` into `out` (`out_len` must be
/// `n_ids` x the table's row size), in the order asked (repeated ids are
/// fetched once), waiting at most `timeout_us` (`ENGRAM_NO_DEADLINE`:
/// until the fetch ends); `served` (may be NULL) says how.
///
/// # Safety
/// `t` as for `engram_node_tables_count`; the arrays hold the lengths
/// given; `served` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_node_tables_lookup(
    t: *const engram_node_tables,
    table: u32,
    ids: *const u64,
    n_ids: usize,
    out: *mut u8,
    out_len: usize,
    timeout_us: i64,
    served: *mut engram_served,
) -> engram_status {
    guard(|| {
        // SAFETY: the caller's promise.
        let Some(t) = (unsafe { t.as_ref() }) else {
            return bad("tables is NULL");
        };
        let timeout = match timeout_us {
            super::ENGRAM_NO_DEADLINE => None,
            us if us >= 0 => Some(Duration::from_micros(us as u64)),
            us => {
                return bad(&format!(
                    "timeout {us} us is negative (ENGRAM_NO_DEADLINE is -1)"
                ));
            }
        };
        // SAFETY: the caller's promises.
        let ids = match unsafe { borrow(ids, n_ids, "ids") } {
            Ok(i) => i,
            Err(s) => return s,
        };
        // SAFETY: as above.
        let out = match unsafe { borrow_mut(out, out_len, "out") } {
            Ok(o) => o,
            Err(s) => return s,
        };
        match t.inner.lookup(table, ids, out, timeout) {
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

/// Table `table` as this process maps it (a host-local donor's memory, or
/// the node's own copy), waiting up to `wait_ms` for a host socket to hand
/// it over; read it with `engram_view_info` (an encoded table's rows lie
/// back to back, `row_bytes` each) and free it with `engram_view_free`.
///
/// # Safety
/// `t` as for `engram_node_tables_count`; `out` points to writable storage
/// for one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_node_tables_view(
    t: *const engram_node_tables,
    table: u32,
    wait_ms: u64,
    out: *mut *mut engram_view,
) -> engram_status {
    guard(|| {
        // SAFETY: the caller's promise.
        let Some(t) = (unsafe { t.as_ref() }) else {
            return bad("tables is NULL");
        };
        if out.is_null() {
            return bad("out is NULL");
        }
        // SAFETY: `out` is writable (the caller's promise), checked non-NULL.
        unsafe {
            give_view(
                t.inner.table_view(table, Duration::from_millis(wait_ms)),
                out,
            )
        }
    })
}

/// Close: let lookups in flight end (at most `drain_ms`), then stop. The
/// handle stays valid (calls return `ENGRAM_CLOSED`) until freed.
///
/// # Safety
/// `t` as for `engram_node_tables_count`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_node_tables_close(
    t: *mut engram_node_tables,
    drain_ms: u64,
) -> engram_status {
    guard(|| {
        // SAFETY: the caller's promise.
        let Some(t) = (unsafe { t.as_ref() }) else {
            return bad("tables is NULL");
        };
        t.inner
            .close(Duration::from_millis(drain_ms.min(3_600_000)));
        ENGRAM_OK
    })
}

/// Free tables (closing them first, with a 2 s drain). NULL is a no-op.
///
/// # Safety
/// `t` is NULL or tables not yet freed; no other thread uses them during
/// or after this call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_node_tables_free(t: *mut engram_node_tables) {
    guard_or((), || {
        if !t.is_null() {
            // SAFETY: made by Box::into_raw in engram_node_tables_open, freed once.
            drop(unsafe { Box::from_raw(t) });
        }
    });
}

/// Dequantize `rows_len` bytes of rows of encoding `encoding` (a name, as
/// `engram_table_desc.encoding`) into `out` as bf16 bit patterns
/// (`out_len` must be rows x values), as the engines compute them;
/// `tensor_scale` is the table's scale (for an encoding with one).
///
/// # Safety
/// `encoding` is a NUL-terminated string; the arrays hold the lengths given.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn engram_dequantize_encoded_bf16(
    encoding: *const c_char,
    tensor_scale: f32,
    rows: *const u8,
    rows_len: usize,
    out: *mut u16,
    out_len: usize,
) -> engram_status {
    guard(|| {
        if encoding.is_null() {
            return bad("encoding is NULL");
        }
        // SAFETY: the caller's promise.
        let Ok(name) = unsafe { CStr::from_ptr(encoding) }.to_str() else {
            return bad("encoding is not UTF-8");
        };
        let e = match RowEncoding::parse(name) {
            Ok(e) => e,
            Err(e) => return bad(&e.to_string()),
        };
        // SAFETY: the caller's promises.
        unsafe {
            dequantize_with(rows, rows_len, out, out_len, |r, o| {
                inference_node::embed::dequantize_encoded_bf16(e, Some(tensor_scale), r, o)
            })
        }
    })
}
