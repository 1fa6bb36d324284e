//! The embeddable memory from the languages engines are written in, against
//! real donor processes: the C library (`libengram_rack`) through a C test
//! program and the C example, compiled here with the system's C compiler,
//! and the Python package (`engram_rack`) through its pytest suite.

use std::path::{Path, PathBuf};
use std::process::Command;

use rack_harness::rack_toml::{NodeEntry, RackToml, RouteEntry, TableEntry};
use rack_harness::{DonorProcess, bin, gen_hashed_table, model_rack_config, python_has};

/// The rack of `model_rack_config` plus node `only-donor` (donor `d`
/// alone, with a hard timeout past the tests' own deadlines).
fn rack_config(dir: &Path) -> RackToml {
    let mut rack = model_rack_config(dir).expect("rack");
    let route = |t: u32, f: &str| RouteEntry::new(t, ["d"]).ssd_path(dir.join(f));
    rack.node.push(NodeEntry {
        tokens_per_second: Some(50.0),
        lookup_timeout_ms: Some(1000),
        ..NodeEntry::new(
            "only-donor",
            vec![route(1, "l1.etab"), route(14, "l14.etab")],
        )
    });
    rack
}

/// `rack` written to `dir/rack.toml`.
fn write_rack(dir: &Path, rack: &RackToml) -> PathBuf {
    let config = dir.join("rack.toml");
    rack.write(&config).expect("write config");
    config
}

fn start_donor(config: &Path) -> DonorProcess {
    DonorProcess::start(&["--config", &config.display().to_string(), "--name", "d"])
        .expect("donor starts")
}

/// Compile `source` against the library and its header.
fn compile(source: &str, out: &Path) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let lib_dir = bin("libengram_rack.so")
        .parent()
        .expect("library directory")
        .to_path_buf();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args([
            "-std=c11",
            "-D_DEFAULT_SOURCE",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
        ])
        .arg("-I")
        .arg(root.join("inference-node/capi/include"))
        .arg(root.join(source))
        .arg("-o")
        .arg(out)
        .arg("-L")
        .arg(&lib_dir)
        .args(["-lengram_rack", "-lm"])
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .status()
        .unwrap_or_else(|e| panic!("running {cc}: {e}"));
    assert!(status.success(), "{cc} could not compile {source}");
    out.to_path_buf()
}

/// Run the C test program; its output on failure.
fn c_test(prog: &Path, args: &[&str]) -> String {
    let out = Command::new(prog)
        .args(args)
        .output()
        .expect("run engram_test");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "engram_test {}:\n{text}", args[0]);
    eprint!("{text}");
    text
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

#[test]
fn the_c_library_serves_rows_fails_over_and_refuses_bad_calls() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rack = rack_config(dir.path());
    let config = write_rack(dir.path(), &rack);
    let prog = compile(
        "inference-node/capi/tests/c/engram_test.c",
        &dir.path().join("engram_test"),
    );
    let (l1, l14) = (dir.path().join("l1.etab"), dir.path().join("l14.etab"));
    let c = s(&config);
    let donor = start_donor(&config);
    c_test(&prog, &["rows", &c, "n", &s(&l1), &s(&l14), "4000"]);
    c_test(&prog, &["dequant", &c, "n"]);
    c_test(&prog, &["badinput", &c, "n"]);
    c_test(&prog, &["rowids", &c, "only-donor"]);
    let lookups = std::env::var("ENGRAM_LEAK_LOOKUPS").unwrap_or_else(|_| "1000000".into());
    c_test(&prog, &["leak", &c, "n", &lookups]);
    c_test(
        &prog,
        &["deadline", &c, "only-donor", &donor.id().to_string()],
    );
    c_test(
        &prog,
        &[
            "failover",
            &c,
            "n",
            &donor.id().to_string(),
            &s(&l1),
            &s(&l14),
        ],
    );

    // A donor serving another version of table 1 is never used for it.
    let (other, digest) =
        gen_hashed_table(dir.path(), "l1-other.etab", 1, rack_harness::MODEL_BASE, 12)
            .expect("gen");
    let mut swapped = rack.clone();
    swapped.table[0] = TableEntry::new(1, &other, rack.table[0].rows, digest);
    let other_config = dir.path().join("other.toml");
    swapped.write(&other_config).expect("write");
    let _other = start_donor(&other_config);
    c_test(&prog, &["rows", &c, "n", &s(&l1), &s(&l14), "500", "d"]);
}

#[test]
fn the_c_example_runs_against_a_real_donor() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = write_rack(dir.path(), &rack_config(dir.path()));
    let prog = compile(
        "inference-node/capi/examples/lookup.c",
        &dir.path().join("lookup"),
    );
    let _donor = start_donor(&config);
    let out = Command::new(&prog)
        .args([&s(&config), "n", "5"])
        .output()
        .expect("run the example");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(text.lines().count(), 10, "{text}");
    assert!(text.lines().all(|l| l.contains(": from d in ")), "{text}");
}

