//! Per-second timeline: panels stacked on one shared time axis, each with
//! its own y range and named line series, and event markers (a killed or
//! restarted donor, say) drawn as dashed lines across every panel.

use std::io;
use std::path::{Path, PathBuf};

use super::{Anchor, GRID, INK, MUTED, Rgb, Scene, nice_range, text_px, tick_label, truncate};

/// Panels sharing one x axis (seconds), with labelled events.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timeline {
    /// Shown above the panels.
    pub title: String,
    /// Under the x axis, e.g. "time (s)".
    pub x_label: String,
    /// Top to bottom.
    pub panels: Vec<Panel>,
    /// `(x, label)`: a dashed line across all panels, e.g. `(12.3, "kill -9 donor-a")`.
    pub events: Vec<(f64, String)>,
}

/// One panel: a y axis and its series.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Panel {
    /// Shown above the panel.
    pub title: String,
    /// The y unit, shown after the title.
    pub unit: String,
    /// Each drawn as a line in its own colour.
    pub series: Vec<Series>,
}

/// One named line.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Series {
    /// Shown in the panel's legend.
    pub name: String,
    /// `(x, y)`, joined in the order given; a non-finite point breaks the line.
    pub points: Vec<(f64, f64)>,
}

const PALETTE: [Rgb; 8] = [
    Rgb(31, 119, 180),
    Rgb(255, 127, 14),
    Rgb(44, 160, 44),
    Rgb(214, 39, 40),
    Rgb(148, 103, 189),
    Rgb(140, 86, 75),
    Rgb(227, 119, 194),
    Rgb(23, 190, 207),
];
const EVENT: Rgb = Rgb(120, 40, 160);

const M: f64 = 20.0;
const SCALE: u32 = 2;
const LINE: f64 = 14.0; // text height at SCALE
const WIDTH: f64 = 1100.0;
const TITLE_H: f64 = 40.0;
const EVENT_ROW: f64 = 20.0;
const EVENT_ROWS: usize = 3;
const PANEL_TITLE_H: f64 = 30.0;
const PLOT_H: f64 = 180.0;
const PANEL_GAP: f64 = 16.0;
const AXIS_H: f64 = 56.0;
const Y_LABELS_W: f64 = 100.0;
const LEGEND_ROW: f64 = 20.0;
const MAX_NAME: usize = 20;
const MAX_TITLE: usize = 80;
const MAX_EVENT: usize = 28;

fn finite(p: &(f64, f64)) -> bool {
    p.0.is_finite() && p.1.is_finite()
}

/// Smallest and largest of `vals`, or `None` when there are none.
fn extent(vals: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    vals.fold(None, |acc, v| match acc {
        None => Some((v, v)),
        Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
    })
}

impl Panel {
    fn plot_h(&self) -> f64 {
        PLOT_H.max(self.series.len() as f64 * LEGEND_ROW + 10.0)
    }
}

impl Timeline {
    fn event_rows(&self) -> usize {
        self.events
            .iter()
            .filter(|e| e.0.is_finite())
            .count()
            .min(EVENT_ROWS)
    }

    /// The shared x range over every finite point and event.
    fn x_range(&self) -> (f64, f64, Vec<f64>) {
        let xs = self
            .panels
            .iter()
            .flat_map(|p| &p.series)
            .flat_map(|s| s.points.iter().filter(|p| finite(p)).map(|p| p.0))
            .chain(self.events.iter().map(|e| e.0).filter(|x| x.is_finite()));
        let (lo, hi) = extent(xs).unwrap_or((0.0, 1.0));
        nice_range(lo, hi, 10)
    }

