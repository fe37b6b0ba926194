//! Dependency-free SVG charts for docs/BENCHMARKS.md: a horizontal bar chart (one median per
//! row, with a whisker from min to max) and a line chart for sweeps (log or linear x).
//!
//! The output is a standalone SVG document, byte-identical for the same input so that committed
//! plots change only when the numbers do: coordinates carry at most one decimal, and nothing
//! depends on the clock, hashing or the locale. Missing data never panics: non-finite values are
//! skipped (a bar whose median is not finite shows "n/a"), and a chart with nothing to draw
//! shows a "no data" note.

use std::fmt::{self, Write as _};

/// Width of every chart, px.
const WIDTH: f64 = 720.0;
/// Estimated width of one character of 12 px sans-serif, px.
const CHAR_W: f64 = 6.5;
/// Our bars and series.
const ACCENT: &str = "#e8590c";
/// Everyone else's bars.
const GREY: &str = "#adb5bd";
/// Colours for series that are not ours, in order (the accent is kept for ours).
const PALETTE: [&str; 6] = [
    "#1c7ed6", "#2f9e44", "#7048e8", "#0c8599", "#c2255c", "#495057",
];
/// Text and axes.
const INK: &str = "#212529";
/// Notes, the reference line, "n/a".
const MUTED: &str = "#868e96";
/// Grid lines.
const GRID: &str = "#e9ecef";
/// Min–max whiskers on bars.
const WHISKER: &str = "#343a40";
/// Text attributes of a chart's title.
const TITLE: &str = r#"font-size="14" font-weight="bold""#;
/// Text attributes of tick and reference labels.
const SMALL: &str = r#"font-size="11""#;
/// Line attributes of the reference line.
const DASHED: &str = r#" stroke-dasharray="5 3""#;

/// A chart written to docs/bench/`file` and shown in docs/BENCHMARKS.md under `title`.
pub(crate) struct Figure {
    pub(crate) file: String,
    pub(crate) title: String,
    pub(crate) svg: String,
}

impl Figure {
    pub(crate) fn bars(
        file: &str,
        title: &str,
        unit: &str,
        bars: &[Bar],
        reference: Option<(&str, f64)>,
    ) -> Figure {
        Figure {
            file: file.to_owned(),
            title: title.to_owned(),
            svg: bar_chart(title, unit, bars, reference),
        }
    }

    pub(crate) fn lines(
        file: &str,
        title: &str,
        x_label: &str,
        y_label: &str,
        series: &[Series],
    ) -> Figure {
        Figure {
            file: file.to_owned(),
            title: title.to_owned(),
            svg: line_chart(title, x_label, y_label, series, true),
        }
    }
}

/// The Markdown that shows `figures` (docs/BENCHMARKS.md links docs/bench/).
pub(crate) fn embed(figures: &[Figure]) -> String {
    let mut md = String::new();
    for f in figures {
        let _ = writeln!(md, "![{}](bench/{})\n", f.title, f.file);
    }
    md
}

impl Bar {
    /// A bar from a median and its spread.
    pub(crate) fn new(
        label: impl Into<String>,
        (median, min, max): (f64, f64, f64),
        ours: bool,
    ) -> Bar {
        Bar {
            label: label.into(),
            median,
            min,
            max,
            ours,
        }
    }
}

/// One bar: a median with its min–max spread over rounds.
#[derive(Debug, Clone)]
pub(crate) struct Bar {
    pub(crate) label: String,
    pub(crate) median: f64,
    pub(crate) min: f64,
    pub(crate) max: f64,
    /// Drawn in the accent colour (fastpath), others in grey.
    pub(crate) ours: bool,
}

/// One line of a sweep chart.
#[derive(Debug, Clone)]
pub(crate) struct Series {
    pub(crate) name: String,
    /// (x, median, min, max) per point.
    pub(crate) points: Vec<(f64, f64, f64, f64)>,
    /// Drawn in the accent colour and thicker (fastpath).
    pub(crate) ours: bool,
}

