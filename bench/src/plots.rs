//! SVG plots for the trace-replay report: TTFT CDFs, requests in flight per worker, and grouped bars.
//!
//! This module owns turning benchmark results into self-contained SVG files that the Markdown
//! report links to. It draws with plotters' SVG backend and no font feature on purpose: the SVG
//! backend writes every label as a `<text>` element and leaves the glyphs to whoever views the
//! file, so rendering needs no font files, no fontconfig and no freetype (plotters then only
//! estimates text widths for layout, which is all an SVG needs). Each series keeps the colour of
//! its input position, so callers that pass policies in the same order get the same colour per
//! policy on every plot. The arithmetic (CDF points, requests in flight, axis ticks) lives in pure
//! helpers so it is tested without reading SVG back.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context;
use plotters::coord::Shift;
use plotters::prelude::{
    BLACK, BindKeyPoints, ChartBuilder, Color, DrawingArea, IntoDrawingArea, IntoFont, IntoLogRange, LineSeries,
    PathElement, RGBColor, Rectangle, SVGBackend, TRANSPARENT, TextStyle, WHITE,
};
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// Width and height of every plot in pixels.
const SIZE: (u32, u32) = (900, 500);
/// At most this many points per CDF line: past a few hundred the line looks the same, and a
/// run of 100k requests would otherwise give a multi-megabyte SVG.
const CDF_MAX_POINTS: usize = 500;
/// Time points on which requests in flight are counted.
const LOAD_GRID_POINTS: usize = 600;
/// A generic family, so any viewer picks a font it has.
const FONT: &str = "sans-serif";

/// Tableau 10: ten hues that stay apart for the ~8 policies or workers a run has, on white.
const PALETTE: [RGBColor; 10] = [
    RGBColor(0x4e, 0x79, 0xa7),
    RGBColor(0xf2, 0x8e, 0x2b),
    RGBColor(0xe1, 0x57, 0x59),
    RGBColor(0x76, 0xb7, 0xb2),
    RGBColor(0x59, 0xa1, 0x4f),
    RGBColor(0xed, 0xc9, 0x48),
    RGBColor(0xb0, 0x7a, 0xa1),
    RGBColor(0xff, 0x9d, 0xa7),
    RGBColor(0x9c, 0x75, 0x5f),
    RGBColor(0xba, 0xb0, 0xac),
];

