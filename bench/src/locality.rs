//! What a token stream does to the rack's rows: how often a row is asked
//! for again, what an LRU cache or a static hot set of a given size would
//! serve, how much a serving batch saves by asking each distinct row once,
//! and how many SSD pages a token touches. Pure computation over the row
//! ids V4.1's hashing gives (`engram-bench locality` feeds it a real text
//! through the real tokenizer; no table is read).

use std::collections::HashMap;

use engram_protocol::etab::ROWS_PER_PAGE;
use engram_protocol::hashing::{COLUMNS, HEADS, HashParams, SequenceHasher};
use serde::Serialize;

/// Row requests of one position: layer 1's 24, then layer 14's.
pub const PER_POSITION: usize = 2 * COLUMNS;

/// A row of either table as one key: the table's index above bit 40
/// (rows are below 2^40).
fn key(layer: usize, row: u64) -> u64 {
    ((layer as u64) << 40) | row
}

/// The 48 row keys of every position of `seq` (compressed ids), hashed as
/// one sequence from its start with `pad`.
pub fn requests(params: &HashParams, pad: i64, seq: &[u32]) -> Vec<[u64; PER_POSITION]> {
    let Ok(mut h) = SequenceHasher::new(params, pad) else {
        return Vec::new();
    };
    let mut out = Vec::with_capacity(seq.len());
    for &id in seq {
        let mut rows = [[0u64; COLUMNS]; 2];
        if let Ok(true) = h.push(i64::from(id), &mut rows) {
            let mut k = [0u64; PER_POSITION];
            for (l, layer) in rows.iter().enumerate() {
                for (c, &r) in layer.iter().enumerate() {
                    k[l * COLUMNS + c] = key(l, r);
                }
            }
            out.push(k);
        }
    }
    out
}

/// How often a row asked for was asked for before (anywhere earlier).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Repeats {
    /// All requests.
    pub all: f64,
    /// Requests of the n-gram orders 2, 3 and 4 (each 8 heads x 2 tables).
    pub by_order: [f64; 3],
}

/// The share of requests an LRU cache of `rows` rows would have served.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CacheHits {
    /// Capacity in rows (264 bytes each).
    pub rows: usize,
    /// Share of requests served.
    pub hit_rate: f64,
}

/// Requests served by a batch of `sequences` asking each distinct row once.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct BatchDedup {
    /// Sequences decoding together.
    pub sequences: usize,
    /// Distinct rows per step over rows asked (1: nothing shared).
    pub distinct: f64,
    /// Distinct rows a step fetches, on average (both tables).
    pub rows_per_step: f64,
}

/// The SSD copy's pages (15 rows to 4 KiB) a token reads.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Pages {
    /// Distinct pages per token (both tables).
    pub per_token: f64,
    /// Share of page reads of a page read earlier in the text.
    pub repeat: f64,
    /// Distinct pages over the whole text.
    pub distinct: usize,
}

/// The whole report.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Locality {
    /// Positions (tokens).
    pub tokens: usize,
    /// Row requests (48 a token).
    pub requests: usize,
    /// Distinct rows asked for.
    pub distinct_rows: usize,
    /// Repeat rates.
    pub repeats: Repeats,
    /// An LRU cache of each size.
    pub lru: Vec<CacheHits>,
    /// A static set of the most requested rows of each size (an ideal one:
    /// chosen knowing the whole text).
    pub hot_set: Vec<CacheHits>,
    /// Deduplication within batches.
    pub batches: Vec<BatchDedup>,
    /// SSD pages.
    pub pages: Pages,
}

/// Share `n / d` (0 when `d` is 0).
fn share(n: usize, d: usize) -> f64 {
    if d == 0 { 0.0 } else { n as f64 / d as f64 }
}

