use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::Arc;

use engram_protocol::hashing::Preset;
use engram_protocol::synthetic::synthetic_row;

use super::clock::FakeClock;
use super::*;
use crate::engram::{CpuFusion, FusionShape, FusionWeights};
use engram_protocol::ROW_BYTES;

const MS: Duration = Duration::from_millis(1);

/// Rows from the generator, ready `delay(slot, call)` after the fetch starts.
struct FakeFetcher<'a, D: Fn(usize, usize) -> Duration> {
    clock: &'a FakeClock,
    delay: D,
    calls: [usize; 2],
    /// (slot, rows asked) per call.
    log: RefCell<Vec<(usize, usize)>>,
    fail_slot: Option<usize>,
    /// Where each fetch's rows were delivered (the buffers' addresses).
    delivered: RefCell<Vec<usize>>,
    /// Added to a fetch's time for each row it asks for.
    per_row: Duration,
    /// When each fetch started, and when each warm-up came (with its lead).
    starts: RefCell<Vec<Duration>>,
    warmed: RefCell<Vec<(Duration, Duration)>>,
    /// Say a fetch was taken up this long after it was asked for (its
    /// hops); `None`: say nothing, as a fetcher that cannot tell.
    picked_after: Option<Duration>,
}

impl<'a, D: Fn(usize, usize) -> Duration> FakeFetcher<'a, D> {
    fn new(clock: &'a FakeClock, delay: D) -> Self {
        Self {
            clock,
            delay,
            calls: [0; 2],
            log: RefCell::new(Vec::new()),
            fail_slot: None,
            delivered: RefCell::new(Vec::new()),
            per_row: Duration::ZERO,
            starts: RefCell::new(Vec::new()),
            warmed: RefCell::new(Vec::new()),
            picked_after: None,
        }
    }
}

impl<D: Fn(usize, usize) -> Duration> Fetcher for FakeFetcher<'_, D> {
    /// (slot, rows, ready, asked).
    type Pending = (usize, Vec<u64>, Duration, Duration);

    fn start(&mut self, slot: usize, rows: &[u64], _sweep: bool) -> Self::Pending {
        let ready = self.clock.now()
            + (self.delay)(slot, self.calls[slot])
            + self.per_row * rows.len() as u32;
        self.calls[slot] += 1;
        self.log.borrow_mut().push((slot, rows.len()));
        self.starts.borrow_mut().push(self.clock.now());
        (slot, rows.to_vec(), ready, self.clock.now())
    }

    fn warm(&mut self, lead: Duration) {
        self.warmed.borrow_mut().push((self.clock.now(), lead));
    }

    fn wait(&mut self, (slot, rows, ready, asked): Self::Pending) -> Fetch {
        let (asked, picked) = match self.picked_after {
            Some(d) => (Some(asked), Some(asked + d)),
            None => (None, None),
        };
        if self.fail_slot == Some(slot) {
            return Fetch {
                ready,
                error: Some("every source failed".into()),
                messages: 1,
                ..Fetch::default()
            };
        }
        let layer = [1, 14][slot];
        let mut bytes = vec![0; rows.len() * ROW_BYTES];
        for (r, out) in rows.iter().zip(bytes.chunks_exact_mut(ROW_BYTES)) {
            synthetic_row(7, layer, *r, out.try_into().expect("one row"));
        }
        self.delivered.borrow_mut().push(bytes.as_ptr() as usize);
        Fetch {
            bytes,
            ready,
            sources: vec!["fake".into()],
            messages: 1,
            asked,
            picked,
            ..Fetch::default()
        }
    }
}

/// Fusion that takes `cost` of fake time per call.
#[derive(Debug)]
struct SlowFusion<'a> {
    inner: CpuFusion,
    clock: &'a FakeClock,
    cost: Duration,
    /// Where each call's rows were (the buffer's address).
    read: Vec<usize>,
}

impl Fusion for SlowFusion<'_> {
    fn name(&self) -> &'static str {
        "slow"
    }
    fn shape(&self) -> FusionShape {
        self.inner.shape()
    }
    fn fuse(
        &mut self,
        layer: u32,
        rows: &[u8],
        live: &[bool],
        hidden: &mut [f32],
    ) -> Result<(), FusionError> {
        self.clock.advance(self.cost);
        self.read.push(rows.as_ptr() as usize);
        self.inner.fuse(layer, rows, live, hidden)
    }
}

fn params() -> HashParams {
    HashParams::new(Preset::from_base(1000).expect("base")).expect("params")
}

fn cpu() -> CpuFusion {
    let shape = FusionShape::new(8, 2).expect("shape");
    CpuFusion::new(Arc::new(FusionWeights::from_seed(3, shape)))
}

