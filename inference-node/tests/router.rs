//! The router under paused tokio time, driven by a fake source with fault
//! injection: hedging at the right moment, failover, breakers that open,
//! half-open and close, re-admission by probes, version exclusion, corrupt
//! answers never returned, the hard timeout and both policies, and
//! reconfiguration while lookups run.

mod fake;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use cluster_config::{Hedge, Policy};
use inference_node::router::{Breaker, MissReason, RouterError};
use inference_node::source::SourceError;
use tokio::time::Instant;

use fake::*;

#[tokio::test(start_paused = true)]
async fn the_primary_answers_alone_when_it_is_fast() {
    let a = Fake::new("a", Fault::Ok(us(40)));
    let b = Fake::new("b", Fault::Ok(us(40)));
    let r = rig(&[&a, &b], settings(Hedge::Fixed(us(100)), Policy::Fail));
    let (res, out) = fetch(&r).await;
    let f = res.expect("fetched");
    assert_eq!(f.source.as_deref(), Some("a"));
    assert_eq!((f.hedges, f.failovers, f.late), (0, 0, false));
    assert_eq!(f.elapsed, us(40));
    assert_eq!(b.calls(), 0);
    assert_rows(&out);
    assert_eq!(
        metric(
            &r,
            "engram_node_rows_served_total{table=\"1\",source=\"a\"}"
        ),
        "24"
    );
}

#[tokio::test(start_paused = true)]
async fn fetch_vec_hands_over_the_buffer_the_source_filled_without_a_copy() {
    let a = Fake::new("a", Fault::Ok(us(40)));
    let r = rig(&[&a], settings(Hedge::Off, Policy::Fail));
    let mut out = Vec::new();
    let mut seen = Vec::new();
    for _ in 0..4 {
        let f = r.router.fetch_vec(&ROWS, &mut out).await.expect("fetched");
        assert_eq!(f.source.as_deref(), Some("a"));
        // The very buffer the source wrote the rows into.
        assert_eq!(out.as_ptr() as usize, a.filled.load(Ordering::SeqCst));
        assert_rows(&out);
        seen.push(out.as_ptr() as usize);
    }
    // Two buffers take turns: the caller's, and the one in the pool.
    seen.sort_unstable();
    seen.dedup();
    assert!(seen.len() <= 2, "{} distinct buffers", seen.len());
    // A fetch that fails leaves the caller's buffer as it was; zeros fill it.
    a.set(Fault::Fail(us(1), SourceError::Unavailable("gone".into())));
    let before = out.clone();
    assert!(r.router.fetch_vec(&ROWS, &mut out).await.is_err());
    assert_eq!(out, before);
    let z = rig(&[&a], settings(Hedge::Off, Policy::Zeros));
    let f = z.router.fetch_vec(&ROWS, &mut out).await.expect("zeros");
    assert!(f.is_zeros());
    assert_eq!(out, vec![0u8; ROWS.len() * engram_protocol::ROW_BYTES]);
}

#[tokio::test(start_paused = true)]
async fn a_hedge_goes_out_at_the_hedge_delay_and_its_rows_win() {
    let a = Fake::new("a", Fault::Ok(us(1_000)));
    let b = Fake::new("b", Fault::Ok(us(60)));
    let r = rig(&[&a, &b], settings(Hedge::Fixed(us(100)), Policy::Fail));
    let (res, out) = fetch(&r).await;
    let f = res.expect("fetched");
    assert_eq!(f.source.as_deref(), Some("b"));
    assert_eq!(f.hedges, 1);
    // Hedge sent at 100 us, answered 60 us later.
    assert_eq!(f.elapsed, us(160));
    assert!(!f.late);
    assert_rows(&out);
    assert_eq!(
        metric(&r, "engram_node_hedges_sent_total{table=\"1\"}"),
        "1"
    );
    assert_eq!(
        metric(&r, "engram_node_hedges_won_total{table=\"1\",source=\"b\"}"),
        "1"
    );
}

