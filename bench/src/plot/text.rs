//! Text in the PNG: a wrapper around plotters' bitmap back end that draws
//! text glyph by glyph with `ab_glyph`, from the embedded font.
//!
//! Why: plotters' own `ab_glyph` drawing puts each glyph's outline at its
//! pen position without the glyph's left side bearing, so narrow glyphs
//! (`.`, `(`, `%`) hug the left of their cell and `13.5%` reads `13. 5%`.
//! Here each glyph is placed at pen position plus bearing, as the font
//! means it. Widths are the same sums of advances plotters measures with,
//! so its layout (axis labels, anchors) and this drawing agree. Everything
//! but text goes to the wrapped back end unchanged.

use ab_glyph::{Font as _, FontRef, PxScale, ScaleFont as _, point};
use plotters_backend::text_anchor::{HPos, VPos};
use plotters_backend::{
    BackendColor, BackendCoord, BackendStyle, BackendTextStyle, DrawingBackend, DrawingErrorKind,
    FontTransform,
};

/// `inner` with text drawn from `font`.
#[derive(Debug)]
pub(super) struct GlyphText<DB> {
    inner: DB,
    font: FontRef<'static>,
}

impl<DB> GlyphText<DB> {
    pub(super) fn new(inner: DB, font: FontRef<'static>) -> Self {
        Self { inner, font }
    }
}

/// Width in pixels of `text` at plotters font size `size` (the sum of advances and kerning).
pub(super) fn advance_width(font: &FontRef<'static>, size: f64, text: &str) -> f64 {
    let font = font.as_scaled(PxScale::from(size as f32));
    let mut width = 0.0;
    let mut prev = None;
    for c in text.chars() {
        let id = font.glyph_id(c);
        if let Some(p) = prev {
            width += font.kern(p, id);
        }
        width += font.h_advance(id);
        prev = Some(id);
    }
    f64::from(width)
}

impl<DB: DrawingBackend> DrawingBackend for GlyphText<DB> {
    type ErrorType = DB::ErrorType;

    fn get_size(&self) -> (u32, u32) {
        self.inner.get_size()
    }