fn tokens(n: usize) -> Tokens {
    let mut t = input::builtin().expect("built-in");
    t.raw.truncate(n);
    t.compressed.truncate(n);
    t
}

fn run_fake<D: Fn(usize, usize) -> Duration>(
    spec: &LoopSpec,
    toks: &Tokens,
    delay: D,
    fusion_cost: Duration,
) -> (Summary, Vec<StepRecord>, Vec<(usize, usize)>) {
    let (s, steps, log, _) = run_fake_traced(spec, toks, delay, fusion_cost);
    (s, steps, log)
}

/// Which buffers the fake fetches delivered rows in, and which ones the
/// fusion read, call by call.
struct Buffers {
    delivered: Vec<usize>,
    read: Vec<usize>,
    /// When the fetches started and the warm-ups came (see [`FakeFetcher`]).
    starts: Vec<Duration>,
    warmed: Vec<(Duration, Duration)>,
}

fn run_fake_traced<D: Fn(usize, usize) -> Duration>(
    spec: &LoopSpec,
    toks: &Tokens,
    delay: D,
    fusion_cost: Duration,
) -> (Summary, Vec<StepRecord>, Vec<(usize, usize)>, Buffers) {
    let clock = FakeClock::default();
    let mut fetcher = FakeFetcher::new(&clock, delay);
    let mut fusion = SlowFusion {
        inner: cpu(),
        clock: &clock,
        cost: fusion_cost,
        read: Vec::new(),
    };
    let mut steps = Vec::new();
    let s = run(
        &clock,
        &mut fetcher,
        &mut fusion,
        &params(),
        v41_slots(1, 14),
        toks,
        spec,
        &AtomicBool::new(false),
        &mut |r| {
            steps.push(r.clone());
            Ok(())
        },
    )
    .expect("run");
    let log = fetcher.log.into_inner();
    let buffers = Buffers {
        delivered: fetcher.delivered.into_inner(),
        read: fusion.read,
        starts: fetcher.starts.into_inner(),
        warmed: fetcher.warmed.into_inner(),
    };
    (s, steps, log, buffers)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-6
}

#[test]
fn each_step_warms_the_path_its_lead_before_the_next_steps_fetches() {
    let lead = Duration::from_micros(300);
    let spec = LoopSpec {
        max_tokens: Some(3),
        warm_lead: lead,
        ..LoopSpec::default()
    };
    // The second step's layer 1 is late by 1.75 ms: its end moves, and
    // the warm-up with it.
    let delays = [[0.1, 1.0], [2.0, 1.0], [0.1, 1.0]];
    let (_, steps, _, seen) = run_fake_traced(
        &spec,
        &tokens(50),
        |slot, call| Duration::from_secs_f64(delays[call][slot] / 1e3),
        Duration::ZERO,
    );
    assert_eq!(seen.warmed.len(), 3, "{:?}", seen.warmed);
    for (r, &(at, l)) in steps.iter().zip(&seen.warmed) {
        assert_eq!(l, lead);
        let end = Duration::from_secs_f64((r.start_us + r.time_us) / 1e6);
        assert!(
            (end - at).abs_diff(lead) < Duration::from_micros(1),
            "step {}: warmed at {at:?}, ends at {end:?}",
            r.step
        );
    }
    // Two fetches a step (one per table), the next step's right after
    // the warm-up's lead.
    assert_eq!(seen.starts.len(), 6);
    for k in 0..2 {
        let gap = seen.starts[2 * (k + 1)] - seen.warmed[k].0;
        assert!(gap.abs_diff(lead) < Duration::from_micros(1), "{gap:?}");
    }
    // Off: no warm-up at all.
    let spec = LoopSpec {
        warm_lead: Duration::ZERO,
        ..spec
    };
    let (_, _, _, seen) = run_fake_traced(&spec, &tokens(50), |_, _| MS / 10, Duration::ZERO);
    assert!(seen.warmed.is_empty());
}

