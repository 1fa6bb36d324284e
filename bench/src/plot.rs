//! Charts for benchmark reports, as SVG (text) and PNG (raster), with no
//! plotting dependency: a [`Heatmap`] of measured and predicted slowdowns
//! (sources x token rates) and a per-second [`Timeline`] of panels sharing
//! one time axis, with event markers such as a killed donor.
//!
//! Layers: a chart lays itself out once into a [`Scene`] of rectangles,
//! lines, polylines and text; the scene is then written either as SVG or
//! drawn on a [`raster::Canvas`] (5x7 bitmap font) and encoded as PNG. Text
//! sizes are chosen so the SVG's monospace text and the bitmap font take
//! about the same room.
//!
//! Not a general plotting library: no log axes, no rotation, ASCII labels
//! in the PNG (other characters draw as `?`).

mod font;
mod heatmap;
pub mod raster;
mod sample;
mod timeline;

use std::fmt::Write as _;
use std::io;
use std::path::{Path, PathBuf};

pub use heatmap::{Heatmap, SlowdownClass};
pub use sample::{PlotSampleArgs, run_sample};
pub use timeline::{Panel, Series, Timeline};

use raster::Canvas;

/// An sRGB colour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rgb(pub u8, pub u8, pub u8);

impl Rgb {
    /// `#rrggbb`.
    pub fn hex(self) -> String {
        format!("#{:02x}{:02x}{:02x}", self.0, self.1, self.2)
    }

    /// The colour `t` (0..=1) of the way from `self` to `to`.
    pub fn mix(self, to: Rgb, t: f64) -> Rgb {
        // NaN counts as 0; infinities clamp to the ends.
        let t = if t.is_nan() { 0.0 } else { t.clamp(0.0, 1.0) };
        let m = |a: u8, b: u8| (f64::from(a) + (f64::from(b) - f64::from(a)) * t).round() as u8;
        Rgb(m(self.0, to.0), m(self.1, to.1), m(self.2, to.2))
    }

    /// Perceived brightness, 0..=255, to pick black or white text on it.
    pub fn luma(self) -> f64 {
        0.299 * f64::from(self.0) + 0.587 * f64::from(self.1) + 0.114 * f64::from(self.2)
    }
}

const WHITE: Rgb = Rgb(255, 255, 255);
const BLACK: Rgb = Rgb(0, 0, 0);
const INK: Rgb = Rgb(34, 34, 34);
const GRID: Rgb = Rgb(225, 225, 225);
const MUTED: Rgb = Rgb(110, 110, 110);

/// Where a text's `x` is: its left end, centre or right end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Anchor {
    Start,
    Middle,
    End,
}

/// One drawing primitive, in pixels from the top left.
#[derive(Debug, Clone, PartialEq)]
pub enum Shape {
    /// A filled rectangle, optionally outlined.
    Rect {
        x: f64,
        y: f64,
        w: f64,
        h: f64,
        fill: Rgb,
        stroke: Option<Rgb>,
    },
    /// A straight line; `dash` draws it dashed.
    Line {
        from: (f64, f64),
        to: (f64, f64),
        color: Rgb,
        width: f64,
        dash: bool,
    },
    /// Connected points.
    Polyline {
        points: Vec<(f64, f64)>,
        color: Rgb,
        width: f64,
    },
    /// Text whose baseline is at `y`; `scale` 1 is the 5x7 font at 1:1.
    Text {
        x: f64,
        y: f64,
        text: String,
        scale: u32,
        anchor: Anchor,
        color: Rgb,
    },
}

/// A laid-out chart: what both back ends draw.
#[derive(Debug, Clone, PartialEq)]
pub struct Scene {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// Drawn in order, later over earlier.
    pub shapes: Vec<Shape>,
}

impl Scene {
    /// An empty white scene.
    pub fn new(width: f64, height: f64) -> Self {
        let side = |v: f64| v.ceil().clamp(1.0, f64::from(raster::MAX_SIDE)) as u32;
        Self {
            width: side(width),
            height: side(height),
            shapes: Vec::new(),
        }
    }

    /// Add a rectangle.
    pub fn rect(&mut self, x: f64, y: f64, w: f64, h: f64, fill: Rgb, stroke: Option<Rgb>) {
        self.shapes.push(Shape::Rect {
            x,
            y,
            w,
            h,
            fill,
            stroke,
        });
    }

