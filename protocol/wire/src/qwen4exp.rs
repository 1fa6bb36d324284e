//! Qwen4Exp's n-gram table addressing (Qwen3.8-Flash-Next's PLE table), as
//! vLLM's `Qwen4ExpNGramEmbedding.compute_ngram_ids` and SGLang's
//! `Qwen4ExpNGramEmbedding._hash_contexts` compute it (docs/models.md).
//!
//! Raw token ids, no compressed vocabulary. Per PLE layer (index `l` among
//! the model's PLE layers) and order `n` (2 to `ngram_size`), one mix of the
//! token and the `n - 1` before it:
//! `mix = t[0]·m[0] ^ t[-1]·m[1] ^ … ^ t[-(n-1)]·m[n-1]` in wrapping
//! signed 64-bit arithmetic, where `m` are the layer's multipliers (odd,
//! from splitmix64 of `seed + 10007·l + γ·(k + 1)`, below
//! `(2^63 - 1) / vocab`). Each of the order's `heads_per_ngram` heads takes
//! `mix` modulo its own prime (Euclidean: never negative) plus its offset
//! in the table: head `h` of layer `l` has the `(l·heads + h + 1)`-th prime
//! above `base - 1`, and the heads lie one after another (orders 2, then
//! 3, …; heads in order within each). An end-of-sequence token starts a
//! new segment: a token before the last EOS (the EOS itself excluded) is
//! replaced by the EOS id, as is one before the sequence's start.

use thiserror::Error;

use crate::hashing::is_prime;

/// Qwen3.8-Flash-Next's raw vocabulary.
pub const QWEN38_VOCAB: u64 = 248_320;
/// Its n-gram table's base size (`ngram_vocab_size_base`).
pub const QWEN38_BASE: u64 = 20_000_000;
/// Orders 2 and 3.
pub const QWEN38_NGRAM_SIZE: usize = 3;
/// Heads per order.
pub const QWEN38_HEADS_PER_NGRAM: usize = 8;
/// The table is padded to a multiple of this many rows.
pub const QWEN38_DIVISIBLE_BY: u64 = 128;
/// The configs' default hash seed.
pub const DEFAULT_SEED: u64 = 1234;

/// Most orders (`ngram_size`) accepted.
pub const MAX_NGRAM_SIZE: usize = 8;
/// Most heads per order accepted.
pub const MAX_HEADS_PER_NGRAM: usize = 64;
/// Largest base size accepted.
pub const MAX_BASE: u64 = 1 << 40;

const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
const M1: u64 = 0xBF58_476D_1CE4_E5B9;
const M2: u64 = 0x94D0_49BB_1331_11EB;
const LAYER_PRIME: u64 = 10_007;

/// Why Qwen4Exp hashing parameters or a token are not accepted.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Qwen4ExpError {
    /// A parameter outside what the scheme supports.
    #[error("{what} is {value}: {why}")]
    Param {
        /// The parameter.
        what: &'static str,
        /// Its value.
        value: u64,
        /// The bound it breaks.
        why: &'static str,
    },
    /// A token id outside the vocabulary.
    #[error("token id {id} is out of range: ids are 0..{vocab}")]
    Token {
        /// The rejected id.
        id: i64,
        /// The vocabulary size.
        vocab: u64,
    },
}

/// What a Qwen4Exp config says about one PLE layer's n-gram table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Qwen4ExpConfig {
    /// `ngram_size`: orders 2 to this.
    pub ngram_size: usize,
    /// `heads_per_ngram`.
    pub heads_per_ngram: usize,
    /// `vocab_size` (raw ids are below it).
    pub vocab: u64,
    /// `ngram_vocab_size_base`.
    pub base: u64,
    /// `seed`.
    pub seed: u64,
    /// `eos_token_id`: it starts a new segment.
    pub eos: u64,
    /// `make_ngram_vocab_size_divisible_by`.
    pub divisible_by: u64,
    /// This PLE layer's index among the model's PLE layers (0 for the
    /// first).
    pub layer_index: u64,
}

impl Qwen4ExpConfig {
    /// Qwen3.8-Flash-Next's table with end-of-sequence id `eos` (from its
    /// `config.json`).
    pub fn qwen38_flash_next(eos: u64) -> Self {
        Self {
            ngram_size: QWEN38_NGRAM_SIZE,
            heads_per_ngram: QWEN38_HEADS_PER_NGRAM,
            vocab: QWEN38_VOCAB,
            base: QWEN38_BASE,
            seed: DEFAULT_SEED,
            eos,
            divisible_by: QWEN38_DIVISIBLE_BY,
            layer_index: 0,
        }
    }
}

