//! The PNG back end: an RGB canvas with rectangles, lines and 5x7 text, and
//! a PNG encoder (one IDAT chunk, zlib via flate2, CRC32 via crc32fast).

use std::io::Write;

use flate2::Compression;
use flate2::write::ZlibEncoder;

use super::font::{self, ADVANCE, GLYPH_H};
use super::{Anchor, Rgb};

/// Largest canvas side in pixels; larger scenes are clipped, not allocated.
pub const MAX_SIDE: u32 = 8_192;

/// An RGB image, row-major, 3 bytes per pixel.
#[derive(Debug, Clone)]
pub struct Canvas {
    width: u32,
    height: u32,
    px: Vec<u8>,
}

impl Canvas {
    /// A `width` x `height` canvas (each side clamped to 1..=[`MAX_SIDE`]) filled with `bg`.
    pub fn new(width: u32, height: u32, bg: Rgb) -> Self {
        let width = width.clamp(1, MAX_SIDE);
        let height = height.clamp(1, MAX_SIDE);
        let px = [bg.0, bg.1, bg.2].repeat(width as usize * height as usize);
        Self { width, height, px }
    }

    /// Width in pixels.
    pub fn width(&self) -> u32 {
        self.width
    }

    /// Height in pixels.
    pub fn height(&self) -> u32 {
        self.height
    }

    /// The colour at (`x`, `y`), or `None` outside the canvas.
    pub fn get(&self, x: u32, y: u32) -> Option<Rgb> {
        if x >= self.width || y >= self.height {
            return None;
        }
        let i = (y as usize * self.width as usize + x as usize) * 3;
        Some(Rgb(self.px[i], self.px[i + 1], self.px[i + 2]))
    }

    fn set(&mut self, x: i64, y: i64, c: Rgb) {
        if x < 0 || y < 0 || x >= i64::from(self.width) || y >= i64::from(self.height) {
            return;
        }
        let i = (y as usize * self.width as usize + x as usize) * 3;
        self.px[i..i + 3].copy_from_slice(&[c.0, c.1, c.2]);
    }

    /// Fill the pixels whose centres lie in the rectangle (clipped to the canvas).
    pub fn fill_rect(&mut self, x: f64, y: f64, w: f64, h: f64, c: Rgb) {
        let clamp = |v: f64, max: u32| v.round().clamp(0.0, f64::from(max)) as i64;
        let (x0, x1) = (clamp(x, self.width), clamp(x + w, self.width));
        let (y0, y1) = (clamp(y, self.height), clamp(y + h, self.height));
        for yy in y0..y1 {
            for xx in x0..x1 {
                self.set(xx, yy, c);
            }
        }
    }

    /// Outline a rectangle with 1-pixel lines.
    pub fn stroke_rect(&mut self, x: f64, y: f64, w: f64, h: f64, c: Rgb) {
        self.fill_rect(x, y, w, 1.0, c);
        self.fill_rect(x, y + h - 1.0, w, 1.0, c);
        self.fill_rect(x, y, 1.0, h, c);
        self.fill_rect(x + w - 1.0, y, 1.0, h, c);
    }

    /// A line `width` pixels thick; `dash` draws 6 pixels on, 4 off.
    pub fn line(&mut self, a: (f64, f64), b: (f64, f64), width: f64, c: Rgb, dash: bool) {
        // Far-off endpoints are pulled in so the step count stays bounded;
        // the visible part of such a line bends slightly, which is acceptable
        // for points that the charts keep on the canvas anyway.
        let lim = |v: f64, max: u32| v.clamp(-f64::from(max), 2.0 * f64::from(max));
        let (x0, y0) = (lim(a.0, self.width), lim(a.1, self.height));
        let (x1, y1) = (lim(b.0, self.width), lim(b.1, self.height));
        if ![x0, y0, x1, y1].iter().all(|v| v.is_finite()) {
            return;
        }
        let len = (x1 - x0).hypot(y1 - y0);
        let steps = (len * 2.0).ceil().max(1.0) as u64;
        let w = width.max(1.0);
        for i in 0..=steps {
            let t = i as f64 / steps as f64;
            if dash && (t * len) % 10.0 >= 6.0 {
                continue;
            }
            let (x, y) = (x0 + (x1 - x0) * t, y0 + (y1 - y0) * t);
            self.fill_rect(x - w / 2.0, y - w / 2.0, w, w, c);
        }
    }