#[test]
fn a_fetcher_that_tells_when_it_took_a_fetch_up_gets_its_hops_recorded() {
    let clock = FakeClock::default();
    // Layer 1's rows in after 100 us, layer 14's after 1 ms; each fetch
    // taken up by an I/O thread 30 us after it was asked for.
    let mut fetcher = FakeFetcher::new(&clock, |slot, _| Duration::from_micros([100, 1000][slot]));
    fetcher.picked_after = Some(Duration::from_micros(30));
    let mut steps = Vec::new();
    let s = run(
        &clock,
        &mut fetcher,
        &mut cpu(),
        &params(),
        v41_slots(1, 14),
        &tokens(20),
        &LoopSpec {
            max_tokens: Some(5),
            ..LoopSpec::default()
        },
        &AtomicBool::new(false),
        &mut |r| {
            steps.push(r.clone());
            Ok(())
        },
    )
    .expect("run");
    for r in &steps {
        for (t, round_trip) in r.tables.iter().zip([70.0, 970.0]) {
            let h = t.hops.expect("hops");
            assert!(
                close(h.to_io_us, 30.0) && close(h.round_trip_us, round_trip),
                "{h:?}"
            );
            // The loop waited from its block's start, after the rows
            // were in: nothing to hand over.
            assert!(close(h.to_loop_us, 0.0), "{h:?}");
        }
    }
    let h = s.tables[0].hops_p50_us.expect("medians");
    assert!(
        (h.to_io_us - 30.0).abs() < 0.5 && (h.round_trip_us - 70.0).abs() < 0.5,
        "{h:?}"
    );
    assert!(
        s.render()
            .contains("its hops, p50: to an I/O thread 30 us, round trip 70 us")
    );
    // A fetcher that cannot tell: no hops.
    let (s, steps, _) = run_fake(
        &LoopSpec {
            max_tokens: Some(2),
            ..LoopSpec::default()
        },
        &tokens(20),
        |_, _| MS / 10,
        Duration::ZERO,
    );
    assert!(
        steps
            .iter()
            .all(|r| r.tables.iter().all(|t| t.hops.is_none()))
    );
    assert!(s.tables[0].hops_p50_us.is_none());
}

#[test]
fn a_late_table_costs_its_overshoot_and_the_stall_shifts_later_blocks() {
    // 100 tokens/s: W = 10 ms; block 1 starts at 0.25 ms, block 14 at 3.5 ms.
    let spec = LoopSpec {
        max_tokens: Some(4),
        ..LoopSpec::default()
    };
    let delays = [
        [0.1, 1.0],   // both in time
        [2.0, 5.0],   // layer 1 late by 1.75; block 14 moves to 5.25: in time
        [2.0, 6.0],   // layer 1 late by 1.75, layer 14 by 0.75
        [0.25, 20.0], // layer 14 late by 16.5
    ];
    let (s, steps, _) = run_fake(
        &spec,
        &tokens(50),
        |slot, call| Duration::from_secs_f64(delays[call][slot] / 1e3),
        Duration::ZERO,
    );
    let want = [(0.0, 0.0), (1750.0, 0.0), (1750.0, 750.0), (0.0, 16_500.0)];
    for (r, (a, b)) in steps.iter().zip(want) {
        assert!(
            close(r.tables[0].stall_us, a),
            "step {}: {:?}",
            r.step,
            r.tables[0]
        );
        assert!(
            close(r.tables[1].stall_us, b),
            "step {}: {:?}",
            r.step,
            r.tables[1]
        );
        assert!(close(r.stall_us, a + b));
        assert!(
            close(r.time_us, 10_000.0 + a + b),
            "step {}: {}",
            r.step,
            r.time_us
        );
        assert!(close(r.w_us, 10_000.0) && close(r.overrun_us, 0.0));
        assert!(close(r.tables[0].window_us, 250.0) && close(r.tables[1].window_us, 3250.0));
        assert_eq!(r.tables[0].source.as_deref(), Some("fake"));
    }
    assert!(close(steps[2].tables[1].ready_us, 6000.0));
    // Steps follow each other with no gap.
    assert!(close(steps[1].start_us, 10_000.0) && close(steps[2].start_us, 21_750.0));
    assert_eq!(s.tokens, 4);
    assert_eq!(s.stalled_steps, 3);
    // Percentiles come from the latency histogram (to 0.1%).
    assert!(
        (s.stall_max_us - 16_500.0).abs() <= 16.5,
        "{}",
        s.stall_max_us
    );
    let total_ms = 40.0 + 1.75 + 2.5 + 16.5;
    assert!(
        (s.tokens_per_second - 4000.0 / total_ms).abs() < 1e-6,
        "{}",
        s.tokens_per_second
    );
    assert!((s.slowdown - (total_ms / 40.0 - 1.0)).abs() < 1e-9);
    // Seed 000's formula, each fetch timed from its window's start (layer
    // 14's window starts after block 1, pushed back by layer 1's stall),
    // gives exactly the loop's stalls: (2 - 0.25) + (6 - 2.0 - 3.25) for
    // step 2, (20 - 0.25 - 3.25) for step 3.
    assert!((s.predicted_tokens_per_second - s.tokens_per_second).abs() < 1e-6);
    assert!((s.measured_over_predicted - 1.0).abs() < 1e-9);
    // Timed from the step's start, the overshoots add up: step 2 pays
    // 1.75 + 2.75, step 3 pays 16.75.
    let from_start_ms = 40.0 + 1.75 + (1.75 + 1.75) + 2.75 + 16.75;
    assert!((s.predicted_from_start_tokens_per_second - 4000.0 / from_start_ms).abs() < 1e-6);
    assert_eq!(s.tables[0].by_source.get("fake"), Some(&4));
}

