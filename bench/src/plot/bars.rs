//! Horizontal bars: one measured value per row (seconds, GB/s...), floors
//! in grey and what is measured against them in blue, the value written
//! at the end of each bar.

use std::io;
use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::prelude::{DrawingArea, DrawingBackend, PathElement, Rectangle, Text};
use plotters::style::Color;
use plotters::style::text_anchor::{HPos, VPos};

use super::{
    Chart, DrawResult, GRID, INK, MUTED, Rgb, nice_range, side, text_style, text_width, tick_label,
    truncate,
};

/// One bar.
#[derive(Debug, Clone, PartialEq)]
pub struct Bar {
    /// Its label, left of the bar.
    pub label: String,
    /// Its value (non-finite or negative: drawn as empty).
    pub value: f64,
    /// A floor (grey) rather than a measured path (blue).
    pub floor: bool,
}

/// A bar chart.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Bars {
    /// Shown above the bars.
    pub title: String,
    /// The axis' unit, e.g. "seconds".
    pub unit: String,
    /// Top to bottom.
    pub bars: Vec<Bar>,
}

const M: i32 = 24;
const BAR_H: i32 = 30;
const GAP: i32 = 10;
const PLOT_W: i32 = 640;
const MAX_LABEL: usize = 44;
const MAX_TITLE: usize = 100;
const BLUE: Rgb = Rgb(66, 133, 244);
const GREY: Rgb = Rgb(170, 170, 170);

impl Bars {
    fn label_w(&self) -> i32 {
        self.bars
            .iter()
            .map(|b| text_width(&truncate(&b.label, MAX_LABEL)))
            .max()
            .unwrap_or(0)
    }

    fn top(&self) -> i32 {
        M + 40
    }

    fn range(&self) -> (f64, f64, Vec<f64>) {
        let hi = self
            .bars
            .iter()
            .map(|b| b.value)
            .filter(|v| v.is_finite() && *v > 0.0)
            .fold(0.0, f64::max);
        nice_range(0.0, hi.max(f64::MIN_POSITIVE), 5)
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

impl Chart for Bars {
    fn size(&self) -> (u32, u32) {
        let n = i32::try_from(self.bars.len()).unwrap_or(1000).min(1000);
        let w = M + self.label_w() + 12 + PLOT_W + 120 + M;
        let h = self.top() + n * (BAR_H + GAP) + 50 + M;
        (side(w), side(h))
    }

    fn draw<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> DrawResult<DB> {
        let title = truncate(&self.title, MAX_TITLE);
        area.draw(&Text::new(
            title,
            (M, M),
            text_style(INK, HPos::Left, VPos::Top),
        ))?;
        let x0 = M + self.label_w() + 12;
        let top = self.top();
        let n = i32::try_from(self.bars.len()).unwrap_or(1000).min(1000);
        let bottom = top + n * (BAR_H + GAP);
        let (lo, hi, ticks) = self.range();
        let x_of = |v: f64| x0 + ((v - lo) / (hi - lo) * f64::from(PLOT_W)).round() as i32;
        for t in &ticks {
            let x = x_of(*t);
            area.draw(&PathElement::new(
                vec![(x, top - 4), (x, bottom)],
                GRID.rgb(),
            ))?;
            area.draw(&Text::new(
                tick_label(*t, &ticks),
                (x, bottom + 6),
                text_style(MUTED, HPos::Center, VPos::Top),
            ))?;
        }
        area.draw(&Text::new(
            truncate(&self.unit, 40),
            (x0 + PLOT_W / 2, bottom + 30),
            text_style(MUTED, HPos::Center, VPos::Top),
        ))?;
        for (i, b) in self.bars.iter().take(1000).enumerate() {
            let y = top + i as i32 * (BAR_H + GAP);
            area.draw(&Text::new(
                truncate(&b.label, MAX_LABEL),
                (x0 - 12, y + BAR_H / 2),
                text_style(INK, HPos::Right, VPos::Center),
            ))?;
            if !(b.value.is_finite() && b.value > 0.0) {
                continue;
            }
            let x1 = x_of(b.value.min(hi)).max(x0 + 1);
            let color = if b.floor { GREY } else { BLUE };
            area.draw(&Rectangle::new(
                [(x0, y), (x1, y + BAR_H)],
                color.rgb().filled(),
            ))?;
            area.draw(&Text::new(
                format!("{:.3}", b.value),
                (x1 + 8, y + BAR_H / 2),
                text_style(INK, HPos::Left, VPos::Center),
            ))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_draw_to_svg_with_their_labels_and_values() {
        let chart = Bars {
            title: "load".into(),
            unit: "seconds".into(),
            bars: vec![
                Bar {
                    label: "hash floor".into(),
                    value: 0.36,
                    floor: true,
                },
                Bar {
                    label: "verified start".into(),
                    value: 0.5,
                    floor: false,
                },
                Bar {
                    label: "missing".into(),
                    value: f64::NAN,
                    floor: false,
                },
            ],
        };
        let svg = chart.svg().expect("svg");
        for text in [
            "hash floor",
            "verified start",
            "missing",
            "0.360",
            "0.500",
            "seconds",
        ] {
            assert!(svg.contains(text), "{text} in the SVG");
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let (s, p) = chart.write_both(&dir.path().join("bars")).expect("write");
        assert!(s.is_file() && p.is_file());
    }
}