/// Horizontal bar chart, one bar per row: the label on the left, the median printed at the
/// bar's end, a thin whisker from min to max. The x axis starts at 0 with about 5 nice ticks
/// and `unit` as its title. `ours` bars are drawn in the accent colour, others in grey.
/// `reference` is an optional vertical dashed line with its label (e.g. the empty-program
/// floor). Negative values are drawn at 0 (their label still shows the value).
///
/// 720 px wide, 60 + 28 px per bar high (one row's height when `bars` is empty, for the note).
/// Labels longer than about 49 characters are cut with an ellipsis (the full text is in the
/// row's tooltip).
pub(crate) fn bar_chart(
    title: &str,
    unit: &str,
    bars: &[Bar],
    reference: Option<(&str, f64)>,
) -> String {
    const TOP: f64 = 30.0;
    const ROW: f64 = 28.0;
    const BAR_H: f64 = 16.0;
    const RIGHT: f64 = 64.0;
    const MAX_LABEL_W: f64 = 320.0;
    const MAX_LABEL_CHARS: usize = (MAX_LABEL_W / CHAR_W) as usize;

    let rows = bars.len().max(1);
    let axis_y = TOP + ROW * rows as f64;
    let height = axis_y + 30.0;
    let labels: Vec<String> = bars
        .iter()
        .map(|b| truncate(&b.label, MAX_LABEL_CHARS))
        .collect();
    let longest = labels.iter().map(|l| l.chars().count()).max().unwrap_or(0);
    let left = (longest as f64 * CHAR_W).min(MAX_LABEL_W) + 16.0;
    let right = WIDTH - RIGHT;
    let reference = reference.filter(|(_, v)| v.is_finite());

    let data_max = bars
        .iter()
        .flat_map(|b| [b.median, b.min, b.max])
        .chain(reference.map(|(_, v)| v))
        .filter(|v| v.is_finite())
        .fold(0.0, f64::max);
    let ticks = nice_ticks(data_max);
    let top_tick = ticks.last().copied().unwrap_or(1.0);
    let x = |v: f64| left + v.clamp(0.0, top_tick) / top_tick * (right - left);

    let mut svg = Svg::new(title, height);
    svg.text(10.0, 17.0, "start", TITLE, title);

    for &t in &ticks {
        svg.line((x(t), TOP), (x(t), axis_y), GRID, 1.0, "");
        svg.text(x(t), axis_y + 14.0, "middle", SMALL, &fmt_num(t));
    }
    svg.line((left, axis_y), (right, axis_y), INK, 1.0, "");
    svg.text((left + right) / 2.0, axis_y + 27.0, "middle", "", unit);

    for (i, (bar, label)) in bars.iter().zip(&labels).enumerate() {
        let cy = TOP + ROW * (i as f64 + 0.5);
        svg.push(format_args!(
            "<g><title>{}: {} {} (min {}, max {})</title>\n",
            esc(&bar.label),
            fmt_num(bar.median),
            esc(unit),
            fmt_num(bar.min),
            fmt_num(bar.max)
        ));
        svg.text(left - 8.0, cy + 4.0, "end", "", label);
        if bar.median.is_finite() {
            let fill = if bar.ours { ACCENT } else { GREY };
            svg.push(format_args!(
                "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{fill}\"/>\n",
                Px(left),
                Px(cy - BAR_H / 2.0),
                Px(x(bar.median) - left),
                Px(BAR_H)
            ));
        }
        if bar.min.is_finite() && bar.max.is_finite() {
            let (lo, hi) = (x(bar.min.min(bar.max)), x(bar.min.max(bar.max)));
            svg.line((lo, cy), (hi, cy), WHISKER, 1.0, "");
            svg.line((lo, cy - 5.0), (lo, cy + 5.0), WHISKER, 1.0, "");
            svg.line((hi, cy - 5.0), (hi, cy + 5.0), WHISKER, 1.0, "");
        }
        if bar.median.is_finite() {
            let end = [bar.median, bar.max]
                .into_iter()
                .filter(|v| v.is_finite())
                .map(x)
                .fold(left, f64::max);
            svg.text(end + 6.0, cy + 4.0, "start", "", &fmt_num(bar.median));
        } else {
            let fill = format!("fill=\"{MUTED}\"");
            svg.text(left + 6.0, cy + 4.0, "start", &fill, "n/a");
        }
        svg.push(format_args!("</g>\n"));
    }

    if let Some((label, value)) = reference {
        let rx = x(value);
        svg.line((rx, TOP), (rx, axis_y), MUTED, 1.5, DASHED);
        // The label sits above the plot, on whichever side of the line has room.
        let (lx, anchor) = if rx > (left + right) / 2.0 {
            (rx - 3.0, "end")
        } else {
            (rx + 3.0, "start")
        };
        let attrs = format!("font-size=\"11\" fill=\"{MUTED}\"");
        svg.text(lx, TOP - 2.0, anchor, &attrs, label);
    }
    if bars.is_empty() {
        no_data(&mut svg, (left + right) / 2.0, TOP + ROW / 2.0);
    }
    svg.finish()
}