    /// Text in the 5x7 font at `scale`; `y` is the baseline (the glyphs' bottom edge).
    pub fn text(&mut self, x: f64, y: f64, s: &str, scale: u32, anchor: Anchor, c: Rgb) {
        let scale = scale.max(1);
        let w = f64::from(text_width(s, scale));
        let left = match anchor {
            Anchor::Start => x,
            Anchor::Middle => x - w / 2.0,
            Anchor::End => x - w,
        };
        let top = y - f64::from(GLYPH_H * scale);
        let sc = f64::from(scale);
        for (i, ch) in s.chars().enumerate() {
            let gx = left + (i as f64) * f64::from(ADVANCE * scale);
            for col in 0..font::GLYPH_W {
                for row in 0..GLYPH_H {
                    if font::pixel(ch, col, row) {
                        let px = gx + f64::from(col) * sc;
                        self.fill_rect(px, top + f64::from(row) * sc, sc, sc, c);
                    }
                }
            }
        }
    }

    /// Encode as an 8-bit RGB PNG.
    pub fn png(&self) -> Vec<u8> {
        let row = self.width as usize * 3;
        let mut raw = Vec::with_capacity((row + 1) * self.height as usize);
        for line in self.px.chunks_exact(row) {
            raw.push(0); // filter type None
            raw.extend_from_slice(line);
        }
        let mut z = ZlibEncoder::new(Vec::new(), Compression::default());
        // Writing to a Vec cannot fail.
        z.write_all(&raw).expect("in-memory zlib write");
        let idat = z.finish().expect("in-memory zlib finish");

        let mut ihdr = Vec::with_capacity(13);
        ihdr.extend_from_slice(&self.width.to_be_bytes());
        ihdr.extend_from_slice(&self.height.to_be_bytes());
        ihdr.extend_from_slice(&[8, 2, 0, 0, 0]); // depth 8, RGB, deflate, adaptive, no interlace

        let mut out = PNG_SIGNATURE.to_vec();
        chunk(&mut out, b"IHDR", &ihdr);
        chunk(&mut out, b"IDAT", &idat);
        chunk(&mut out, b"IEND", &[]);
        out
    }
}

/// The eight bytes every PNG file starts with.
pub const PNG_SIGNATURE: [u8; 8] = [0x89, b'P', b'N', b'G', 0x0D, 0x0A, 0x1A, 0x0A];

/// Width in pixels of `s` in the 5x7 font at `scale` (no trailing space).
pub fn text_width(s: &str, scale: u32) -> u32 {
    let n = u32::try_from(s.chars().count()).unwrap_or(u32::MAX);
    (n.saturating_mul(ADVANCE * scale)).saturating_sub(scale)
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    // Chunks here are far below 2^31 bytes: one canvas is at most 8192^2 x 3 bytes before compression.
    let len = u32::try_from(data.len()).expect("PNG chunk under 4 GiB");
    out.extend_from_slice(&len.to_be_bytes());
    let start = out.len();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let crc = crc32fast::hash(&out[start..]);
    out.extend_from_slice(&crc.to_be_bytes());
}

#[cfg(test)]
pub(crate) mod tests {
    use std::io::Read;

    use super::*;