#[test]
fn the_c_library_views_a_host_local_donors_tables_and_its_own_copy() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Donor d also listens on a host socket: node only-donor maps its tables.
    let sock = dir.path().join("d.sock");
    let mut rack = rack_config(dir.path());
    let d = rack.donor_mut("d").expect("donor d");
    d.listen.insert(0, format!("unix://{}", s(&sock)));
    let config = write_rack(dir.path(), &rack);
    let prog = compile(
        "inference-node/capi/tests/c/engram_test.c",
        &dir.path().join("engram_test"),
    );
    let (l1, l14) = (
        s(&dir.path().join("l1.etab")),
        s(&dir.path().join("l14.etab")),
    );
    let c = s(&config);
    let _donor = start_donor(&config);
    let shared = c_test(&prog, &["view", &c, "only-donor", &l1, &l14, "1"]);
    assert_eq!(shared.matches("shared 1, packed 1").count(), 2, "{shared}");
    let own = c_test(&prog, &["view", &c, "ref", &l1, &l14, "0"]);
    assert_eq!(own.matches("shared 0").count(), 2, "{own}");
}

/// The package's pytest suite, against the extension module built in this
/// profile (or, with ENGRAM_PYTHON_WHEEL=1, the wheel pip installed).
#[test]
fn the_python_package_passes_its_tests() {
    if !python_has("numpy, pytest") {
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cmd = Command::new("python3");
    cmd.args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(root.join("inference-node/python/tests"))
        .env(
            "ENGRAM_BIN_DIR",
            bin("memory-donor").parent().expect("bin dir"),
        );
    if std::env::var("ENGRAM_PYTHON_WHEEL").as_deref() != Ok("1") {
        rack_harness::python_package(dir.path()).expect("package");
        cmd.env("PYTHONPATH", dir.path());
    }
    let status = cmd.status().expect("run pytest");
    assert!(status.success(), "the engram_rack pytest suite failed");
}

/// The C library's tables for any model family, on a Qwen4Exp rack (an
/// FP8 table with its scale and an NVFP4 table): each described, its rows
/// by id the generator's (checked by hash), a host-local donor's table
/// mapped with its row size, bad calls refused.
#[test]
fn the_c_library_gives_a_qwen4exp_racks_rows_of_any_encoding() {
    use engram_protocol::encoding::RowEncoding;
    use engram_protocol::synthetic::synthetic_encoded_row;
    use rack_harness::rack_toml::{DonorEntry, ModelSection};
    let dir = tempfile::tempdir().expect("tempdir");
    const ROWS: u64 = 4_000;
    let tables = [
        (
            1,
            RowEncoding::Fp8PerTensor { values: 160 },
            3,
            Some(0.0123),
        ),
        (2, RowEncoding::Nvfp4 { values: 160 }, 4, Some(0.0123)),
    ];
    let mut toml = RackToml::new("q");
    for (id, enc, seed, scale) in tables {
        let (path, digest) = rack_harness::gen_encoded_table(
            dir.path(),
            &format!("t{id}.etab"),
            id,
            enc,
            ROWS,
            seed,
        )
        .expect("gen");
        toml.table.push(TableEntry {
            encoding: Some(enc.name()),
            tensor_scale: scale,
            ..TableEntry::new(id, path, ROWS, digest)
        });
    }
    let sock = dir.path().join("h.sock");
    let port = || format!("127.0.0.1:{}", rack_harness::free_port().expect("port"));
    toml.donor = vec![DonorEntry::new(
        "h",
        [port(), format!("unix://{}", s(&sock))],
        [1, 2],
    )];
    toml.node = vec![
        NodeEntry::new(
            "via-h",
            vec![RouteEntry::new(1, ["h"]), RouteEntry::new(2, ["h"])],
        ),
        NodeEntry::new(
            "ssd",
            vec![RouteEntry::new(1, ["ssd"]), RouteEntry::new(2, ["ssd"])],
        ),
    ];
    toml.model = Some(ModelSection {
        family: Some("qwen4exp".into()),
        eos_token: Some(7),
        ..ModelSection::default()
    });
    let config = write_rack(dir.path(), &toml);
    let _donor = DonorProcess::start(&["--config", &s(&config), "--name", "h"]).expect("donor");
    let prog = compile(
        "inference-node/capi/tests/c/engram_test.c",
        &dir.path().join("engram_test"),
    );
    let fnv = |b: &[u8]| {
        b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
            (h ^ u64::from(x)).wrapping_mul(0x0000_0100_0000_01b3)
        })
    };
    let c = s(&config);
    for (node, shared) in [("via-h", "1"), ("ssd", "0")] {
        let text = c_test(&prog, &["tables", &c, node, shared]);
        for (id, enc, seed, _) in tables {
            let mut want = Vec::new();
            for r in [0, 7, ROWS - 1, 7] {
                let mut row = vec![0u8; enc.row_bytes()];
                assert!(synthetic_encoded_row(enc, seed, id, r, &mut row));
                want.extend_from_slice(&row);
            }
            let line = format!(
                "table {id}: layer {id}, {ROWS} rows of {} bytes, {}",
                enc.row_bytes(),
                enc.name()
            );
            assert!(text.contains(&line), "{node}: {line}\n{text}");
            let hash = format!("rows-fnv {:016x}", fnv(&want));
            assert!(text.contains(&hash), "{node}, table {id}: {hash}\n{text}");
        }
        assert_eq!(
            text.matches("view shared 1, packed 1").count(),
            if shared == "1" { 2 } else { 0 },
            "{text}"
        );
    }
}
