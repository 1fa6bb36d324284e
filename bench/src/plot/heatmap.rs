//! Slowdown heatmap: sources (rows) x token rates (columns), each cell the
//! measured slowdown with the model's prediction beside it, coloured by
//! class: no stall (green), some (amber, 0-30%), high (red, 30% and up).

use std::io;
use std::path::{Path, PathBuf};

use super::{Anchor, BLACK, INK, MUTED, Rgb, Scene, WHITE, percent, text_px, truncate};

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

const M: f64 = 20.0;
const SCALE: u32 = 2;
const LINE: f64 = 14.0; // text height at SCALE
const TITLE_H: f64 = 40.0;
const HEADER_H: f64 = 30.0;
const CELL_H: f64 = 48.0;
const LEGEND_H: f64 = 60.0;
const MAX_LABEL: usize = 24;
const MAX_COL_LABEL: usize = 16;
const MAX_TITLE: usize = 80;

fn cell(grid: &[Vec<Option<f64>>], r: usize, c: usize) -> Option<f64> {
    grid.get(r)?
        .get(c)
        .copied()
        .flatten()
        .filter(|v| v.is_finite())
}

/// Where the grid sits.
struct Layout {
    grid_x: f64,
    grid_y: f64,
    cell_w: f64,
    width: f64,
    height: f64,
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
        let chars = |v: &[String], max: usize| v.iter().map(|s| s.chars().count().min(max)).max();
        let label_w = text_px(chars(&self.rows, MAX_LABEL).unwrap_or(0), SCALE) + 16.0;
        let cell_chars = (0..self.rows.len())
            .flat_map(|r| (0..self.cols.len()).map(move |c| (r, c)))
            .map(|(r, c)| self.cell_text(r, c).chars().count())
            .chain(chars(&self.cols, MAX_COL_LABEL))
            .max()
            .unwrap_or(0);
        let cell_w = (text_px(cell_chars, SCALE) + 24.0).max(100.0);
        let grid_w = label_w + cell_w * self.cols.len() as f64;
        let legend_w = text_px(56, SCALE);
        let title_w = text_px(self.title.chars().count().min(MAX_TITLE), SCALE);
        Layout {
            grid_x: M + label_w,
            grid_y: M + TITLE_H + HEADER_H,
            cell_w,
            width: 2.0 * M + grid_w.max(legend_w).max(title_w),
            height: 2.0 * M + TITLE_H + HEADER_H + CELL_H * self.rows.len() as f64 + LEGEND_H,
        }
    }

    fn cell_rect(&self, l: &Layout, row: usize, col: usize) -> (f64, f64, f64, f64) {
        let x = l.grid_x + l.cell_w * col as f64;
        let y = l.grid_y + CELL_H * row as f64;
        (x, y, l.cell_w, CELL_H)
    }

    /// The chart laid out for drawing.
    pub fn scene(&self) -> Scene {
        let l = self.layout();
        let mut s = Scene::new(l.width, l.height);
        let title = truncate(&self.title, MAX_TITLE);
        s.text(M, M + LINE, &title, SCALE, Anchor::Start, INK);
        for (c, label) in self.cols.iter().enumerate() {
            let (x, _, w, _) = self.cell_rect(&l, 0, c);
            let label = truncate(label, MAX_COL_LABEL);
            s.text(
                x + w / 2.0,
                l.grid_y - 10.0,
                &label,
                SCALE,
                Anchor::Middle,
                INK,
            );
        }
        for (r, label) in self.rows.iter().enumerate() {
            let (_, y, _, h) = self.cell_rect(&l, r, 0);
            let label = truncate(label, MAX_LABEL);
            let baseline = y + (h + LINE) / 2.0;
            s.text(l.grid_x - 12.0, baseline, &label, SCALE, Anchor::End, INK);
            for c in 0..self.cols.len() {
                let (x, y, w, h) = self.cell_rect(&l, r, c);
                let (m, p) = self.cell(r, c);
                let fill = m.or(p).map_or(MISSING, SlowdownClass::color);
                s.rect(x, y, w, h, fill, Some(WHITE));
                let ink = if fill.luma() < 110.0 { WHITE } else { BLACK };
                let text = self.cell_text(r, c);
                s.text(x + w / 2.0, baseline, &text, SCALE, Anchor::Middle, ink);
            }
        }
        self.legend(&mut s, &l);
        s
    }

    fn legend(&self, s: &mut Scene, l: &Layout) {
        let y = l.grid_y + CELL_H * self.rows.len() as f64 + 20.0;
        let mut x = M;
        for (class, v) in [
            (SlowdownClass::NoStall, 0.0),
            (SlowdownClass::Some, 0.15),
            (SlowdownClass::High, 0.6),
        ] {
            s.rect(x, y, 24.0, 16.0, SlowdownClass::color(v), Some(MUTED));
            s.text(x + 32.0, y + 15.0, class.label(), SCALE, Anchor::Start, INK);
            x += 32.0 + text_px(class.label().len(), SCALE) + 24.0;
        }
        let note = "cell: measured (pred predicted), darker = slower";
        s.text(M, y + 40.0, note, SCALE, Anchor::Start, MUTED);
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
    fn cells_are_coloured_by_class() {
        let h = sample();
        let l = h.layout();
        let canvas = h.scene().canvas();
        // Above the text, at the cell's horizontal middle.
        let at = |r, c| {
            let (x, y, w, _) = h.cell_rect(&l, r, c);
            canvas
                .get((x + w / 2.0) as u32, (y + 6.0) as u32)
                .expect("inside")
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
    }

    #[test]
    fn png_and_svg_are_well_formed() {
        let h = sample();
        let (w, hh, _) = decode(&h.png());
        let l = h.layout();
        assert_eq!((w, hh), (l.width.ceil() as u32, l.height.ceil() as u32));
        let svg = h.svg();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("slowdown &lt;by source&gt; &amp; rate"));
        assert!(svg.contains("3.4% (pred 3.1%)"));
    }

    #[test]
    fn empty_ragged_and_nan_inputs_do_not_panic() {
        let empty = Heatmap::default();
        decode(&empty.png());
        assert!(empty.svg().ends_with("</svg>\n"));
        let odd = Heatmap {
            title: "x".repeat(500),
            rows: vec!["r".repeat(200), "s".into()],
            cols: vec!["c".into(), "d".into(), "e".into()],
            measured: vec![vec![Some(f64::NAN)], vec![]],
            predicted: vec![vec![Some(f64::INFINITY), Some(-1.0)]],
        };
        assert_eq!(odd.cell_text(0, 0), "n/a");
        let (w, _, _) = decode(&odd.png());
        assert!(w < 2000, "long labels are cut: {w}");
        assert!(!odd.svg().contains("NaN"));
    }
}