/// Line chart: the x axis is logarithmic (base 10, a tick per decade labelled 1, 10, 100, 1k,
/// 10k, 100k, 1M…) when `log_x`, linear from 0 otherwise; y from 0 with nice ticks. Each
/// series is a polyline through its points (sorted by x) with markers and vertical min–max
/// whiskers, in its own colour (ours in the accent colour and thicker), named in a legend
/// above the plot. Points that cannot be placed are skipped: a non-finite x or median, and
/// x ≤ 0 on a log axis or x < 0 on a linear one.
///
/// 720 px wide, about 340 px high (more when the legend wraps).
pub(crate) fn line_chart(
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    log_x: bool,
) -> String {
    const LEFT: f64 = 64.0;
    const RIGHT: f64 = WIDTH - 24.0;
    const PLOT_H: f64 = 240.0;
    const LEGEND_ROW: f64 = 18.0;
    const MAX_NAME_CHARS: usize = 60;

    // Legend items flow left to right from the plot's left edge, wrapping at the right edge.
    let names: Vec<String> = series
        .iter()
        .map(|s| truncate(&s.name, MAX_NAME_CHARS))
        .collect();
    let mut legend = Vec::with_capacity(names.len());
    let (mut lx, mut ly) = (LEFT, 36.0);
    for name in &names {
        let w = 30.0 + name.chars().count() as f64 * CHAR_W + 18.0;
        if lx + w > WIDTH - 10.0 && lx > LEFT {
            (lx, ly) = (LEFT, ly + LEGEND_ROW);
        }
        legend.push((lx, ly));
        lx += w;
    }
    let top = if names.is_empty() { 36.0 } else { ly + 16.0 };
    let bottom = top + PLOT_H;
    let height = bottom + 44.0;

    let points: Vec<Vec<(f64, f64, f64, f64)>> = series
        .iter()
        .map(|s| {
            let mut p: Vec<_> = s
                .points
                .iter()
                .copied()
                .filter(|&(x, m, _, _)| {
                    x.is_finite() && m.is_finite() && if log_x { x > 0.0 } else { x >= 0.0 }
                })
                .collect();
            p.sort_by(|a, b| a.0.total_cmp(&b.0));
            p
        })
        .collect();
    let all = || points.iter().flatten();

    // The x axis in transformed space (log10 of x, or x): ticks, and the range [lo, hi].
    let (x_ticks, lo, hi) = if log_x {
        let min = all().map(|p| p.0).fold(f64::INFINITY, f64::min);
        let max = all().map(|p| p.0).fold(0.0, f64::max);
        decade_ticks(min, max)
    } else {
        let ticks = nice_ticks(all().map(|p| p.0).fold(0.0, f64::max));
        let hi = ticks.last().copied().unwrap_or(1.0);
        (ticks, 0.0, hi)
    };
    let tf = |v: f64| if log_x { v.log10() } else { v };
    let x = |v: f64| LEFT + (tf(v) - lo) / (hi - lo) * (RIGHT - LEFT);
    let y_ticks = nice_ticks(
        all()
            .flat_map(|&(_, m, a, b)| [m, a, b])
            .filter(|v| v.is_finite())
            .fold(0.0, f64::max),
    );
    let y_top = y_ticks.last().copied().unwrap_or(1.0);
    let y = |v: f64| bottom - v.clamp(0.0, y_top) / y_top * PLOT_H;

    let mut svg = Svg::new(title, height);
    svg.text(10.0, 17.0, "start", TITLE, title);

    for &t in &y_ticks {
        svg.line((LEFT, y(t)), (RIGHT, y(t)), GRID, 1.0, "");
        svg.text(LEFT - 6.0, y(t) + 4.0, "end", SMALL, &fmt_num(t));
    }
    for &t in &x_ticks {
        let label = if log_x { fmt_compact(t) } else { fmt_num(t) };
        svg.line((x(t), top), (x(t), bottom), GRID, 1.0, "");
        svg.text(x(t), bottom + 16.0, "middle", SMALL, &label);
    }
    svg.line((LEFT, top), (LEFT, bottom), INK, 1.0, "");
    svg.line((LEFT, bottom), (RIGHT, bottom), INK, 1.0, "");
    svg.text((LEFT + RIGHT) / 2.0, bottom + 34.0, "middle", "", x_label);
    svg.push(format_args!(
        "<text transform=\"translate(16,{}) rotate(-90)\" text-anchor=\"middle\">{}</text>\n",
        Px((top + bottom) / 2.0),
        esc(y_label)
    ));

    // Colour, line width and dash of each series, in the order given.
    let mut others = 0;
    let mut ours = 0;
    let styles: Vec<(&str, f64, &str)> = series
        .iter()
        .map(|s| {
            let (colour, width, n) = if s.ours {
                ours += 1;
                (ACCENT, 2.5, ours - 1)
            } else {
                others += 1;
                (PALETTE[(others - 1) % PALETTE.len()], 1.5, others - 1)
            };
            // Tell apart a second series of ours, or others once the palette repeats.
            let repeats = if s.ours { n > 0 } else { n >= PALETTE.len() };
            let dash = if repeats {
                r#" stroke-dasharray="6 3""#
            } else {
                ""
            };
            (colour, width, dash)
        })
        .collect();

    // Ours last, on top of the others.
    let order = (0..series.len())
        .filter(|&i| !series[i].ours)
        .chain((0..series.len()).filter(|&i| series[i].ours));
    for i in order {
        let (colour, width, dash) = styles[i];
        let pts = &points[i];
        if pts.len() > 1 {
            let mut coords = String::new();
            for (j, &(px, m, _, _)) in pts.iter().enumerate() {
                let sep = if j == 0 { "" } else { " " };
                let _ = write!(coords, "{sep}{},{}", Px(x(px)), Px(y(m)));
            }
            svg.push(format_args!(
                "<polyline points=\"{coords}\" fill=\"none\" stroke=\"{colour}\" \
                 stroke-width=\"{}\" stroke-linejoin=\"round\"{dash}/>\n",
                Px(width)
            ));
        }
        for &(px, m, a, b) in pts {
            let cx = x(px);
            if a.is_finite() && b.is_finite() {
                let (y_lo, y_hi) = (y(a.min(b)), y(a.max(b)));
                svg.line((cx, y_lo), (cx, y_hi), colour, 1.0, "");
                svg.line((cx - 3.0, y_lo), (cx + 3.0, y_lo), colour, 1.0, "");
                svg.line((cx - 3.0, y_hi), (cx + 3.0, y_hi), colour, 1.0, "");
            }
            marker(&mut svg, cx, y(m), colour, width);
        }
    }

    for ((name, &(lx, ly)), &(colour, width, dash)) in names.iter().zip(&legend).zip(&styles) {
        svg.line((lx, ly - 4.0), (lx + 22.0, ly - 4.0), colour, width, dash);
        marker(&mut svg, lx + 11.0, ly - 4.0, colour, width);
        svg.text(lx + 28.0, ly, "start", "", name);
    }
    if points.iter().all(Vec::is_empty) {
        no_data(&mut svg, (LEFT + RIGHT) / 2.0, top + PLOT_H / 2.0);
    }
    svg.finish()
}