#[tokio::test(start_paused = true)]
async fn the_hedge_never_waits_past_the_deadline() {
    let a = Fake::new("a", Fault::Ok(us(5_000)));
    let b = Fake::new("b", Fault::Ok(us(10)));
    let r = rig(&[&a, &b], settings(Hedge::Fixed(us(2_000)), Policy::Fail));
    let f = fetch(&r).await.0.expect("fetched");
    // Deadline = window 250 + grace 50: the hedge goes then, not at 2 ms.
    assert_eq!(f.elapsed, us(310));
    assert!(f.late);
    assert_eq!(
        metric(&r, "engram_node_deadline_misses_total{table=\"1\"}"),
        "1"
    );

    // Hedging off: the next source still gets the lookup at the deadline.
    let r = rig(&[&a, &b], settings(Hedge::Off, Policy::Fail));
    let f = fetch(&r).await.0.expect("fetched");
    assert_eq!((f.source.as_deref(), f.elapsed), (Some("b"), us(310)));
}

#[tokio::test(start_paused = true)]
async fn percentile_hedging_follows_recent_latencies() {
    let a = Fake::new("a", Fault::Ok(us(80)));
    let b = Fake::new("b", Fault::Ok(us(10)));
    let r = rig(&[&a, &b], settings(Hedge::Percentile(99.0), Policy::Fail));
    for _ in 0..40 {
        assert_eq!(fetch(&r).await.0.expect("ok").source.as_deref(), Some("a"));
    }
    assert_eq!(
        b.calls(),
        0,
        "no hedge while the primary is at its usual speed"
    );
    // Now the primary slows down: the hedge goes at its p99 (80 us, to the
    // latency histogram's 1% precision), and b answers 10 us later.
    a.set(Fault::Ok(us(400)));
    let f = fetch(&r).await.0.expect("ok");
    assert_eq!((f.source.as_deref(), f.hedges), (Some("b"), 1));
    assert!(
        f.elapsed >= us(90) && f.elapsed <= us(91),
        "hedged at {:?}",
        f.elapsed - us(10)
    );
}

#[tokio::test(start_paused = true)]
async fn a_failure_moves_to_the_next_source_at_once() {
    let a = Fake::new(
        "a",
        Fault::Fail(us(20), SourceError::Unavailable("refused".into())),
    );
    let b = Fake::new("b", Fault::Ok(us(30)));
    let r = rig(&[&a, &b], settings(Hedge::Fixed(us(200)), Policy::Fail));
    let (res, out) = fetch(&r).await;
    let f = res.expect("fetched");
    assert_eq!(
        (f.source.as_deref(), f.failovers, f.elapsed),
        (Some("b"), 1, us(50))
    );
    assert_rows(&out);
    assert_eq!(
        metric(
            &r,
            "engram_node_source_errors_total{table=\"1\",source=\"a\",kind=\"unavailable\"}"
        ),
        "1"
    );
}

#[tokio::test(start_paused = true)]
async fn the_breaker_opens_half_opens_on_a_probe_and_closes_on_success() {
    let a = Fake::new(
        "a",
        Fault::Fail(us(5), SourceError::Unavailable("down".into())),
    );
    let b = Fake::new("b", Fault::Ok(us(30)));
    let r = rig(&[&a, &b], settings(Hedge::Fixed(us(200)), Policy::Fail));
    a.healthy.store(false, Ordering::SeqCst);
    for _ in 0..3 {
        fetch(&r).await.0.expect("b answers");
    }
    assert_eq!(r.health[0].breaker(), Breaker::Open);
    assert_eq!(metric(&r, "engram_node_breaker_state{source=\"a\"}"), "2");
    // Open: no traffic at all.
    for _ in 0..5 {
        assert_eq!(fetch(&r).await.0.expect("ok").elapsed, us(30));
    }
    assert_eq!(a.calls(), 3);
    // A failing probe keeps it open.
    r.health[0].probe().await;
    assert_eq!(r.health[0].breaker(), Breaker::Open);
    // The donor comes back: the probe half-opens, a good lookup closes.
    a.healthy.store(true, Ordering::SeqCst);
    a.set(Fault::Ok(us(20)));
    r.health[0].probe().await;
    assert_eq!(r.health[0].breaker(), Breaker::HalfOpen);
    let f = fetch(&r).await.0.expect("ok");
    assert_eq!(f.source.as_deref(), Some("a"));
    assert_eq!(r.health[0].breaker(), Breaker::Closed);
    assert_eq!(metric(&r, "engram_node_breaker_state{source=\"a\"}"), "0");
}