    /// Add a line.
    pub fn line(&mut self, from: (f64, f64), to: (f64, f64), color: Rgb, width: f64, dash: bool) {
        self.shapes.push(Shape::Line {
            from,
            to,
            color,
            width,
            dash,
        });
    }

    /// Add text.
    pub fn text(&mut self, x: f64, y: f64, text: &str, scale: u32, anchor: Anchor, color: Rgb) {
        self.shapes.push(Shape::Text {
            x,
            y,
            text: text.to_string(),
            scale,
            anchor,
            color,
        });
    }

    /// The scene as a standalone SVG document.
    pub fn svg(&self) -> String {
        let (w, h) = (self.width, self.height);
        let mut s = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" \
             viewBox=\"0 0 {w} {h}\" font-family=\"DejaVu Sans Mono, Menlo, monospace\">\n\
             <rect x=\"0\" y=\"0\" width=\"{w}\" height=\"{h}\" fill=\"#ffffff\"/>\n"
        );
        // Writing to a String cannot fail; the results are ignored.
        for shape in &self.shapes {
            let _ = match shape {
                Shape::Rect {
                    x,
                    y,
                    w,
                    h,
                    fill,
                    stroke,
                } => {
                    let st = stroke.map_or(String::new(), |c| format!(" stroke=\"{}\"", c.hex()));
                    writeln!(
                        s,
                        "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\"{st}/>",
                        num(*x),
                        num(*y),
                        num(w.max(0.0)),
                        num(h.max(0.0)),
                        fill.hex()
                    )
                }
                Shape::Line {
                    from,
                    to,
                    color,
                    width,
                    dash,
                } => writeln!(
                    s,
                    "<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"{}\" stroke-width=\"{}\"{}/>",
                    num(from.0),
                    num(from.1),
                    num(to.0),
                    num(to.1),
                    color.hex(),
                    num(*width),
                    if *dash {
                        " stroke-dasharray=\"6 4\""
                    } else {
                        ""
                    }
                ),
                Shape::Polyline {
                    points,
                    color,
                    width,
                } => {
                    let pts: Vec<String> = points
                        .iter()
                        .map(|p| format!("{},{}", num(p.0), num(p.1)))
                        .collect();
                    writeln!(
                        s,
                        "<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"{}\" stroke-linejoin=\"round\"/>",
                        pts.join(" "),
                        color.hex(),
                        num(*width)
                    )
                }
                Shape::Text {
                    x,
                    y,
                    text,
                    scale,
                    anchor,
                    color,
                } => {
                    let anchor = match anchor {
                        Anchor::Start => "start",
                        Anchor::Middle => "middle",
                        Anchor::End => "end",
                    };
                    writeln!(
                        s,
                        "<text x=\"{}\" y=\"{}\" font-size=\"{}\" text-anchor=\"{anchor}\" fill=\"{}\">{}</text>",
                        num(*x),
                        num(*y),
                        10 * (*scale).max(1),
                        color.hex(),
                        escape_xml(text)
                    )
                }
            };
        }
        s.push_str("</svg>\n");
        s
    }

    /// The scene drawn on a canvas.
    pub fn canvas(&self) -> Canvas {
        let mut c = Canvas::new(self.width, self.height, WHITE);
        for shape in &self.shapes {
            match shape {
                Shape::Rect {
                    x,
                    y,
                    w,
                    h,
                    fill,
                    stroke,
                } => {
                    c.fill_rect(*x, *y, *w, *h, *fill);
                    if let Some(st) = stroke {
                        c.stroke_rect(*x, *y, *w, *h, *st);
                    }
                }
                Shape::Line {
                    from,
                    to,
                    color,
                    width,
                    dash,
                } => c.line(*from, *to, *width, *color, *dash),
                Shape::Polyline {
                    points,
                    color,
                    width,
                } => {
                    for pair in points.windows(2) {
                        c.line(pair[0], pair[1], *width, *color, false);
                    }
                }
                Shape::Text {
                    x,
                    y,
                    text,
                    scale,
                    anchor,
                    color,
                } => c.text(*x, *y, text, *scale, *anchor, *color),
            }
        }
        c
    }

    /// The scene as a PNG file's bytes.
    pub fn png(&self) -> Vec<u8> {
        self.canvas().png()
    }

    /// Write `stem.svg` and `stem.png`; returns both paths.
    pub fn write_both(&self, stem: &Path) -> io::Result<(PathBuf, PathBuf)> {
        let svg = stem.with_extension("svg");
        let png = stem.with_extension("png");
        std::fs::write(&svg, self.svg())?;
        std::fs::write(&png, self.png())?;
        Ok((svg, png))
    }
}

