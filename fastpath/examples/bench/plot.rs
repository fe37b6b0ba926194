//! The report's charts, drawn with plotters' SVG backend: horizontal bars (one median per
//! row, a whisker from min to max) and lines over a sweep (log x). A [`Figure`] holds its
//! data; [`Figure::render`] draws it when the report is written. Non-finite values are left
//! out of a chart rather than failing it.

use std::fmt::Write as _;

use plotters::{
    coord::ranged1d::{IntoSegmentedCoord as _, SegmentValue},
    prelude::*,
    style::text_anchor::{HPos, Pos, VPos},
};

/// Width of every chart, px.
const WIDTH: u32 = 760;
/// Our bars and series.
const ACCENT: RGBColor = RGBColor(0xe8, 0x59, 0x0c);
/// Our second and later series (fastpath at another hook).
const ACCENT_DARK: RGBColor = RGBColor(0x99, 0x3a, 0x08);
/// Everyone else's bars.
const GREY: RGBColor = RGBColor(0xad, 0xb5, 0xbd);
/// Colours for series that are not ours, in order (the accent is kept for ours).
const PALETTE: [RGBColor; 6] = [
    RGBColor(0x1c, 0x7e, 0xd6),
    RGBColor(0x2f, 0x9e, 0x44),
    RGBColor(0x70, 0x48, 0xe8),
    RGBColor(0x0c, 0x85, 0x99),
    RGBColor(0xc2, 0x25, 0x5c),
    RGBColor(0x49, 0x50, 0x57),
];
/// Whiskers and the reference line.
const INK: RGBColor = RGBColor(0x34, 0x3a, 0x40);
/// Labels longer than this are cut with an ellipsis (the full text is in the report's table).
const MAX_LABEL_CHARS: usize = 48;

/// A chart written to docs/bench/`file` and shown in docs/BENCHMARKS.md under `title`.
pub(crate) struct Figure {
    pub(crate) file: String,
    pub(crate) title: String,
    chart: Chart,
}

