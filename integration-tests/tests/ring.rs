//! The engine ring against a real donor: a CPU stand-in for the engine's
//! kernels publishes requests and spins on the done words with a clock of
//! its own (the GPU timer's part), while the node's ring client serves
//! them from the rack. Rows equal the table's, DEAD and invalid positions
//! are zeros with their status, requests in flight together are all
//! served, a `kill -9` of the donor fails over to the SSD copy with no
//! request lost, a frozen rack is answered (SSD or late zeros) before the
//! GPU's deadline, a client that goes leaves every wait to end at that
//! deadline, never hanging, and requests without rows under a `fail`
//! policy (the client's answer or the GPU's give-up) are faults in the
//! header, where `zeros` gives none.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engram_protocol::ROW_BYTES;
use engram_protocol::ring::{GPU_TIMEOUT, NO_ROW, SERVED_SSD, client_state};
use engram_protocol::synthetic::{SplitMix64, first_mismatch};
use inference_node::embed::EmbeddedNode;
use inference_node::ring::{Fault, RingMemory, RingOptions, Shape, Status, serve};
use rack_harness::ring_engine::CpuEngine as Engine;
use rack_harness::{DonorProcess, MODEL_SEED, model_rack, model_rack_config};

const POSITIONS: u32 = 64;

fn shape() -> Shape {
    Shape {
        slots: 4,
        layers: 2,
        columns: 24,
        positions: POSITIONS,
        first_column: 0,
        layer_ids: [1, 14],
        gpu_deadline_ns: 2_000_000_000,
        row_bytes: 264,
    }
}

/// Random positions of both tables: live ones with valid ids, some DEAD.
fn positions(rng: &mut SplitMix64, n: usize, rows: [u64; 2]) -> Vec<Vec<Vec<i64>>> {
    (0..n)
        .map(|_| {
            if rng.below(8) == 0 {
                return vec![vec![NO_ROW; 24], vec![NO_ROW; 24]];
            }
            (0..2)
                .map(|l| (0..24).map(|_| rng.below(rows[l]) as i64).collect())
                .collect()
        })
        .collect()
}

/// Every position's rows are the table's (zeros for DEAD ones).
fn check(ids: &[Vec<Vec<i64>>], l: usize, got: &[u8]) {
    let layer = [1, 14][l];
    for (p, pos) in ids.iter().enumerate() {
        let bytes = &got[p * 24 * ROW_BYTES..(p + 1) * 24 * ROW_BYTES];
        if pos[l][0] == NO_ROW {
            assert!(bytes.iter().all(|&b| b == 0), "DEAD position {p}");
            continue;
        }
        let rows: Vec<u64> = pos[l].iter().map(|&r| r as u64).collect();
        assert_eq!(
            first_mismatch(MODEL_SEED, layer, &rows, bytes),
            None,
            "position {p}, layer {layer}"
        );
    }
}

fn start_donor(config: &Path) -> DonorProcess {
    DonorProcess::start(&["--config", &config.display().to_string(), "--name", "d"])
        .expect("donor starts")
}

fn served_ring(
    mem: &Arc<EmbeddedNode>,
    opts: RingOptions,
) -> (Engine, inference_node::ring::RingServer) {
    let ring = Arc::new(RingMemory::create(&shape()).expect("ring"));
    let mem = inference_node::embed::NodeMemory::V41(Arc::clone(mem));
    let server = serve(mem, Arc::clone(&ring), opts).expect("serve");
    (Engine::new(ring), server)
}

