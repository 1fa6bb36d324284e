//! Engram row addressing (docs/ENGRAM.md section 3): 24 row ids per Engram layer
//! per token position, from the compressed ids of the token and the three
//! before it.
//!
//! What it is: the prime search that sizes each layer's table, the hashing
//! presets (`v41`, or any base size for small tables that run the same code),
//! and [`SequenceHasher`], a per-sequence state that takes a prefill and then
//! decode steps one token at a time, so a sequence hashed in one go and one
//! split anywhere give the same rows by construction.
//!
//! What it is not: the token map (raw id -> compressed id) lives with the
//! tokenizer in the inference node; this module starts from compressed ids.

use std::collections::HashSet;
use std::fmt;
use std::str::FromStr;

use thiserror::Error;

/// Model layers that run Engram, in the order their primes are taken.
pub const ENGRAM_LAYERS: [u32; 2] = [1, 14];
/// Largest n-gram order (orders 2..=4).
pub const MAX_NGRAM: usize = 4;
/// Hash heads per order.
pub const HEADS: usize = 8;
/// Row ids per layer per position: (MAX_NGRAM - 1) * HEADS.
pub const COLUMNS: usize = (MAX_NGRAM - 1) * HEADS;
/// The compressed id of a masked position (image placeholders).
pub const DEAD: i32 = -1;
/// V4.1's base size: its primes are the smallest above `V41_BASE - 1`.
pub const V41_BASE: u64 = 16_000_000;
/// V4.1's compressed vocabulary size; every compressed id is below it.
pub const V41_COMPRESSED_VOCAB: u32 = 99_092;
/// V4.1's raw pad token id (its compressed id is the pad used in hashing).
pub const V41_PAD_RAW_ID: u32 = 2;
/// V4.1's per-layer multipliers `m0..m3` (layers 1 and 14).
pub const V41_MULTIPLIERS: [[u64; MAX_NGRAM]; 2] = [
    [
        76_632_096_046_245,
        4_839_876_093_313,
        35_959_672_319_349,
        73_987_337_458_391,
    ],
    [
        67_716_810_739_261,
        51_510_806_800_915,
        30_921_347_202_721,
        82_619_226_485_591,
    ],
];
/// Smallest base size accepted.
pub const MIN_BASE: u64 = 2;
/// Largest base size accepted (keeps a layer's rows far below `etab::MAX_ROWS`).
pub const MAX_BASE: u64 = 1 << 34;

/// Why hashing parameters or an id are not accepted.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HashError {
    /// A preset name that is neither `v41` nor a base size.
    #[error("{0:?} is not a hashing preset (`v41`, or a base size {MIN_BASE}..={MAX_BASE})")]
    Preset(String),
    /// A compressed id outside the vocabulary (and not DEAD).
    #[error("compressed id {id} is out of range: ids are 0..{vocab} or -1 (DEAD)")]
    IdOutOfRange {
        /// The rejected compressed id.
        id: i64,
        /// Compressed vocabulary size: valid ids are `0..vocab`.
        vocab: u32,
    },
    /// The pad id is outside the vocabulary.
    #[error("pad id {id} is out of range 0..{vocab}")]
    PadOutOfRange {
        /// The rejected pad id.
        id: i64,
        /// Compressed vocabulary size: valid ids are `0..vocab`.
        vocab: u32,
    },
    /// The layer is not one of [`ENGRAM_LAYERS`].
    #[error("layer {0} does not run Engram (layers: 1, 14)")]
    Layer(u32),
}

/// A hashing preset: V4.1's, or the same scheme with another base size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// DeepSeek V4.1 Flash (base 16,000,000).
    V41,
    /// Primes taken above `base - 1`, V4.1's multipliers.
    Base(u64),
}

impl Preset {
    /// The base size: primes are the smallest above `base - 1`.
    pub fn base(self) -> u64 {
        match self {
            Self::V41 => V41_BASE,
            Self::Base(b) => b,
        }
    }

    /// The name recorded in table metadata (`hash_preset`), if any.
    pub fn name(self) -> Option<&'static str> {
        match self {
            Self::V41 => Some("v41"),
            Self::Base(_) => None,
        }
    }

    /// A preset from a base size, checked.
    pub fn from_base(base: u64) -> Result<Self, HashError> {
        if (MIN_BASE..=MAX_BASE).contains(&base) {
            Ok(Self::Base(base))
        } else {
            Err(HashError::Preset(base.to_string()))
        }
    }
}