#[test]
fn fusion_fits_its_blocks_and_only_work_past_the_step_is_overrun() {
    let spec = LoopSpec {
        max_tokens: Some(2),
        ..LoopSpec::default()
    };
    let fast = |_: usize, _: usize| Duration::from_micros(100);
    let (_, steps, _) = run_fake(&spec, &tokens(10), fast, 3 * MS);
    assert!(
        steps
            .iter()
            .all(|r| close(r.time_us, 10_000.0) && close(r.overrun_us, 0.0))
    );
    assert!(close(steps[0].fusion_us, 6000.0));
    // 9 ms per layer: block 1 ends at 9.25, block 14 at 18.25: 8.25 past W.
    let (s, steps, _) = run_fake(&spec, &tokens(10), fast, 9 * MS);
    assert!(close(steps[0].overrun_us, 8250.0), "{:?}", steps[0]);
    assert!(close(steps[0].stall_us, 0.0));
    assert!((s.overrun_ms - 16.5).abs() < 1e-9);
    // The loop thread late into block 14 (5 ms of layer-1 fusion) while
    // layer 14's rows arrive at 4.5 ms: on the model's schedule block 14
    // started at 3.5 ms and waited 1 ms; the thread's lateness is not stall.
    let late14 = |slot: usize, _: usize| Duration::from_micros([100, 4_500][slot]);
    let (s, steps, _) = run_fake(&spec, &tokens(10), late14, 5 * MS);
    assert!(
        close(steps[0].tables[1].stall_us, 1000.0),
        "{:?}",
        steps[0].tables[1]
    );
    assert!(close(steps[0].time_us, 11_000.0) && close(steps[0].overrun_us, 0.0));
    assert!((s.measured_over_predicted - 1.0).abs() < 1e-9);
}

fn checksums(steps: &[StepRecord]) -> BTreeMap<(u32, u32), Checksum> {
    steps
        .iter()
        .flat_map(|r| r.positions.iter())
        .map(|p| ((p.seq, p.index), p.checksum))
        .collect()
}

#[test]
fn distinct_rows_are_asked_in_the_fusions_order_and_fused_where_they_landed() {
    let spec = LoopSpec {
        prefill: 30,
        ..LoopSpec::default()
    };
    let instant = |_: usize, _: usize| Duration::ZERO;
    let (_, steps, _, buffers) = run_fake_traced(&spec, &tokens(40), instant, Duration::ZERO);
    let Buffers {
        delivered, read, ..
    } = buffers;
    let fusion_read = read;
    assert_eq!(fusion_read.len(), delivered.len());
    // The prefill repeats rows: they are asked once each and gathered into
    // the fusion's layout, a buffer of the loop's own.
    assert!(steps[0].tables[0].unique_rows < 30 * 24);
    assert!(!delivered.contains(&fusion_read[0]));
    // Each decoding position asks 24 distinct rows, in the fusion's order:
    // the fusion reads the very buffer the rows were delivered in.
    assert_eq!(steps[1].tables[0].unique_rows, 24);
    for (k, (read, got)) in fusion_read.iter().zip(&delivered).enumerate().skip(2) {
        assert_eq!(read, got, "fusion call {k} read another buffer");
    }
}

