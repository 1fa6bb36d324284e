//! Charts for benchmark reports, as SVG and PNG, drawn with `plotters`: a
//! [`Heatmap`] of measured and predicted slowdowns (sources x token rates)
//! and a per-second [`Timeline`] of panels sharing one time axis, with event
//! markers such as a killed donor, and [`Bars`] (one value per row against
//! its floors).
//!
//! Layers: each chart lays itself out in pixels and draws onto a plotters
//! drawing area ([`Chart::draw`]); the same drawing goes to plotters' SVG
//! back end (text stays text) and to its bitmap back end, which writes the
//! PNG. Text in the PNG uses DejaVu Sans Mono, embedded from `bench/fonts/`
//! and registered with plotters at first use, so no system font is needed
//! (its glyphs are placed by [`text`], which mends plotters' spacing); the
//! SVG names the generic `monospace` family, which its viewer resolves.
//!
//! Not a general plotting library: charts are laid out for the reports the
//! bench writes, with labels cut to fixed lengths.

mod bars;
mod heatmap;
mod sample;
mod text;
mod timeline;

use std::io;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use ab_glyph::FontRef;
use plotters::coord::Shift;
use plotters::prelude::{
    BitMapBackend, DrawingArea, DrawingAreaErrorKind, DrawingBackend, IntoDrawingArea, IntoFont,
    SVGBackend,
};
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::{FontDesc, FontFamily, FontStyle, RGBColor, TextStyle, register_font};

pub use bars::{Bar, Bars};
pub use heatmap::{Heatmap, SlowdownClass};
pub use sample::{PlotSampleArgs, run_sample};
pub use timeline::{Panel, Series, Timeline};

/// DejaVu Sans Mono 2.37; its licence is in `bench/fonts/LICENSE`.
const FONT: &[u8] = include_bytes!("../fonts/DejaVuSansMono.ttf");

/// Font size handed to plotters for every text (its pixel height is about
/// `TEXT_SIZE / 1.24`; the SVG writes that as `font-size`).
const TEXT_SIZE: f64 = 20.0;

/// Largest side of a chart in pixels; larger layouts are clipped, not allocated.
const MAX_SIDE: i32 = 8_192;

/// An sRGB colour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rgb(pub u8, pub u8, pub u8);

impl Rgb {
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

    /// The same colour for plotters.
    fn rgb(self) -> RGBColor {
        RGBColor(self.0, self.1, self.2)
    }
}

const WHITE: Rgb = Rgb(255, 255, 255);
const BLACK: Rgb = Rgb(0, 0, 0);
const INK: Rgb = Rgb(34, 34, 34);
const GRID: Rgb = Rgb(225, 225, 225);
const MUTED: Rgb = Rgb(110, 110, 110);

/// A chart drawn the same way on either back end.
trait Chart {
    /// Width and height in pixels, each within `1..=MAX_SIDE`.
    fn size(&self) -> (u32, u32);

    /// Draw on `area`, which is white and [`Chart::size`] large.
    fn draw<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> DrawResult<DB>;
}

/// What drawing on back end `DB` may fail with.
type DrawResult<DB> = Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

/// The embedded font, registered with plotters under the generic families
/// (plotters looks fonts up by family name), once per process.
fn register_fonts() -> io::Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        [
            FontFamily::Monospace,
            FontFamily::SansSerif,
            FontFamily::Serif,
        ]
        .iter()
        .all(|f| register_font(f.as_str(), FontStyle::Normal, FONT).is_ok())
    });
    if ok {
        Ok(())
    } else {
        Err(io::Error::other("the embedded font does not parse"))
    }
}

/// The embedded font, for the PNG's text.
fn font_ref() -> io::Result<FontRef<'static>> {
    FontRef::try_from_slice(FONT).map_err(|e| io::Error::other(format!("the embedded font: {e}")))
}

/// The font every chart writes in.
fn font() -> FontDesc<'static> {
    (FontFamily::Monospace, TEXT_SIZE).into_font()
}

/// Text in `color`, placed by its `h` side and `v` edge.
fn text_style(color: Rgb, h: HPos, v: VPos) -> TextStyle<'static> {
    font().color(&color.rgb()).pos(Pos::new(h, v))
}

