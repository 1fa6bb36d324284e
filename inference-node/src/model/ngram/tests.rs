use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use engram_protocol::qwen4exp::Qwen4ExpConfig;
use engram_protocol::synthetic::synthetic_encoded_row;

use super::*;
use crate::model::clock::FakeClock;
use crate::model::{Checksum, Fetch};

const SEED: u64 = 11;
const EOS: u32 = 7;
const FP8: RowEncoding = RowEncoding::Fp8PerTensor { values: 160 };
const MS: Duration = Duration::from_millis(1);

fn model(encoding: RowEncoding) -> NgramModel {
    let hashing = Qwen4ExpHashing::new(Qwen4ExpConfig {
        base: 1_000,
        ..Qwen4ExpConfig::qwen38_flash_next(u64::from(EOS))
    })
    .expect("hashing");
    let slot = TableSlot {
        table: 1,
        layer: 1,
        window_blocks: 1,
        row_bytes: encoding.row_bytes(),
    };
    NgramModel::synthetic(hashing, encoding, 0.0123, slot, (16, 4), 5).expect("model")
}

/// Rows from the generator, `delay` after the fetch starts; every row
/// asked is logged.
struct Rows<'a> {
    clock: &'a FakeClock,
    encoding: RowEncoding,
    delay: Duration,
    asked: RefCell<Vec<Vec<u64>>>,
    fail: bool,
}

impl<'a> Rows<'a> {
    fn new(clock: &'a FakeClock, encoding: RowEncoding) -> Self {
        Self {
            clock,
            encoding,
            delay: Duration::ZERO,
            asked: RefCell::new(Vec::new()),
            fail: false,
        }
    }
}

impl Fetcher for Rows<'_> {
    type Pending = (Vec<u64>, Duration);

    fn start(&mut self, _slot: usize, rows: &[u64], _sweep: bool) -> Self::Pending {
        self.asked.borrow_mut().push(rows.to_vec());
        (rows.to_vec(), self.clock.now() + self.delay)
    }

    fn wait(&mut self, (rows, ready): Self::Pending) -> Fetch {
        if self.fail {
            return Fetch {
                ready,
                error: Some("every source failed".into()),
                messages: 1,
                ..Fetch::default()
            };
        }
        let size = self.encoding.row_bytes();
        let mut bytes = vec![0u8; rows.len() * size];
        for (&r, out) in rows.iter().zip(bytes.chunks_exact_mut(size)) {
            assert!(synthetic_encoded_row(self.encoding, SEED, 1, r, out));
        }
        Fetch {
            bytes,
            ready,
            sources: vec!["fake".into()],
            messages: 1,
            ..Fetch::default()
        }
    }
}

/// 60 tokens of a small vocabulary (n-grams repeat), an EOS at 25.
fn tokens() -> Vec<u32> {
    (0..60u32)
        .map(|i| if i == 25 { EOS } else { 100 + (i * 7) % 13 })
        .collect()
}

type Outputs = BTreeMap<(u32, u32), Checksum>;

fn run_with(
    m: &NgramModel,
    raw: &[u32],
    spec: &LoopSpec,
    fetcher: &mut Rows<'_>,
    clock: &FakeClock,
) -> (Summary, Outputs, Vec<StepRecord>) {
    let mut out = Outputs::new();
    let mut steps = Vec::new();
    let stop = AtomicBool::new(false);
    let summary = run(clock, fetcher, m, raw, spec, &stop, &mut |r| {
        for p in &r.positions {
            assert!(out.insert((p.seq, p.index), p.checksum).is_none());
        }
        steps.push(r.clone());
        Ok(())
    })
    .expect("run");
    (summary, out, steps)
}

fn outputs(m: &NgramModel, raw: &[u32], spec: &LoopSpec) -> Outputs {
    let clock = FakeClock::default();
    let mut f = Rows::new(&clock, m.encoding);
    run_with(m, raw, spec, &mut f, &clock).1
}