#[test]
fn prefill_speculation_and_decode_fuse_bit_identical_outputs() {
    let toks = tokens(120);
    let instant = |_: usize, _: usize| Duration::ZERO;
    let (_, decode, log) = run_fake(&LoopSpec::default(), &toks, instant, Duration::ZERO);
    assert_eq!(decode.len(), 120);
    assert!(log.iter().all(|&(_, n)| n <= 24));
    let reference = checksums(&decode);
    assert_eq!(reference.len(), 120);

    // Fusion changed the states: a run whose layer-14 fetch fails differs.
    let clock = FakeClock::default();
    let mut failing = FakeFetcher::new(&clock, instant);
    failing.fail_slot = Some(1);
    let mut unfused = Vec::new();
    let s = run(
        &clock,
        &mut failing,
        &mut cpu(),
        &params(),
        v41_slots(1, 14),
        &toks,
        &LoopSpec::default(),
        &AtomicBool::new(false),
        &mut |r| {
            unfused.push(r.clone());
            Ok(())
        },
    )
    .expect("run");
    assert_eq!(s.failed_steps, 120);
    assert_eq!(s.tables[1].failed, 120);
    assert!(unfused[5].tables[1].error.is_some() && unfused[5].tables[1].source.is_none());
    let differ = checksums(&unfused)
        .iter()
        .filter(|(k, v)| reference.get(k) != Some(v))
        .count();
    assert!(differ > 100, "{differ}");

    // A 50-position prefill, then decode.
    let spec = LoopSpec {
        prefill: 50,
        ..LoopSpec::default()
    };
    let (s, steps, log) = run_fake(&spec, &toks, instant, Duration::ZERO);
    assert_eq!(steps[0].kind, StepKind::Prefill);
    assert_eq!(steps[0].positions.len(), 50);
    assert_eq!(steps[0].tables[0].rows, 50 * 24);
    // Real text repeats: the sweep asks for fewer distinct rows than it needs.
    assert!(steps[0].tables[0].unique_rows < 50 * 24);
    assert_eq!(log[0].1, steps[0].tables[0].unique_rows);
    assert_eq!((s.prefill_positions, s.tokens), (50, 70));
    assert_eq!(checksums(&steps), reference);

    // Speculation: 3 draft positions verified with each token.
    let spec = LoopSpec {
        speculate: 3,
        ..LoopSpec::default()
    };
    let (s, steps, log) = run_fake(&spec, &toks, instant, Duration::ZERO);
    assert_eq!(steps.len(), 30);
    assert!(
        steps
            .iter()
            .all(|r| r.kind == StepKind::Verify && r.positions.len() == 4)
    );
    assert!(
        steps
            .iter()
            .all(|r| r.tables[0].rows == 4 * 24 || r.positions.len() < 4)
    );
    assert_eq!(log.len(), 60, "one message per table per step");
    assert_eq!(s.tokens, 120);
    assert_eq!(checksums(&steps), reference);
}

#[test]
fn a_batch_is_one_message_per_table_per_step_and_matches_each_sequence_alone() {
    let toks = tokens(120);
    let instant = |_: usize, _: usize| Duration::ZERO;
    let spec = LoopSpec {
        batch: 3,
        ..LoopSpec::default()
    };
    let (s, steps, log) = run_fake(&spec, &toks, instant, Duration::ZERO);
    assert_eq!(steps.len(), 40);
    assert_eq!(log.len(), 80);
    assert!(steps.iter().all(|r| r.positions.len() == 3));
    assert_eq!(s.tokens, 120);
    let batched = checksums(&steps);
    for seq in 0..3u32 {
        let part = Tokens {
            raw: toks.raw[seq as usize * 40..(seq as usize + 1) * 40].to_vec(),
            compressed: toks.compressed[seq as usize * 40..(seq as usize + 1) * 40].to_vec(),
            ..toks.clone()
        };
        let (_, alone, _) = run_fake(&LoopSpec::default(), &part, instant, Duration::ZERO);
        for ((_, index), sum) in checksums(&alone) {
            assert_eq!(
                batched.get(&(seq, index)),
                Some(&sum),
                "seq {seq} position {index}"
            );
        }
    }
}

#[test]
fn token_limits_stop_and_bad_specs_are_refused() {
    let toks = tokens(100);
    let instant = |_: usize, _: usize| Duration::ZERO;
    let spec = LoopSpec {
        max_tokens: Some(10),
        speculate: 3,
        ..LoopSpec::default()
    };
    let (s, steps, _) = run_fake(&spec, &toks, instant, Duration::ZERO);
    assert_eq!(s.tokens, 10);
    assert_eq!(steps.last().map(|r| r.positions.len()), Some(2));

    let clock = FakeClock::default();
    let mut f = FakeFetcher::new(&clock, instant);
    let stop = AtomicBool::new(false);
    let mut n = 0;
    let s = run(
        &clock,
        &mut f,
        &mut cpu(),
        &params(),
        v41_slots(1, 14),
        &toks,
        &LoopSpec::default(),
        &stop,
        &mut |_| {
            n += 1;
            if n == 7 {
                stop.store(true, Ordering::Relaxed);
            }
            Ok(())
        },
    )
    .expect("run");
    assert_eq!(s.tokens, 7);

    for bad in [
        LoopSpec {
            tokens_per_second: 0.0,
            ..LoopSpec::default()
        },
        LoopSpec {
            tokens_per_second: f64::NAN,
            ..LoopSpec::default()
        },
        LoopSpec {
            batch: 0,
            ..LoopSpec::default()
        },
        LoopSpec {
            batch: 101,
            ..LoopSpec::default()
        },
    ] {
        let r = run(
            &clock,
            &mut f,
            &mut cpu(),
            &params(),
            v41_slots(1, 14),
            &toks,
            &bad,
            &AtomicBool::new(false),
            &mut |_| Ok(()),
        );
        assert!(matches!(r, Err(LoopError::Spec(_))), "{bad:?}");
    }
    // An id the hashing refuses names its place.
    let mut t = toks.clone();
    t.compressed[5] = 1 << 40;
    let e = run(
        &clock,
        &mut f,
        &mut cpu(),
        &params(),
        v41_slots(1, 14),
        &t,
        &LoopSpec::default(),
        &AtomicBool::new(false),
        &mut |_| Ok(()),
    )
    .expect_err("bad id")
    .to_string();
    assert!(e.contains("position 5"), "{e}");
}