    /// The chart laid out for drawing.
    pub fn scene(&self) -> Scene {
        let legend_w = self
            .panels
            .iter()
            .flat_map(|p| &p.series)
            .map(|s| s.name.chars().count().min(MAX_NAME))
            .max()
            .map_or(0.0, |n| text_px(n, SCALE) + 44.0);
        let left = M + Y_LABELS_W;
        let right = WIDTH - M - legend_w;
        let events_h = self.event_rows() as f64 * EVENT_ROW;
        let panels_top = M + TITLE_H + events_h;
        let panels_h: f64 = self
            .panels
            .iter()
            .map(|p| PANEL_TITLE_H + p.plot_h() + PANEL_GAP)
            .sum();
        let height = panels_top + panels_h.max(PANEL_TITLE_H) + AXIS_H + M;
        let mut s = Scene::new(WIDTH, height);
        let title = truncate(&self.title, MAX_TITLE);
        s.text(M, M + LINE, &title, SCALE, Anchor::Start, INK);

        let (xlo, xhi, xticks) = self.x_range();
        let px = |x: f64| left + (x - xlo) / (xhi - xlo) * (right - left);

        if self.panels.is_empty() {
            s.text(
                left,
                panels_top + LINE,
                "(no panels)",
                SCALE,
                Anchor::Start,
                MUTED,
            );
        }
        let mut top = panels_top;
        for panel in &self.panels {
            let plot_top = top + PANEL_TITLE_H;
            let plot_h = panel.plot_h();
            self.panel(
                &mut s,
                panel,
                (left, right),
                (plot_top, plot_h),
                &px,
                &xticks,
            );
            self.legend(&mut s, panel, right + 16.0, plot_top);
            top = plot_top + plot_h + PANEL_GAP;
        }
        let axis_y = top - PANEL_GAP;
        for &t in &xticks {
            let label = tick_label(t, &xticks);
            s.text(
                px(t),
                axis_y + 8.0 + LINE,
                &label,
                SCALE,
                Anchor::Middle,
                INK,
            );
        }
        let x_label = truncate(&self.x_label, MAX_TITLE);
        let mid = (left + right) / 2.0;
        s.text(
            mid,
            axis_y + 28.0 + 2.0 * LINE,
            &x_label,
            SCALE,
            Anchor::Middle,
            INK,
        );

        let mut row = 0;
        for (x, label) in self.events.iter().filter(|e| e.0.is_finite()) {
            let ex = px(*x);
            s.line((ex, panels_top), (ex, axis_y), EVENT, 2.0, true);
            let ly = M + TITLE_H + row as f64 * EVENT_ROW + LINE;
            let label = truncate(label, MAX_EVENT);
            // Labels near the right edge hang to the left of their line.
            let room = text_px(label.chars().count(), SCALE) + 4.0;
            let (lx, anchor) = if ex + room > right + legend_w {
                (ex - 4.0, Anchor::End)
            } else {
                (ex + 4.0, Anchor::Start)
            };
            s.text(lx, ly, &label, SCALE, anchor, EVENT);
            row = (row + 1) % EVENT_ROWS;
        }
        s
    }

    fn panel(
        &self,
        s: &mut Scene,
        panel: &Panel,
        (left, right): (f64, f64),
        (top, h): (f64, f64),
        px: &dyn Fn(f64) -> f64,
        xticks: &[f64],
    ) {
        let title = match (panel.title.is_empty(), panel.unit.is_empty()) {
            (_, true) => panel.title.clone(),
            (true, false) => format!("({})", panel.unit),
            (false, false) => format!("{} ({})", panel.title, panel.unit),
        };
        let title = truncate(&title, MAX_TITLE);
        s.text(left, top - 10.0, &title, SCALE, Anchor::Start, INK);

        let ys = panel
            .series
            .iter()
            .flat_map(|s| s.points.iter().filter(|p| finite(p)).map(|p| p.1));
        let (lo, hi) = extent(ys).unwrap_or((0.0, 1.0));
        let (ylo, yhi, yticks) = nice_range(lo, hi, 4);
        let py = |y: f64| top + h - (y - ylo) / (yhi - ylo) * h;

        s.rect(left, top, right - left, h, Rgb(255, 255, 255), Some(MUTED));
        for &t in &yticks {
            let y = py(t);
            s.line((left, y), (right, y), GRID, 1.0, false);
            let label = tick_label(t, &yticks);
            s.text(left - 8.0, y + LINE / 2.0, &label, SCALE, Anchor::End, INK);
        }
        for &t in xticks {
            s.line((px(t), top), (px(t), top + h), GRID, 1.0, false);
        }
        for (i, series) in panel.series.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            for run in series.points.split(|p| !finite(p)) {
                let pts: Vec<(f64, f64)> = run.iter().map(|&(x, y)| (px(x), py(y))).collect();
                match pts.as_slice() {
                    [] => {}
                    [(x, y)] => s.rect(x - 3.0, y - 3.0, 6.0, 6.0, color, None),
                    _ => s.shapes.push(super::Shape::Polyline {
                        points: pts,
                        color,
                        width: 2.0,
                    }),
                }
            }
        }
    }

    fn legend(&self, s: &mut Scene, panel: &Panel, x: f64, top: f64) {
        for (i, series) in panel.series.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            let y = top + 4.0 + i as f64 * LEGEND_ROW;
            s.rect(x, y + 6.0, 20.0, 4.0, color, None);
            let name = truncate(&series.name, MAX_NAME);
            s.text(x + 28.0, y + LINE, &name, SCALE, Anchor::Start, INK);
        }
    }

    /// The chart as an SVG document.
    pub fn svg(&self) -> String {
        self.scene().svg()
    }

    /// The chart as PNG bytes.
    pub fn png(&self) -> Vec<u8> {
        self.scene().png()
    }

    /// Write `stem.svg` and `stem.png`; returns both paths.
    pub fn write_both(&self, stem: &Path) -> io::Result<(PathBuf, PathBuf)> {
        self.scene().write_both(stem)
    }
}