fn spec(batch: usize, prefill: usize) -> LoopSpec {
    LoopSpec {
        batch,
        prefill,
        warm_lead: Duration::ZERO,
        ..LoopSpec::default()
    }
}

#[test]
fn outputs_do_not_depend_on_how_positions_are_grouped_into_steps() {
    for e in [FP8, RowEncoding::Nvfp4 { values: 160 }] {
        let m = model(e);
        let raw = tokens();
        let decode = outputs(&m, &raw, &spec(1, 0));
        assert_eq!(decode.len(), raw.len());
        // Prefilled in part, or whole: the same outputs.
        assert_eq!(outputs(&m, &raw, &spec(1, 20)), decode, "{e:?}");
        assert_eq!(outputs(&m, &raw, &spec(1, raw.len())), decode, "{e:?}");
        // Two sequences in one batch: each as if it ran alone.
        let batch = outputs(&m, &raw, &spec(2, 5));
        let (a, b) = raw.split_at(30);
        let alone_a = outputs(&m, a, &spec(1, 0));
        let alone_b = outputs(&m, b, &spec(1, 0));
        for ((seq, index), sum) in &batch {
            let alone = if *seq == 0 { &alone_a } else { &alone_b };
            assert_eq!(
                alone.get(&(0, *index)),
                Some(sum),
                "{e:?} seq {seq} at {index}"
            );
        }
        assert_eq!(batch.len(), raw.len());
        // The first sequence's first 30 outputs are the whole input's too.
        for i in 0..30u32 {
            assert_eq!(alone_a.get(&(0, i)), decode.get(&(0, i)));
        }
        // And they depend on the rows: another encoding's differ.
        let other = outputs(&model(RowEncoding::Bf16 { values: 160 }), &raw, &spec(1, 0));
        assert_ne!(other, decode);
    }
}

#[test]
fn the_rows_asked_are_the_hashing_of_the_whole_sequence_eos_and_all() {
    let m = model(FP8);
    let raw = tokens();
    let clock = FakeClock::default();
    let mut f = Rows::new(&clock, FP8);
    let (summary, _, steps) = run_with(&m, &raw, &spec(1, 0), &mut f, &clock);
    let ids: Vec<i64> = raw.iter().map(|&t| i64::from(t)).collect();
    let want = m.hashing().ids(&[], &ids).expect("ids");
    let asked: BTreeSet<u64> = f.asked.borrow().iter().flatten().copied().collect();
    assert_eq!(asked, want.iter().copied().collect::<BTreeSet<_>>());
    // One message a step, 16 rows a token, each step's rows distinct.
    assert_eq!(f.asked.borrow().len(), raw.len());
    assert!(steps.iter().all(|s| s.tables[0].rows == 16));
    assert_eq!(summary.tokens, raw.len() as u64);
    // After the EOS a window starts afresh: position 26's rows are those of
    // a sequence that begins with the EOS.
    let fresh = m.hashing().ids(&[], &ids[25..27]).expect("ids");
    assert_eq!(&want[26 * 16..27 * 16], &fresh[16..32]);
}

#[test]
fn the_step_waits_for_its_rows_at_the_ple_layers_block() {
    let m = model(FP8);
    let raw = tokens();
    let clock = FakeClock::default();
    let mut f = Rows::new(&clock, FP8);
    // 100 tokens/s: W = 10 ms, layer 1's block starts at 0.25 ms.
    f.delay = 3 * MS;
    let (summary, _, steps) = run_with(&m, &raw[..10], &spec(1, 0), &mut f, &clock);
    for s in &steps {
        assert!((s.stall_us - 2_750.0).abs() < 1e-6, "{}", s.stall_us);
        assert!((s.time_us - 12_750.0).abs() < 1e-6, "{}", s.time_us);
        assert_eq!(s.tables[0].source.as_deref(), Some("fake"));
    }
    assert_eq!(summary.stalled_steps, 10);
    // Rows in before the block: no stall, a step of exactly W.
    let clock = FakeClock::default();
    let mut f = Rows::new(&clock, FP8);
    f.delay = Duration::from_micros(200);
    let (_, _, steps) = run_with(&m, &raw[..10], &spec(1, 0), &mut f, &clock);
    assert!(
        steps
            .iter()
            .all(|s| s.stall_us == 0.0 && s.time_us == 10_000.0)
    );
}