#[test]
fn trace_lines_read_back_as_the_records_written() {
    let spec = LoopSpec {
        max_tokens: Some(6),
        prefill: 4,
        ..LoopSpec::default()
    };
    let (_, steps, _) = run_fake(&spec, &tokens(20), |_, _| 2 * MS, Duration::ZERO);
    for r in &steps {
        let line = serde_json::to_string(r).expect("JSON");
        let back: StepRecord = serde_json::from_str(&line).expect("reads back");
        assert_eq!(&back, r);
    }
    let bad = serde_json::to_string(&steps[1])
        .expect("JSON")
        .replace("\"decode\"", "\"sideways\"");
    let e = serde_json::from_str::<StepRecord>(&bad).expect_err("unknown kind");
    assert!(e.to_string().contains("sideways"), "{e}");
}

#[test]
fn draft_prefetch_fetches_each_draft_as_it_appears_and_fuses_identical_outputs() {
    let toks = tokens(120);
    let instant = |_: usize, _: usize| Duration::ZERO;
    let reference = checksums(&run_fake(&LoopSpec::default(), &toks, instant, Duration::ZERO).1);
    let spec = |prefetch| LoopSpec {
        speculate: 3,
        max_tokens: Some(40),
        draft: Some(Draft {
            per_token: MS,
            prefetch,
            reject_percent: 0,
        }),
        ..LoopSpec::default()
    };
    // Without prefetch: one message per table when the pass starts (3 ms
    // in), its 96 rows taking 2 ms: table 1 (window 0.25 ms) stalls 1.75 ms.
    let (s, off, log) = run_fake(&spec(false), &toks, |_, _| 2 * MS, Duration::ZERO);
    assert_eq!(log.len(), 20, "one message per table per step");
    for r in &off {
        assert!(close(r.draft_us, 3000.0), "{}", r.draft_us);
        assert!(close(r.tables[0].ready_us, 2000.0));
        assert!(close(r.tables[0].stall_us, 1750.0), "{:?}", r.tables[0]);
        assert!(
            close(r.time_us, 3000.0 + 10_000.0 + 1750.0),
            "{}",
            r.time_us
        );
    }
    assert!(close(s.draft_s, 10.0 * 3e-3));
    // Slowdown counts stalls, not the drafts' time.
    assert!(
        close(s.slowdown, 10.0 * 1.75 / (10.0 * 13.0)),
        "{}",
        s.slowdown
    );
    // With prefetch: a message per position group as it appears (0, 1, 2
    // and 3 ms), each of 24 rows taking 0.5 ms: the last is ready 0.5 ms
    // into the pass, so table 1 stalls 0.25 ms.
    let (s2, on, log) = run_fake(&spec(true), &toks, |_, _| MS / 2, Duration::ZERO);
    assert!(log.len() > 20 && log.len() <= 80, "{}", log.len());
    assert!(log.iter().all(|&(_, n)| n <= 24));
    for r in &on {
        assert!(close(r.tables[0].ready_us, 500.0), "{:?}", r.tables[0]);
        assert!(close(r.tables[0].stall_us, 250.0), "{:?}", r.tables[0]);
        assert!(r.tables[0].messages > 1);
        assert_eq!(r.tables[0].rows, 4 * 24);
    }
    assert!(s2.tokens_per_second > s.tokens_per_second);
    // The same outputs either way, and the same as plain decoding.
    let (a, b) = (checksums(&off), checksums(&on));
    assert_eq!(a, b);
    assert_eq!(a.len(), 40);
    assert!(a.iter().all(|(k, v)| reference.get(k) == Some(v)));
}

