//! `engram-bench model`: seed 000's timing model for one V4.1 token at a
//! target rate, from the two tables' fetch times, computed only through
//! `cluster_config::plan::predict` so this and `engram-cluster plan` agree.

use anyhow::{Result, bail};
use clap::Args;
use cluster_config::plan::{predict, v41_windows_ms};
use serde::Serialize;

/// Arguments of `engram-bench model`.
#[derive(Debug, Args)]
pub struct ModelArgs {
    /// Target token rate R (the token time is W = 1000/R ms).
    #[arg(long, allow_negative_numbers = true)]
    tokens_per_second: f64,
    /// Time until table 0's rows (layer 1) arrive, in ms.
    #[arg(long, allow_negative_numbers = true)]
    f0_ms: f64,
    /// Time until table 1's rows (layer 14) arrive, in ms.
    #[arg(long, allow_negative_numbers = true)]
    f1_ms: f64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// Highest target rate accepted.
const MAX_RATE: f64 = 100_000.0;
/// Longest fetch time accepted, in ms.
const MAX_FETCH_MS: f64 = 60_000.0;

/// The model's figures for one token.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ModelReport {
    /// R.
    pub tokens_per_second_target: f64,
    /// W = 1000/R, in ms.
    pub token_ms: f64,
    /// [W/40, 13W/40], in ms.
    pub windows_ms: [f64; 2],
    /// [f0, f1], in ms.
    pub fetch_ms: [f64; 2],
    /// max(0, f0 - w0) + max(0, f1 - w1), in ms.
    pub extra_ms: f64,
    /// T = W + extra, in ms.
    pub time_ms: f64,
    /// 1000/T.
    pub tokens_per_second: f64,
    /// extra / W.
    pub slowdown: f64,
}

/// Check the inputs: each error names its flag.
pub fn validate(rate: f64, f0_ms: f64, f1_ms: f64) -> Result<()> {
    if !(rate.is_finite() && rate > 0.0 && rate <= MAX_RATE) {
        bail!("--tokens-per-second must be finite, > 0 and <= {MAX_RATE} (got {rate})");
    }
    for (flag, f) in [("--f0-ms", f0_ms), ("--f1-ms", f1_ms)] {
        if !(f.is_finite() && (0.0..=MAX_FETCH_MS).contains(&f)) {
            bail!("{flag} must be finite, >= 0 and <= {MAX_FETCH_MS} (got {f})");
        }
    }
    Ok(())
}

/// The model at `rate` tokens/s with fetch times `f0_ms`, `f1_ms` (validated).
pub fn model(rate: f64, f0_ms: f64, f1_ms: f64) -> Result<ModelReport> {
    validate(rate, f0_ms, f1_ms)?;
    let token_ms = 1000.0 / rate;
    let windows_ms = v41_windows_ms(token_ms);
    let p = predict(token_ms, &[(windows_ms[0], f0_ms), (windows_ms[1], f1_ms)]);
    Ok(ModelReport {
        tokens_per_second_target: rate,
        token_ms: p.token_ms,
        windows_ms,
        fetch_ms: [f0_ms, f1_ms],
        extra_ms: p.extra_ms,
        time_ms: p.time_ms,
        tokens_per_second: p.tokens_per_second,
        slowdown: p.slowdown,
    })
}

/// `engram-bench model`.
pub fn run(a: &ModelArgs) -> Result<()> {
    let r = model(a.tokens_per_second, a.f0_ms, a.f1_ms)?;
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(());
    }
    let ms = |v: f64| format!("{v:.3} ms");
    let rows = [
        (
            "target R",
            format!("{} tokens/s", r.tokens_per_second_target),
        ),
        ("token W = 1000/R", ms(r.token_ms)),
        ("window w0 = W/40", ms(r.windows_ms[0])),
        ("window w1 = 13W/40", ms(r.windows_ms[1])),
        ("fetch f0", ms(r.fetch_ms[0])),
        ("fetch f1", ms(r.fetch_ms[1])),
        ("extra", ms(r.extra_ms)),
        ("T = W + extra", ms(r.time_ms)),
        ("tokens/s = 1000/T", format!("{:.2}", r.tokens_per_second)),
        ("slowdown = extra/W", format!("{:.1}%", r.slowdown * 100.0)),
    ];
    let w = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    println!("seed 000's timing model, V4.1 (tables at layers 1 and 14)");
    for (k, v) in rows {
        println!("  {k:<w$}  {v}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hundred_tokens_per_second() {
        let r = model(100.0, 0.59, 0.59).expect("valid");
        assert_eq!(r.token_ms, 10.0);
        assert_eq!(r.windows_ms, [0.25, 3.25]);
        assert!((r.extra_ms - 0.34).abs() < 1e-12, "{r:?}");
        assert!((r.tokens_per_second - 1000.0 / 10.34).abs() < 1e-9, "{r:?}");
        assert!((r.slowdown - 0.034).abs() < 1e-12, "{r:?}");
    }

    #[test]
    fn both_tables_can_overshoot() {
        let r = model(1000.0, 0.4, 0.4).expect("valid");
        assert!((r.extra_ms - (0.375 + 0.075)).abs() < 1e-12, "{r:?}");
        let r = model(25.0, 0.0, 0.0).expect("valid");
        assert_eq!(
            (r.extra_ms, r.slowdown, r.tokens_per_second),
            (0.0, 0.0, 25.0)
        );
    }

    #[test]
    fn every_rule_names_its_flag() {
        let err = |r, f0, f1| model(r, f0, f1).expect_err("invalid").to_string();
        for r in [0.0, -1.0, f64::NAN, f64::INFINITY, 100_001.0] {
            assert!(err(r, 0.1, 0.1).starts_with("--tokens-per-second"), "{r}");
        }
        for f in [-1.0, f64::NAN, f64::NEG_INFINITY, 60_001.0] {
            assert!(err(100.0, f, 0.1).starts_with("--f0-ms"), "{f}");
            assert!(err(100.0, 0.1, f).starts_with("--f1-ms"), "{f}");
        }
        assert!(model(MAX_RATE, MAX_FETCH_MS, 0.0).is_ok());
    }
}