/// A coordinate for SVG: two decimals, non-finite as 0.
fn num(v: f64) -> String {
    let v = if v.is_finite() { v } else { 0.0 };
    let s = format!("{v:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// `s` safe as XML text or attribute value; control characters XML forbids are dropped.
pub fn escape_xml(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c if (c as u32) < 0x20 && !matches!(c, '\t' | '\n' | '\r') => {}
            c => out.push(c),
        }
    }
    out
}

/// `s` cut to at most `max` characters, ending in `...` when cut.
pub fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_string();
    }
    let keep = max.saturating_sub(3);
    let mut out: String = s.chars().take(keep).collect();
    out.push_str(&"..."[..max.min(3)]);
    out
}

/// Width in pixels of `chars` characters of text at `scale` (both back ends).
fn text_px(chars: usize, scale: u32) -> f64 {
    (chars as f64) * f64::from(font::ADVANCE * scale)
}

/// A range widened to round numbers, and ticks on it: `(lo, hi, ticks)`.
/// Non-finite or empty input gives `0..1`; a single value is padded.
fn nice_range(lo: f64, hi: f64, target_ticks: usize) -> (f64, f64, Vec<f64>) {
    let (mut lo, mut hi) = if lo.is_finite() && hi.is_finite() && lo <= hi {
        (lo, hi)
    } else {
        (0.0, 1.0)
    };
    if hi - lo <= f64::EPSILON * hi.abs().max(1.0) {
        let pad = if lo == 0.0 { 1.0 } else { lo.abs() * 0.1 };
        (lo, hi) = (lo - pad, hi + pad);
    }
    let raw = (hi - lo) / target_ticks.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let (lo, hi) = ((lo / step).floor() * step, (hi / step).ceil() * step);
    let n = ((hi - lo) / step).round() as usize;
    let ticks = (0..=n.min(100)).map(|i| lo + step * i as f64).collect();
    (lo, hi, ticks)
}

/// A tick label with as many decimals as the ticks' spacing needs.
fn tick_label(v: f64, ticks: &[f64]) -> String {
    let step = match ticks {
        [a, b, ..] => (b - a).abs(),
        _ => 1.0,
    };
    let decimals = if step >= 1.0 || step <= 0.0 {
        0
    } else {
        (-step.log10().floor()) as usize
    };
    let s = format!("{v:.decimals$}");
    if s.trim_start_matches('-')
        .chars()
        .all(|c| c == '0' || c == '.')
    {
        s.trim_start_matches('-').to_string()
    } else {
        s
    }
}

/// A slowdown fraction as a percentage with one decimal: `0.034` -> `3.4%`.
pub fn percent(v: f64) -> String {
    format!("{:.1}%", v * 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_and_truncate() {
        assert_eq!(escape_xml("a<b & \"c\"\u{1}"), "a&lt;b &amp; &quot;c&quot;");
        assert_eq!(truncate("abcdef", 6), "abcdef");
        assert_eq!(truncate("abcdefg", 6), "abc...");
        assert_eq!(truncate("\u{e9}\u{e9}\u{e9}\u{e9}", 2), "..");
        assert_eq!(percent(0.034), "3.4%");
    }

    #[test]
    fn ranges_are_padded_and_round() {
        let (lo, hi, t) = nice_range(3.0, 3.0, 5);
        assert!(lo < 3.0 && hi > 3.0 && t.len() >= 2, "{lo} {hi} {t:?}");
        let (lo, hi, t) = nice_range(0.0, 97.0, 5);
        assert_eq!((lo, hi), (0.0, 100.0));
        assert_eq!(t.len(), 6);
        assert_eq!(tick_label(t[1], &t), "20");
        let (lo, hi, _) = nice_range(f64::NAN, 1.0, 5);
        assert_eq!((lo, hi), (0.0, 1.0));
        let (_, _, t) = nice_range(0.0, 0.03, 5);
        assert_eq!(tick_label(t[1], &t), "0.01");
        assert_eq!(tick_label(-0.0, &t), "0.00");
    }

    #[test]
    fn svg_escapes_text_and_is_closed() {
        let mut s = Scene::new(10.0, 10.0);
        s.text(1.0, 1.0, "<kill & restart>", 1, Anchor::Start, INK);
        s.line((f64::NAN, 0.0), (1.0, f64::INFINITY), INK, 1.0, true);
        let svg = s.svg();
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("&lt;kill &amp; restart&gt;"));
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
    }
}