/// The colour of the series at input position `i`; past ten series the colours repeat.
fn colour(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// Writes the empirical CDF of time to first token of each series to the SVG file `path`.
///
/// Each series is a name (the routing policy) and its TTFT samples in milliseconds, in any
/// order. Non-finite samples are skipped, and a series with no finite sample is left out (its
/// colour stays reserved so the other series keep theirs). The x axis is logarithmic, from the
/// 1-2-5 value (1, 2, 5, 10, 20, ... ms) at or below the smallest positive sample to the one at
/// or above the largest; samples at or below zero are drawn at the left edge. Each line has at
/// most 500 points, so a run of any size gives an SVG of tens of kilobytes.
pub fn ttft_cdf(path: &Path, title: &str, series: &[(String, Vec<f64>)]) -> anyhow::Result<()> {
    let lines: Vec<_> = series
        .iter()
        .enumerate()
        .map(|(i, (name, samples))| (i, name.as_str(), cdf_points(samples, CDF_MAX_POINTS)))
        .filter(|(_, _, points)| !points.is_empty())
        .collect();
    render(path, |root| {
        let legend: Vec<(usize, &str)> = lines.iter().map(|(i, name, _)| (*i, *name)).collect();
        let Some(area) = frame(root, title, &legend, Marker::Line)? else {
            return Ok(());
        };
        let xs = lines.iter().flat_map(|(_, _, points)| points.iter().map(|p| p.0));
        let (lo, hi, ticks) = log_axis(xs);
        let mut chart = ChartBuilder::on(&area)
            .margin(10)
            .x_label_area_size(45)
            .y_label_area_size(60)
            .build_cartesian_2d((lo..hi).log_scale().with_key_points(ticks), 0f64..1f64)?;
        chart
            .configure_mesh()
            .x_desc("TTFT (ms, log scale)")
            .y_desc("fraction of requests")
            .x_label_formatter(&|v| format_tick(*v))
            .y_label_formatter(&|v| format!("{v:.1}"))
            .light_line_style(TRANSPARENT)
            .label_style((FONT, 15))
            .axis_desc_style((FONT, 18))
            .draw()?;
        for (i, _, points) in &lines {
            let style = colour(*i).stroke_width(2);
            chart.draw_series(LineSeries::new(points.iter().map(|&(x, y)| (x.max(lo), y)), style))?;
        }
        Ok(())
    })
}

/// Writes the number of requests in flight on each worker over time to the SVG file `path`.
///
/// Each interval is (worker name, start, end) of one request, in seconds: the request counts
/// on that worker from its start included to its end excluded. Intervals with a non-finite
/// bound or an end before the start are skipped. The counts are taken on 600 evenly spaced
/// time points from the earliest start to the latest end, one line per worker in name order;
/// so a request shorter than the grid step (a 600th of the run) may fall between two points.
/// With no usable interval the file is a valid SVG that says "no data".
pub fn worker_load(path: &Path, title: &str, intervals: &[(String, f64, f64)]) -> anyhow::Result<()> {
    let mut by_worker: BTreeMap<&str, Vec<(f64, f64)>> = BTreeMap::new();
    for (worker, start, end) in intervals {
        if is_interval(*start, *end) {
            by_worker.entry(worker.as_str()).or_default().push((*start, *end));
        }
    }
    let t0 = by_worker.values().flatten().map(|i| i.0).fold(f64::INFINITY, f64::min);
    let t1 = by_worker
        .values()
        .flatten()
        .map(|i| i.1)
        .fold(f64::NEG_INFINITY, f64::max);
    let grid = time_grid(t0, t1, LOAD_GRID_POINTS);
    let lines: Vec<(&str, Vec<usize>)> = by_worker
        .iter()
        .map(|(worker, spans)| (*worker, in_flight(spans, &grid)))
        .collect();
    render(path, |root| {
        let legend: Vec<(usize, &str)> = lines.iter().enumerate().map(|(i, (name, _))| (i, *name)).collect();
        let Some(area) = frame(root, title, &legend, Marker::Line)? else {
            return Ok(());
        };
        let peak = lines
            .iter()
            .flat_map(|(_, counts)| counts.iter().copied())
            .max()
            .unwrap_or(0);
        // A run whose requests all start and end at one instant still needs a non-empty axis.
        let x_end = if t1 > t0 { t1 } else { t0 + 1.0 };
        let mut chart = ChartBuilder::on(&area)
            .margin(10)
            .x_label_area_size(45)
            .y_label_area_size(60)
            .build_cartesian_2d(t0..x_end, 0usize..peak + 1)?;
        chart
            .configure_mesh()
            .x_desc("time (s)")
            .y_desc("requests in flight")
            .x_label_formatter(&|v| format_number(*v))
            .light_line_style(TRANSPARENT)
            .label_style((FONT, 15))
            .axis_desc_style((FONT, 18))
            .draw()?;
        for (i, (_, counts)) in lines.iter().enumerate() {
            let points = grid.iter().copied().zip(counts.iter().copied());
            chart.draw_series(LineSeries::new(points, colour(i).stroke_width(2)))?;
        }
        Ok(())
    })
}

/// Writes a grouped bar chart to the SVG file `path`.
///
/// Each group is a metric label (for example "TTFT avg") and one (policy, value) per policy;
/// `y_label` names the unit of the values. Policies are drawn in the order they first appear
/// over all groups, with the same colour and slot in every group, so a policy missing from a
/// group leaves a gap. Values that are negative or not finite are left out rather than drawn
/// as something they are not. With nothing to draw the file is a valid SVG that says "no data".
pub fn bars(path: &Path, title: &str, y_label: &str, groups: &[(String, Vec<(String, f64)>)]) -> anyhow::Result<()> {
    let mut policies: Vec<&str> = Vec::new();
    for (_, values) in groups {
        for (policy, _) in values {
            if !policies.contains(&policy.as_str()) {
                policies.push(policy);
            }
        }
    }
    let drawable = |v: f64| v.is_finite() && v >= 0.0;
    let peak = groups
        .iter()
        .flat_map(|(_, values)| values.iter().map(|v| v.1))
        .filter(|v| drawable(*v))
        .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))));
    render(path, |root| {
        let legend: Vec<(usize, &str)> = if peak.is_some() {
            policies.iter().copied().enumerate().collect()
        } else {
            Vec::new()
        };
        let Some(area) = frame(root, title, &legend, Marker::Box)? else {
            return Ok(());
        };
        // All values zero still needs a non-empty axis; otherwise leave a little headroom.
        let y_end = match peak {
            Some(p) if p > 0.0 => p * 1.1,
            _ => 1.0,
        };
        // plotters only formats custom tick positions on an integer axis, so x counts thousandths
        // of a group: group g spans [g * SLOT, (g + 1) * SLOT) with its label at the middle.
        const SLOT: i64 = 1000;
        let centres: Vec<i64> = (0..groups.len() as i64).map(|g| g * SLOT + SLOT / 2).collect();
        let label_of = |x: &i64| {
            let g = usize::try_from(x.div_euclid(SLOT)).unwrap_or(0);
            groups.get(g).map(|(label, _)| label.clone()).unwrap_or_default()
        };
        let mut chart = ChartBuilder::on(&area)
            .margin(10)
            .x_label_area_size(45)
            .y_label_area_size(70)
            .build_cartesian_2d((0..groups.len() as i64 * SLOT).with_key_points(centres), 0f64..y_end)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .y_desc(y_label)
            .x_label_formatter(&label_of)
            .y_label_formatter(&|v| format_number(*v))
            .light_line_style(TRANSPARENT)
            .label_style((FONT, 16))
            .axis_desc_style((FONT, 18))
            .draw()?;
        // The bars of a group share its middle 80% so groups stay apart, with a small gap between
        // neighbouring bars so bars of the same height stay readable.
        let width = 0.8 * SLOT as f64 / policies.len() as f64;
        for (p, policy) in policies.iter().enumerate() {
            let style = colour(p).filled();
            let rects = groups.iter().enumerate().filter_map(|(g, (_, values))| {
                let value = values.iter().find(|(name, _)| name == policy).map(|v| v.1)?;
                let x0 = g as f64 * SLOT as f64 + 0.1 * SLOT as f64 + p as f64 * width;
                let (left, right) = ((x0 + 0.05 * width).round() as i64, (x0 + 0.95 * width).round() as i64);
                drawable(value).then(|| Rectangle::new([(left, 0.0), (right, value)], style))
            });
            chart.draw_series(rects)?;
        }
        Ok(())
    })
}

