//! Python's view of the full-size planar copies: `engram_rack`'s
//! `Memory.table_view(layer)` maps donor `p`'s memory, and `view.offsets(r)`
//! gives where each row's values and scales lie, past 64 GiB for every
//! scale.

use std::process::Command;

use cluster_config::Config;

use super::{LAYERS, Tables};

/// Prints, per layer and row asked, `[values_at, scales_at, hex of the
/// 256 values and 8 scales]`.
const SCRIPT: &str = r#"
import json, sys
import engram_rack
cfg, node, ask = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
m = engram_rack.Memory(cfg, node, metrics="off")
out = {}
for layer, rows in ask.items():
    v = m.table_view(int(layer), 30.0)
    mv = memoryview(v)
    res = []
    for r in rows:
        a, s = v.offsets(r)
        res.append([a, s, (bytes(mv[a:a + 256]) + bytes(mv[s:s + 8])).hex()])
    out[layer] = {"layout": v.layout, "shared": v.shared, "rows": res}
m.close()
print(json.dumps(out))
"#;

/// The rows Python reads from its view equal the tables', at the offsets
/// the planar layout gives.
pub fn view_rows(t: &Tables, config: &Config) {
    if !rack_harness::python_has("numpy") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cmd = Command::new("python3");
    if std::env::var("ENGRAM_PYTHON_WHEEL").as_deref() != Ok("1") {
        rack_harness::python_package(dir.path()).expect("package");
        cmd.env("PYTHONPATH", dir.path());
    }
    let ask: serde_json::Map<String, serde_json::Value> = (0..2)
        .map(|i| (LAYERS[i].to_string(), serde_json::json!(t.lookups(i))))
        .collect();
    let out = cmd
        .args(["-c", SCRIPT])
        .arg(&config.path)
        .arg("n")
        .arg(serde_json::Value::Object(ask).to_string())
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    for i in 0..2 {
        let got = &v[LAYERS[i].to_string()];
        assert_eq!(got["layout"], "planar");
        assert_eq!(got["shared"], true);
        let scales_at = t.rows[i] * 256;
        let rows = t.lookups(i);
        let answers = got["rows"].as_array().expect("rows");
        assert_eq!(answers.len(), rows.len());
        for (&r, a) in rows.iter().zip(answers) {
            assert_eq!(a[0].as_u64(), Some(r * 256), "row {r} values");
            assert_eq!(a[1].as_u64(), Some(scales_at + r * 8), "row {r} scales");
            let want: String = t
                .expected(i, r)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            assert_eq!(
                a[2].as_str(),
                Some(want.as_str()),
                "python: table {} row {r}",
                LAYERS[i]
            );
        }
    }
}