/// A PLE layer's hashing constants, derived from its config and checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Qwen4ExpHashing {
    /// The config they come from.
    pub config: Qwen4ExpConfig,
    /// One multiplier per position in the window (`ngram_size` of them).
    pub multipliers: Vec<i64>,
    /// Each head's prime (rows of its part of the table).
    pub sizes: Vec<u64>,
    /// Each head's first row.
    pub offsets: Vec<u64>,
    /// Rows the heads address (`sum(sizes)`).
    pub rows: u64,
    /// Rows of the table as stored: `rows` rounded up to `divisible_by`.
    pub padded_rows: u64,
}

/// splitmix64's output function of `x` (its state advanced by γ first).
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(GAMMA);
    z = (z ^ (z >> 30)).wrapping_mul(M1);
    z = (z ^ (z >> 27)).wrapping_mul(M2);
    z ^ (z >> 31)
}

fn param(what: &'static str, value: u64, why: &'static str) -> Qwen4ExpError {
    Qwen4ExpError::Param { what, value, why }
}

impl Qwen4ExpHashing {
    /// The constants of `config`, or which parameter is out of bounds.
    pub fn new(config: Qwen4ExpConfig) -> Result<Self, Qwen4ExpError> {
        let c = config;
        if !(2..=MAX_NGRAM_SIZE).contains(&c.ngram_size) {
            return Err(param("ngram_size", c.ngram_size as u64, "2 to 8"));
        }
        if !(1..=MAX_HEADS_PER_NGRAM).contains(&c.heads_per_ngram) {
            return Err(param(
                "heads_per_ngram",
                c.heads_per_ngram as u64,
                "1 to 64",
            ));
        }
        if c.vocab == 0 || c.vocab > 1 << 32 {
            return Err(param("vocab_size", c.vocab, "1 to 2^32"));
        }
        if !(2..=MAX_BASE).contains(&c.base) {
            return Err(param("ngram_vocab_size_base", c.base, "2 to 2^40"));
        }
        if c.eos >= c.vocab {
            return Err(param("eos_token_id", c.eos, "below vocab_size"));
        }
        if !(1..=1 << 20).contains(&c.divisible_by) {
            return Err(param(
                "make_ngram_vocab_size_divisible_by",
                c.divisible_by,
                "1 to 2^20",
            ));
        }
        if c.layer_index > 1024 {
            return Err(param("the PLE layer index", c.layer_index, "0 to 1024"));
        }
        let half_bound = (((1u64 << 63) - 1) / c.vocab / 2).max(1);
        let base_seed = c.seed.wrapping_add(LAYER_PRIME.wrapping_mul(c.layer_index));
        let multipliers = (0..c.ngram_size as u64)
            .map(|k| {
                let x = base_seed.wrapping_add(GAMMA.wrapping_mul(k + 1));
                (2 * (splitmix64(x) % half_bound) + 1) as i64
            })
            .collect();
        let heads = (c.ngram_size - 1) * c.heads_per_ngram;
        // Head h of layer l: the (l·heads + h + 1)-th prime above base - 1.
        let skip = c.layer_index * heads as u64;
        let mut p = c.base - 1;
        let mut next = || {
            p += 1;
            while !is_prime(p) {
                p += 1;
            }
            p
        };
        for _ in 0..skip {
            next();
        }
        let sizes: Vec<u64> = (0..heads).map(|_| next()).collect();
        let offsets = sizes
            .iter()
            .scan(0u64, |at, &s| {
                let o = *at;
                *at += s;
                Some(o)
            })
            .collect();
        let rows: u64 = sizes.iter().sum();
        let padded_rows = rows.div_ceil(c.divisible_by) * c.divisible_by;
        Ok(Self {
            config,
            multipliers,
            sizes,
            offsets,
            rows,
            padded_rows,
        })
    }

    /// Rows per token (heads over every order).
    pub fn heads(&self) -> usize {
        self.sizes.len()
    }