#[test]
fn rejected_drafts_waste_their_rows_but_never_change_the_outputs_kept() {
    let toks = tokens(200);
    let instant = |_: usize, _: usize| Duration::ZERO;
    let plain = LoopSpec {
        max_tokens: Some(60),
        ..LoopSpec::default()
    };
    let (ref_summary, ref_steps, _) = run_fake(&plain, &toks, instant, Duration::ZERO);
    let reference = checksums(&ref_steps);
    assert_eq!(reference.len(), 60);
    let spec = |reject_percent, prefetch| LoopSpec {
        speculate: 4,
        max_tokens: Some(60),
        draft: Some(Draft {
            per_token: MS,
            prefetch,
            reject_percent,
        }),
        ..LoopSpec::default()
    };
    let (none, none_steps, _) = run_fake(&spec(0, false), &toks, instant, Duration::ZERO);
    assert_eq!((none.rejected_positions, none.wasted_bytes), (0, 0));
    assert_eq!(none_steps.len(), 12, "5 positions a step, all kept");
    for prefetch in [false, true] {
        let (s, steps, _) = run_fake(&spec(40, prefetch), &toks, instant, Duration::ZERO);
        assert!(s.rejected_positions > 10, "{}", s.rejected_positions);
        assert!(s.wasted_bytes > 0);
        assert!(
            steps.len() > 12,
            "rejections cost steps: {} steps",
            steps.len()
        );
        // Every step keeps at least its known position.
        assert!(steps.iter().all(|r| !r.positions.is_empty()));
        // The kept outputs are the plain run's, bit for bit, position for
        // position, and their digest says so.
        assert_eq!(checksums(&steps), reference);
        assert_eq!(s.tokens, 60);
        assert_eq!(s.outputs_digest, ref_summary.outputs_digest);
        assert_eq!(
            steps.iter().map(|r| r.rejected).sum::<u64>(),
            s.rejected_positions
        );
    }
    // Every draft wrong: one position a step, the drafts all wasted.
    let (all, steps, _) = run_fake(&spec(100, false), &toks, instant, Duration::ZERO);
    assert_eq!(steps.len(), 60);
    // Four drafts a step, fewer as the last positions of `max_tokens`
    // leave less room: 56 x 4 + 3 + 2 + 1.
    assert_eq!(all.rejected_positions, 56 * 4 + 3 + 2 + 1);
    assert_eq!(all.outputs_digest, ref_summary.outputs_digest);
}

#[test]
fn a_draft_stand_in_needs_speculation_and_a_bounded_time() {
    let toks = tokens(20);
    let clock = FakeClock::default();
    let mut fetcher = FakeFetcher::new(&clock, |_, _| Duration::ZERO);
    for (spec, want) in [
        (
            LoopSpec {
                draft: Some(Draft {
                    per_token: MS,
                    prefetch: true,
                    reject_percent: 0,
                }),
                ..LoopSpec::default()
            },
            "needs speculation",
        ),
        (
            LoopSpec {
                speculate: 2,
                draft: Some(Draft {
                    per_token: MAX_DRAFT_TIME + MS,
                    prefetch: false,
                    reject_percent: 0,
                }),
                ..LoopSpec::default()
            },
            "over the limit",
        ),
        (
            LoopSpec {
                speculate: 2,
                draft: Some(Draft {
                    per_token: MS,
                    prefetch: false,
                    reject_percent: 101,
                }),
                ..LoopSpec::default()
            },
            "over 100%",
        ),
    ] {
        let e = run(
            &clock,
            &mut fetcher,
            &mut cpu(),
            &params(),
            v41_slots(1, 14),
            &toks,
            &spec,
            &AtomicBool::new(false),
            &mut |_| Ok(()),
        )
        .expect_err("refused");
        assert!(e.to_string().contains(want), "{e}");
    }
}

/// A batch of four decoders that a long prefill joins at step 5.
struct Join {
    tokens: Arc<Tokens>,
    step: usize,
    prefill: usize,
    records: Vec<StepRecord>,
}

impl BatchDriver for Join {
    fn admit(&mut self, running: usize) -> Vec<SeqSpec> {
        let seq = |tag: u64, range: std::ops::Range<usize>, prefill, limit| SeqSpec {
            tag,
            tokens: Arc::clone(&self.tokens),
            range,
            prefill,
            speculate: 0,
            limit: Some(limit),
        };
        let out = match self.step {
            0 => (0..4u64).map(|t| seq(t, 0..100, 0, 30)).collect::<Vec<_>>(),
            5 => vec![seq(9, 0..self.prefill + 10, self.prefill, 3)],
            _ => Vec::new(),
        };
        assert!(running <= 5);
        out
    }