/// The empirical CDF of `samples` as (value, fraction of samples at or below it) points,
/// sorted by value, skipping non-finite samples, with at most `max_points` points.
///
/// Downsampling keeps evenly spaced ranks and always the last one, so the line still ends at
/// the largest sample with fraction 1 and the fractions stay exact for the ranks kept.
fn cdf_points(samples: &[f64], max_points: usize) -> Vec<(f64, f64)> {
    let mut sorted: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    let keep = n.min(max_points);
    // rank = k * n / keep grows by at least one per step (keep <= n) and reaches n at k = keep.
    (1..=keep)
        .map(|k| {
            let rank = k * n / keep;
            (sorted[rank - 1], rank as f64 / n as f64)
        })
        .collect()
}

/// How many of `intervals` (start included, end excluded) cover each time in `at`.
///
/// Sorting the starts and the ends once makes each count two binary searches: the intervals
/// started by `t` minus those already ended by `t` (an ended interval has also started). That
/// is O((n + points) log n) instead of checking every interval at every point. Intervals with
/// a non-finite bound or an end before the start are ignored.
fn in_flight(intervals: &[(f64, f64)], at: &[f64]) -> Vec<usize> {
    let valid = || intervals.iter().filter(|(s, e)| is_interval(*s, *e));
    let mut starts: Vec<f64> = valid().map(|i| i.0).collect();
    let mut ends: Vec<f64> = valid().map(|i| i.1).collect();
    starts.sort_by(f64::total_cmp);
    ends.sort_by(f64::total_cmp);
    at.iter()
        .map(|&t| starts.partition_point(|&s| s <= t) - ends.partition_point(|&e| e <= t))
        .collect()
}

/// Whether (start, end) is a usable interval: both finite and not reversed.
fn is_interval(start: f64, end: f64) -> bool {
    start.is_finite() && end.is_finite() && start <= end
}

