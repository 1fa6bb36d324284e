//! Slowdown heatmap: sources (rows) x token rates (columns), each cell the
//! measured slowdown with the model's prediction beside it, coloured by
//! class: no stall (green), some (amber, 0-30%), high (red, 30% and up).

use std::io;
use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::prelude::{DrawingArea, DrawingBackend, Rectangle, Text};
use plotters::style::Color;
use plotters::style::text_anchor::{HPos, VPos};

use super::{
    BLACK, Chart, DrawResult, INK, MUTED, Rgb, WHITE, percent, side, text_style, text_width,
    truncate,
};

/// Measured and predicted slowdowns (fractions: `0.034` is 3.4%) per source and token rate.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Heatmap {
    /// Shown above the grid.
    pub title: String,
    /// One per row, e.g. "local RAM", "donor TCP", "SSD copy".
    pub rows: Vec<String>,
    /// One per column, e.g. "25 tok/s".
    pub cols: Vec<String>,
    /// `measured[row][col]`; missing or non-finite cells show the prediction only.
    pub measured: Vec<Vec<Option<f64>>>,
    /// `predicted[row][col]`, from seed 000's model.
    pub predicted: Vec<Vec<Option<f64>>>,
}

/// The three classes of a slowdown the colours show.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlowdownClass {
    /// Below 0.05% (shows as 0.0%), including measurement noise below zero.
    NoStall,
    /// From 0.05% up to 30%.
    Some,
    /// 30% and up.
    High,
}

/// Slowdowns below this show as 0.0% and count as no stall.
const NO_STALL_BELOW: f64 = 0.0005;
/// Slowdowns from this up count as high.
const HIGH_FROM: f64 = 0.30;
/// Where the red shade reaches its darkest.
const DARKEST_AT: f64 = 1.0;

const GREEN: Rgb = Rgb(102, 187, 106);
const AMBER_LIGHT: Rgb = Rgb(255, 226, 140);
const AMBER_DARK: Rgb = Rgb(240, 160, 20);
const RED_LIGHT: Rgb = Rgb(235, 110, 95);
const RED_DARK: Rgb = Rgb(150, 20, 20);
const MISSING: Rgb = Rgb(235, 235, 235);

impl SlowdownClass {
    /// The class of slowdown `v`.
    pub fn of(v: f64) -> Self {
        if v < NO_STALL_BELOW {
            Self::NoStall
        } else if v < HIGH_FROM {
            Self::Some
        } else {
            Self::High
        }
    }

    /// The legend's label.
    pub fn label(self) -> &'static str {
        match self {
            Self::NoStall => "no stall",
            Self::Some => "some (0-30%)",
            Self::High => "high (>=30%)",
        }
    }

    /// Cell colour for slowdown `v`: the class's hue, darker for larger `v`.
    pub fn color(v: f64) -> Rgb {
        match Self::of(v) {
            Self::NoStall => GREEN,
            Self::Some => AMBER_LIGHT.mix(AMBER_DARK, v / HIGH_FROM),
            Self::High => RED_LIGHT.mix(RED_DARK, (v - HIGH_FROM) / (DARKEST_AT - HIGH_FROM)),
        }
    }
}

const M: i32 = 20;
const TITLE_H: i32 = 40;
const HEADER_H: i32 = 30;
const CELL_H: i32 = 48;
const LEGEND_H: i32 = 60;
const MAX_LABEL: usize = 24;
const MAX_COL_LABEL: usize = 16;
const MAX_TITLE: usize = 80;
const NOTE: &str = "cell: measured (pred predicted), darker = slower";

fn cell(grid: &[Vec<Option<f64>>], r: usize, c: usize) -> Option<f64> {
    grid.get(r)?
        .get(c)
        .copied()
        .flatten()
        .filter(|v| v.is_finite())
}

/// Where the grid sits, in pixels from the top left.
struct Layout {
    grid_x: i32,
    grid_y: i32,
    cell_w: i32,
    width: i32,
    height: i32,
}

impl Heatmap {
    /// Measured and predicted slowdown of one cell (non-finite values are missing).
    pub fn cell(&self, row: usize, col: usize) -> (Option<f64>, Option<f64>) {
        (
            cell(&self.measured, row, col),
            cell(&self.predicted, row, col),
        )
    }

    /// The cell's text: `3.4% (pred 3.1%)`, `3.4%`, `pred 3.1%` or `n/a`.
    pub fn cell_text(&self, row: usize, col: usize) -> String {
        match self.cell(row, col) {
            (Some(m), Some(p)) => format!("{} (pred {})", percent(m), percent(p)),
            (Some(m), None) => percent(m),
            (None, Some(p)) => format!("pred {}", percent(p)),
            (None, None) => "n/a".to_string(),
        }
    }