/// Width in pixels of `text` in the chart font.
fn text_width(text: &str) -> i32 {
    static FONT_REF: OnceLock<Option<FontRef<'static>>> = OnceLock::new();
    let width = match FONT_REF.get_or_init(|| font_ref().ok()) {
        Some(f) => text::advance_width(f, TEXT_SIZE, text),
        // The font does not parse (drawing says so): a monospace guess.
        None => text.chars().count() as f64 * TEXT_SIZE * 0.52,
    };
    width.ceil().min(f64::from(i32::MAX)) as i32
}

/// A layout length as a chart side.
fn side(v: i32) -> u32 {
    v.clamp(1, MAX_SIDE).unsigned_abs()
}

fn drawing_failed<E: std::error::Error + Send + Sync>(e: DrawingAreaErrorKind<E>) -> io::Error {
    io::Error::other(format!("drawing a chart: {e}"))
}

/// `chart` drawn on `backend`, which is then flushed (the bitmap back end writes its file).
fn draw_on<DB: DrawingBackend>(backend: DB, chart: &impl Chart) -> io::Result<()> {
    register_fonts()?;
    let area = backend.into_drawing_area();
    area.fill(&WHITE.rgb()).map_err(drawing_failed)?;
    chart.draw(&area).map_err(drawing_failed)?;
    area.present().map_err(drawing_failed)
}

/// `chart` as a standalone SVG document.
fn svg(chart: &impl Chart) -> io::Result<String> {
    let mut out = String::new();
    draw_on(SVGBackend::with_string(&mut out, chart.size()), chart)?;
    Ok(out)
}

/// Write `stem.svg` and `stem.png`; returns both paths.
fn write_both(chart: &impl Chart, stem: &Path) -> io::Result<(PathBuf, PathBuf)> {
    let svg_path = stem.with_extension("svg");
    let png_path = stem.with_extension("png");
    std::fs::write(&svg_path, svg(chart)?)?;
    let bitmap = BitMapBackend::new(&png_path, chart.size());
    draw_on(text::GlyphText::new(bitmap, font_ref()?), chart)?;
    Ok((svg_path, png_path))
}

/// `s` as a label: control characters dropped, cut to at most `max`
/// characters, ending in `...` when cut.
pub fn truncate(s: &str, max: usize) -> String {
    let s: String = s.chars().filter(|c| !c.is_control()).collect();
    if s.chars().count() <= max {
        return s;
    }
    let keep = max.saturating_sub(3);
    let mut out: String = s.chars().take(keep).collect();
    out.push_str(&"..."[..max.min(3)]);
    out
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

    /// The PNG at `path`, decoded.
    pub(super) fn read_png(path: &Path) -> image::RgbImage {
        let bytes = std::fs::read(path).expect("PNG written");
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        image::load_from_memory_with_format(&bytes, image::ImageFormat::Png)
            .expect("PNG decodes")
            .to_rgb8()
    }

    /// The texts of an SVG that plotters wrote (each on the line after its `<text>`).
    pub(super) fn texts(svg: &str) -> Vec<&str> {
        let lines: Vec<&str> = svg.lines().collect();
        lines
            .windows(2)
            .filter(|w| w[0].starts_with("<text"))
            .map(|w| w[1])
            .collect()
    }

    /// `chart` written into a fresh directory: its SVG text and decoded PNG.
    pub(super) fn render(chart: &impl Chart) -> (String, image::RgbImage) {
        let dir = tempfile::tempdir().expect("tempdir");
        let (svg, png) = write_both(chart, &dir.path().join("chart")).expect("written");
        let svg = std::fs::read_to_string(svg).expect("SVG written");
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        (svg, read_png(&png))
    }

    #[test]
    fn labels_are_cleaned_and_cut() {
        assert_eq!(truncate("a<b\u{1}", 6), "a<b");
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
    fn the_embedded_font_measures_text() {
        register_fonts().expect("DejaVu Sans Mono parses");
        let (one, ten) = (text_width("m"), text_width(&"m".repeat(10)));
        assert!(one > 5 && (ten - 10 * one).abs() <= 10, "{one} {ten}");
        // plotters measures the same widths (its axis labels are placed by them).
        let plotters = font().box_size("13.5% (pred 13.5%)").expect("measured");
        let ours = text_width("13.5% (pred 13.5%)");
        assert!(
            (i64::from(plotters.0) - i64::from(ours)).abs() <= 1,
            "{plotters:?} {ours}"
        );
    }
}