/// `points` evenly spaced times from `t0` to `t1` both included; just `t0` when the span is
/// empty, and nothing when there is no data (`t0` not finite).
fn time_grid(t0: f64, t1: f64, points: usize) -> Vec<f64> {
    if !t0.is_finite() || points == 0 {
        return Vec::new();
    }
    if !t1.is_finite() || t1 <= t0 || points == 1 {
        return vec![t0];
    }
    let step = (t1 - t0) / (points - 1) as f64;
    // The last point is set to t1 exactly so float error cannot push it past the data.
    (0..points)
        .map(|k| if k + 1 == points { t1 } else { t0 + step * k as f64 })
        .collect()
}

/// The log x axis for values `xs`: its range and its ticks.
///
/// The range runs from the largest 1-2-5 value (1, 2, 5, 10, 20, ...) at or below the smallest
/// positive value to the smallest one at or above the largest value, so the lines fill the
/// width and both ends get a round label; 1..10 when no value is positive. Every 1-2-5 value
/// is a tick over up to three decades, only the powers of ten beyond, so labels never crowd.
fn log_axis(xs: impl Iterator<Item = f64>) -> (f64, f64, Vec<f64>) {
    let (min, max) = xs
        .filter(|x| *x > 0.0 && x.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| (lo.min(x), hi.max(x)));
    let (first, last) = if min.is_finite() {
        (nice_floor(min), nice_ceil(max))
    } else {
        (0, 3)
    };
    // All values on one 1-2-5 step would give an empty range.
    let last = last.max(first + 1);
    let ticks = (first..=last)
        .filter(|k| last - first <= 9 || k.rem_euclid(3) == 0)
        .map(nice)
        .collect();
    (nice(first), nice(last), ticks)
}

/// The `k`-th value of the 1-2-5 sequence: ..., 0.5, 1 (k = 0), 2, 5, 10, 20, ...
fn nice(k: i32) -> f64 {
    [1.0, 2.0, 5.0][k.rem_euclid(3) as usize] * 10f64.powi(k.div_euclid(3))
}

/// The largest `k` with `nice(k) <= x`, for a positive finite `x`. The relative tolerance
/// keeps a value that is a 1-2-5 step up to float error on that step.
fn nice_floor(x: f64) -> i32 {
    let mut k = 3 * x.log10().floor() as i32 + 2;
    while nice(k) > x * (1.0 + 1e-9) {
        k -= 1;
    }
    k
}

/// The smallest `k` with `nice(k) >= x`, for a positive finite `x`.
fn nice_ceil(x: f64) -> i32 {
    let mut k = 3 * x.log10().floor() as i32;
    while nice(k) < x * (1.0 - 1e-9) {
        k += 1;
    }
    k
}

/// A log tick label: as many decimals as a value below 1 needs, none otherwise.
fn format_tick(v: f64) -> String {
    let decimals = if v >= 1.0 || v <= 0.0 {
        0
    } else {
        (-v.log10().floor()) as usize
    };
    format!("{v:.decimals$}")
}

/// A linear tick label without the trailing zeros plotters' default adds ("20" not "20.0").
fn format_number(v: f64) -> String {
    let fixed = format!("{v:.6}");
    let trimmed = fixed.trim_end_matches('0').trim_end_matches('.');
    if trimmed == "-0" {
        "0".to_string()
    } else {
        trimmed.to_string()
    }
}

/// How a legend entry shows its series' colour.
#[derive(Clone, Copy)]
enum Marker {
    /// A short thick line, for line plots.
    Line,
    /// A filled square, for bars.
    Box,
}

/// Renders a plot into an SVG string and writes it to `path`, so a failed draw never leaves a
/// half-written file and the write error carries the path.
fn render(
    path: &Path,
    draw: impl FnOnce(&DrawingArea<SVGBackend<'_>, Shift>) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE)?;
        draw(&root)?;
        root.present()?;
    }
    std::fs::write(path, svg).with_context(|| format!("writing plot {}", path.display()))
}