    fn layout(&self) -> Layout {
        let widest = |v: &[String], max: usize| {
            v.iter()
                .map(|s| text_width(&truncate(s, max)))
                .max()
                .unwrap_or(0)
        };
        let label_w = widest(&self.rows, MAX_LABEL) + 16;
        let cell_text_w = (0..self.rows.len())
            .flat_map(|r| (0..self.cols.len()).map(move |c| (r, c)))
            .map(|(r, c)| text_width(&self.cell_text(r, c)))
            .max()
            .unwrap_or(0);
        let cell_w = (cell_text_w.max(widest(&self.cols, MAX_COL_LABEL)) + 24).max(100);
        let cols = i32::try_from(self.cols.len()).unwrap_or(i32::MAX);
        let rows = i32::try_from(self.rows.len()).unwrap_or(i32::MAX);
        let grid_w = label_w.saturating_add(cell_w.saturating_mul(cols));
        let legend_w = legend_entries()
            .map(|(label, _)| text_width(label) + 56)
            .sum::<i32>()
            .max(text_width(NOTE));
        let title_w = text_width(&truncate(&self.title, MAX_TITLE));
        Layout {
            grid_x: M + label_w,
            grid_y: M + TITLE_H + HEADER_H,
            cell_w,
            width: (2 * M).saturating_add(grid_w.max(legend_w).max(title_w)),
            height: (2 * M + TITLE_H + HEADER_H + LEGEND_H)
                .saturating_add(CELL_H.saturating_mul(rows)),
        }
    }

    /// `(x, y, w, h)` of a cell.
    fn cell_rect(&self, l: &Layout, row: usize, col: usize) -> (i32, i32, i32, i32) {
        let at =
            |i: usize, step: i32| i32::try_from(i).map_or(i32::MAX, |i| i.saturating_mul(step));
        let x = l.grid_x.saturating_add(at(col, l.cell_w));
        let y = l.grid_y.saturating_add(at(row, CELL_H));
        (x, y, l.cell_w, CELL_H)
    }