#[test]
fn a_ring_is_served_with_the_tables_rows_and_every_status() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = model_rack(dir.path()).expect("rack");
    let _donor = start_donor(&config);
    let mem = Arc::new(EmbeddedNode::open(&config, "n").expect("open"));
    let rows = mem.table_rows().expect("rows");
    let (mut eng, server) = served_ring(&mem, RingOptions::default());
    assert_eq!(eng.ring.client_state(), client_state::SERVING);
    let mut rng = SplitMix64::new(7);
    // One request at a time, of every size up to a slot.
    for i in 0..100 {
        let n = 1 + rng.below(u64::from(POSITIONS)) as usize;
        let ids = positions(&mut rng, n, rows);
        let seq = eng.publish(3, &ids);
        for l in 0..2 {
            let a = eng.wait(seq, l, n as u32);
            assert_eq!(a.status, Some(Status::Ok as u32), "step {i}, section {l}");
            check(&ids, l as usize, &a.rows);
        }
    }
    // Three in flight at once (micro-batches, graphs in flight).
    let batches: Vec<_> = (0..3).map(|_| positions(&mut rng, 16, rows)).collect();
    let seqs: Vec<u64> = batches.iter().map(|b| eng.publish(3, b)).collect();
    for (b, &seq) in batches.iter().zip(&seqs) {
        for l in 0..2 {
            let a = eng.wait(seq, l, 16);
            assert_eq!(a.status, Some(Status::Ok as u32));
            check(b, l as usize, &a.rows);
        }
    }
    // Invalid ids (past the table; a no-row id beside live ones): those
    // positions are zeros, the rest served, and the status says so.
    let mut bad = positions(&mut rng, 4, rows);
    bad[0] = vec![vec![NO_ROW; 24], vec![NO_ROW; 24]];
    bad[1][0][3] = rows[0] as i64;
    bad[2][1][5] = NO_ROW;
    bad[3][1][0] = -7;
    let seq = eng.publish(3, &bad);
    for l in 0..2 {
        let a = eng.wait(seq, l, 4);
        assert_eq!(a.status, Some(Status::BadIds as u32), "section {l}");
        assert!(a.rows[ROW_BYTES * 24..].iter().all(|&b| b == 0));
    }
    assert_eq!(
        server
            .counters()
            .bad_positions
            .load(std::sync::atomic::Ordering::Relaxed),
        3
    );
    // A request of DEAD positions only (graph padding, a dummy batch):
    // answered at once with zeros, nothing fetched.
    let dead = vec![vec![vec![NO_ROW; 24], vec![NO_ROW; 24]]; 8];
    let seq = eng.publish(3, &dead);
    let a = eng.wait(seq, 0, 8);
    assert_eq!(a.status, Some(Status::Ok as u32));
    assert!(a.rows.iter().all(|&b| b == 0));
    // Every wait the engine counted in the header reaches the node's
    // histogram, per layer, in the same buckets.
    let waits: Vec<u64> = (0..2).map(|l| eng.ring.waits(l).iter().sum()).collect();
    assert_eq!(waits, [105, 104]);
    let want = [
        format!(
            "engram_node_ring_gpu_wait_seconds_count{{layer=\"1\"}} {}",
            waits[0]
        ),
        format!(
            "engram_node_ring_gpu_wait_seconds_count{{layer=\"14\"}} {}",
            waits[1]
        ),
    ];
    let t0 = Instant::now();
    let mut text = String::new();
    while t0.elapsed() < Duration::from_secs(10) {
        text = mem.metrics_text().expect("metrics");
        if want.iter().all(|w| text.contains(w.as_str())) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        want.iter().all(|w| text.contains(w.as_str())),
        "{want:?}\n{text}"
    );
    let fastest = eng
        .ring
        .waits(0)
        .iter()
        .position(|&n| n > 0)
        .expect("a wait");
    let le = engram_protocol::ring::wait_bucket_bounds(fastest).1 * 1e-9;
    let below = text
        .lines()
        .filter(|l| {
            l.starts_with("engram_node_ring_gpu_wait_seconds_bucket{") && l.contains("layer=\"1\"")
        })
        .find(|l| l.contains(&format!("le=\"{le}\"")));
    assert!(
        below.is_some_and(|l| l.ends_with(&format!(" {}", eng.ring.waits(0)[fastest]))),
        "bucket le={le}: {below:?}"
    );
    server.stop();
    assert_eq!(eng.ring.client_state(), client_state::GONE);
}

#[test]
fn kill_9_of_the_donor_fails_over_through_the_ring_and_a_gone_client_never_hangs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = model_rack(dir.path()).expect("rack");
    let donor = start_donor(&config);
    let mem = Arc::new(EmbeddedNode::open(&config, "n").expect("open"));
    let rows = mem.table_rows().expect("rows");
    let (mut eng, server) = served_ring(&mem, RingOptions::default());
    let mut rng = SplitMix64::new(9);
    let mut ssd = 0;
    for i in 0..120 {
        if i == 40 {
            donor.signal(libc::SIGKILL);
        }
        let ids = positions(&mut rng, 8, rows);
        let seq = eng.publish(3, &ids);
        for l in 0..2 {
            let a = eng.wait(seq, l, 8);
            assert_eq!(
                a.status,
                Some(Status::Ok as u32),
                "step {i}: no request lost"
            );
            check(&ids, l as usize, &a.rows);
            ssd += usize::from(a.served & SERVED_SSD != 0);
        }
    }
    assert!(ssd > 0, "the SSD copy served after the kill");
    // The client goes: the engine's waits end at the GPU's deadline.
    server.stop();
    let short = Shape {
        gpu_deadline_ns: 50_000_000,
        ..*eng.ring.shape()
    };
    let ring = Arc::new(RingMemory::create(&short).expect("ring"));
    let mut orphan = Engine::new(ring);
    let seq = orphan.publish(3, &positions(&mut rng, 2, rows));
    let t0 = Instant::now();
    let a = orphan.wait(seq, 0, 2);
    assert_eq!(a.status, None, "no client: the deadline ends the wait");
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert!(a.rows.iter().all(|&b| b == 0));
}