#[tokio::test(start_paused = true)]
async fn a_failure_while_half_open_opens_again() {
    let a = Fake::new("a", Fault::Fail(us(5), SourceError::Timeout));
    let b = Fake::new("b", Fault::Ok(us(30)));
    let r = rig(&[&a, &b], settings(Hedge::Fixed(us(200)), Policy::Fail));
    for _ in 0..3 {
        fetch(&r).await.0.expect("ok");
    }
    r.health[0].probe().await;
    assert_eq!(r.health[0].breaker(), Breaker::HalfOpen);
    fetch(&r).await.0.expect("ok");
    assert_eq!(
        r.health[0].breaker(),
        Breaker::Open,
        "one failure on trial reopens"
    );
}

#[tokio::test(start_paused = true)]
async fn a_lost_race_on_trial_counts_but_does_not_reopen_at_once() {
    // Back from a restart, the primary is slower than its peer for a while.
    let a = Fake::new("a", Fault::Hang);
    let b = Fake::new("b", Fault::Ok(us(30)));
    let r = rig(&[&a, &b], settings(Hedge::Fixed(us(100)), Policy::Fail));
    for _ in 0..3 {
        fetch(&r).await.0.expect("the hedge answers");
    }
    assert_eq!(r.health[0].breaker(), Breaker::Open);
    r.health[0].probe().await;
    assert_eq!(r.health[0].breaker(), Breaker::HalfOpen);
    a.set(Fault::Ok(us(300)));
    for _ in 0..2 {
        assert_eq!(fetch(&r).await.0.expect("ok").source.as_deref(), Some("b"));
        assert_eq!(
            r.health[0].breaker(),
            Breaker::HalfOpen,
            "a lost race on trial is not a failure"
        );
    }
    // Its answers speed up: the trial succeeds and the breaker closes.
    a.set(Fault::Ok(us(40)));
    assert_eq!(fetch(&r).await.0.expect("ok").source.as_deref(), Some("a"));
    assert_eq!(r.health[0].breaker(), Breaker::Closed);

    // Losing every race still opens it, on trial too.
    a.set(Fault::Hang);
    for _ in 0..3 {
        fetch(&r).await.0.expect("the hedge answers");
    }
    assert_eq!(r.health[0].breaker(), Breaker::Open);
    r.health[0].probe().await;
    for _ in 0..3 {
        fetch(&r).await.0.expect("the hedge answers");
    }
    assert_eq!(r.health[0].breaker(), Breaker::Open);
}

#[tokio::test(start_paused = true)]
async fn background_probes_readmit_a_quiet_source_within_two_intervals() {
    let a = Fake::new(
        "a",
        Fault::Fail(us(5), SourceError::Unavailable("down".into())),
    );
    let b = Fake::new("b", Fault::Ok(us(30)));
    let r = rig(&[&a, &b], settings(Hedge::Fixed(us(200)), Policy::Fail));
    for _ in 0..3 {
        fetch(&r).await.0.expect("ok");
    }
    assert_eq!(r.health[0].breaker(), Breaker::Open);
    let interval = us(1_000);
    tokio::spawn(r.health[0].clone().probe_loop(interval));
    let healed = Instant::now();
    while r.health[0].breaker() != Breaker::Closed {
        tokio::time::sleep(us(1)).await;
        assert!(healed.elapsed() <= 2 * interval + us(1), "not re-admitted");
    }
}

#[tokio::test(start_paused = true)]
async fn a_hung_source_loses_every_race_and_its_breaker_opens() {
    let a = Fake::new("a", Fault::Hang);
    let b = Fake::new("b", Fault::Ok(us(30)));
    let r = rig(&[&a, &b], settings(Hedge::Fixed(us(100)), Policy::Fail));
    for _ in 0..3 {
        let f = fetch(&r).await.0.expect("the hedge answers");
        assert_eq!((f.source.as_deref(), f.elapsed), (Some("b"), us(130)));
    }
    assert_eq!(r.health[0].breaker(), Breaker::Open);
    // Now lookups go straight to b.
    assert_eq!(fetch(&r).await.0.expect("ok").elapsed, us(30));
}