/// Ticks from 0 to the first "nice" value (1, 2, 2.5 or 5 times a power of ten, times the
/// number of steps) at or above `max`, about 5 steps. `[0, 1]` when `max` is not a positive
/// finite number, so an axis always has a range.
fn nice_ticks(max: f64) -> Vec<f64> {
    if !(max.is_finite() && max > 0.0) {
        return vec![0.0, 1.0];
    }
    let raw = max / 5.0;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .into_iter()
        .map(|m| m * magnitude)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * magnitude);
    // The epsilon keeps 0.3 / 0.1 = 3.0000000000000004 from adding a tick.
    let steps = (max / step - 1e-9).ceil().max(1.0) as u32;
    (0..=steps).map(|i| f64::from(i) * step).collect()
}

/// Log-axis ticks: one per decade from the one at or below `min` to the one at or above `max`
/// (at least one decade; every n-th decade when there are more than 10), with the axis range
/// in log10 space. 1 to 10 when there are no points.
fn decade_ticks(min: f64, max: f64) -> (Vec<f64>, f64, f64) {
    let (lo, hi) = if min.is_finite() && max.is_finite() && min > 0.0 {
        (min.log10().floor(), max.log10().ceil())
    } else {
        (0.0, 1.0)
    };
    let hi = hi.max(lo + 1.0);
    let (first, last) = (lo as i32, hi as i32);
    let stride = ((last - first + 9) / 10).max(1);
    let ticks = (first..=last)
        .step_by(stride as usize)
        .map(|k| 10f64.powi(k))
        .collect();
    (ticks, lo, hi)
}