/// A failed fetch's positions are fused as zero rows (the state kept in
/// step): recorded with the table's error, their outputs those of zero
/// rows, not the table's.
#[test]
fn a_failed_fetch_is_recorded_and_fused_as_zero_rows() {
    let m = model(FP8);
    let raw = tokens();
    let clock = FakeClock::default();
    let mut f = Rows::new(&clock, FP8);
    f.fail = true;
    let (summary, out, steps) = run_with(&m, &raw[..5], &spec(1, 0), &mut f, &clock);
    assert_eq!(summary.failed_steps, 5);
    assert!(steps.iter().all(|s| s.tables[0].error.is_some()));
    assert_eq!(out.len(), 5, "the positions are recorded");
    let fused = outputs(&m, &raw[..5], &spec(1, 0));
    assert!(out.iter().all(|(k, v)| fused.get(k) != Some(v)));
    // The outputs of a fetch that answered zero rows.
    struct Zeros<'a>(Rows<'a>);
    impl Fetcher for Zeros<'_> {
        type Pending = (Vec<u64>, Duration);
        fn start(&mut self, slot: usize, rows: &[u64], sweep: bool) -> Self::Pending {
            self.0.start(slot, rows, sweep)
        }
        fn wait(&mut self, p: Self::Pending) -> Fetch {
            let mut f = self.0.wait(p);
            f.bytes.fill(0);
            f.zeros = true;
            f
        }
    }
    let clock = FakeClock::default();
    let mut z = Zeros(Rows::new(&clock, FP8));
    let stop = AtomicBool::new(false);
    let mut zero = Outputs::new();
    run(
        &clock,
        &mut z,
        &m,
        &raw[..5],
        &spec(1, 0),
        &stop,
        &mut |r| {
            zero.extend(r.positions.iter().map(|p| ((p.seq, p.index), p.checksum)));
            Ok(())
        },
    )
    .expect("run");
    assert_eq!(out, zero);
}

#[test]
fn a_spec_it_cannot_run_is_refused() {
    let m = model(FP8);
    let raw = tokens();
    let clock = FakeClock::default();
    let mut f = Rows::new(&clock, FP8);
    let stop = AtomicBool::new(false);
    let speculate = LoopSpec {
        speculate: 2,
        ..spec(1, 0)
    };
    let e = run(&clock, &mut f, &m, &raw, &speculate, &stop, &mut |_| Ok(()))
        .expect_err("speculation")
        .to_string();
    assert!(e.contains("V4.1"), "{e}");
    let e = run(
        &clock,
        &mut f,
        &m,
        &raw[..1],
        &spec(2, 0),
        &stop,
        &mut |_| Ok(()),
    )
    .expect_err("batch")
    .to_string();
    assert!(e.contains("cannot make 2 sequences"), "{e}");
    let big = vec![248_320u32; 3];
    let e = run(
        &clock,
        &mut f,
        &m,
        &big,
        &spec(1, 0),
        &stop,
        &mut |_| Ok(()),
    )
    .expect_err("id")
    .to_string();
    assert!(e.contains("248320"), "{e}");
}

/// The daemon's continuous batch: two decoders from step 0 (one of them
/// cancelled at step 6), a sequence joining at step 3 that prefills 20
/// positions in chunks of the budget beside them, and a limit on each.
struct Join {
    tokens: Arc<Tokens>,
    step: usize,
    records: Vec<StepRecord>,
    finished: Vec<(usize, u64)>,
}