#[cfg(test)]
mod tests {
    use super::super::raster::tests::decode;
    use super::*;

    fn series(name: &str, points: Vec<(f64, f64)>) -> Series {
        Series {
            name: name.into(),
            points,
        }
    }

    #[test]
    fn panels_series_and_events_are_drawn() {
        let t = Timeline {
            title: "failover".into(),
            x_label: "time (s)".into(),
            panels: vec![
                Panel {
                    title: "tokens/s".into(),
                    unit: "tok/s".into(),
                    series: vec![
                        series("node-a", (0..40).map(|i| (f64::from(i), 100.0)).collect()),
                        series("node-b", (0..40).map(|i| (f64::from(i), 90.0)).collect()),
                    ],
                },
                Panel {
                    title: "p99".into(),
                    unit: "us".into(),
                    series: vec![series("lookup", vec![(1.0, 5.0), (2.0, 9.0)])],
                },
            ],
            events: vec![
                (12.3, "kill -9 donor-a".into()),
                (25.0, "restart donor-a".into()),
            ],
        };
        let svg = t.svg();
        assert_eq!(svg.matches("<polyline").count(), 3);
        assert_eq!(svg.matches("stroke-dasharray").count(), 2);
        assert!(svg.contains("kill -9 donor-a") && svg.contains("tokens/s (tok/s)"));
        let (w, h, _) = decode(&t.png());
        assert_eq!(w, WIDTH as u32);
        assert!(h > 2 * PLOT_H as u32);
        // Two series in one panel get different colours.
        assert!(svg.contains(&PALETTE[0].hex()) && svg.contains(&PALETTE[1].hex()));
    }

    #[test]
    fn degenerate_inputs_do_not_panic() {
        let cases = [
            Timeline::default(),
            Timeline {
                panels: vec![Panel::default()],
                events: vec![(f64::NAN, "never".into())],
                ..Timeline::default()
            },
            Timeline {
                title: "t".repeat(300),
                x_label: "x".into(),
                panels: vec![Panel {
                    title: String::new(),
                    unit: "<&>".into(),
                    series: vec![
                        series("empty", vec![]),
                        series("one", vec![(5.0, 3.0)]),
                        series("flat", vec![(1.0, 7.0), (2.0, 7.0), (f64::NAN, 1.0)]),
                        series("inf", vec![(f64::INFINITY, 1.0), (1.0, f64::NEG_INFINITY)]),
                        series(&"n".repeat(100), vec![(0.0, -1e300), (1.0, 1e300)]),
                    ],
                }],
                events: vec![(5.0, "e".repeat(100)), (5.0, "same time".into())],
            },
        ];
        for t in &cases {
            decode(&t.png());
            let svg = t.svg();
            assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
            assert!(!svg.contains("NaN") && !svg.contains("inf\""));
        }
        assert!(cases[2].svg().contains("(&lt;&amp;&gt;)"));
        assert_eq!(cases[2].svg().matches("<polyline").count(), 2);
    }
}
