//! Latency samples: the rack's latency histogram (re-exported), medians
//! over rounds, a plain table, and the synthetic table files the
//! benchmarks generate on first use.

pub use daemon_runtime::latency::{Latency, LatencySummary as Summary};

/// Median of values (the mean of the middle two for an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Per-field medians of several rounds' summaries.
pub fn median_summary(rounds: &[Summary]) -> Summary {
    let m = |f: fn(&Summary) -> f64| median(rounds.iter().map(f).collect());
    Summary {
        p50_us: m(|s| s.p50_us),
        p99_us: m(|s| s.p99_us),
        p999_us: m(|s| s.p999_us),
        max_us: m(|s| s.max_us),
    }
}

/// Print rows of cells as an aligned plain-text table.
pub fn print_table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let line = |cells: Vec<&str>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:>w$}"))
            .collect();
        println!("{}", padded.join("  "));
    };
    line(header.to_vec());
    for r in rows {
        line(r.iter().map(String::as_str).collect());
    }
}

/// Generate `file` (layer 1, `rows` rows, generator seed `seed`) with
/// `memory-donor gen` unless it exists.
pub fn ensure_table(file: &std::path::Path, rows: u64, seed: u64) -> anyhow::Result<()> {
    use anyhow::Context;
    if file.is_file() {
        return Ok(());
    }
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir)?;
    }
    eprintln!(
        "generating {} ({rows} rows, {:.2} GB of rows) ...",
        file.display(),
        (rows * engram_protocol::ROW_BYTES as u64) as f64 / 1e9
    );
    let status = std::process::Command::new(rack_harness::bin("memory-donor"))
        .args(["gen", "--layer", "1", "--seed", &seed.to_string()])
        .args(["--rows", &rows.to_string()])
        .arg("--out")
        .arg(file)
        // Its summary line is progress, not the benchmark's output (which
        // may be JSON).
        .stdout(std::io::stderr())
        .status()
        .context("running memory-donor gen")?;
    if !status.success() {
        anyhow::bail!("memory-donor gen failed");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_of_values_and_of_summaries() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(vec![]).is_nan());
        let s = Summary {
            p50_us: 500.0,
            p99_us: 990.0,
            p999_us: 999.0,
            max_us: 1000.0,
        };
        let m = median_summary(&[
            s,
            Summary { p50_us: 0.0, ..s },
            Summary { p50_us: 1e9, ..s },
        ]);
        assert_eq!(m.p50_us, s.p50_us);
    }
}