/// Repeat rates of `reqs`.
pub fn repeats(reqs: &[[u64; PER_POSITION]]) -> Repeats {
    let mut seen = std::collections::HashSet::new();
    let mut hits = [0usize; 3];
    for p in reqs {
        for (i, &k) in p.iter().enumerate() {
            if !seen.insert(k) {
                hits[(i % COLUMNS) / HEADS] += 1;
            }
        }
    }
    let per_order = reqs.len() * 2 * HEADS;
    Repeats {
        all: share(hits.iter().sum(), reqs.len() * PER_POSITION),
        by_order: hits.map(|h| share(h, per_order)),
    }
}

/// LRU hit rates at each capacity, from every request's stack distance
/// (distinct rows asked since its previous request) in one pass: a
/// request hits an LRU of `c` rows when that distance is below `c`.
pub fn lru(reqs: &[[u64; PER_POSITION]], sizes: &[usize]) -> Vec<CacheHits> {
    let n = reqs.len() * PER_POSITION;
    // Fenwick tree over time: 1 where a request is its row's latest.
    let mut tree = vec![0u32; n + 1];
    let add = |tree: &mut [u32], mut i: usize, v: i32| {
        i += 1;
        while i < tree.len() {
            tree[i] = tree[i].wrapping_add_signed(v);
            i += i & i.wrapping_neg();
        }
    };
    let sum = |tree: &[u32], mut i: usize| {
        let mut s = 0u64;
        while i > 0 {
            s += u64::from(tree[i]);
            i &= i - 1;
        }
        s
    };
    let mut last: HashMap<u64, usize> = HashMap::new();
    let mut distances = Vec::new();
    for (t, &k) in reqs.iter().flatten().enumerate() {
        if let Some(t0) = last.insert(k, t) {
            distances.push(sum(&tree, t) - sum(&tree, t0 + 1));
            add(&mut tree, t0, -1);
        }
        add(&mut tree, t, 1);
    }
    sizes
        .iter()
        .map(|&c| CacheHits {
            rows: c,
            hit_rate: share(distances.iter().filter(|&&d| d < c as u64).count(), n),
        })
        .collect()
}

/// The share of requests the `c` most requested rows take, per size.
pub fn hot_set(reqs: &[[u64; PER_POSITION]], sizes: &[usize]) -> (usize, Vec<CacheHits>) {
    let mut counts: HashMap<u64, usize> = HashMap::new();
    for &k in reqs.iter().flatten() {
        *counts.entry(k).or_default() += 1;
    }
    let mut by: Vec<usize> = counts.into_values().collect();
    by.sort_unstable_by(|a, b| b.cmp(a));
    let total = reqs.len() * PER_POSITION;
    let hits = sizes
        .iter()
        .map(|&c| CacheHits {
            rows: c,
            hit_rate: share(by.iter().take(c).sum(), total),
        })
        .collect();
    (by.len(), hits)
}

/// Batches of `sequences` sequences: `ids` cut into that many equal
/// sequences (each hashed from its own start) decoding in step.
pub fn batch(params: &HashParams, pad: i64, ids: &[u32], sequences: usize) -> BatchDedup {
    let len = ids.len() / sequences.max(1);
    let seqs: Vec<_> = ids
        .chunks(len.max(1))
        .take(sequences)
        .map(|s| requests(params, pad, s))
        .collect();
    let steps = seqs.iter().map(Vec::len).min().unwrap_or(0);
    let mut step_keys = std::collections::HashSet::new();
    let (mut distinct, mut asked) = (0usize, 0usize);
    for t in 0..steps {
        step_keys.clear();
        for s in &seqs {
            step_keys.extend(s[t]);
        }
        distinct += step_keys.len();
        asked += seqs.len() * PER_POSITION;
    }
    BatchDedup {
        sequences: seqs.len(),
        distinct: share(distinct, asked),
        rows_per_step: share(distinct, steps),
    }
}