    /// `(width, height, decoded image data)` of a PNG, checking signature,
    /// chunk order and every chunk's CRC.
    pub(crate) fn decode(png: &[u8]) -> (u32, u32, Vec<u8>) {
        assert_eq!(&png[..8], &PNG_SIGNATURE);
        let mut at = 8;
        let (mut w, mut h, mut idat, mut kinds) = (0, 0, Vec::new(), Vec::new());
        while at < png.len() {
            let len = u32::from_be_bytes(png[at..at + 4].try_into().expect("4 bytes")) as usize;
            let kind = &png[at + 4..at + 8];
            let data = &png[at + 8..at + 8 + len];
            let crc = u32::from_be_bytes(png[at + 8 + len..at + 12 + len].try_into().expect("4"));
            assert_eq!(
                crc,
                crc32fast::hash(&png[at + 4..at + 8 + len]),
                "CRC of {kind:?}"
            );
            match kind {
                b"IHDR" => {
                    w = u32::from_be_bytes(data[0..4].try_into().expect("4 bytes"));
                    h = u32::from_be_bytes(data[4..8].try_into().expect("4 bytes"));
                    assert_eq!(&data[8..], &[8, 2, 0, 0, 0]);
                }
                b"IDAT" => idat.extend_from_slice(data),
                _ => {}
            }
            kinds.push(String::from_utf8_lossy(kind).into_owned());
            at += 12 + len;
        }
        assert_eq!(at, png.len());
        assert_eq!(kinds.first().map(String::as_str), Some("IHDR"));
        assert_eq!(kinds.last().map(String::as_str), Some("IEND"));
        let mut raw = Vec::new();
        flate2::read::ZlibDecoder::new(&idat[..])
            .read_to_end(&mut raw)
            .expect("zlib stream decodes");
        assert_eq!(raw.len(), h as usize * (1 + w as usize * 3));
        (w, h, raw)
    }

    #[test]
    fn png_structure_and_pixels() {
        let mut c = Canvas::new(7, 3, Rgb(255, 255, 255));
        c.fill_rect(2.0, 1.0, 1.0, 1.0, Rgb(1, 2, 3));
        let (w, h, raw) = decode(&c.png());
        assert_eq!((w, h), (7, 3));
        let row1 = &raw[(1 + 7 * 3)..2 * (1 + 7 * 3)];
        assert_eq!(row1[0], 0, "filter byte");
        assert_eq!(&row1[1 + 2 * 3..1 + 3 * 3], &[1, 2, 3]);
        assert_eq!(c.get(2, 1), Some(Rgb(1, 2, 3)));
        assert_eq!(c.get(7, 0), None);
    }

    #[test]
    fn drawing_clips_and_survives_wild_input() {
        let mut c = Canvas::new(0, 0, Rgb(0, 0, 0));
        assert_eq!((c.width(), c.height()), (1, 1));
        c.fill_rect(-1e300, f64::NAN, f64::INFINITY, 1e300, Rgb(9, 9, 9));
        c.line((f64::NAN, 0.0), (1.0, 1.0), 2.0, Rgb(9, 9, 9), false);
        c.line((-1e300, -1e300), (1e300, 1e300), 2.0, Rgb(9, 9, 9), true);
        c.text(-50.0, 1e9, "\u{1F600}<&>", 3, Anchor::End, Rgb(9, 9, 9));
        decode(&c.png());
    }

    #[test]
    fn text_is_drawn_where_measured() {
        let mut c = Canvas::new(40, 20, Rgb(255, 255, 255));
        assert_eq!(text_width("TT", 1), 11);
        c.text(20.0, 10.0, "T", 1, Anchor::Middle, Rgb(0, 0, 0));
        // T's stem is its middle column; its bar the top row.
        assert_eq!(c.get(20, 9), Some(Rgb(0, 0, 0)));
        assert_eq!(c.get(18, 3), Some(Rgb(0, 0, 0)));
        assert_eq!(c.get(18, 9), Some(Rgb(255, 255, 255)));
    }
}
