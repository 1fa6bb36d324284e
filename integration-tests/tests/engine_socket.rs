//! `inference-node engines`, the host's one rack client, against real
//! processes: a host-local donor laid out planar for layer 1, a donor
//! across the network for layer 14. Eight engines (the ranks of an
//! 8-GPU host) attach at once: each is handed layer 1's memory (planar,
//! the donor's own copy: its rows where an engine's kernel reads them) and
//! told layer 14 is remote, attaches a ring for its own head slice and
//! reads its rows through it. A `kill -9` of the engine client leaves
//! every engine's wait to end at its GPU deadline and their sockets closed,
//! never hanging. A user the socket does not allow is refused.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use engram_protocol::ROW_BYTES;
use engram_protocol::synthetic::{SplitMix64, first_mismatch, synthetic_row};
use inference_node::engines::EngineClient;
use inference_node::ring::{RingMemory, Shape, Status};
use rack_harness::rack_toml::{DonorEntry, RouteEntry};
use rack_harness::ring_engine::CpuEngine;
use rack_harness::{DonorProcess, MODEL_SEED, Process, bin, free_port, model_rack_config};

/// Donor `h` (TCP and a host socket, planar) holds layer 1's table, donor
/// `d` (TCP) layer 14's; node `n` routes 1 to `h` and 14 to `d`, each with
/// the SSD copy behind.
fn rack(dir: &Path) -> (PathBuf, PathBuf) {
    let mut toml = model_rack_config(dir).expect("rack");
    let socket = dir.join("h.sock");
    toml.donor.push(DonorEntry {
        host_layout: Some("planar".into()),
        ..DonorEntry::new(
            "h",
            [
                format!("127.0.0.1:{}", free_port().expect("port")),
                format!("unix://{}", socket.display()),
            ],
            [1],
        )
    });
    let n = toml
        .node
        .iter_mut()
        .find(|n| n.name == "n")
        .expect("node n");
    let (l1, l14) = (toml.table[0].path.clone(), toml.table[1].path.clone());
    n.route = vec![
        RouteEntry::new(1, ["h", "ssd"]).ssd_path(&l1),
        RouteEntry::new(14, ["d", "ssd"]).ssd_path(&l14),
    ];
    let path = dir.join("rack.toml");
    toml.write(&path).expect("config");
    (path, socket)
}

fn engines(config: &Path, socket: &Path) -> Process {
    let mut cmd = Command::new(bin("inference-node"));
    cmd.args(["engines", "--config"])
        .arg(config)
        .args(["--name", "n", "--metrics", "off", "--socket"])
        .arg(socket)
        .env("RUST_LOG", "info");
    let p = Process::spawn(cmd).expect("engines starts");
    p.wait_line(Duration::from_secs(60), |l| {
        l.contains("ready engines=").then_some(())
    })
    .expect("ready");
    p
}

/// Rank `r`'s ring: layer 14's section only, its 3 of the 24 heads.
fn ring_of(rank: u32) -> Arc<RingMemory> {
    let shape = Shape {
        slots: 4,
        layers: 1,
        columns: 3,
        positions: 32,
        first_column: rank * 3,
        layer_ids: [14, 0],
        gpu_deadline_ns: 300_000_000,
        row_bytes: 264,
    };
    Arc::new(RingMemory::create(&shape).expect("ring"))
}

/// Layer 1's memory as handed over: planar, each row where a kernel reads it.
fn check_layer1(client: &EngineClient, rows: u64) {
    let t = &client.tables[0];
    assert_eq!((t.layer, t.table), (1, 1));
    let (file, msg) = t.memory.as_ref().expect("layer 1 is host-local");
    assert_eq!(msg["layout"], "planar", "{msg}");
    let scales_at = msg["scales_at"].as_u64().expect("scales_at") as usize;
    let at = |off: usize, n: usize| {
        let mut b = vec![0u8; n];
        std::os::unix::fs::FileExt::read_exact_at(file, &mut b, off as u64).expect("read");
        b
    };
    let mut rng = SplitMix64::new(5);
    let mut want = [0u8; ROW_BYTES];
    for _ in 0..200 {
        let r = rng.below(rows);
        synthetic_row(MODEL_SEED, 1, r, &mut want);
        let r = r as usize;
        assert_eq!(at(r * 256, 256), want[..256], "row {r}'s values");
        assert_eq!(at(scales_at + r * 8, 8), want[256..], "row {r}'s scales");
    }
    assert!(client.tables[1].memory.is_none(), "layer 14 is remote");
}