impl FromStr for Preset {
    type Err = HashError;

    /// `v41`, or a base size (`1000`, `1_000`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.eq_ignore_ascii_case("v41") {
            return Ok(Self::V41);
        }
        let digits: String = s.chars().filter(|c| *c != '_').collect();
        match digits.parse::<u64>() {
            Ok(b) if !digits.is_empty() => Self::from_base(b),
            _ => Err(HashError::Preset(s.to_string())),
        }
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::V41 => f.write_str("v41"),
            Self::Base(b) => write!(f, "base {b}"),
        }
    }
}

/// `h mod p` by multiplication (Barrett, one correction step): a 64-bit
/// division costs tens of cycles and a position needs 48 of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Reducer {
    p: u64,
    /// floor((2^64 - 1) / p); the quotient estimate is short by at most one.
    m: u64,
}

impl Reducer {
    const fn new(p: u64) -> Self {
        Self { p, m: u64::MAX / p }
    }

    #[inline(always)]
    fn reduce(self, h: u64) -> u64 {
        let q = ((u128::from(h) * u128::from(self.m)) >> 64) as u64;
        let r = h.wrapping_sub(q.wrapping_mul(self.p));
        if r >= self.p { r - self.p } else { r }
    }
}

/// One Engram layer's hashing constants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerHashing {
    /// Model layer.
    pub layer: u32,
    /// Multipliers for look-back positions 0..=3 (odd, below 2^47).
    pub multipliers: [u64; MAX_NGRAM],
    /// Table size of each column, col = (n - 2) * HEADS + head.
    pub primes: [u64; COLUMNS],
    /// Exclusive prefix sum of `primes`: where each column starts in the table.
    pub offsets: [u64; COLUMNS],
    /// Rows of the layer's table: the sum of `primes`.
    pub rows: u64,
    reducers: [Reducer; COLUMNS],
}

/// The hashing constants of both Engram layers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HashParams {
    /// The preset they come from.
    pub preset: Preset,
    /// Layers 1 and 14, in that order.
    pub layers: [LayerHashing; 2],
    /// Compressed ids are below this.
    pub vocab: u32,
}

/// True when `n` is prime (deterministic Miller-Rabin for all u64).
pub fn is_prime(n: u64) -> bool {
    if n < 2 {
        return false;
    }
    for p in [2u64, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37] {
        if n.is_multiple_of(p) {
            return n == p;
        }
    }
    let mul = |a: u64, b: u64| (u128::from(a) * u128::from(b) % u128::from(n)) as u64;
    let pow = |mut b: u64, mut e: u64| {
        let mut r = 1u64;
        while e > 0 {
            if e & 1 == 1 {
                r = mul(r, b);
            }
            b = mul(b, b);
            e >>= 1;
        }
        r
    };
    let s = (n - 1).trailing_zeros();
    let d = (n - 1) >> s;
    'witness: for a in [2u64, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37] {
        let mut x = pow(a, d);
        if x == 1 || x == n - 1 {
            continue;
        }
        for _ in 1..s {
            x = mul(x, x);
            if x == n - 1 {
                continue 'witness;
            }
        }
        return false;
    }
    true
}

/// The smallest prime above `start` that is not in `used`.
fn next_unused_prime(start: u64, used: &HashSet<u64>) -> u64 {
    let mut c = start + 1;
    while !is_prime(c) || used.contains(&c) {
        c += 1;
    }
    c
}

impl HashParams {
    /// V4.1 Flash's constants.
    pub fn v41() -> Self {
        Self::build(Preset::V41)
    }

    /// The constants of a preset. Primes are searched as V4.1 does: layer by
    /// layer, order by order, head by head; each order restarts at
    /// `base - 1` and each head continues after the previous head's prime,
    /// skipping primes already used.
    pub fn new(preset: Preset) -> Result<Self, HashError> {
        let base = preset.base();
        if !(MIN_BASE..=MAX_BASE).contains(&base) {
            return Err(HashError::Preset(base.to_string()));
        }
        Ok(Self::build(preset))
    }

