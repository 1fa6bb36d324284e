//! A batch of positions, as an engine hands them over: raw token ids cut
//! into segments (one per sequence of a serving batch), each segment with
//! the up-to-three tokens that precede it in its sequence. Turned here into
//! each layer's row ids, deduplicated, with the map from every live
//! position's 24 columns back to them.

use engram_protocol::hashing::{COLUMNS, DEAD, HashParams, MAX_NGRAM, SequenceHasher};

use super::EmbedError;
use crate::engram::TokenMap;
use crate::engram::addresses::MAX_POSITIONS;

/// A context slot with no token: the segment starts its sequence (or is
/// within the first three tokens of it).
pub const NO_TOKEN: i64 = -2;

/// Tokens of context that matter: hashing looks three tokens back.
pub const CONTEXT: usize = MAX_NGRAM - 1;

/// Most segments one batch holds.
pub const MAX_SEGMENTS: usize = 65_536;

/// Row ids of a DEAD position in [`super::EmbeddedNode::addresses`]' output.
pub const NO_ROW: u64 = u64::MAX;

/// One sequence's part of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Positions (consecutive ids of the batch).
    pub len: usize,
    /// The raw ids of the three tokens before them in their sequence,
    /// oldest first; [`NO_TOKEN`] where the sequence has none (only at its
    /// start, so only leading slots); `-1` is a DEAD token.
    pub context: [i64; CONTEXT],
}

impl Segment {
    /// `len` positions that start their sequence.
    pub fn start(len: usize) -> Self {
        Self {
            len,
            context: [NO_TOKEN; CONTEXT],
        }
    }

    /// `len` positions after `before` (the sequence's tokens so far, or at
    /// least its last three; only those are kept).
    pub fn after(len: usize, before: &[i64]) -> Self {
        let mut context = [NO_TOKEN; CONTEXT];
        let keep = before.len().min(CONTEXT);
        context[CONTEXT - keep..].copy_from_slice(&before[before.len() - keep..]);
        Self { len, context }
    }
}

/// What the addressing needs: the hashing, the token map (none: ids are
/// compressed already) and the pad's compressed id.
#[derive(Debug)]
pub(crate) struct Addressing {
    pub params: HashParams,
    pub map: Option<TokenMap>,
    pub pad: i64,
}

/// One layer's rows for a batch.
#[derive(Debug, Default)]
pub(crate) struct LayerRows {
    /// Distinct row ids, ascending: what is fetched.
    pub unique: Vec<u64>,
    /// For each live position, its 24 columns as indexes into `unique`.
    pub index: Vec<u32>,
}

/// A batch, addressed.
#[derive(Debug)]
pub(crate) struct Plan {
    /// Whether each position is live (DEAD positions fetch nothing).
    pub live: Vec<bool>,
    /// Layers 1 and 14.
    pub layers: [LayerRows; 2],
}

impl Addressing {
    /// Raw id -> compressed id (DEAD stays DEAD), or why not.
    fn compress(&self, raw: i64, what: impl Fn() -> String) -> Result<i64, EmbedError> {
        if raw == i64::from(DEAD) {
            return Ok(raw);
        }
        if raw < 0 {
            return Err(EmbedError::BadInput(format!(
                "{}: token id {raw} is negative (the only negative id is -1, DEAD)",
                what()
            )));
        }
        match &self.map {
            None => Ok(raw),
            Some(map) => u32::try_from(raw)
                .ok()
                .and_then(|r| map.get(r))
                .map(i64::from)
                .ok_or_else(|| {
                    EmbedError::BadInput(format!(
                        "{}: raw token id {raw} is not in the token map ({} ids)",
                        what(),
                        map.raw_len()
                    ))
                }),
        }
    }

    /// Hash every position of `ids` cut into `segments`, calling `each`
    /// with the position's index and its rows (`None`: DEAD).
    fn walk(
        &self,
        ids: &[i64],
        segments: &[Segment],
        mut each: impl FnMut(usize, Option<&[[u64; COLUMNS]; 2]>),
    ) -> Result<(), EmbedError> {
        check_shape(ids, segments)?;
        let mut h = SequenceHasher::new(&self.params, self.pad)
            .map_err(|e| EmbedError::Config(format!("the pad token: {e}")))?;
        let mut rows = [[0u64; COLUMNS]; 2];
        let mut at = 0;
        for (s, seg) in segments.iter().enumerate() {
            h.reset();
            let mut started = false;
            for (k, &c) in seg.context.iter().enumerate() {
                if c == NO_TOKEN {
                    if started {
                        return Err(EmbedError::BadInput(format!(
                            "segment {s}: context slot {k} has no token after one that has: \
                             only the oldest slots may be empty (a sequence's start)"
                        )));
                    }
                    continue;
                }
                started = true;
                let c = self.compress(c, || format!("segment {s}, context slot {k}"))?;
                h.push(c, &mut rows).map_err(|e| {
                    EmbedError::BadInput(format!("segment {s}, context slot {k}: {e}"))
                })?;
            }
            for (p, &raw) in ids.iter().enumerate().skip(at).take(seg.len) {
                let id = self.compress(raw, || format!("position {p}"))?;
                let live = h
                    .push(id, &mut rows)
                    .map_err(|e| EmbedError::BadInput(format!("position {p}: {e}")))?;
                each(p, live.then_some(&rows));
            }
            at += seg.len;
        }
        Ok(())
    }