    fn cancelled(&mut self) -> Vec<u64> {
        Vec::new()
    }

    fn after_step(&mut self, rec: Option<&StepRecord>, _finished: &[u64]) {
        self.step += 1;
        if let Some(r) = rec {
            self.records.push(r.clone());
        }
    }
}

/// Run [`Join`] with a prefill budget; its step records.
fn join_with_budget(budget: usize) -> Vec<StepRecord> {
    let toks = Arc::new(tokens(700));
    let clock = FakeClock::default();
    let mut fetcher = FakeFetcher::new(&clock, |_, _| Duration::ZERO);
    // 1 us a row: a 24-row position costs 24 us of fetch.
    fetcher.per_row = Duration::from_micros(1);
    let spec = LoopSpec {
        prefill_budget: budget,
        ..LoopSpec::default()
    };
    let mut driver = Join {
        tokens: toks,
        step: 0,
        prefill: 512,
        records: Vec::new(),
    };
    run_batch(
        &clock,
        &mut fetcher,
        &mut cpu(),
        &params(),
        v41_slots(1, 14),
        &spec,
        &mut driver,
    )
    .expect("the batch runs");
    driver.records
}

#[test]
fn a_joining_prefill_comes_in_chunks_and_the_decoders_keep_their_step_time() {
    let decoders = |r: &StepRecord| r.positions.iter().filter(|p| p.seq != 9).count();
    let joined = |recs: &[StepRecord]| -> BTreeMap<u32, Checksum> {
        recs.iter()
            .flat_map(|r| &r.positions)
            .filter(|p| p.seq == 9)
            .map(|p| (p.index, p.checksum))
            .collect()
    };
    // No budget: the joiner's 512 positions in one step, the decoders
    // waiting for their rows behind it (up to 12,288 distinct rows a
    // table: milliseconds of stall).
    let whole = join_with_budget(0);
    let worst_whole = whole.iter().map(|r| r.time_us).fold(0.0, f64::max);
    let w_us = whole[0].w_us;
    assert!(worst_whole > w_us + 5_000.0, "{worst_whole} us");
    // A budget of 64: the prefill in 8 chunks, each beside the decoders'
    // positions, every step within its W plus a 64-position fetch.
    let chunked = join_with_budget(64);
    let chunks: Vec<&StepRecord> = chunked.iter().filter(|r| r.prefilled > 0).collect();
    assert_eq!(
        chunks.len(),
        8,
        "{:?}",
        chunks.iter().map(|r| r.prefilled).collect::<Vec<_>>()
    );
    for r in &chunks {
        assert_eq!(r.prefilled, 64);
        assert_eq!(decoders(r), 4, "the decoders run beside each chunk");
        assert!(
            r.time_us <= w_us + (64.0 + 4.0) * 24.0 + 1.0,
            "a step of {} us (W {w_us} us)",
            r.time_us
        );
    }
    let worst_chunked = chunked.iter().map(|r| r.time_us).fold(0.0, f64::max);
    assert!(
        (worst_chunked - w_us) * 4.0 < worst_whole - w_us,
        "the worst step over W: {worst_chunked} vs {worst_whole} us"
    );
    // The same outputs either way: the joiner's prefill and decode, and
    // the decoders'.
    assert_eq!(joined(&whole), joined(&chunked));
    assert_eq!(joined(&chunked).len(), 512 + 3);
    let all = |recs: &[StepRecord]| -> BTreeMap<(u32, u32), Checksum> {
        recs.iter()
            .flat_map(|r| &r.positions)
            .map(|p| ((p.seq, p.index), p.checksum))
            .collect()
    };
    assert_eq!(all(&whole), all(&chunked));
}

#[test]
fn a_checksum_is_written_and_read_as_16_hex_digits() {
    let c = checksum(&[1.0, -2.5, 3.25]);
    let hex = c.to_string();
    assert_eq!(hex.len(), 16);
    assert!(
        hex.bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    );
    assert_eq!(hex.parse::<Checksum>(), Ok(c));
    let json = serde_json::to_string(&c).expect("json");
    assert_eq!(json, format!("\"{hex}\""));
    assert_eq!(serde_json::from_str::<Checksum>(&json).expect("read"), c);
    for bad in [
        "",
        "0123",
        "0123456789abcdeg",
        "0123456789abcdef0",
        "é123456789abcde",
    ] {
        assert!(bad.parse::<Checksum>().is_err(), "{bad:?}");
        assert!(serde_json::from_str::<Checksum>(&format!("\"{bad}\"")).is_err());
    }
}