    fn build(preset: Preset) -> Self {
        let base = preset.base();
        let mut used = HashSet::new();
        let layers = [0usize, 1].map(|li| {
            let mut primes = [0u64; COLUMNS];
            for n in 0..MAX_NGRAM - 1 {
                let mut start = base - 1;
                for head in 0..HEADS {
                    let p = next_unused_prime(start, &used);
                    used.insert(p);
                    primes[n * HEADS + head] = p;
                    start = p;
                }
            }
            let mut offsets = [0u64; COLUMNS];
            let mut sum = 0u64;
            for (o, p) in offsets.iter_mut().zip(primes) {
                *o = sum;
                sum += p;
            }
            LayerHashing {
                layer: ENGRAM_LAYERS[li],
                multipliers: V41_MULTIPLIERS[li],
                primes,
                offsets,
                rows: sum,
                reducers: primes.map(Reducer::new),
            }
        });
        Self {
            preset,
            layers,
            vocab: V41_COMPRESSED_VOCAB,
        }
    }

    /// The constants of one layer (1 or 14).
    pub fn layer(&self, layer: u32) -> Result<&LayerHashing, HashError> {
        self.layers
            .iter()
            .find(|l| l.layer == layer)
            .ok_or(HashError::Layer(layer))
    }

    /// Check a compressed id: DEAD or in `0..vocab`.
    pub fn check_id(&self, id: i64) -> Result<i32, HashError> {
        if id == i64::from(DEAD) || (0..i64::from(self.vocab)).contains(&id) {
            Ok(id as i32)
        } else {
            Err(HashError::IdOutOfRange {
                id,
                vocab: self.vocab,
            })
        }
    }
}

/// Row ids of one position: 24 per layer, layers 1 and 14, offsets included.
pub type PositionRows = [[u64; COLUMNS]; 2];

/// A look-back slot that is before the start of the sequence.
const BEFORE_START: i64 = -2;

/// Hashes one sequence, a token at a time (prefill is a loop of `push`).
#[derive(Debug, Clone)]
pub struct SequenceHasher<'a> {
    params: &'a HashParams,
    pad: u64,
    /// Compressed ids of the last three tokens, most recent first; DEAD or
    /// BEFORE_START where there is none.
    history: [i64; MAX_NGRAM - 1],
}

impl<'a> SequenceHasher<'a> {
    /// A new sequence; `pad` is the compressed id of the pad token.
    pub fn new(params: &'a HashParams, pad: i64) -> Result<Self, HashError> {
        if !(0..i64::from(params.vocab)).contains(&pad) {
            return Err(HashError::PadOutOfRange {
                id: pad,
                vocab: params.vocab,
            });
        }
        Ok(Self {
            params,
            pad: pad as u64,
            history: [BEFORE_START; MAX_NGRAM - 1],
        })
    }

    /// Start over (a new sequence with the same parameters and pad).
    pub fn reset(&mut self) {
        self.history = [BEFORE_START; MAX_NGRAM - 1];
    }

    /// Hash the next token. Writes its rows and returns `Ok(true)`, or
    /// returns `Ok(false)` (rows untouched) when the token is DEAD: its gate
    /// is 0 and its rows are not needed. An out-of-range id is an error and
    /// leaves the state unchanged.
    pub fn push(&mut self, id: i64, out: &mut PositionRows) -> Result<bool, HashError> {
        let id = self.params.check_id(id)?;
        let prev = self.history;
        self.history = [i64::from(id), prev[0], prev[1]];
        if id == DEAD {
            return Ok(false);
        }
        // Shift k is blocked when there is no token k back or any of the
        // tokens 1..=k back is DEAD; once blocked, every larger shift is too.
        let mut x = [id as u64, self.pad, self.pad, self.pad];
        for (k, &h) in prev.iter().enumerate() {
            if h < 0 {
                break;
            }
            x[k + 1] = h as u64;
        }
        for (layer, rows) in self.params.layers.iter().zip(out.iter_mut()) {
            hash_layer(layer, &x, rows);
        }
        Ok(true)
    }
}

/// The 24 row ids of one layer for look-back ids `x` (ids below the
/// vocabulary, so every product stays below 2^63 and the mix is non-negative).
#[inline(always)]
fn hash_layer(layer: &LayerHashing, x: &[u64; MAX_NGRAM], rows: &mut [u64; COLUMNS]) {
    let m = &layer.multipliers;
    let mut mix = x[0].wrapping_mul(m[0]);
    for n in 0..MAX_NGRAM - 1 {
        mix ^= x[n + 1].wrapping_mul(m[n + 1]);
        for head in 0..HEADS {
            let col = n * HEADS + head;
            rows[col] = layer.reducers[col].reduce(mix) + layer.offsets[col];
        }
    }
}