    fn legend<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
        l: &Layout,
    ) -> DrawResult<DB> {
        let rows = i32::try_from(self.rows.len()).unwrap_or(i32::MAX);
        let y = l.grid_y.saturating_add(CELL_H.saturating_mul(rows)) + 20;
        let mut x = M;
        for (label, v) in legend_entries() {
            let swatch = [(x, y), (x + 24, y + 16)];
            area.draw(&Rectangle::new(
                swatch,
                SlowdownClass::color(v).rgb().filled(),
            ))?;
            area.draw(&Rectangle::new(swatch, MUTED.rgb()))?;
            let style = text_style(INK, HPos::Left, VPos::Center);
            area.draw(&Text::new(label, (x + 32, y + 8), style))?;
            x += 32 + text_width(label) + 24;
        }
        let style = text_style(MUTED, HPos::Left, VPos::Center);
        area.draw(&Text::new(NOTE, (M, y + 34), style))
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

/// The legend: each class's label and a slowdown that shows its colour.
fn legend_entries() -> impl Iterator<Item = (&'static str, f64)> {
    [
        (SlowdownClass::NoStall, 0.0),
        (SlowdownClass::Some, 0.15),
        (SlowdownClass::High, 0.6),
    ]
    .into_iter()
    .map(|(c, v)| (c.label(), v))
}

impl Chart for Heatmap {
    fn size(&self) -> (u32, u32) {
        let l = self.layout();
        (side(l.width), side(l.height))
    }

    fn draw<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> DrawResult<DB> {
        let l = self.layout();
        let title = truncate(&self.title, MAX_TITLE);
        area.draw(&Text::new(
            title,
            (M, M),
            text_style(INK, HPos::Left, VPos::Top),
        ))?;
        for (c, label) in self.cols.iter().enumerate() {
            let (x, _, w, _) = self.cell_rect(&l, 0, c);
            let style = text_style(INK, HPos::Center, VPos::Bottom);
            area.draw(&Text::new(
                truncate(label, MAX_COL_LABEL),
                (x + w / 2, l.grid_y - 8),
                style,
            ))?;
        }
        for (r, label) in self.rows.iter().enumerate() {
            let (_, y, _, h) = self.cell_rect(&l, r, 0);
            let style = text_style(INK, HPos::Right, VPos::Center);
            area.draw(&Text::new(
                truncate(label, MAX_LABEL),
                (l.grid_x - 12, y + h / 2),
                style,
            ))?;
            for c in 0..self.cols.len() {
                let (x, y, w, h) = self.cell_rect(&l, r, c);
                let (m, p) = self.cell(r, c);
                let fill = m.or(p).map_or(MISSING, SlowdownClass::color);
                let corners = [(x, y), (x + w, y + h)];
                area.draw(&Rectangle::new(corners, fill.rgb().filled()))?;
                area.draw(&Rectangle::new(corners, WHITE.rgb()))?;
                let ink = if fill.luma() < 110.0 { WHITE } else { BLACK };
                let style = text_style(ink, HPos::Center, VPos::Center);
                area.draw(&Text::new(
                    self.cell_text(r, c),
                    (x + w / 2, y + h / 2),
                    style,
                ))?;
            }
        }
        self.legend(area, &l)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{render, texts};
    use super::*;

    fn sample() -> Heatmap {
        Heatmap {
            title: "slowdown <by source> & rate".into(),
            rows: vec!["local RAM".into(), "donor TCP".into(), "SSD copy".into()],
            cols: vec!["100".into(), "1000".into()],
            measured: vec![
                vec![Some(0.0), Some(0.0)],
                vec![Some(0.01), Some(0.08)],
                vec![Some(0.034), None],
            ],
            predicted: vec![
                vec![Some(0.0), Some(0.0)],
                vec![None, Some(0.075)],
                vec![Some(0.031), Some(0.45)],
            ],
        }
    }

    #[test]
    fn classes_and_shades() {
        assert_eq!(SlowdownClass::of(-0.001), SlowdownClass::NoStall);
        assert_eq!(SlowdownClass::of(0.034), SlowdownClass::Some);
        assert_eq!(SlowdownClass::of(0.30), SlowdownClass::High);
        let (a, b) = (SlowdownClass::color(0.05), SlowdownClass::color(0.25));
        assert!(b.luma() < a.luma(), "more slowdown is darker");
        assert_eq!(SlowdownClass::color(f64::INFINITY), RED_DARK);
    }

    #[test]
    fn cell_texts() {
        let h = sample();
        assert_eq!(h.cell_text(2, 0), "3.4% (pred 3.1%)");
        assert_eq!(h.cell_text(1, 0), "1.0%");
        assert_eq!(h.cell_text(2, 1), "pred 45.0%");
        assert_eq!(h.cell_text(9, 9), "n/a");
    }

    #[test]
    fn cells_are_coloured_by_class_and_sized_by_layout() {
        let h = sample();
        let l = h.layout();
        let (svg, png) = render(&h);
        assert_eq!(png.dimensions(), (side(l.width), side(l.height)));
        // Above the text, at the cell's horizontal middle.
        let at = |r, c| {
            let (x, y, w, _) = h.cell_rect(&l, r, c);
            let p = png.get_pixel((x + w / 2).unsigned_abs(), (y + 6).unsigned_abs());
            Rgb(p[0], p[1], p[2])
        };
        let green = at(0, 1);
        assert!(
            green.1 > green.0 + 40 && green.1 > green.2 + 40,
            "{green:?}"
        );
        let red = at(2, 1); // predicted only: 45%
        assert!(red.0 > red.1 + 60 && red.0 > red.2 + 60, "{red:?}");
        let amber = at(2, 0);
        assert!(amber.0 > 200 && amber.1 > 150 && amber.2 < 160, "{amber:?}");
        // Text is drawn in the cell: dark pixels around its middle.
        let (x, y, w, hh) = h.cell_rect(&l, 2, 0);
        let dark = (x + 4..x + w - 4)
            .flat_map(|x| (y + 4..y + hh - 4).map(move |y| (x, y)))
            .filter(|&(x, y)| png.get_pixel(x.unsigned_abs(), y.unsigned_abs())[0] < 100)
            .count();
        assert!(dark > 50, "cell text drawn: {dark} dark pixels");

        let texts = texts(&svg);
        assert_eq!(texts[0], "slowdown &lt;by source&gt; &amp; rate");
        for text in ["3.4% (pred 3.1%)", "pred 45.0%", "SSD copy", "1000", NOTE] {
            assert!(texts.contains(&text), "{text}");
        }
        for (label, _) in legend_entries() {
            assert!(
                texts.contains(&label.replace('>', "&gt;").as_str()),
                "{label}"
            );
        }
    }

    #[test]
    fn empty_ragged_and_nan_inputs_do_not_panic() {
        let (svg, png) = render(&Heatmap::default());
        assert!(svg.ends_with("</svg>\n"));
        assert!(png.width() > 100);
        let odd = Heatmap {
            title: "x".repeat(500),
            rows: vec!["r".repeat(200), "s\u{7}".into()],
            cols: vec!["c".into(), "d".into(), "e".into()],
            measured: vec![vec![Some(f64::NAN)], vec![]],
            predicted: vec![vec![Some(f64::INFINITY), Some(-1.0)]],
        };
        assert_eq!(odd.cell_text(0, 0), "n/a");
        let (svg, png) = render(&odd);
        assert!(png.width() < 2000, "long labels are cut: {}", png.width());
        assert!(!svg.contains("NaN") && !svg.contains('\u{7}'));
    }
}