/// Draws the title and the legend (colour index, name) in a column on the right, and returns
/// the area left for the chart; or, with an empty legend (nothing to plot), writes "no data"
/// under the title and returns `None`.
///
/// The legend sits outside the chart so it can never hide a line or a bar.
fn frame<'a>(
    root: &DrawingArea<SVGBackend<'a>, Shift>,
    title: &str,
    legend: &[(usize, &str)],
    marker: Marker,
) -> anyhow::Result<Option<DrawingArea<SVGBackend<'a>, Shift>>> {
    let body = root.titled(title, (FONT, 24).into_font().color(&BLACK))?;
    let (width, height) = body.dim_in_pixel();
    if legend.is_empty() {
        let style = text_style(20, HPos::Center);
        body.draw_text("no data", &style, (width as i32 / 2, height as i32 / 2))?;
        return Ok(None);
    }
    // Wide enough for the longest name at the estimated ~8 px per character, within bounds.
    let longest = legend.iter().map(|(_, name)| name.chars().count()).max().unwrap_or(0);
    let legend_width = (48 + 8 * longest as u32).clamp(120, 280);
    let (chart, key) = body.split_horizontally(width.saturating_sub(legend_width));
    let style = text_style(16, HPos::Left);
    for (row, (i, name)) in legend.iter().enumerate() {
        let y = 40 + 22 * row as i32;
        match marker {
            Marker::Line => key.draw(&PathElement::new(vec![(8, y), (32, y)], colour(*i).stroke_width(3)))?,
            Marker::Box => key.draw(&Rectangle::new([(13, y - 7), (27, y + 7)], colour(*i).filled()))?,
        }
        key.draw_text(name, &style, (40, y))?;
    }
    Ok(Some(chart))
}