#[tokio::test(start_paused = true)]
async fn a_version_mismatch_excludes_the_source_until_its_digest_matches() {
    let a = Fake::new(
        "a",
        Fault::Fail(
            us(5),
            SourceError::VersionMismatch {
                table: TABLE,
                detail: "other".into(),
            },
        ),
    );
    let b = Fake::new("b", Fault::Ok(us(30)));
    let r = rig(&[&a, &b], settings(Hedge::Fixed(us(200)), Policy::Fail));
    *a.digest.lock() = OTHER;
    fetch(&r).await.0.expect("b answers");
    assert!(!r.health[0].admissible(TABLE));
    assert_eq!(
        r.health[0].breaker(),
        Breaker::Closed,
        "not a fault, a version"
    );
    fetch(&r).await.0.expect("ok");
    assert_eq!(a.calls(), 1, "excluded: never asked again");
    r.health[0].probe().await;
    assert!(!r.health[0].admissible(TABLE), "still the wrong digest");
    *a.digest.lock() = PINNED;
    a.set(Fault::Ok(us(10)));
    r.health[0].probe().await;
    assert!(r.health[0].admissible(TABLE));
    assert_eq!(fetch(&r).await.0.expect("ok").source.as_deref(), Some("a"));
    assert_eq!(
        metric(
            &r,
            "engram_node_version_mismatches_total{table=\"1\",source=\"a\"}"
        ),
        "1"
    );
}

#[tokio::test(start_paused = true)]
async fn corrupt_answers_are_never_returned() {
    let a = Fake::new("a", Fault::BadBytes(us(10)));
    let b = Fake::new("b", Fault::Ok(us(30)));
    let c = Fake::new(
        "c",
        Fault::Fail(us(10), SourceError::Corrupt("checksum".into())),
    );
    let r = rig(&[&a, &c, &b], settings(Hedge::Fixed(us(200)), Policy::Fail));
    let (res, out) = fetch(&r).await;
    let f = res.expect("b answers");
    assert_eq!((f.source.as_deref(), f.failovers), (Some("b"), 2));
    assert_rows(&out);
    assert_eq!(
        metric(
            &r,
            "engram_node_checksum_failures_total{table=\"1\",source=\"a\"}"
        ),
        "1"
    );
    assert_eq!(
        metric(
            &r,
            "engram_node_checksum_failures_total{table=\"1\",source=\"c\"}"
        ),
        "1"
    );
    // With nothing good left, the caller gets an error, never the bytes.
    let r = rig(&[&a], settings(Hedge::Off, Policy::Fail));
    let (res, out) = fetch(&r).await;
    // The error keeps each source's cause, typed: a's answer was corrupt.
    match &res {
        Err(RouterError::AllFailed { attempts, .. }) => assert!(
            matches!(
                attempts.as_slice(),
                [m] if m.source == "a" && matches!(m.why, MissReason::Failed(SourceError::Corrupt(_)))
            ),
            "{attempts:?}"
        ),
        other => panic!("expected AllFailed, got {other:?}"),
    }
    assert!(
        out.iter().all(|&b| b == 0xAA),
        "the caller's buffer is untouched"
    );
}

#[tokio::test(start_paused = true)]
async fn a_draining_source_gets_no_new_lookups() {
    let a = Fake::new("a", Fault::Ok(us(10)));
    let b = Fake::new("b", Fault::Ok(us(30)));
    let r = rig(&[&a, &b], settings(Hedge::Fixed(us(200)), Policy::Fail));
    a.draining.store(true, Ordering::SeqCst);
    let f = fetch(&r).await.0.expect("ok");
    assert_eq!(
        (f.source.as_deref(), f.elapsed, f.failovers),
        (Some("b"), us(30), 0)
    );
    assert_eq!(a.calls(), 0);
    assert_eq!(r.health[0].breaker(), Breaker::Closed);
}