/// Hash a whole sequence: one entry per position, `None` for DEAD tokens.
pub fn hash_sequence(
    params: &HashParams,
    pad: i64,
    ids: &[i64],
) -> Result<Vec<Option<PositionRows>>, HashError> {
    let mut h = SequenceHasher::new(params, pad)?;
    let mut out = Vec::with_capacity(ids.len());
    for &id in ids {
        let mut rows = [[0u64; COLUMNS]; 2];
        out.push(h.push(id, &mut rows)?.then_some(rows));
    }
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)] // positions index several arrays at once
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn v41_primes_and_table_sizes_match_the_model() {
        let p = HashParams::v41();
        assert_eq!(p.layers[0].layer, 1);
        assert_eq!(p.layers[1].layer, 14);
        assert_eq!(p.layers[0].rows, 384_006_168);
        assert_eq!(p.layers[1].rows, 384_016_682);
        assert_eq!(p.layers[0].primes[0], 16_000_057);
        assert_eq!(p.layers[0].primes[COLUMNS - 1], 16_000_463);
        assert_eq!(p.layers[1].primes[0], 16_000_477);
        assert_eq!(p.layers[1].primes[COLUMNS - 1], 16_000_889);
        for l in &p.layers {
            assert!(l.primes.windows(2).all(|w| w[0] < w[1]));
            assert!(l.primes.iter().all(|&q| is_prime(q)));
            assert_eq!(l.offsets[0], 0);
            assert_eq!(l.offsets[23] + l.primes[23], l.rows);
            for m in l.multipliers {
                assert_eq!(m % 2, 1, "multipliers are odd");
                // bound = (INT64_MAX // 99092) // 2; m = 2r + 1 with r < bound.
                assert!(m < 2 * ((i64::MAX as u64 / 99_092) / 2));
                assert!(u128::from(m) * u128::from(V41_COMPRESSED_VOCAB - 1) < 1u128 << 63);
            }
        }
        // No prime is used twice across the two layers.
        let all: HashSet<u64> = p.layers.iter().flat_map(|l| l.primes).collect();
        assert_eq!(all.len(), 2 * COLUMNS);
        assert_eq!(
            HashParams::new(Preset::Base(V41_BASE)).unwrap().layers,
            p.layers
        );
    }

    #[test]
    fn small_presets_take_primes_above_base_minus_one() {
        let p = HashParams::new(Preset::Base(1000)).unwrap();
        // Primes from 1000 on: 1009 1013 1019 1021 1031 1033 1039 1049 ...
        assert_eq!(&p.layers[0].primes[..4], &[1009, 1013, 1019, 1021]);
        let want: Vec<u64> = (1000..).filter(|&n| is_prime(n)).take(48).collect();
        let got: Vec<u64> = p.layers.iter().flat_map(|l| l.primes).collect();
        assert_eq!(got, want);
        // A prime base is itself the first prime (above base - 1).
        assert_eq!(
            HashParams::new(Preset::Base(1009)).unwrap().layers[0].primes[0],
            1009
        );
        assert!(HashParams::new(Preset::Base(1)).is_err());
        assert!(HashParams::new(Preset::Base(MAX_BASE + 1)).is_err());
    }

    #[test]
    fn presets_parse() {
        assert_eq!("v41".parse(), Ok(Preset::V41));
        assert_eq!("1_000".parse(), Ok(Preset::Base(1000)));
        assert!("".parse::<Preset>().is_err());
        assert!("v4".parse::<Preset>().is_err());
        assert!("0".parse::<Preset>().is_err());
        assert!("-5".parse::<Preset>().is_err());
    }

    #[test]
    fn primality_matches_trial_division() {
        let slow = |n: u64| {
            n >= 2
                && (2..)
                    .take_while(|d| d * d <= n)
                    .all(|d| !n.is_multiple_of(d))
        };
        for n in 0..20_000 {
            assert_eq!(is_prime(n), slow(n), "{n}");
        }
        assert!(is_prime(18_446_744_073_709_551_557)); // largest u64 prime
        assert!(!is_prime(3_215_031_751)); // strong pseudoprime to 2, 3, 5, 7
    }

    /// The hash written straight from the spec, with `%` and signed i64.
    fn reference(params: &HashParams, pad: i64, ids: &[i64], t: usize) -> Option<PositionRows> {
        if ids[t] == -1 {
            return None;
        }
        let mut x = [ids[t], pad, pad, pad];
        let mut blocked = false;
        for k in 1..4 {
            blocked = blocked || t < k || ids[t - k] == -1;
            if !blocked {
                x[k] = ids[t - k];
            }
        }
        let mut out = [[0u64; COLUMNS]; 2];
        for (l, o) in params.layers.iter().zip(out.iter_mut()) {
            let m = l.multipliers.map(|m| m as i64);
            let mut h = x[0] * m[0];
            for n in 2..=4 {
                h ^= x[n - 1] * m[n - 1];
                for head in 0..HEADS {
                    let col = (n - 2) * HEADS + head;
                    o[col] = (h % l.primes[col] as i64) as u64 + l.offsets[col];
                }
            }
        }
        Some(out)
    }

    #[test]
    fn start_of_sequence_and_dead_tokens_use_the_pad() {
        let p = HashParams::new(Preset::Base(1000)).unwrap();
        let ids = [5, 6, 7, 8, -1, 9, 10, -1, -1, 11, 12, 13, 14];
        let got = hash_sequence(&p, 2, &ids).unwrap();
        for t in 0..ids.len() {
            assert_eq!(got[t], reference(&p, 2, &ids, t), "position {t}");
        }
        // Position 0 is (5, pad, pad, pad); position 5 follows a DEAD token,
        // so it hashes like position 0 of a sequence starting with 9.
        let fresh = hash_sequence(&p, 2, &[9, 10]).unwrap();
        assert_eq!(got[5], fresh[0]);
        assert_eq!(got[6], fresh[1]);
        assert_eq!(got[4], None);
        // The 2-gram of position 1 sees token 5, so it differs from a start.
        assert_ne!(got[1], hash_sequence(&p, 2, &[6]).unwrap()[0]);
        // Every row lands inside its own column.
        for rows in got.iter().flatten() {
            for (l, r) in p.layers.iter().zip(rows) {
                for c in 0..COLUMNS {
                    assert!(r[c] >= l.offsets[c] && r[c] < l.offsets[c] + l.primes[c]);
                }
            }
        }
    }

    #[test]
    fn bad_ids_are_errors_and_leave_the_state_alone() {
        let p = HashParams::v41();
        let mut h = SequenceHasher::new(&p, 2).unwrap();
        let mut rows = [[0; COLUMNS]; 2];
        assert!(h.push(99_091, &mut rows).unwrap());
        let before = h.history;
        for bad in [99_092, -2, i64::MAX, i64::MIN] {
            assert!(matches!(
                h.push(bad, &mut rows),
                Err(HashError::IdOutOfRange { .. })
            ));
        }
        assert_eq!(h.history, before);
        assert!(SequenceHasher::new(&p, -1).is_err());
        assert!(SequenceHasher::new(&p, 99_092).is_err());
        assert_eq!(p.layer(7), Err(HashError::Layer(7)));
    }

    proptest! {
        #[test]
        fn barrett_reduction_matches_remainder(h in 0u64..(1 << 63), p in 2u64..(1 << 40)) {
            prop_assert_eq!(Reducer::new(p).reduce(h), h % p);
        }

        #[test]
        fn hashing_matches_the_reference(
            ids in proptest::collection::vec(prop_oneof![Just(-1i64), 0i64..99_092], 0..40),
            pad in 0i64..99_092,
        ) {
            let p = HashParams::v41();
            let got = hash_sequence(&p, pad, &ids).unwrap();
            for t in 0..ids.len() {
                prop_assert_eq!(got[t], reference(&p, pad, &ids, t));
            }
        }

        #[test]
        fn prefill_then_decode_equals_one_prefill(
            ids in proptest::collection::vec(prop_oneof![1 => Just(-1i64), 8 => 0i64..99_092], 1..64),
            split in 0usize..64,
        ) {
            let p = HashParams::v41();
            let whole = hash_sequence(&p, 2, &ids).unwrap();
            let split = split.min(ids.len());
            let mut h = SequenceHasher::new(&p, 2).unwrap();
            let mut got = Vec::new();
            // Prefill the first part as a batch, then decode one token at a time
            // from a clone of the state (as a server that forks a sequence would).
            for &id in &ids[..split] {
                let mut r = [[0; COLUMNS]; 2];
                got.push(h.push(id, &mut r).unwrap().then_some(r));
            }
            let mut h = h.clone();
            for &id in &ids[split..] {
                let mut r = [[0; COLUMNS]; 2];
                got.push(h.push(id, &mut r).unwrap().then_some(r));
            }
            prop_assert_eq!(got, whole);
        }
    }
}