    /// Row ids of every position: `out[p][layer][column]` flattened
    /// (`ids.len() * 2 * 24` entries), [`NO_ROW`] for a DEAD position.
    pub fn addresses(
        &self,
        ids: &[i64],
        segments: &[Segment],
        out: &mut [u64],
    ) -> Result<(), EmbedError> {
        let want = ids.len() * 2 * COLUMNS;
        if out.len() != want {
            return Err(EmbedError::BadInput(format!(
                "the output holds {} row ids; {} positions need {want} (positions x 2 layers x {COLUMNS})",
                out.len(),
                ids.len()
            )));
        }
        self.walk(ids, segments, |p, rows| {
            let dst = &mut out[p * 2 * COLUMNS..(p + 1) * 2 * COLUMNS];
            match rows {
                Some(r) => {
                    dst[..COLUMNS].copy_from_slice(&r[0]);
                    dst[COLUMNS..].copy_from_slice(&r[1]);
                }
                None => dst.fill(NO_ROW),
            }
        })
    }

    /// Address a batch for fetching.
    pub fn plan(&self, ids: &[i64], segments: &[Segment]) -> Result<Plan, EmbedError> {
        let mut live = Vec::with_capacity(ids.len());
        let mut all: [Vec<u64>; 2] = Default::default();
        self.walk(ids, segments, |_, rows| {
            live.push(rows.is_some());
            if let Some(r) = rows {
                all[0].extend_from_slice(&r[0]);
                all[1].extend_from_slice(&r[1]);
            }
        })?;
        let layers = all.map(|rows| {
            let mut unique = rows.clone();
            unique.sort_unstable();
            unique.dedup();
            let index = rows
                .iter()
                .map(|r| unique.binary_search(r).unwrap_or(0) as u32)
                .collect();
            LayerRows { unique, index }
        });
        Ok(Plan { live, layers })
    }
}

/// Bounds on a batch's shape, before any work.
fn check_shape(ids: &[i64], segments: &[Segment]) -> Result<(), EmbedError> {
    if ids.is_empty() {
        return Err(EmbedError::BadInput(
            "no positions: the token id list is empty".into(),
        ));
    }
    if ids.len() > MAX_POSITIONS {
        return Err(EmbedError::BadInput(format!(
            "{} positions is more than the {MAX_POSITIONS} one call takes",
            ids.len()
        )));
    }
    if segments.is_empty() || segments.len() > MAX_SEGMENTS {
        return Err(EmbedError::BadInput(format!(
            "{} segments: a batch has 1 to {MAX_SEGMENTS}",
            segments.len()
        )));
    }
    let mut total = 0usize;
    for (s, seg) in segments.iter().enumerate() {
        if seg.len == 0 {
            return Err(EmbedError::BadInput(format!(
                "segment {s} has no positions"
            )));
        }
        total = total.saturating_add(seg.len);
    }
    if total != ids.len() {
        return Err(EmbedError::BadInput(format!(
            "the segments cover {total} positions but {} token ids were given",
            ids.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use engram_protocol::hashing::{Preset, hash_sequence};

    fn addressing() -> Addressing {
        Addressing {
            params: HashParams::new(Preset::from_base(1000).expect("base")).expect("params"),
            map: None,
            pad: 2,
        }
    }

    #[test]
    fn a_segment_after_its_context_hashes_as_the_whole_sequence_does() {
        let a = addressing();
        let seq: Vec<i64> = vec![5, 9, -1, 7, 3, 8, 1, 4];
        let whole = hash_sequence(&a.params, a.pad, &seq).expect("hash");
        for cut in 0..seq.len() {
            let seg = Segment::after(seq.len() - cut, &seq[..cut]);
            let mut out = vec![0u64; (seq.len() - cut) * 48];
            a.addresses(&seq[cut..], &[seg], &mut out)
                .expect("addresses");
            for (i, want) in whole[cut..].iter().enumerate() {
                let got = &out[i * 48..(i + 1) * 48];
                match want {
                    Some(r) => {
                        assert_eq!(&got[..24], &r[0], "cut {cut} position {i}");
                        assert_eq!(&got[24..], &r[1]);
                    }
                    None => assert!(got.iter().all(|&x| x == NO_ROW)),
                }
            }
        }
    }

    #[test]
    fn a_plan_maps_every_column_back_to_its_row() {
        let a = addressing();
        let ids = [5i64, 5, 5, -1, 6, 5, 5, 5];
        let segs = [Segment::start(4), Segment::start(4)];
        let plan = a.plan(&ids, &segs).expect("plan");
        let mut flat = vec![0u64; ids.len() * 48];
        a.addresses(&ids, &segs, &mut flat).expect("addresses");
        assert_eq!(plan.live, [true, true, true, false, true, true, true, true]);
        for (l, layer) in plan.layers.iter().enumerate() {
            assert!(layer.unique.windows(2).all(|w| w[0] < w[1]));
            let mut k = 0;
            for (p, &live) in plan.live.iter().enumerate() {
                if !live {
                    continue;
                }
                for c in 0..24 {
                    let row = layer.unique[layer.index[k] as usize];
                    assert_eq!(row, flat[p * 48 + l * 24 + c]);
                    k += 1;
                }
            }
        }
    }

    #[test]
    fn bad_batches_are_refused_with_the_position() {
        let a = addressing();
        let e = |ids: &[i64], segs: &[Segment]| a.plan(ids, segs).expect_err("refused").to_string();
        assert!(e(&[], &[Segment::start(0)]).contains("empty"));
        assert!(e(&[1, 2], &[Segment::start(1)]).contains("cover 1"));
        assert!(e(&[1, -7], &[Segment::start(2)]).contains("position 1: token id -7"));
        assert!(
            e(&[1, 200_000], &[Segment::start(2)]).contains("position 1: compressed id 200000")
        );
        let gap = Segment {
            len: 1,
            context: [3, NO_TOKEN, 4],
        };
        assert!(e(&[1], &[gap]).contains("context slot 1"));
        assert!(e(&[1], &[Segment::start(0), Segment::start(1)]).contains("segment 0"));
    }
}