impl BatchDriver for Join {
    fn admit(&mut self, _running: usize) -> Vec<SeqSpec> {
        let seq = |tag: u64, range: Range<usize>, prefill, limit| SeqSpec {
            tag,
            tokens: Arc::clone(&self.tokens),
            range,
            prefill,
            speculate: 0,
            limit: Some(limit),
        };
        match self.step {
            0 => vec![seq(0, 0..60, 0, 12), seq(1, 30..60, 0, 20)],
            3 => vec![seq(2, 10..60, 20, 5)],
            _ => Vec::new(),
        }
    }

    fn cancelled(&mut self) -> Vec<u64> {
        if self.step == 6 { vec![1] } else { Vec::new() }
    }

    fn after_step(&mut self, rec: Option<&StepRecord>, finished: &[u64]) {
        self.finished
            .extend(finished.iter().map(|&t| (self.step, t)));
        self.step += 1;
        self.records.extend(rec.cloned());
    }
}

#[test]
fn sequences_join_and_leave_a_batch_and_fuse_as_alone() {
    let m = model(FP8);
    let raw = tokens();
    let clock = FakeClock::default();
    let mut f = Rows::new(&clock, FP8);
    let batch = LoopSpec {
        prefill_budget: 8,
        ..spec(1, 0)
    };
    let mut driver = Join {
        tokens: Arc::new(raw_tokens(raw.clone(), String::new())),
        step: 0,
        records: Vec::new(),
        finished: Vec::new(),
    };
    run_batch(&clock, &mut f, &m, &batch, &mut driver).expect("the batch runs");
    let per_seq = |tag: u32| -> Outputs {
        driver
            .records
            .iter()
            .flat_map(|r| &r.positions)
            .filter(|p| p.seq == tag)
            .map(|p| ((0, p.index), p.checksum))
            .collect()
    };
    // Each sequence's outputs are those of its tokens run alone.
    for (tag, from, n) in [(0u32, 0usize, 12usize), (1, 30, 6), (2, 10, 25)] {
        let got = per_seq(tag);
        assert_eq!(got.len(), n, "sequence {tag}");
        let alone = outputs(&m, &raw[from..from + n], &spec(1, 0));
        assert_eq!(got, alone, "sequence {tag}");
    }
    // The joiner's 20 prefill positions came 8, 8 and 4 beside both decoders.
    let chunks: Vec<(u64, usize)> = driver
        .records
        .iter()
        .filter(|r| r.prefilled > 0)
        .map(|r| (r.prefilled, r.positions.len()))
        .collect();
    assert_eq!(chunks, vec![(8, 10), (8, 10), (4, 6)], "{chunks:?}");
    assert!(driver.records.iter().all(|r| r.kind == StepKind::Decode));
    // Sequence 0 ends at its limit; 1 left when cancelled (not finished).
    assert!(driver.finished.contains(&(11, 0)), "{:?}", driver.finished);
    assert!(driver.finished.iter().all(|&(_, t)| t != 1));
    assert!(driver.finished.iter().any(|&(_, t)| t == 2));
}

#[test]
fn a_batch_refuses_a_speculating_sequence() {
    struct Speculate(Arc<Tokens>);
    impl BatchDriver for Speculate {
        fn admit(&mut self, running: usize) -> Vec<SeqSpec> {
            if running > 0 {
                return Vec::new();
            }
            vec![SeqSpec {
                tag: 0,
                tokens: self.0.clone(),
                range: 0..10,
                prefill: 0,
                speculate: 1,
                limit: None,
            }]
        }
        fn cancelled(&mut self) -> Vec<u64> {
            Vec::new()
        }
        fn after_step(&mut self, _: Option<&StepRecord>, _: &[u64]) {}
    }
    let m = model(FP8);
    let clock = FakeClock::default();
    let mut f = Rows::new(&clock, FP8);
    let mut d = Speculate(Arc::new(raw_tokens(tokens(), String::new())));
    let e = run_batch(&clock, &mut f, &m, &spec(1, 0), &mut d)
        .expect_err("refused")
        .to_string();
    assert!(e.contains("V4.1"), "{e}");
}