#[test]
fn a_frozen_rack_is_answered_before_the_gpus_deadline() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = model_rack(dir.path()).expect("rack");
    let donor = start_donor(&config);
    let mem = Arc::new(EmbeddedNode::open(&config, "n").expect("open"));
    let rows = mem.table_rows().expect("rows");
    let opts = RingOptions {
        deadline: Duration::from_millis(30),
        ..RingOptions::default()
    };
    let (mut eng, _server) = served_ring(&mem, opts);
    let mut rng = SplitMix64::new(3);
    // Warm, then freeze the donor: every request is still answered, by
    // the SSD copy or as late zeros, never left to the GPU's deadline.
    let ids = positions(&mut rng, 8, rows);
    let seq = eng.publish(3, &ids);
    assert_eq!(eng.wait(seq, 0, 8).status, Some(Status::Ok as u32));
    donor.signal(libc::SIGSTOP);
    let mut statuses = Vec::new();
    for _ in 0..20 {
        let ids = positions(&mut rng, 8, rows);
        let seq = eng.publish(3, &ids);
        for l in 0..2 {
            let a = eng.wait(seq, l, 8);
            let st = a.status.expect("answered before the GPU's deadline");
            assert!(st == Status::Ok as u32 || st == Status::Late as u32, "{st}");
            if st == Status::Ok as u32 {
                check(&ids, l as usize, &a.rows);
            } else {
                assert!(a.rows.iter().all(|&b| b == 0));
            }
            statuses.push(st);
        }
    }
    donor.signal(libc::SIGCONT);
    assert_eq!(statuses.len(), 40);
}

#[test]
fn no_rows_under_the_fail_policy_are_faults_the_engine_sees_and_zeros_are_not() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut rack = model_rack_config(dir.path()).expect("rack");
    // Donor `d` alone, no SSD copy: once it is gone no source is left.
    let alone = |name: &str, policy: &str| {
        let mut n = rack.node[0].clone();
        n.name = name.into();
        for r in &mut n.route {
            r.sources = vec!["d".into()];
            r.policy = Some(policy.into());
            r.hard_timeout_ms = Some(300);
        }
        n
    };
    let (fails, zeros) = (alone("fails", "fail"), alone("zeros", "zeros"));
    rack.node.extend([fails, zeros]);
    let config = dir.path().join("rack.toml");
    rack.write(&config).expect("write");
    let donor = start_donor(&config);
    let open = |name| Arc::new(EmbeddedNode::open(&config, name).expect("open"));
    let (mem_fail, mem_zeros) = (open("fails"), open("zeros"));
    let rows = mem_fail.table_rows().expect("rows");
    let opts = RingOptions {
        deadline: Duration::from_millis(150),
        ..RingOptions::default()
    };
    let (mut eng_fail, fail_server) = served_ring(&mem_fail, opts);
    let (mut eng_zeros, zeros_server) = served_ring(&mem_zeros, opts);
    let mut rng = SplitMix64::new(5);
    for eng in [&mut eng_fail, &mut eng_zeros] {
        let ids = positions(&mut rng, 4, rows);
        let seq = eng.publish(3, &ids);
        assert_eq!(eng.wait(seq, 0, 4).status, Some(Status::Ok as u32));
        assert_eq!(eng.wait(seq, 1, 4).status, Some(Status::Ok as u32));
        assert_eq!(eng.ring.faults().0, 0, "rows came: no fault");
    }
    donor.signal(libc::SIGKILL);
    drop(donor);
    // Under `fail`: zeros on the engine's side, and a fault in the header
    // naming the request and the engine step it belongs to.
    eng_fail.step = 7;
    let seq = eng_fail.publish(1, &positions(&mut rng, 4, rows));
    let a = eng_fail.wait(seq, 0, 4);
    assert!(a.rows.iter().all(|&b| b == 0));
    let st = a.status.expect("answered before the GPU's deadline");
    assert!(
        st == Status::Failed as u32 || st == Status::Late as u32,
        "{st}"
    );
    let (n, fseq, section, status) = eng_fail.ring.faults();
    assert_eq!((n, fseq, section, status), (1, seq, 0, st));
    let logged = Fault {
        seq,
        step: 7,
        section: 0,
        status: st,
    };
    assert_eq!(eng_fail.ring.fault(1), Some(logged));
    assert_eq!(eng_fail.ring.fault(2), None, "no second fault yet");
    // Under `zeros`: zeros too, and no fault.
    let seq = eng_zeros.publish(1, &positions(&mut rng, 4, rows));
    let a = eng_zeros.wait(seq, 0, 4);
    assert!(a.rows.iter().all(|&b| b == 0));
    assert_eq!(eng_zeros.ring.faults().0, 0);
    // A wait that the GPU's deadline ended (the client stuck): the client
    // turns the engine's give-up word into the table's policy.
    eng_fail.ring.gave_up(seq + 100);
    eng_zeros.ring.gave_up(seq + 100);
    let t0 = Instant::now();
    while eng_fail.ring.faults().0 < 2 && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(1));
    }
    let (n, fseq, _, status) = eng_fail.ring.faults();
    assert_eq!((n, fseq, status), (2, seq + 100, GPU_TIMEOUT));
    // The client never took that request, so it cannot say its step.
    let f = eng_fail.ring.fault(2).expect("logged");
    assert_eq!((f.seq, f.step, f.status), (seq + 100, 0, GPU_TIMEOUT));
    assert_eq!(eng_fail.ring.fault(1), Some(logged), "still in the log");
    assert_eq!(
        fail_server
            .counters()
            .gpu_timeouts
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(eng_zeros.ring.faults().0, 0);
    assert_eq!(
        zeros_server
            .counters()
            .gpu_timeouts
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}
