//! Per-second timeline: panels stacked on one shared time axis, each with
//! its own y range and named line series, and event markers (a killed or
//! restarted donor, say) drawn as dashed lines across every panel.

use std::io;
use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};
use plotters::coord::types::RangedCoordf64;
use plotters::element::DashedPathElement;
use plotters::prelude::{
    ChartBuilder, Circle, DrawingArea, DrawingAreaErrorKind, DrawingBackend, LineSeries, Rectangle,
    Text,
};
use plotters::style::text_anchor::{HPos, VPos};
use plotters::style::{Color, TRANSPARENT};

use super::{
    Chart, DrawResult, GRID, INK, MUTED, Rgb, nice_range, side, text_style, text_width, tick_label,
    truncate,
};

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

const M: i32 = 20;
const WIDTH: i32 = 1100;
const TITLE_H: i32 = 40;
const EVENT_ROW: i32 = 20;
const EVENT_ROWS: usize = 3;
const PANEL_TITLE_H: i32 = 30;
const PLOT_H: i32 = 180;
const PANEL_GAP: i32 = 16;
const AXIS_H: i32 = 64;
const Y_LABELS_W: i32 = 80;
const LEGEND_ROW: i32 = 20;
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

/// A linear axis whose grid lines and labels are at `ticks` (plotters'
/// own tick choice differs from [`nice_range`]'s, which the labels follow).
#[derive(Debug, Clone)]
struct Axis {
    lo: f64,
    hi: f64,
    ticks: Vec<f64>,
}

impl Axis {
    /// The axis over `lo..=hi` widened to round numbers.
    fn new(lo: f64, hi: f64, target_ticks: usize) -> Self {
        let (lo, hi, ticks) = nice_range(lo, hi, target_ticks);
        Self { lo, hi, ticks }
    }

    fn label(&self, v: f64) -> String {
        tick_label(v, &self.ticks)
    }
}

impl Ranged for Axis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        RangedCoordf64::from(self.lo..self.hi).map(value, limit)
    }

    fn key_points<H: KeyPointHint>(&self, hint: H) -> Vec<f64> {
        // Only bold grid lines: the ticks.
        if hint.weight().allow_light_points() {
            Vec::new()
        } else {
            self.ticks.clone()
        }
    }

    fn range(&self) -> std::ops::Range<f64> {
        self.lo..self.hi
    }
}

impl Panel {
    fn plot_h(&self) -> i32 {
        let rows = i32::try_from(self.series.len()).unwrap_or(i32::MAX);
        PLOT_H.max(rows.saturating_mul(LEGEND_ROW).saturating_add(10))
    }

    /// The title with the unit in brackets.
    fn heading(&self) -> String {
        let title = match (self.title.is_empty(), self.unit.is_empty()) {
            (_, true) => self.title.clone(),
            (true, false) => format!("({})", self.unit),
            (false, false) => format!("{} ({})", self.title, self.unit),
        };
        truncate(&title, MAX_TITLE)
    }
}

/// Where the panels sit, in pixels from the top left.
struct Layout {
    /// Left end of the panels' y labels.
    left: i32,
    /// Right end of the plots; the legends are to its right.
    right: i32,
    /// Top of the first panel's title.
    panels_top: i32,
    /// Bottom of the last plot, where the x axis is.
    axis_y: i32,
    height: i32,
}

impl Timeline {
    fn events(&self) -> impl Iterator<Item = &(f64, String)> {
        self.events.iter().filter(|e| e.0.is_finite())
    }

    /// The shared x axis over every finite point and event.
    fn x_axis(&self) -> Axis {
        let xs = self
            .panels
            .iter()
            .flat_map(|p| &p.series)
            .flat_map(|s| s.points.iter().filter(|p| finite(p)).map(|p| p.0))
            .chain(self.events().map(|e| e.0));
        let (lo, hi) = extent(xs).unwrap_or((0.0, 1.0));
        Axis::new(lo, hi, 10)
    }