/// A value label: 12.3k, 1.23M (3 significant digits) from 10,000 up, otherwise at most 3
/// significant digits after the point (27, 1.5, 0.0123, 1234); "n/a" when not finite.
fn fmt_num(v: f64) -> String {
    if v.is_finite() && v.abs() >= 10_000.0 {
        fmt_si(v)
    } else {
        fmt_sig3(v)
    }
}

/// Like [`fmt_num`] but with the suffix from 1,000 up: log-axis labels 1, 10, 100, 1k, 10k.
fn fmt_compact(v: f64) -> String {
    if v.is_finite() && v.abs() >= 1_000.0 {
        fmt_si(v)
    } else {
        fmt_sig3(v)
    }
}

/// `v` (|v| ≥ 1000) to 3 significant digits with a k, M or G suffix. Rounds first, so
/// 999,999 is 1M rather than 1000k.
fn fmt_si(v: f64) -> String {
    let step = 10f64.powf(v.abs().log10().floor() - 2.0);
    let r = (v / step).round() * step;
    for (scale, suffix) in [(1e9, "G"), (1e6, "M"), (1e3, "k")] {
        if r.abs() >= scale {
            return format!("{}{suffix}", fmt_sig3(r / scale));
        }
    }
    fmt_sig3(r)
}

/// `v` with as many decimals as make 3 significant digits (none for |v| ≥ 100; at most 6),
/// trailing zeros dropped; "n/a" when not finite.
fn fmt_sig3(v: f64) -> String {
    if !v.is_finite() {
        return "n/a".to_string();
    }
    if v == 0.0 {
        return "0".to_string();
    }
    let decimals = (2.0 - v.abs().log10().floor()).clamp(0.0, 6.0) as usize;
    let s = format!("{v:.decimals$}");
    let s = if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.')
    } else {
        &s
    };
    let s = if s == "-0" { "0" } else { s };
    s.to_string()
}

/// A coordinate: at most one decimal, no "-0", 0 for a non-finite value.
struct Px(f64);

impl fmt::Display for Px {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tenths = if self.0.is_finite() {
            (self.0 * 10.0).round()
        } else {
            0.0
        };
        if tenths == 0.0 {
            f.write_str("0")
        } else if tenths % 10.0 == 0.0 {
            write!(f, "{}", tenths / 10.0)
        } else {
            write!(f, "{:.1}", tenths / 10.0)
        }
    }
}

/// `s` escaped for XML text and double-quoted attributes; control characters XML cannot
/// carry are dropped.
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\t' | '\n' | '\r' => out.push(' '),
            c if c.is_control() => {}
            c => out.push(c),
        }
    }
    out
}