/// The SSD pages of `reqs`: per token, and repeats over the text.
pub fn pages(reqs: &[[u64; PER_POSITION]]) -> Pages {
    let mut seen = std::collections::HashSet::new();
    let mut token = std::collections::HashSet::new();
    let (mut reads, mut again) = (0usize, 0usize);
    for p in reqs {
        token.clear();
        // A row's page: its table's bit kept, its row / 15.
        token.extend(
            p.iter()
                .map(|&k| (k >> 40 << 40) | ((k & ((1 << 40) - 1)) / ROWS_PER_PAGE)),
        );
        reads += token.len();
        again += token.iter().filter(|&&pg| !seen.insert(pg)).count();
    }
    Pages {
        per_token: share(reads, reqs.len()),
        repeat: share(again, reads),
        distinct: seen.len(),
    }
}

/// The report for `ids` (compressed ids of one text, one sequence), with
/// caches of `sizes` rows and batches of `batches` sequences.
pub fn report(
    params: &HashParams,
    pad: i64,
    ids: &[u32],
    sizes: &[usize],
    batches: &[usize],
) -> Locality {
    let reqs = requests(params, pad, ids);
    let (distinct_rows, hot) = hot_set(&reqs, sizes);
    Locality {
        tokens: reqs.len(),
        requests: reqs.len() * PER_POSITION,
        distinct_rows,
        repeats: repeats(&reqs),
        lru: lru(&reqs, sizes),
        hot_set: hot,
        batches: batches
            .iter()
            .map(|&s| batch(params, pad, ids, s))
            .collect(),
        pages: pages(&reqs),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engram_protocol::hashing::Preset;

    /// V4.1's: columns of 16 million rows, so distinct n-grams almost
    /// never share a row.
    fn params() -> HashParams {
        HashParams::new(Preset::V41).expect("params")
    }

    #[test]
    fn a_text_said_twice_repeats_every_row_the_second_time() {
        let p = params();
        let once: Vec<u32> = (0..500).map(|i| (i * 7919 % 9973) as u32).collect();
        let mut twice = once.clone();
        twice.extend(&once);
        let r = report(&p, 2, &twice, &[1, 100_000], &[1, 2]);
        assert_eq!(r.tokens, 1000);
        // The second pass repeats all but its first three positions' look-backs.
        assert!(
            r.repeats.all > 0.49 && r.repeats.all <= 0.5,
            "{:?}",
            r.repeats
        );
        // An LRU that holds the whole first pass serves every repeat; one row, nothing.
        assert_eq!(r.lru[0].hit_rate, 0.0);
        assert!(
            (r.lru[1].hit_rate - r.repeats.all).abs() < 1e-12,
            "{:?}",
            r.lru
        );
        // Two sequences that are the same text share every row at every step.
        assert_eq!(r.batches[0].distinct, 1.0);
        assert_eq!(r.batches[1].distinct, 0.5);
        assert_eq!(r.batches[1].rows_per_step, 48.0);
        assert_eq!(r.pages.per_token, 48.0);
        assert!(r.pages.repeat >= r.repeats.all);
    }

    #[test]
    fn lru_stack_distances_match_a_simulated_lru() {
        // Every 48-row position is one of 40 (a small id alphabet), so rows recur.
        let p = params();
        let ids: Vec<u32> = (0..3000u64)
            .map(|i| ((i * i + 3 * i) % 40) as u32)
            .collect();
        let reqs = requests(&p, 2, &ids);
        let sizes = [48, 500, 2000, 5000];
        let fast = lru(&reqs, &sizes);
        for (c, got) in sizes.iter().zip(&fast) {
            let mut order: Vec<u64> = Vec::new();
            let mut hits = 0usize;
            for &k in reqs.iter().flatten() {
                if let Some(i) = order.iter().position(|&x| x == k) {
                    hits += 1;
                    order.remove(i);
                } else if order.len() == *c {
                    order.remove(0);
                }
                order.push(k);
            }
            assert_eq!(
                got.hit_rate,
                share(hits, reqs.len() * PER_POSITION),
                "{c} rows"
            );
        }
        // The ideal static set serves at least what an LRU of its size does.
        let (_, hot) = hot_set(&reqs, &sizes);
        assert!(hot.iter().zip(&fast).all(|(h, l)| h.hit_rate >= l.hit_rate));
    }
}