    fn layout(&self) -> Layout {
        let legend_w = self
            .panels
            .iter()
            .flat_map(|p| &p.series)
            .map(|s| text_width(&truncate(&s.name, MAX_NAME)) + 44)
            .max()
            .unwrap_or(0);
        let event_rows = self.events().count().min(EVENT_ROWS) as i32;
        let panels_top = M + TITLE_H + event_rows * EVENT_ROW;
        let panels_h = self
            .panels
            .iter()
            .map(|p| PANEL_TITLE_H + p.plot_h() + PANEL_GAP)
            .fold(0, i32::saturating_add);
        let axis_y = panels_top + panels_h.max(PANEL_TITLE_H + PANEL_GAP) - PANEL_GAP;
        Layout {
            left: M,
            right: (WIDTH - M - legend_w).max(WIDTH / 2),
            panels_top,
            axis_y,
            height: axis_y.saturating_add(AXIS_H + M),
        }
    }

    /// Draw one panel whose plot starts at `top`; returns the pixel column
    /// of each event on the shared x axis.
    fn panel<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
        l: &Layout,
        panel: &Panel,
        top: i32,
        last: bool,
    ) -> Result<Vec<i32>, DrawingAreaErrorKind<DB::ErrorType>> {
        let x_axis = self.x_axis();
        let ys = panel
            .series
            .iter()
            .flat_map(|s| s.points.iter().filter(|p| finite(p)).map(|p| p.1));
        let (lo, hi) = extent(ys).unwrap_or((0.0, 1.0));
        let y_axis = Axis::new(lo, hi, 4);
        let (xs, ys) = (x_axis.range(), y_axis.range());
        let axis_h = if last { AXIS_H } else { 0 };
        let plot_area = area.clone().shrink(
            (l.left, top),
            (side(l.right - l.left), side(panel.plot_h() + axis_h)),
        );
        let style = text_style(INK, HPos::Left, VPos::Bottom);
        area.draw(&Text::new(
            panel.heading(),
            (l.left + Y_LABELS_W, top - 8),
            style,
        ))?;

        let mut chart = ChartBuilder::on(&plot_area)
            .y_label_area_size(Y_LABELS_W)
            .x_label_area_size(axis_h)
            .build_cartesian_2d(x_axis.clone(), y_axis.clone())?;
        let x_label = |v: &f64| x_axis.label(*v);
        let y_label = |v: &f64| y_axis.label(*v);
        let mut mesh = chart.configure_mesh();
        // The frame drawn below stands for the axes: no axis lines, no tick marks.
        mesh.bold_line_style(GRID.rgb())
            .axis_style(TRANSPARENT)
            .label_style(text_style(INK, HPos::Center, VPos::Center))
            .axis_desc_style(text_style(INK, HPos::Center, VPos::Center))
            .x_label_formatter(&x_label)
            .y_label_formatter(&y_label);
        if last {
            mesh.x_desc(truncate(&self.x_label, MAX_TITLE));
        }
        mesh.draw()?;
        chart.plotting_area().draw(&Rectangle::new(
            [(xs.start, ys.start), (xs.end, ys.end)],
            MUTED.rgb().stroke_width(1),
        ))?;
        for (i, series) in panel.series.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()].rgb();
            for run in series.points.split(|p| !finite(p)) {
                match run {
                    [] => {}
                    [p] => {
                        chart.draw_series([Circle::new(*p, 3, color.filled())])?;
                    }
                    _ => {
                        let line = LineSeries::new(run.iter().copied(), color.stroke_width(2));
                        chart.draw_series(line)?;
                    }
                }
            }
            let y = top + 4 + i32::try_from(i).map_or(i32::MAX, |i| i.saturating_mul(LEGEND_ROW));
            let x = l.right + 16;
            area.draw(&Rectangle::new(
                [(x, y + 6), (x + 20, y + 10)],
                color.filled(),
            ))?;
            let style = text_style(INK, HPos::Left, VPos::Center);
            let name = truncate(&series.name, MAX_NAME);
            area.draw(&Text::new(name, (x + 28, y + 8), style))?;
        }
        Ok(self
            .events()
            .map(|e| chart.backend_coord(&(e.0, ys.start)).0)
            .collect())
    }

    /// The chart as an SVG document.
    pub fn svg(&self) -> io::Result<String> {
        super::svg(self)
    }

    /// Write `stem.svg` and `stem.png`; returns both paths.
    pub fn write_both(&self, stem: &Path) -> io::Result<(PathBuf, PathBuf)> {
        super::write_both(self, stem)
    }
}