/// `s` cut to `max_chars` characters, the last one an ellipsis, when it is longer.
fn truncate(s: &str, max_chars: usize) -> String {
    if s.chars().count() <= max_chars {
        return s.to_string();
    }
    let mut cut: String = s.chars().take(max_chars.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

/// A point marker: a filled circle with a white rim.
fn marker(svg: &mut Svg, cx: f64, cy: f64, colour: &str, line_width: f64) {
    svg.push(format_args!(
        "<circle cx=\"{}\" cy=\"{}\" r=\"{}\" fill=\"{colour}\" stroke=\"#fff\"/>\n",
        Px(cx),
        Px(cy),
        Px(line_width + 1.5)
    ));
}

/// The note on a chart with nothing to draw, centred on (`x`, `y`).
fn no_data(svg: &mut Svg, x: f64, y: f64) {
    let attrs = format!("fill=\"{MUTED}\" font-style=\"italic\"");
    svg.text(x, y + 4.0, "middle", &attrs, "no data");
}

/// An SVG document being written; [`Svg::finish`] closes it.
struct Svg(String);

impl Svg {
    /// The opening tag (720 px wide, 12 px sans-serif), the title and a white background.
    fn new(title: &str, height: f64) -> Self {
        let mut svg = Svg(String::new());
        svg.push(format_args!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" \
             viewBox=\"0 0 {w} {h}\" font-family=\"sans-serif\" font-size=\"12\" fill=\"{INK}\">\n\
             <title>{}</title>\n\
             <rect width=\"{w}\" height=\"{h}\" fill=\"#fff\"/>\n",
            esc(title),
            w = Px(WIDTH),
            h = Px(height),
        ));
        svg
    }

    fn push(&mut self, args: fmt::Arguments<'_>) {
        // Writing into a String cannot fail.
        let _ = self.0.write_fmt(args);
    }

    /// A line from `a` to `b`; `extra` is more attributes, starting with a space.
    fn line(&mut self, a: (f64, f64), b: (f64, f64), stroke: &str, width: f64, extra: &str) {
        self.push(format_args!(
            "<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"{stroke}\" \
             stroke-width=\"{}\"{extra}/>\n",
            Px(a.0),
            Px(a.1),
            Px(b.0),
            Px(b.1),
            Px(width)
        ));
    }

    /// `text` (escaped here) at (`x`, `y`); `attrs` is more attributes, or "".
    fn text(&mut self, x: f64, y: f64, anchor: &str, attrs: &str, text: &str) {
        let sep = if attrs.is_empty() { "" } else { " " };
        self.push(format_args!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"{anchor}\"{sep}{attrs}>{}</text>\n",
            Px(x),
            Px(y),
            esc(text)
        ));
    }

    fn finish(mut self) -> String {
        self.0.push_str("</svg>\n");
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bar(label: &str, median: f64, min: f64, max: f64, ours: bool) -> Bar {
        Bar {
            label: label.to_string(),
            median,
            min,
            max,
            ours,
        }
    }

    /// A chart is one closed document with no non-finite numbers in it.
    fn assert_document(svg: &str) {
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<svg").count(), 1);
        for bad in ["NaN", "inf", "\"-0\""] {
            assert!(!svg.contains(bad), "{bad} in {svg}");
        }
    }

    #[test]
    fn nice_ticks_are_round_and_cover_the_max() {
        assert_eq!(nice_ticks(27.0), [0.0, 10.0, 20.0, 30.0]);
        assert_eq!(nice_ticks(100.0), [0.0, 20.0, 40.0, 60.0, 80.0, 100.0]);
        assert_eq!(
            nice_ticks(1234.0),
            [0.0, 250.0, 500.0, 750.0, 1000.0, 1250.0]
        );
        assert_eq!(nice_ticks(0.3).len(), 4);
        for bad in [0.0, -5.0, f64::NAN, f64::INFINITY] {
            assert_eq!(nice_ticks(bad), [0.0, 1.0]);
        }
        for max in [0.07, 1.0, 3.3, 9.9, 27.0, 101.0, 4_567.0, 123_456.0, 9.9e6] {
            let ticks = nice_ticks(max);
            assert!((3..=7).contains(&ticks.len()), "{max}: {ticks:?}");
            assert!(ticks[ticks.len() - 2] < max && max <= ticks[ticks.len() - 1]);
        }
    }

    #[test]
    fn numbers_are_short() {
        let cases = [
            (0.0, "0"),
            (-0.0, "0"),
            (27.0, "27"),
            (1.5, "1.5"),
            (1.23456, "1.23"),
            (9.996, "10"),
            (0.012345, "0.0123"),
            (123.4, "123"),
            (1234.4, "1234"),
            (9_999.0, "9999"),
            (10_000.0, "10k"),
            (12_345.0, "12.3k"),
            (999_999.0, "1M"),
            (1_234_567.0, "1.23M"),
            (1_200_000.0, "1.2M"),
            (-12_345.0, "-12.3k"),
            (3.2e9, "3.2G"),
            (f64::NAN, "n/a"),
            (f64::NEG_INFINITY, "n/a"),
        ];
        for (v, want) in cases {
            assert_eq!(fmt_num(v), want, "{v}");
        }
        let compact = [
            (1.0, "1"),
            (100.0, "100"),
            (1e3, "1k"),
            (1e5, "100k"),
            (1e6, "1M"),
        ];
        for (v, want) in compact {
            assert_eq!(fmt_compact(v), want, "{v}");
        }
    }

    #[test]
    fn coordinates_have_at_most_one_decimal() {
        let cases = [
            (12.0, "12"),
            (12.345, "12.3"),
            (1.04, "1"),
            (0.96, "1"),
            (-0.01, "0"),
            (-2.5, "-2.5"),
            (f64::NAN, "0"),
        ];
        for (v, want) in cases {
            assert_eq!(Px(v).to_string(), want, "{v}");
        }
    }

    #[test]
    fn text_is_escaped() {
        assert_eq!(esc(r#"a&b <c> "d""#), "a&amp;b &lt;c&gt; &quot;d&quot;");
        assert_eq!(esc("x\u{0}y\nz"), "xy z");
        let svg = bar_chart("<&>", "\"u\"", &[bar("a<b", 1.0, 1.0, 1.0, true)], None);
        assert_document(&svg);
        assert!(svg.contains("&lt;&amp;&gt;") && svg.contains("a&lt;b"));
        assert!(!svg.contains("a<b") && !svg.contains("\"u\""));
    }

    #[test]
    fn long_labels_are_cut() {
        assert_eq!(truncate("abcdef", 4), "abc…");
        assert_eq!(truncate("abcd", 4), "abcd");
        let long = "x".repeat(200);
        let svg = bar_chart("t", "ns", &[bar(&long, 1.0, 0.5, 2.0, false)], None);
        assert!(svg.contains(&format!(">{}…</text>", "x".repeat(48))));
    }

    #[test]
    fn bar_chart_size_and_contents() {
        let bars = [
            bar("fastpath", 30.0, 29.0, 33.0, true),
            bar("iptables", 120.0, 110.0, 140.0, false),
        ];
        let svg = bar_chart("t", "ns/packet", &bars, Some(("floor", 27.0)));
        assert_document(&svg);
        assert!(svg.contains("height=\"116\""));
        assert!(svg.contains(ACCENT) && svg.contains(GREY));
        assert!(svg.contains(">floor</text>") && svg.contains("stroke-dasharray"));
        assert_eq!(
            svg,
            bar_chart("t", "ns/packet", &bars, Some(("floor", 27.0)))
        );
    }

    #[test]
    fn empty_and_nan_input_render() {
        let svg = bar_chart("t", "ns", &[], None);
        assert_document(&svg);
        assert!(svg.contains("no data"));

        let nan = f64::NAN;
        let bars = [
            bar("a", nan, nan, nan, true),
            bar("b", 5.0, nan, f64::INFINITY, false),
            bar("c", -3.0, 4.0, -1.0, false),
        ];
        let svg = bar_chart("t", "ns", &bars, Some(("ref", nan)));
        assert_document(&svg);
        assert!(svg.contains(">n/a</text>"));

        for log_x in [false, true] {
            let svg = line_chart("t", "x", "y", &[], log_x);
            assert_document(&svg);
            assert!(svg.contains("no data"));
            let series = [
                Series {
                    name: "ours".into(),
                    points: vec![
                        (nan, 1.0, 1.0, 1.0),
                        (0.0, 2.0, nan, 3.0),
                        (-1.0, nan, 0.0, 0.0),
                    ],
                    ours: true,
                },
                Series {
                    name: "empty".into(),
                    points: vec![],
                    ours: false,
                },
            ];
            assert_document(&line_chart("t", "x", "y", &series, log_x));
        }
    }

    #[test]
    fn line_chart_log_axis() {
        let series: Vec<Series> = (0..9)
            .map(|i| Series {
                name: format!("series {i}"),
                points: [1.0, 1_000.0, 100_000.0, 10_000.0]
                    .into_iter()
                    .map(|x| (x, 10.0 + f64::from(i), 9.0, 12.0 + f64::from(i)))
                    .collect(),
                ours: i == 0,
            })
            .collect();
        let svg = line_chart("t", "entries", "ns", &series, true);
        assert_document(&svg);
        for label in [">1<", ">10<", ">100<", ">1k<", ">10k<", ">100k<"] {
            assert!(svg.contains(label), "{label}");
        }
        assert!(!svg.contains(">1M<"));
        assert_eq!(svg.matches("<polyline").count(), 9);
        assert_eq!(svg, line_chart("t", "entries", "ns", &series, true));
    }
}