    /// The rows of `tokens` (one chunk of a sequence) after `context` (the
    /// sequence's tokens before the chunk; the last `ngram_size - 1` are
    /// enough): `heads()` row ids per token, token by token. Tokens must be
    /// below the vocabulary.
    pub fn ids(&self, context: &[i64], tokens: &[i64]) -> Result<Vec<u64>, Qwen4ExpError> {
        let c = &self.config;
        for &t in context.iter().chain(tokens) {
            if t < 0 || t as u64 >= c.vocab {
                return Err(Qwen4ExpError::Token {
                    id: t,
                    vocab: c.vocab,
                });
            }
        }
        let eos = c.eos as i64;
        let n = c.ngram_size;
        // The window that matters: the last n - 1 tokens of the context.
        let ctx = &context[context.len().saturating_sub(n - 1)..];
        let all: Vec<i64> = ctx.iter().chain(tokens).copied().collect();
        let mut out = Vec::with_capacity(tokens.len() * self.heads());
        let mut window = vec![eos; n];
        for p in ctx.len()..all.len() {
            // window[s]: the token s before p within p's segment, else EOS.
            window[0] = all[p];
            let mut live = true;
            for s in 1..n {
                live = live && p >= s && all[p - s] != eos;
                window[s] = if live { all[p - s] } else { eos };
            }
            for order in 2..=n {
                let mix =
                    (0..order).fold(0i64, |m, k| m ^ window[k].wrapping_mul(self.multipliers[k]));
                let first = (order - 2) * c.heads_per_ngram;
                for h in first..first + c.heads_per_ngram {
                    let r = mix.rem_euclid(self.sizes[h] as i64) as u64;
                    out.push(r + self.offsets[h]);
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen38() -> Qwen4ExpHashing {
        Qwen4ExpHashing::new(Qwen4ExpConfig::qwen38_flash_next(248_044)).expect("params")
    }

    #[test]
    fn qwen38s_table_is_sixteen_primes_above_twenty_million() {
        let h = qwen38();
        assert_eq!(h.heads(), 16);
        assert_eq!(h.rows, 320_001_446);
        assert_eq!(h.padded_rows, 320_001_536);
        assert!(h.sizes.iter().all(|&p| p >= QWEN38_BASE && is_prime(p)));
        assert!(h.sizes.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(h.offsets[0], 0);
        assert_eq!(h.offsets[15] + h.sizes[15], h.rows);
        assert!(h.multipliers.iter().all(|&m| m > 0 && m % 2 == 1));
        let bound = ((1u64 << 63) - 1) / QWEN38_VOCAB;
        assert!(h.multipliers.iter().all(|&m| (m as u64) < bound));
    }

    #[test]
    fn splitmix64_is_the_reference_generator() {
        // splitmix64's first outputs from state 0 (its published values).
        let mut s = 0u64;
        let mut next = || {
            let v = splitmix64(s);
            s = s.wrapping_add(GAMMA);
            v
        };
        assert_eq!(next(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(next(), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(next(), 0x06C4_5D18_8009_454F);
    }

    #[test]
    fn an_eos_starts_a_new_segment_and_a_chunk_equals_the_whole() {
        let h = qwen38();
        let eos = 248_044;
        let seq = [11, 22, 33, eos, 44, 55, 66, 77];
        let whole = h.ids(&[], &seq).expect("ids");
        assert_eq!(whole.len(), seq.len() * 16);
        // In chunks, with the context before each: the same rows.
        for cut in 0..seq.len() {
            let (a, b) = seq.split_at(cut);
            let mut chunked = h.ids(&[], a).expect("a");
            chunked.extend(h.ids(a, b).expect("b"));
            assert_eq!(chunked, whole, "cut at {cut}");
        }
        // The token after an EOS hashes as a sequence's first token does.
        let first = h.ids(&[], &[44]).expect("first");
        assert_eq!(&whole[4 * 16..5 * 16], &first[..]);
        // And the one after it, as a sequence's second.
        let second = h.ids(&[44], &[55]).expect("second");
        assert_eq!(&whole[5 * 16..6 * 16], &second[..]);
        // Before any EOS the window is the tokens themselves.
        assert_ne!(h.ids(&[], &[22]).expect("x"), whole[16..32].to_vec());
        assert!(whole.iter().all(|&r| r < h.rows));
    }

    #[test]
    fn bad_tokens_and_parameters_are_refused() {
        let h = qwen38();
        assert!(matches!(
            h.ids(&[], &[QWEN38_VOCAB as i64]),
            Err(Qwen4ExpError::Token { .. })
        ));
        assert!(matches!(
            h.ids(&[-1], &[3]),
            Err(Qwen4ExpError::Token { .. })
        ));
        let ok = Qwen4ExpConfig::qwen38_flash_next(5);
        for bad in [
            Qwen4ExpConfig {
                ngram_size: 1,
                ..ok
            },
            Qwen4ExpConfig {
                ngram_size: 9,
                ..ok
            },
            Qwen4ExpConfig {
                heads_per_ngram: 0,
                ..ok
            },
            Qwen4ExpConfig { vocab: 0, ..ok },
            Qwen4ExpConfig { base: 1, ..ok },
            Qwen4ExpConfig {
                base: MAX_BASE + 1,
                ..ok
            },
            Qwen4ExpConfig {
                eos: QWEN38_VOCAB,
                ..ok
            },
            Qwen4ExpConfig {
                divisible_by: 0,
                ..ok
            },
            Qwen4ExpConfig {
                layer_index: 1025,
                ..ok
            },
        ] {
            assert!(Qwen4ExpHashing::new(bad).is_err(), "{bad:?}");
        }
        // A second PLE layer's heads continue the primes.
        let l1 = Qwen4ExpHashing::new(Qwen4ExpConfig {
            layer_index: 1,
            ..ok
        })
        .expect("l1");
        assert!(l1.sizes[0] > qwen38().sizes[15]);
    }
}