enum Chart {
    Bars {
        unit: String,
        bars: Vec<Bar>,
        reference: Option<(String, f64)>,
    },
    Lines {
        x_label: String,
        y_label: String,
        series: Vec<Series>,
    },
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

/// One line of a sweep chart.
#[derive(Debug, Clone)]
pub(crate) struct Series {
    pub(crate) name: String,
    /// (x, median, min, max) per point.
    pub(crate) points: Vec<(f64, f64, f64, f64)>,
    /// Drawn in the accent colour and thicker (fastpath).
    pub(crate) ours: bool,
}

/// A chart that plotters could not draw.
#[derive(Debug, thiserror::Error)]
#[error("drawing the chart {file}: {message}")]
pub(crate) struct PlotError {
    file: String,
    message: String,
}

impl Figure {
    /// Horizontal bars, one per row, on an x axis from 0 in `unit`; `reference` is a vertical
    /// line with its label (e.g. the empty-program floor).
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
            chart: Chart::Bars {
                unit: unit.to_owned(),
                bars: bars.to_vec(),
                reference: reference.map(|(l, v)| (l.to_owned(), v)),
            },
        }
    }

    /// Lines over a logarithmic x axis, one per series, with min–max whiskers at each point.
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
            chart: Chart::Lines {
                x_label: x_label.to_owned(),
                y_label: y_label.to_owned(),
                series: series.to_vec(),
            },
        }
    }

    /// The chart as a standalone SVG document.
    pub(crate) fn render(&self) -> Result<String, PlotError> {
        let mut svg = String::new();
        let drawn = match &self.chart {
            Chart::Bars {
                unit,
                bars,
                reference,
            } => bar_chart(&mut svg, &self.title, unit, bars, reference.as_ref()),
            Chart::Lines {
                x_label,
                y_label,
                series,
            } => line_chart(&mut svg, &self.title, x_label, y_label, series),
        };
        drawn.map_err(|e| PlotError {
            file: self.file.clone(),
            message: e.to_string(),
        })?;
        Ok(svg)
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

type DrawResult = Result<(), Box<dyn std::error::Error>>;

fn bar_chart(
    svg: &mut String,
    title: &str,
    unit: &str,
    bars: &[Bar],
    reference: Option<&(String, f64)>,
) -> DrawResult {
    // Row slots, the first bar at the top (slot `slots - 1`). Two at least: plotters maps a
    // one-value range to pixel 0 rather than into the plot.
    let slots = bars.len().max(2);
    let slot = |i: usize| slots - 1 - i;
    // A bar's upper edge: the next slot's start, or the plot's edge for the top slot.
    let upper = |s: usize| {
        if s + 1 < slots {
            SegmentValue::Exact(s + 1)
        } else {
            SegmentValue::Last
        }
    };
    let height = 90 + 30 * slots as u32;
    let labels: Vec<String> = bars
        .iter()
        .map(|b| truncate(&b.label, MAX_LABEL_CHARS))
        .collect();
    let label_w = labels.iter().map(|l| l.chars().count()).max().unwrap_or(0) as u32 * 7 + 10;
    let top = bars
        .iter()
        .flat_map(|b| [b.median, b.max])
        .chain(reference.map(|r| r.1))
        .filter(|v| v.is_finite())
        .fold(0.0, f64::max);
    // Room on the right for the median printed at each bar's end.
    let x_max = if top > 0.0 { top * 1.15 } else { 1.0 };
    // The reference line is named on the axis: a legend box would cover the top bar.
    let reference = reference.filter(|r| r.1.is_finite());
    let x_desc = match reference {
        Some((label, _)) => format!("{unit} (vertical line: {label})"),
        None => unit.to_owned(),
    };
    let root = SVGBackend::with_string(svg, (WIDTH, height)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(label_w)
        .build_cartesian_2d(0.0..x_max, (0..slots - 1).into_segmented())?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .x_desc(x_desc)
        .y_labels(slots)
        .y_label_formatter(&|v| match v {
            SegmentValue::CenterOf(s) if *s < slots => {
                labels.get(slot(*s)).cloned().unwrap_or_default()
            }
            _ => String::new(),
        })
        .x_label_formatter(&|v| fmt_num(*v))
        .draw()?;
    let finite: Vec<(usize, &Bar)> = bars
        .iter()
        .enumerate()
        .filter(|(_, b)| b.median.is_finite())
        .collect();
    chart.draw_series(finite.iter().map(|&(i, b)| {
        let colour = if b.ours { ACCENT } else { GREY };
        let mut bar = Rectangle::new(
            [
                (0.0, SegmentValue::Exact(slot(i))),
                (b.median.max(0.0), upper(slot(i))),
            ],
            colour.filled(),
        );
        bar.set_margin(7, 7, 0, 0);
        bar
    }))?;
    chart.draw_series(
        finite
            .iter()
            .filter(|(_, b)| b.min.is_finite() && b.max.is_finite())
            .map(|&(i, b)| {
                PathElement::new(
                    vec![
                        (b.min.max(0.0), SegmentValue::CenterOf(slot(i))),
                        (b.max.max(0.0), SegmentValue::CenterOf(slot(i))),
                    ],
                    INK.stroke_width(1),
                )
            }),
    )?;
    let value_style =
        TextStyle::from(("sans-serif", 12).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
    chart.draw_series(finite.iter().map(|&(i, b)| {
        let end = if b.max.is_finite() {
            b.median.max(b.max)
        } else {
            b.median
        };
        Text::new(
            format!(" {}", fmt_num(b.median)),
            (end.max(0.0), SegmentValue::CenterOf(slot(i))),
            value_style.clone(),
        )
    }))?;
    if let Some((_, value)) = reference {
        chart.draw_series(std::iter::once(PathElement::new(
            vec![
                (*value, SegmentValue::Exact(0)),
                (*value, SegmentValue::Last),
            ],
            INK.stroke_width(2),
        )))?;
    }
    root.present()?;
    Ok(())
}

fn line_chart(
    svg: &mut String,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
) -> DrawResult {
    let placed = |s: &Series| -> Vec<(f64, f64, f64, f64)> {
        let mut p: Vec<_> = s
            .points
            .iter()
            .copied()
            .filter(|(x, m, _, _)| x.is_finite() && *x > 0.0 && m.is_finite())
            .collect();
        p.sort_by(|a, b| a.0.total_cmp(&b.0));
        p
    };
    let all: Vec<(f64, f64, f64, f64)> = series.iter().flat_map(placed).collect();
    let x_lo = all.iter().map(|p| p.0).fold(f64::INFINITY, f64::min);
    let x_hi = all.iter().map(|p| p.0).fold(0.0, f64::max);
    let (x_lo, x_hi) = if x_lo.is_finite() && x_hi > x_lo {
        (x_lo / 1.5, x_hi * 1.5)
    } else {
        (1.0, 10.0)
    };
    let y_hi = all
        .iter()
        .flat_map(|p| [p.1, p.3])
        .filter(|v| v.is_finite())
        .fold(0.0, f64::max);
    let y_hi = if y_hi > 0.0 { y_hi * 1.1 } else { 1.0 };
    let root = SVGBackend::with_string(svg, (WIDTH, 400)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((x_lo..x_hi).log_scale(), 0.0..y_hi)?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .x_label_formatter(&|v| fmt_num(*v))
        .y_label_formatter(&|v| fmt_num(*v))
        .draw()?;
    let mut others = PALETTE.iter().cycle();
    let mut ours = [ACCENT, ACCENT_DARK].into_iter();
    for s in series {
        let colour = if s.ours {
            ours.next().unwrap_or(ACCENT_DARK)
        } else {
            *others.next().unwrap_or(&GREY)
        };
        let width = if s.ours { 3 } else { 2 };
        let points = placed(s);
        chart
            .draw_series(LineSeries::new(
                points.iter().map(|p| (p.0, p.1)),
                colour.stroke_width(width),
            ))?
            .label(truncate(&s.name, MAX_LABEL_CHARS))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(width))
            });
        chart.draw_series(
            points
                .iter()
                .map(|p| Circle::new((p.0, p.1), 3, colour.filled())),
        )?;
        chart.draw_series(
            points
                .iter()
                .filter(|p| p.2.is_finite() && p.3.is_finite())
                .map(|p| PathElement::new(vec![(p.0, p.2), (p.0, p.3)], colour.stroke_width(1))),
        )?;
    }
    if !series.is_empty() {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(GREY)
            .position(SeriesLabelPosition::UpperRight)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

/// `s` cut to `max` characters with an ellipsis.
fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_owned()
    } else {
        let cut: String = s.chars().take(max.saturating_sub(1)).collect();
        format!("{cut}…")
    }
}

/// An axis or value label: 12.3k, 1.23M from 10,000 up, else up to 3 significant digits.
fn fmt_num(v: f64) -> String {
    if !v.is_finite() {
        return "n/a".to_owned();
    }
    for (scale, suffix) in [(1e9, "G"), (1e6, "M"), (1e4, "k")] {
        if v.abs() >= scale {
            let unit = if suffix == "k" { 1e3 } else { scale };
            return format!("{}{suffix}", sig3(v / unit));
        }
    }
    sig3(v)
}

/// `v` with the decimals that make 3 significant digits (none from 100 up), trailing zeros
/// dropped.
fn sig3(v: f64) -> String {
    if v == 0.0 {
        return "0".to_owned();
    }
    let decimals = (2.0 - v.abs().log10().floor()).clamp(0.0, 6.0) as usize;
    let s = format!("{v:.decimals$}");
    let s = if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.')
    } else {
        &s
    };
    if s == "-0" {
        "0".to_owned()
    } else {
        s.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bar(label: &str, median: f64, min: f64, max: f64, ours: bool) -> Bar {
        Bar::new(label, (median, min, max), ours)
    }

    #[test]
    fn numbers_are_short() {
        for (v, want) in [
            (0.0, "0"),
            (27.0, "27"),
            (1.5, "1.5"),
            (0.0123, "0.0123"),
            (1234.0, "1234"),
            (12_345.0, "12.3k"),
            (1_230_000.0, "1.23M"),
            (f64::NAN, "n/a"),
        ] {
            assert_eq!(fmt_num(v), want, "fmt_num({v})");
        }
    }

    #[test]
    fn long_labels_are_cut() {
        assert_eq!(truncate("short", 10), "short");
        assert_eq!(truncate("abcdefghijkl", 5), "abcd…");
    }

    #[test]
    fn bar_chart_draws_labels_values_and_reference() {
        let svg = Figure::bars(
            "t.svg",
            "ns per packet",
            "ns",
            &[
                bar("fastpath", 120.0, 100.0, 140.0, true),
                bar("iptables", 300.0, 280.0, 320.0, false),
            ],
            Some(("floor", 35.0)),
        )
        .render()
        .unwrap_or_else(|e| panic!("expected an SVG, got {e}"));
        assert!(svg.starts_with("<svg"), "not an SVG document: {svg:.80}");
        for want in [
            "ns per packet",
            "fastpath",
            "iptables",
            "floor",
            " 120",
            " 300",
        ] {
            assert!(svg.contains(want), "expected {want:?} in the chart");
        }
    }

    #[test]
    fn empty_and_nan_input_render() {
        let empty = Figure::bars("e.svg", "nothing", "ns", &[], None).render();
        assert!(empty.is_ok(), "an empty bar chart failed: {empty:?}");
        let nan = Figure::bars(
            "n.svg",
            "nan",
            "ns",
            &[bar("x", f64::NAN, f64::NAN, f64::NAN, false)],
            Some(("floor", f64::NAN)),
        )
        .render();
        assert!(nan.is_ok(), "a NaN bar failed: {nan:?}");
        let lines = Figure::lines("l.svg", "none", "x", "y", &[]).render();
        assert!(lines.is_ok(), "an empty line chart failed: {lines:?}");
    }

    #[test]
    fn line_chart_names_every_series() {
        let series = |name: &str, ours: bool| Series {
            name: name.to_owned(),
            points: vec![
                (1.0, 10.0, 9.0, 11.0),
                (1000.0, 12.0, 11.0, 13.0),
                (100_000.0, 11.0, 10.0, 12.0),
            ],
            ours,
        };
        let svg = Figure::lines(
            "s.svg",
            "sweep",
            "services",
            "conn/s",
            &[series("fastpath", true), series("haproxy", false)],
        )
        .render()
        .unwrap_or_else(|e| panic!("expected an SVG, got {e}"));
        for want in ["sweep", "services", "conn/s", "fastpath", "haproxy", "100k"] {
            assert!(svg.contains(want), "expected {want:?} in the chart");
        }
    }
}