#[tokio::test(start_paused = true)]
async fn the_hard_timeout_bounds_a_lookup_and_the_policy_decides() {
    let a = Fake::new("a", Fault::Hang);
    let b = Fake::new("b", Fault::Hang);
    let r = rig(&[&a, &b], settings(Hedge::Fixed(us(100)), Policy::Fail));
    let start = Instant::now();
    let (res, out) = fetch(&r).await;
    assert_eq!(start.elapsed(), us(2_000));
    match res {
        Err(RouterError::AllFailed {
            table, attempts, ..
        }) => {
            assert_eq!(table, TABLE);
            assert!(
                attempts
                    .iter()
                    .any(|a| matches!(a.why, MissReason::HardTimeout(_))),
                "{attempts:?}"
            );
        }
        other => panic!("expected AllFailed, got {other:?}"),
    }
    assert!(out.iter().all(|&b| b == 0xAA));
    assert_eq!(
        metric(&r, "engram_node_failed_lookups_total{table=\"1\"}"),
        "1"
    );

    let r = rig(&[&a, &b], settings(Hedge::Fixed(us(100)), Policy::Zeros));
    let (res, out) = fetch(&r).await;
    let f = res.expect("zeros by policy");
    assert!(f.is_zeros());
    assert!(out.iter().all(|&b| b == 0));
    assert_eq!(
        metric(&r, "engram_node_zeros_served_total{table=\"1\"}"),
        "1"
    );
}