    fn ensure_prepared(&mut self) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.ensure_prepared()
    }

    fn present(&mut self) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.present()
    }

    fn draw_pixel(
        &mut self,
        point: BackendCoord,
        color: BackendColor,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.draw_pixel(point, color)
    }

    fn draw_line<S: BackendStyle>(
        &mut self,
        from: BackendCoord,
        to: BackendCoord,
        style: &S,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.draw_line(from, to, style)
    }

    fn draw_rect<S: BackendStyle>(
        &mut self,
        upper_left: BackendCoord,
        bottom_right: BackendCoord,
        style: &S,
        fill: bool,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.draw_rect(upper_left, bottom_right, style, fill)
    }

    fn draw_path<S: BackendStyle, I: IntoIterator<Item = BackendCoord>>(
        &mut self,
        path: I,
        style: &S,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.draw_path(path, style)
    }

    fn draw_circle<S: BackendStyle>(
        &mut self,
        center: BackendCoord,
        radius: u32,
        style: &S,
        fill: bool,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.draw_circle(center, radius, style, fill)
    }

    fn fill_polygon<S: BackendStyle, I: IntoIterator<Item = BackendCoord>>(
        &mut self,
        vert: I,
        style: &S,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.fill_polygon(vert, style)
    }

    fn blit_bitmap(
        &mut self,
        pos: BackendCoord,
        size: (u32, u32),
        src: &[u8],
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.inner.blit_bitmap(pos, size, src)
    }

    fn draw_text<S: BackendTextStyle>(
        &mut self,
        text: &str,
        style: &S,
        pos: BackendCoord,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        let color = style.color();
        // The charts never rotate text; plotters draws any that is rotated.
        if color.alpha == 0.0 || !matches!(style.transform(), FontTransform::None) {
            return self.inner.draw_text(text, style, pos);
        }
        let scaled = self.font.as_scaled(PxScale::from(style.size() as f32));
        let width = advance_width(&self.font, style.size(), text);
        let x0 = f64::from(pos.0)
            - match style.anchor().h_pos {
                HPos::Left => 0.0,
                HPos::Center => width / 2.0,
                HPos::Right => width,
            };
        // The box from ascent to descent sits on `pos` as the anchor says.
        let (ascent, descent) = (f64::from(scaled.ascent()), f64::from(scaled.descent()));
        let baseline = f64::from(pos.1)
            + match style.anchor().v_pos {
                VPos::Top => ascent,
                VPos::Center => (ascent + descent) / 2.0,
                VPos::Bottom => descent,
            };
        let mut pen = x0 as f32;
        let mut prev = None;
        for c in text.chars() {
            let id = scaled.glyph_id(c);
            if let Some(p) = prev {
                pen += scaled.kern(p, id);
            }
            prev = Some(id);
            let glyph = id.with_scale_and_position(scaled.scale(), point(pen, baseline as f32));
            pen += scaled.h_advance(id);
            let Some(outline) = self.font.outline_glyph(glyph) else {
                continue; // a space, or a glyph the font lacks
            };
            let min = outline.px_bounds().min;
            let mut coverage = Vec::new();
            outline.draw(|x, y, c| coverage.push((x, y, c)));
            for (x, y, c) in coverage {
                let at = (min.x as i32 + x as i32, min.y as i32 + y as i32);
                let alpha = color.alpha * f64::from(c.clamp(0.0, 1.0));
                if alpha > 0.0 {
                    let rgb = color.rgb;
                    self.inner.draw_pixel(at, BackendColor { alpha, rgb })?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use plotters::prelude::{BitMapBackend, IntoDrawingArea, Text};
    use plotters::style::text_anchor::Pos;
    use plotters::style::{IntoFont, RGBColor};

    use super::*;

    /// Columns holding ink in a `w` x `h` RGB buffer.
    fn inked_columns(buf: &[u8], w: usize) -> Vec<usize> {
        (0..w)
            .filter(|x| buf.chunks(w * 3).any(|row| row[x * 3] < 128))
            .collect()
    }

    #[test]
    fn narrow_glyphs_sit_inside_their_cell() {
        let font = FontRef::try_from_slice(super::super::FONT).expect("font parses");
        super::super::register_fonts().expect("font registers");
        let (w, h) = (120usize, 40usize);
        let mut buf = vec![255u8; w * h * 3];
        {
            let backend = BitMapBackend::with_buffer(&mut buf, (w as u32, h as u32));
            let area = GlyphText::new(backend, font.clone()).into_drawing_area();
            let style = ("monospace", 20.0)
                .into_font()
                .color(&RGBColor(0, 0, 0))
                .pos(Pos::new(HPos::Left, VPos::Top));
            area.draw(&Text::new("1.5", (10, 5), style)).expect("drawn");
            area.present().expect("presented");
        }
        let cols = inked_columns(&buf, w);
        let advance = advance_width(&font, 20.0, "1");
        // The dot is drawn in the middle of the second cell, not at its left edge.
        let dot_cell = (10.0 + advance) as usize..(10.0 + 2.0 * advance) as usize;
        let dot: Vec<usize> = cols
            .iter()
            .copied()
            .filter(|c| dot_cell.contains(c))
            .collect();
        let (first, last) = (dot[0], dot[dot.len() - 1]);
        let (left_gap, right_gap) = (first - dot_cell.start, dot_cell.end - last);
        assert!(left_gap.abs_diff(right_gap) <= 2, "{dot:?} in {dot_cell:?}");
        // Nothing above the anchor or far below the text.
        let rows: Vec<usize> = (0..h)
            .filter(|y| {
                buf[y * w * 3..(y + 1) * w * 3]
                    .chunks(3)
                    .any(|p| p[0] < 128)
            })
            .collect();
        assert!(rows[0] >= 5 && rows[rows.len() - 1] < 5 + 20, "{rows:?}");
    }
}