impl Chart for Timeline {
    fn size(&self) -> (u32, u32) {
        (side(WIDTH), side(self.layout().height))
    }

    fn draw<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> DrawResult<DB> {
        let l = self.layout();
        let title = truncate(&self.title, MAX_TITLE);
        area.draw(&Text::new(
            title,
            (M, M),
            text_style(INK, HPos::Left, VPos::Top),
        ))?;
        if self.panels.is_empty() {
            let style = text_style(MUTED, HPos::Left, VPos::Top);
            area.draw(&Text::new("(no panels)", (l.left, l.panels_top), style))?;
            return Ok(());
        }
        let mut top = l.panels_top + PANEL_TITLE_H;
        let mut event_x = Vec::new();
        for (i, panel) in self.panels.iter().enumerate() {
            event_x = self.panel(area, &l, panel, top, i + 1 == self.panels.len())?;
            top = top.saturating_add(panel.plot_h() + PANEL_GAP + PANEL_TITLE_H);
        }
        for (row, (ex, (_, label))) in event_x.into_iter().zip(self.events()).enumerate() {
            let line = [(ex, l.panels_top), (ex, l.axis_y)];
            area.draw(&DashedPathElement::new(
                line,
                6,
                4,
                EVENT.rgb().stroke_width(2),
            ))?;
            let y = M + TITLE_H + (row % EVENT_ROWS) as i32 * EVENT_ROW;
            let label = truncate(label, MAX_EVENT);
            // Labels near the right edge hang to the left of their line.
            let (lx, h) = if ex + text_width(&label) + 4 > WIDTH - M {
                (ex - 4, HPos::Right)
            } else {
                (ex + 4, HPos::Left)
            };
            area.draw(&Text::new(label, (lx, y), text_style(EVENT, h, VPos::Top)))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{render, texts};
    use super::*;

    fn series(name: &str, points: Vec<(f64, f64)>) -> Series {
        Series {
            name: name.into(),
            points,
        }
    }

    /// How plotters' SVG writes `c` as a stroke.
    fn stroke(c: Rgb) -> String {
        format!("stroke=\"#{:02X}{:02X}{:02X}\"", c.0, c.1, c.2)
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
        let (svg, png) = render(&t);
        let lines: Vec<&str> = svg.lines().filter(|l| l.starts_with("<polyline")).collect();
        // One line per series, each panel's first series in the first colour.
        let colored = |c| lines.iter().filter(|l| l.contains(&stroke(c))).count();
        assert_eq!((colored(PALETTE[0]), colored(PALETTE[1])), (2, 1));
        for text in [
            "failover",
            "kill -9 donor-a",
            "restart donor-a",
            "tokens/s (tok/s)",
            "p99 (us)",
            "node-b",
            "lookup",
            "time (s)",
        ] {
            assert!(texts(&svg).contains(&text), "{text}");
        }
        // Each event is a dashed line: many short dashes in its colour, top to bottom.
        let dashes = svg.matches(&stroke(EVENT)).count();
        assert!(dashes > 2 * 20, "{dashes} dashes");
        assert_eq!(png.width(), side(WIDTH));
        assert!(png.height() > 2 * side(PLOT_H));
        let purple = png
            .pixels()
            .filter(|p| p[0] == EVENT.0 && p[1] == EVENT.1 && p[2] == EVENT.2)
            .count();
        assert!(purple > 200, "event markers in the PNG: {purple} pixels");
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
            let (svg, png) = render(t);
            assert!(!svg.contains("NaN") && !svg.contains("inf\""));
            assert_eq!(png.width(), side(WIDTH));
        }
        let (svg, _) = render(&cases[2]);
        assert!(texts(&svg).contains(&"(&lt;&amp;&gt;)"));
        let cut = format!("{}...", "e".repeat(MAX_EVENT - 3));
        assert!(texts(&svg).contains(&cut.as_str()));
        let lines = svg.lines().filter(|l| l.starts_with("<polyline"));
        // "flat" and the long-named series are lines; "one" is a dot.
        let series_lines = lines.filter(|l| PALETTE.iter().any(|&c| l.contains(&stroke(c))));
        assert_eq!(series_lines.count(), 2);
        assert!(svg.contains("<circle"));
    }
}