#[tokio::test(start_paused = true)]
async fn when_every_source_fails_fast_the_policy_answers_without_waiting() {
    let e = SourceError::Unavailable("refused".into());
    let a = Fake::new("a", Fault::Fail(us(5), e.clone()));
    let b = Fake::new("b", Fault::Fail(us(5), e));
    let r = rig(&[&a, &b], settings(Hedge::Fixed(us(100)), Policy::Zeros));
    let f = fetch(&r).await.0.expect("zeros");
    assert!(f.is_zeros());
    assert_eq!(f.elapsed, us(10));
    let r = rig(&[&a, &b], settings(Hedge::Fixed(us(100)), Policy::Fail));
    let err = fetch(&r).await.0.expect_err("fails");
    let msg = err.to_string();
    assert!(
        msg.contains("a: unavailable: refused") && msg.contains("b: unavailable"),
        "{msg}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_bad_request_is_not_retried_elsewhere() {
    let a = Fake::new(
        "a",
        Fault::Fail(
            us(5),
            SourceError::BadRequest("row 9e9 out of range".into()),
        ),
    );
    let b = Fake::new("b", Fault::Ok(us(5)));
    let r = rig(&[&a, &b], settings(Hedge::Fixed(us(100)), Policy::Zeros));
    let err = fetch(&r).await.0.expect_err("bad request");
    assert!(matches!(err, RouterError::BadRequest { .. }), "{err:?}");
    assert_eq!(b.calls(), 0);
    assert_eq!(r.health[0].breaker(), Breaker::Closed);
}

#[tokio::test(start_paused = true)]
async fn a_reconfiguration_applies_from_the_next_lookup() {
    let a = Fake::new("a", Fault::Hang);
    let b = Fake::new("b", Fault::Ok(us(10)));
    let r = rig(&[&a, &b], settings(Hedge::Fixed(us(100)), Policy::Fail));
    let f = fetch(&r).await.0.expect("the hedge answers");
    assert_eq!((f.source.as_deref(), f.elapsed), (Some("b"), us(110)));

    // Hedging off and a longer grace: b is asked at the new deadline.
    let mut s = settings(Hedge::Off, Policy::Fail);
    s.grace = us(150);
    r.router.reconfigure(s, r.health.clone(), &r.metrics);
    let now = r.router.settings();
    assert_eq!((now.hedge, now.grace), (Hedge::Off, us(150)));
    let f = fetch(&r).await.0.expect("b at the deadline");
    assert_eq!((f.source.as_deref(), f.elapsed), (Some("b"), us(410)));

    // A shorter window, no grace: the deadline moves in.
    let mut s = settings(Hedge::Off, Policy::Fail);
    (s.window, s.grace) = (us(100), us(0));
    r.router.reconfigure(s, r.health.clone(), &r.metrics);
    let f = fetch(&r).await.0.expect("b at the deadline");
    assert_eq!(f.elapsed, us(110));

    // Policy zeros and a shorter hard timeout, over a hung source alone
    // (a lost three races: its breaker is open).
    assert_eq!(r.health[0].breaker(), Breaker::Open);
    let c = Fake::new("c", Fault::Hang);
    let mut s = settings(Hedge::Off, Policy::Zeros);
    s.hard_timeout = us(500);
    r.router
        .reconfigure(s, vec![health(&r.metrics, &c)], &r.metrics);
    assert_eq!(r.router.settings().policy, Policy::Zeros);
    let start = Instant::now();
    let f = fetch(&r).await.0.expect("zeros by policy");
    assert!(f.is_zeros());
    assert_eq!(start.elapsed(), us(500));
}

#[tokio::test(start_paused = true)]
async fn reconfigured_sources_are_asked_in_their_new_order() {
    let a = Fake::new("a", Fault::Ok(us(10)));
    let b = Fake::new("b", Fault::Ok(us(10)));
    let c = Fake::new("c", Fault::Ok(us(10)));
    let r = rig(&[&a, &b], settings(Hedge::Fixed(us(100)), Policy::Fail));
    assert_eq!(fetch(&r).await.0.expect("ok").source.as_deref(), Some("a"));

    // a removed, b first, c added.
    let hc = health(&r.metrics, &c);
    let s = settings(Hedge::Fixed(us(100)), Policy::Fail);
    r.router
        .reconfigure(s, vec![r.health[1].clone(), hc.clone()], &r.metrics);
    let names: Vec<String> = r
        .router
        .sources()
        .iter()
        .map(|h| h.source.name().to_string())
        .collect();
    assert_eq!(names, ["b", "c"]);
    assert!(
        Arc::ptr_eq(&r.router.sources()[0], &r.health[1]),
        "b's health is kept"
    );
    let (res, out) = fetch(&r).await;
    assert_eq!(res.expect("ok").source.as_deref(), Some("b"));
    assert_rows(&out);
    b.set(Fault::Fail(us(5), SourceError::Unavailable("down".into())));
    let f = fetch(&r).await.0.expect("c answers");
    assert_eq!((f.source.as_deref(), f.failovers), (Some("c"), 1));
    assert_eq!(a.calls(), 1, "a removed: never asked again");
    assert_eq!(
        metric(
            &r,
            "engram_node_rows_served_total{table=\"1\",source=\"c\"}"
        ),
        "24"
    );
}

#[tokio::test(start_paused = true)]
async fn a_lookup_in_flight_finishes_with_what_it_started_with() {
    let a = Fake::new("a", Fault::Ok(us(400)));
    let b = Fake::new("b", Fault::Ok(us(10)));
    let r = rig(&[&a], settings(Hedge::Off, Policy::Fail));
    let hb = health(&r.metrics, &b);
    let reconfigure = async {
        tokio::time::sleep(us(50)).await;
        let mut s = settings(Hedge::Fixed(us(100)), Policy::Zeros);
        s.hard_timeout = us(200);
        r.router
            .reconfigure(s, vec![hb.clone(), r.health[0].clone()], &r.metrics);
    };
    let ((res, out), ()) = tokio::join!(fetch(&r), reconfigure);
    // Started on [a], no hedge, a 2 ms hard timeout: a answers late, alone.
    let f = res.expect("a answers");
    assert_eq!(
        (f.source.as_deref(), f.elapsed, f.hedges, f.late),
        (Some("a"), us(400), 0, true)
    );
    assert_rows(&out);
    assert_eq!(b.calls(), 0);
    // The next lookup uses the new sources.
    let f = fetch(&r).await.0.expect("b answers");
    assert_eq!((f.source.as_deref(), f.elapsed), (Some("b"), us(10)));
}

#[tokio::test(start_paused = true)]
async fn at_the_hard_timeout_the_copy_still_gets_its_read() {
    // Hedging off and both donors hung: the second donor is asked at the
    // deadline, the copy never before the hard timeout, then it is.
    let a = Fake::new("a", Fault::Hang);
    let b = Fake::new("b", Fault::Hang);
    let ssd = Fake::copy("ssd", Fault::Ok(us(30)));
    let r = rig(&[&a, &b, &ssd], settings(Hedge::Off, Policy::Fail));
    let (res, out) = fetch(&r).await;
    let f = res.expect("the copy answers after the hard timeout");
    assert_eq!(f.source.as_deref(), Some("ssd"));
    // Hard timeout 2000, then one read of the copy.
    assert_eq!(f.elapsed, us(2_030));
    assert!(f.late);
    assert_rows(&out);
    assert_eq!(ssd.calls(), 1);

    // A copy already in flight at the hard timeout is waited for, not
    // dropped; the donors still out are.
    let slow_ssd = Fake::copy("ssd", Fault::Ok(us(2_500)));
    let r = rig(
        &[&a, &slow_ssd],
        settings(Hedge::Fixed(us(100)), Policy::Fail),
    );
    let f = fetch(&r).await.0.expect("the copy in flight answers");
    assert_eq!((f.source.as_deref(), f.elapsed), (Some("ssd"), us(2_600)));

    // A copy that hangs too is bounded by one more hard timeout (at
    // least COPY_READ_LIMIT, 1 s; this test counts in milliseconds).
    let dead = Fake::copy("ssd", Fault::Hang);
    let r = rig(&[&a, &dead], settings(Hedge::Off, Policy::Fail));
    let start = Instant::now();
    assert!(fetch(&r).await.0.is_err());
    assert_eq!(start.elapsed(), us(4_000));

    // No copy in the route: the hard timeout is the end.
    let r = rig(&[&a, &b], settings(Hedge::Off, Policy::Fail));
    let start = Instant::now();
    assert!(fetch(&r).await.0.is_err());
    assert_eq!(start.elapsed(), us(2_000));
}

/// Distinct rows for a wide sweep: `n` of them, spread over the table.
fn sweep_rows(n: u64) -> Vec<u64> {
    (0..n).map(|i| i * 7 + 3).collect()
}

#[tokio::test(start_paused = true)]
async fn a_wide_sweep_is_striped_across_replicas_and_not_hedged() {
    use inference_node::model::fetch::fetch_rows;
    let a = Fake::new("a", Fault::Ok(us(10)));
    let b = Fake::new("b", Fault::Ok(us(10)));
    let ssd = Fake::copy("ssd", Fault::Ok(us(1)));
    // A hedge after 1 "us" would fire on every chunk if chunks were hedged.
    let r = rig(&[&a, &b, &ssd], settings(Hedge::Fixed(us(1)), Policy::Fail));
    let rows = sweep_rows(20 * 4096);
    let t0 = Instant::now();
    let f = fetch_rows(&r.router, &rows, 4096).await;
    assert_eq!(f.error, None);
    assert_eq!(
        engram_protocol::synthetic::first_mismatch(SEED, 1, &rows, &f.bytes),
        None
    );
    // 20 chunks, two lanes per replica, 10 each: five rounds of 10.
    assert_eq!((a.calls(), b.calls(), ssd.calls()), (10, 10, 0));
    assert_eq!(f.messages, 20);
    assert_eq!((f.hedges, f.failovers), (0, 0));
    assert_eq!(f.sources.len(), 2, "{:?}", f.sources);
    assert_eq!(t0.elapsed(), us(50));
    assert_eq!(
        metric(&r, "engram_node_hedges_sent_total{table=\"1\"}"),
        "0"
    );
}

#[tokio::test(start_paused = true)]
async fn a_replica_lost_mid_sweep_costs_its_chunks_a_failover_not_the_sweep() {
    use inference_node::model::fetch::fetch_rows;
    let a = Fake::new("a", Fault::Ok(us(10)));
    let b = Fake::new("b", Fault::Ok(us(10)));
    let r = rig(&[&a, &b], settings(Hedge::Off, Policy::Fail));
    let rows = sweep_rows(40 * 2048);
    let killer = {
        let b = b.clone();
        tokio::spawn(async move {
            tokio::time::sleep(us(25)).await;
            b.set(Fault::Fail(
                us(0),
                SourceError::Unavailable("connection reset".into()),
            ));
        })
    };
    let f = fetch_rows(&r.router, &rows, 2048).await;
    killer.await.expect("killer");
    assert_eq!(f.error, None, "the sweep must survive a replica");
    assert_eq!(
        engram_protocol::synthetic::first_mismatch(SEED, 1, &rows, &f.bytes),
        None
    );
    assert_eq!(f.messages, 40);
    // b's breaker opens after 3 failures; each failed chunk went to a. Its
    // two lanes may each have started a chunk on b before the third failure
    // opened it: at most 4 chunks failed over.
    assert_eq!(r.health[1].breaker(), Breaker::Open);
    assert!((3..=4).contains(&f.failovers), "{} failovers", f.failovers);
    assert!(b.calls() >= 4, "b served chunks before it died");
    assert_eq!(a.calls() + b.calls(), 40 + f.failovers);
    assert_eq!(f.sources, vec![Arc::<str>::from("a"), Arc::from("b")]);
}

/// A table of another encoding (FP8, NVFP4): the router sizes the lookup
/// at its row size, discards an answer with an E4M3 NaN code by that
/// encoding's rule (a value for FP8, a block scale for NVFP4) and fails
/// over; a buffer sized for V4.1's rows is a bad request; zeros by policy
/// are zero bytes of the encoding's size.
#[tokio::test(start_paused = true)]
async fn rows_of_another_encoding_are_sized_and_checked_by_it() {
    use engram_protocol::encoding::RowEncoding;
    use engram_protocol::synthetic::synthetic_encoded_row;
    for e in [
        RowEncoding::Fp8PerTensor { values: 160 },
        RowEncoding::Nvfp4 { values: 160 },
    ] {
        let a = Fake::encoded("a", Fault::BadBytes(us(10)), e);
        let b = Fake::encoded("b", Fault::Ok(us(30)), e);
        let s = inference_node::router::RouteSettings {
            encoding: e,
            ..settings(Hedge::Off, Policy::Fail)
        };
        let r = rig(&[&a, &b], s);
        let mut out = vec![0u8; ROWS.len() * e.row_bytes()];
        let f = r.router.fetch(&ROWS, &mut out).await.expect("b answers");
        assert_eq!((f.source.as_deref(), f.failovers), (Some("b"), 1), "{e:?}");
        let mut want = vec![0u8; e.row_bytes()];
        for (&row, got) in ROWS.iter().zip(out.chunks_exact(e.row_bytes())) {
            assert!(synthetic_encoded_row(e, SEED, 1, row, &mut want));
            assert_eq!(got, &want[..], "{e:?} row {row}");
        }
        assert_eq!(
            metric(
                &r,
                "engram_node_checksum_failures_total{table=\"1\",source=\"a\"}"
            ),
            "1",
            "{e:?}"
        );
        let mut v41_sized = vec![0u8; ROWS.len() * engram_protocol::ROW_BYTES];
        let err = r
            .router
            .fetch(&ROWS, &mut v41_sized)
            .await
            .expect_err("bad size");
        assert!(matches!(err, RouterError::BadRequest { .. }), "{err}");
        // Zeros by policy: every source fails, the rows are zero bytes.
        a.set(Fault::Fail(us(5), SourceError::Unavailable("down".into())));
        b.set(Fault::Fail(us(5), SourceError::Unavailable("down".into())));
        let s = inference_node::router::RouteSettings {
            encoding: e,
            ..settings(Hedge::Off, Policy::Zeros)
        };
        let z = rig(&[&a, &b], s);
        let mut out = vec![0xAAu8; ROWS.len() * e.row_bytes()];
        let f = z.router.fetch(&ROWS, &mut out).await.expect("zeros");
        assert!(f.is_zeros());
        assert!(out.iter().all(|&x| x == 0), "{e:?}");
    }
}