/// Black text of `size` anchored at its vertical centre and at `h` horizontally.
fn text_style(size: u32, h: HPos) -> TextStyle<'static> {
    (FONT, size).into_font().color(&BLACK).pos(Pos::new(h, VPos::Center))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads a rendered plot and checks it is one `<svg>` element.
    fn read_svg(path: &Path) -> String {
        let svg = std::fs::read_to_string(path).unwrap();
        let trimmed = svg.trim();
        assert!(
            trimmed.starts_with("<svg"),
            "does not start with <svg: {}",
            &trimmed[..trimmed.len().min(80)]
        );
        assert!(trimmed.ends_with("</svg>"), "does not end with </svg>");
        svg
    }

    /// The text contents of every `<text>` element, in document order.
    fn texts(svg: &str) -> Vec<String> {
        svg.split("<text")
            .skip(1)
            .filter_map(|rest| {
                let body = &rest[rest.find('>')? + 1..];
                Some(body[..body.find("</text>")?].trim().to_string())
            })
            .collect()
    }

    /// The SVG `stroke` attribute of `c`.
    fn stroke(c: RGBColor) -> String {
        let RGBColor(r, g, b) = c;
        format!("stroke=\"#{r:02X}{g:02X}{b:02X}\"")
    }

    /// How many `<polyline>`s each non-black stroke colour has, in palette order.
    fn polylines_by_stroke(svg: &str) -> Vec<(RGBColor, usize)> {
        let lines: Vec<&str> = svg
            .split("<polyline")
            .skip(1)
            .map(|l| &l[..l.find('>').unwrap()])
            .collect();
        assert!(
            lines
                .iter()
                .all(|l| l.contains("stroke=\"#000000\"") || PALETTE.iter().any(|c| l.contains(&stroke(*c))))
        );
        PALETTE
            .iter()
            .map(|c| (*c, lines.iter().filter(|l| l.contains(&stroke(*c))).count()))
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    #[test]
    fn cdf_points_are_sorted_monotone_and_end_at_one() {
        let samples = [30.0, 10.0, f64::NAN, 20.0, 40.0, f64::INFINITY, 10.0];
        let points = cdf_points(&samples, 100);
        assert_eq!(
            points,
            vec![(10.0, 0.2), (10.0, 0.4), (20.0, 0.6), (30.0, 0.8), (40.0, 1.0)]
        );
    }

    #[test]
    fn cdf_points_downsample_keeps_the_maximum() {
        let samples: Vec<f64> = (0..10_000).rev().map(f64::from).collect();
        let points = cdf_points(&samples, 500);
        assert_eq!(points.len(), 500);
        assert_eq!(points.last(), Some(&(9999.0, 1.0)));
        assert!(points.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 < w[1].1));
        // 20 samples per kept rank: the first point is the 20th smallest.
        assert_eq!(points[0], (19.0, 0.002));
        assert!(cdf_points(&samples, 0).is_empty());
        assert!(cdf_points(&[], 500).is_empty());
        assert!(cdf_points(&[f64::NAN, f64::NEG_INFINITY], 500).is_empty());
    }

    #[test]
    fn in_flight_counts_half_open_intervals_exactly() {
        let intervals = [
            (0.0, 2.0),
            (1.0, 3.0),
            (1.0, 1.5),
            (2.0, 2.0),
            (5.0, 4.0),
            (f64::NAN, 1.0),
        ];
        let at = [-1.0, 0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0];
        assert_eq!(in_flight(&intervals, &at), vec![0, 1, 1, 3, 2, 1, 1, 0, 0]);
        assert!(in_flight(&[], &at).iter().all(|c| *c == 0));
    }

    #[test]
    fn time_grid_spans_the_run() {
        let grid = time_grid(1.0, 7.0, 600);
        assert_eq!(grid.len(), 600);
        assert_eq!((grid[0], grid[599]), (1.0, 7.0));
        assert!(grid.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(time_grid(3.0, 3.0, 600), vec![3.0]);
        assert!(time_grid(f64::INFINITY, f64::NEG_INFINITY, 600).is_empty());
    }

    #[test]
    fn log_axis_spans_the_values_on_1_2_5_steps() {
        let (lo, hi, ticks) = log_axis([3.0, 0.0, -4.0, 250.0, f64::NAN].into_iter());
        assert_eq!((lo, hi), (2.0, 500.0));
        assert_eq!(ticks, vec![2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0]);
        assert_eq!(log_axis([100.0].into_iter()), (100.0, 200.0, vec![100.0, 200.0]));
        assert_eq!(log_axis([-1.0].into_iter()), (1.0, 10.0, vec![1.0, 2.0, 5.0, 10.0]));
        assert_eq!(
            log_axis([0.3, 60_000.0].into_iter()).2,
            vec![1.0, 10.0, 100.0, 1e3, 1e4, 1e5]
        );
        assert_eq!((nice_floor(0.05), nice_ceil(0.05), nice(-4)), (-4, -4, 0.05));
        assert_eq!(format_tick(0.2), "0.2");
        assert_eq!(format_tick(0.05), "0.05");
        assert_eq!(format_tick(2000.0), "2000");
        assert_eq!(format_number(20.0), "20");
        assert_eq!(format_number(2.5), "2.5");
        assert_eq!(format_number(-0.0000001), "0");
    }

    #[test]
    fn ttft_cdf_draws_one_line_per_series_with_labels() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cdf.svg");
        let big: Vec<f64> = (0..20_000).map(|i| 5.0 + f64::from(i % 997) * 1.7).collect();
        let series = vec![
            ("round-robin".to_string(), big),
            ("least-load".to_string(), vec![12.0, f64::NAN, 80.0, 33.0, 0.0]),
            ("kv-aware".to_string(), vec![f64::NAN]),
            ("empty".to_string(), vec![]),
        ];
        ttft_cdf(&path, "TTFT CDF <all>", &series).unwrap();
        let svg = read_svg(&path);
        let texts = texts(&svg);
        for want in [
            "TTFT CDF &lt;all&gt;",
            "round-robin",
            "least-load",
            "TTFT (ms, log scale)",
            "fraction of requests",
        ] {
            assert!(texts.iter().any(|t| t == want), "no text {want:?} in {texts:?}");
        }
        // The series with no finite sample are left out of the legend.
        assert!(!texts.iter().any(|t| t == "kv-aware" || t == "empty"));
        // Each drawn series is one line plus its legend marker in its colour; the skipped ones
        // (positions 2 and 3) draw nothing. Axes and ticks are black polylines.
        assert_eq!(polylines_by_stroke(&svg), vec![(colour(0), 2), (colour(1), 2)]);
        // The 20k samples were downsampled: no line has more than 500 points.
        for line in svg.split("<polyline").skip(1) {
            let points = line.split("points=\"").nth(1).unwrap().split('"').next().unwrap();
            assert!(points.split_whitespace().count() <= CDF_MAX_POINTS);
        }
        assert!(svg.len() < 100_000, "{} bytes", svg.len());
    }

    #[test]
    fn worker_load_draws_one_line_per_worker_in_name_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("load.svg");
        let intervals = vec![
            ("worker-b".to_string(), 0.0, 10.0),
            ("worker-a".to_string(), 1.0, 4.0),
            ("worker-a".to_string(), 2.0, 6.0),
            ("worker-c".to_string(), f64::NAN, 3.0),
        ];
        worker_load(&path, "in flight per worker", &intervals).unwrap();
        let svg = read_svg(&path);
        let texts = texts(&svg);
        let a = texts.iter().position(|t| t == "worker-a").unwrap();
        let b = texts.iter().position(|t| t == "worker-b").unwrap();
        assert!(a < b, "legend not in name order: {texts:?}");
        for want in ["in flight per worker", "time (s)", "requests in flight"] {
            assert!(texts.iter().any(|t| t == want), "no text {want:?} in {texts:?}");
        }
        assert!(!texts.iter().any(|t| t == "worker-c"));
        // Colours follow name order: worker-a gets the first one.
        assert_eq!(polylines_by_stroke(&svg), vec![(colour(0), 2), (colour(1), 2)]);
        let a_line = svg
            .split("<polyline")
            .find(|l| l.contains(&stroke(colour(0))) && l.contains("stroke-width=\"2\""));
        let points = a_line
            .unwrap()
            .split("points=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap();
        assert_eq!(points.split_whitespace().count(), LOAD_GRID_POINTS);
    }

    #[test]
    fn empty_inputs_give_a_no_data_svg() {
        let dir = tempfile::tempdir().unwrap();
        type Plot = Box<dyn Fn(&Path) -> anyhow::Result<()>>;
        let cases: [(&str, Plot); 6] = [
            ("load-empty", Box::new(|p| worker_load(p, "load-empty", &[]))),
            ("bars-empty", Box::new(|p| bars(p, "bars-empty", "ms", &[]))),
            ("cdf", Box::new(|p| ttft_cdf(p, "cdf", &[]))),
            (
                "cdf-nan",
                Box::new(|p| ttft_cdf(p, "cdf-nan", &[("rr".into(), vec![f64::NAN, f64::INFINITY])])),
            ),
            (
                "load",
                Box::new(|p| worker_load(p, "load", &[("w".into(), f64::NAN, 1.0)])),
            ),
            (
                "bars",
                Box::new(|p| bars(p, "bars", "ms", &[("TTFT avg".into(), vec![("rr".into(), f64::NAN)])])),
            ),
        ];
        for (name, plot) in cases {
            let path = dir.path().join(format!("{name}.svg"));
            plot(&path).unwrap();
            let svg = read_svg(&path);
            let texts = texts(&svg);
            assert_eq!(texts, vec![name.to_string(), "no data".to_string()], "{name}");
        }
    }

    #[test]
    fn bars_draw_one_bar_per_policy_and_group() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bars.svg");
        let policies = ["round-robin", "least-load", "kv-aware"];
        let groups: Vec<(String, Vec<(String, f64)>)> = ["TTFT avg", "TTFT p99", "E2E avg"]
            .iter()
            .enumerate()
            .map(|(g, label)| {
                let values = policies
                    .iter()
                    .enumerate()
                    .map(|(p, name)| (name.to_string(), (g * 3 + p) as f64));
                (label.to_string(), values.collect())
            })
            .collect();
        // A last group where kv-aware is missing and least-load has no usable value: gaps.
        let mut groups = groups;
        let last = vec![("least-load".to_string(), f64::NAN), ("round-robin".to_string(), 4.0)];
        groups.push(("E2E p99".to_string(), last));
        bars(&path, "latency per policy", "ms", &groups).unwrap();
        let svg = read_svg(&path);
        let texts = texts(&svg);
        for want in ["latency per policy", "ms", "TTFT avg", "TTFT p99", "E2E avg", "E2E p99"]
            .iter()
            .chain(&policies)
        {
            assert!(texts.iter().any(|t| t == want), "no text {want:?} in {texts:?}");
        }
        // Each bar and legend square is a <rect> in its policy colour, in first-seen order.
        for (p, bars) in [4, 3, 3].into_iter().enumerate() {
            let RGBColor(r, g, b) = colour(p);
            let fill = format!("fill=\"#{r:02X}{g:02X}{b:02X}\"");
            assert_eq!(svg.matches(&fill).count(), bars + 1, "policy {p}");
        }
    }
}
