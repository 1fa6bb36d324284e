//! `engram-bench plot-sample`: a heatmap and a timeline from made-up but
//! plausible numbers, to look at the charts without running a benchmark.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use super::{Heatmap, Panel, Series, Timeline};
use crate::model::model;

/// Arguments of `engram-bench plot-sample`.
#[derive(Debug, Args)]
pub struct PlotSampleArgs {
    /// Directory for sample-heatmap.{svg,png} and sample-timeline.{svg,png}.
    #[arg(long)]
    out: PathBuf,
}

const RATES: [f64; 6] = [25.0, 50.0, 100.0, 200.0, 400.0, 1000.0];
/// (source, assumed fetch time of each table in ms), as in `engram-cluster plan`'s defaults.
const SOURCES: [(&str, f64); 3] = [("local RAM", 0.005), ("donor TCP", 0.1), ("SSD copy", 0.4)];

/// A heatmap whose predictions come from the model and whose "measurements"
/// are the predictions nudged by a fixed pattern (one left missing).
pub fn sample_heatmap() -> Result<Heatmap> {
    let mut predicted = Vec::new();
    for (_, f) in SOURCES {
        let row: Result<Vec<_>> = RATES
            .iter()
            .map(|&r| Ok(Some(model(r, f, f)?.slowdown)))
            .collect();
        predicted.push(row?);
    }
    let measured = predicted
        .iter()
        .enumerate()
        .map(|(i, row)| {
            row.iter()
                .enumerate()
                .map(|(j, p)| {
                    let nudge = 1.0 + 0.04 * ((i + 2 * j) % 5) as f64;
                    p.filter(|_| (i, j) != (1, 4)).map(|p| p * nudge + 0.0002)
                })
                .collect()
        })
        .collect();
    Ok(Heatmap {
        title: "Slowdown per source and token rate (sample data)".into(),
        rows: SOURCES.iter().map(|s| s.0.to_string()).collect(),
        cols: RATES.iter().map(|r| format!("{r} tok/s")).collect(),
        measured,
        predicted,
    })
}

/// Two nodes losing donor-a at 12.3 s and getting it back at 25 s.
pub fn sample_timeline() -> Timeline {
    let secs = || (0..=40).map(f64::from);
    let down = |t: f64| (12.3..25.0).contains(&t);
    let rate = |base: f64, dip: f64| -> Vec<(f64, f64)> {
        secs()
            .map(|t| {
                (
                    t,
                    if down(t) {
                        base - dip
                    } else {
                        base - (t % 3.0) * 0.4
                    },
                )
            })
            .collect()
    };
    let p99: Vec<(f64, f64)> = secs()
        .map(|t| {
            (
                t,
                if down(t) {
                    420.0 + (t % 4.0) * 15.0
                } else {
                    95.0 + (t % 5.0) * 4.0
                },
            )
        })
        .collect();
    Timeline {
        title: "Donor failover (sample data)".into(),
        x_label: "time (s)".into(),
        panels: vec![
            Panel {
                title: "token rate".into(),
                unit: "tokens/s".into(),
                series: vec![
                    Series {
                        name: "node-a".into(),
                        points: rate(100.0, 3.5),
                    },
                    Series {
                        name: "node-b".into(),
                        points: rate(96.0, 3.1),
                    },
                ],
            },
            Panel {
                title: "lookup p99".into(),
                unit: "us".into(),
                series: vec![Series {
                    name: "node-a".into(),
                    points: p99,
                }],
            },
        ],
        events: vec![
            (12.3, "kill -9 donor-a".into()),
            (25.0, "restart donor-a".into()),
        ],
    }
}

/// `engram-bench plot-sample`.
pub fn run_sample(a: &PlotSampleArgs) -> Result<()> {
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let written = [
        sample_heatmap()?.write_both(&a.out.join("sample-heatmap")),
        sample_timeline().write_both(&a.out.join("sample-timeline")),
    ];
    for w in written {
        let (svg, png) = w.with_context(|| format!("writing into {}", a.out.display()))?;
        println!("{}\n{}", svg.display(), png.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_covers_all_three_classes() {
        use super::super::SlowdownClass;
        let h = sample_heatmap().expect("valid model inputs");
        let classes: Vec<SlowdownClass> = h
            .predicted
            .iter()
            .flatten()
            .flatten()
            .map(|&v| SlowdownClass::of(v))
            .collect();
        for c in [
            SlowdownClass::NoStall,
            SlowdownClass::Some,
            SlowdownClass::High,
        ] {
            assert!(classes.contains(&c), "{c:?}");
        }
        assert_eq!(h.cell_text(1, 4), "pred 1.5%");
    }

    #[test]
    fn writes_four_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = dir.path().join("plots");
        run_sample(&PlotSampleArgs { out: out.clone() }).expect("written");
        for f in ["sample-heatmap", "sample-timeline"] {
            let png = super::super::tests::read_png(&out.join(format!("{f}.png")));
            assert!(png.width() > 500 && png.height() > 200, "{f}");
            let svg = std::fs::read_to_string(out.join(format!("{f}.svg"))).expect("svg");
            assert!(svg.starts_with("<svg"));
        }
    }
}