/// One rank: attach its ring, read 20 steps of its heads of layer 14.
fn rank(socket: &Path, r: u32, rows14: u64) -> (EngineClient, CpuEngine) {
    let client = EngineClient::connect(socket, Duration::from_secs(10)).expect("connect");
    check_layer1(&client, client.hello["rows"][0].as_u64().expect("rows"));
    let ring = ring_of(r);
    let reply = client
        .attach(&ring, Duration::from_secs(10))
        .expect("attach");
    assert_eq!(reply["ring"], "serving", "{reply}");
    let mut eng = CpuEngine::new(ring);
    let mut rng = SplitMix64::new(u64::from(r));
    for step in 0..20 {
        let ids: Vec<Vec<Vec<i64>>> = (0..8)
            .map(|_| vec![(0..3).map(|_| rng.below(rows14) as i64).collect()])
            .collect();
        let seq = eng.publish(1, &ids);
        let a = eng.wait(seq, 0, 8);
        assert_eq!(a.status, Some(Status::Ok as u32), "rank {r}, step {step}");
        for (p, pos) in ids.iter().enumerate() {
            let want: Vec<u64> = pos[0].iter().map(|&x| x as u64).collect();
            let got = &a.rows[p * 3 * ROW_BYTES..(p + 1) * 3 * ROW_BYTES];
            assert_eq!(first_mismatch(MODEL_SEED, 14, &want, got), None);
        }
    }
    (client, eng)
}

#[test]
fn eight_engines_share_one_rack_client_and_none_hangs_when_it_dies() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (config, _host) = rack(dir.path());
    let c = config.display().to_string();
    let _h = DonorProcess::start(&["--config", &c, "--name", "h"]).expect("donor h");
    let _d = DonorProcess::start(&["--config", &c, "--name", "d"]).expect("donor d");
    let socket = dir.path().join("engines.sock");
    let client = engines(&config, &socket);
    let rows14 = {
        let probe = EngineClient::connect(&socket, Duration::from_secs(10)).expect("connect");
        probe.hello["rows"][1].as_u64().expect("rows")
    };
    let ranks: Vec<_> = (0..8)
        .map(|r| {
            let s = socket.clone();
            std::thread::spawn(move || rank(&s, r, rows14))
        })
        .collect();
    let mut held: Vec<(EngineClient, CpuEngine)> =
        ranks.into_iter().map(|t| t.join().expect("rank")).collect();
    // The client dies: every engine sees its socket close, and a request
    // now ends at the GPU's deadline with zeros, never hanging.
    client.signal(libc::SIGKILL);
    for (c, eng) in &mut held {
        let fd = c.socket().as_raw_fd();
        assert!(daemon_runtime::hostsock::readable(
            fd,
            Duration::from_secs(10)
        ));
        let mut buf = [0u8; 16];
        let (n, _) = daemon_runtime::hostsock::recv(fd, &mut buf).expect("recv");
        assert_eq!(n, 0, "the socket closed");
        let seq = eng.publish(1, &[vec![vec![0, 1, 2]]]);
        let a = eng.wait(seq, 0, 1);
        assert_eq!(a.status, None, "no client: the deadline ends the wait");
        assert!(a.rows.iter().all(|&b| b == 0));
        assert!(a.waited < Duration::from_secs(5));
    }
}

#[test]
fn a_user_not_allowed_is_refused_and_bad_rings_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (config, _host) = rack(dir.path());
    let c = config.display().to_string();
    let _h = DonorProcess::start(&["--config", &c, "--name", "h"]).expect("donor h");
    let socket = dir.path().join("engines.sock");
    let mut cmd = Command::new(bin("inference-node"));
    cmd.args([
        "engines",
        "--config",
        &c,
        "--name",
        "n",
        "--metrics",
        "off",
        "--allow-uid",
        "4242",
        "--socket",
    ])
    .arg(&socket);
    let p = Process::spawn(cmd).expect("engines starts");
    p.wait_line(Duration::from_secs(60), |l| {
        l.contains("ready engines=").then_some(())
    })
    .expect("ready");
    // Root is not uid 4242 and its group is not allowed either (only the
    // listed ids are, once any is listed).
    let e = EngineClient::connect(&socket, Duration::from_secs(10)).expect_err("refused");
    assert!(
        e.to_string().contains("may not use this engine socket"),
        "{e}"
    );
    drop(p);
    let _p = engines(&config, &socket);
    let client = EngineClient::connect(&socket, Duration::from_secs(10)).expect("connect");
    // A ring naming a layer with no Engram table, and more rings than allowed.
    let odd = Shape {
        slots: 2,
        layers: 1,
        columns: 1,
        positions: 1,
        first_column: 0,
        layer_ids: [7, 0],
        gpu_deadline_ns: 1_000_000,
        row_bytes: 264,
    };
    let ring = RingMemory::create(&odd).expect("ring");
    let reply = client
        .attach(&ring, Duration::from_secs(10))
        .expect("reply");
    assert_eq!(reply["ring"], "refused", "{reply}");
    assert!(
        reply["why"]
            .as_str()
            .unwrap_or_default()
            .contains("layer 7"),
        "{reply}"
    );
    let mut served = 0;
    for r in 0..10 {
        let reply = client
            .attach(&ring_of(r % 8), Duration::from_secs(10))
            .expect("reply");
        served += usize::from(reply["ring"] == "serving");
    }
    assert_eq!(served, inference_node::engines::MAX_RINGS);
}
