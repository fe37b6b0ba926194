//! The pure parts of the report: summaries of samples (median, min–max), ratios of samples
//! measured side by side, table cells, and splicing generated blocks into docs/BENCHMARKS.md.
//!
//! The report is hand-written prose around generated blocks: the generator replaces only what
//! lies between `<!-- bench:begin NAME -->` and `<!-- bench:end NAME -->`, so explanations and
//! "Where we lose" survive every regeneration. A block whose markers are missing is appended at
//! the end with its markers, so a new section never vanishes.

use std::fmt::Write as _;

/// (median, min, max) of `samples`; NaN for all three when there are none.
pub(crate) fn stats(samples: &[f64]) -> (f64, f64, f64) {
    let mut s: Vec<f64> = samples.iter().copied().filter(|v| !v.is_nan()).collect();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    match (s.first(), s.last()) {
        (Some(&min), Some(&max)) => {
            let median = if n % 2 == 1 {
                s[n / 2]
            } else {
                (s[n / 2 - 1] + s[n / 2]) / 2.0
            };
            (median, min, max)
        }
        _ => (f64::NAN, f64::NAN, f64::NAN),
    }
}

/// The per-round ratios `of[i] ÷ base[i]` of two configurations measured in the same rounds
/// (drift of the machine between rounds cancels in them); rounds where either is missing are
/// left out.
pub(crate) fn round_ratios(of: &[f64], base: &[f64]) -> Vec<f64> {
    of.iter().zip(base).map(|(a, b)| a / b).collect()
}

/// The medians of `samples` cut into `rounds` consecutive runs of equal length (the rest
/// left out): single runs interleaved with another configuration's become rounds whose
/// medians [`round_ratios`] can pair.
pub(crate) fn round_medians(samples: &[f64], rounds: usize) -> Vec<f64> {
    let len = samples.len() / rounds.max(1);
    if len == 0 {
        return Vec::new();
    }
    samples.chunks_exact(len).map(|c| stats(c).0).collect()
}

/// A table cell: `median (min–max)` with `digits` decimals.
pub(crate) fn cell(median: f64, min: f64, max: f64, digits: usize) -> String {
    format!("{median:.digits$} ({min:.digits$}–{max:.digits$})")
}

/// A Markdown table; `right[i]` right-aligns column i (numbers).
pub(crate) fn table(header: &[&str], right: &[bool], rows: &[Vec<String>]) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "| {} |", header.join(" | "));
    let align: Vec<&str> = (0..header.len())
        .map(|i| {
            if right.get(i).copied().unwrap_or(false) {
                "---:"
            } else {
                "---"
            }
        })
        .collect();
    let _ = writeln!(md, "|{}|", align.join("|"));
    for row in rows {
        let _ = writeln!(md, "| {} |", row.join(" | "));
    }
    md
}

fn begin(name: &str) -> String {
    format!("<!-- bench:begin {name} -->")
}

fn end(name: &str) -> String {
    format!("<!-- bench:end {name} -->")
}

/// `doc` with each block's text put between its markers (replacing what was there); blocks
/// without markers in `doc` are appended with theirs. Text outside the markers is kept as is.
pub(crate) fn splice(doc: &str, blocks: &[(&str, String)]) -> String {
    let mut out = doc.to_owned();
    for (name, text) in blocks {
        let (b, e) = (begin(name), end(name));
        let body = format!("{b}\n{}\n{e}", text.trim_end());
        match out
            .find(&b)
            .and_then(|s| out[s..].find(&e).map(|l| (s, s + l + e.len())))
        {
            Some((start, stop)) => out.replace_range(start..stop, &body),
            None => {
                if !out.is_empty() && !out.ends_with("\n\n") {
                    out.push_str(if out.ends_with('\n') { "\n" } else { "\n\n" });
                }
                out.push_str(&body);
                out.push('\n');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_odd_even_empty_and_nan() {
        assert_eq!(stats(&[3.0, 1.0, 2.0]), (2.0, 1.0, 3.0));
        assert_eq!(stats(&[4.0, 1.0, 3.0, 2.0]), (2.5, 1.0, 4.0));
        assert_eq!(stats(&[f64::NAN, 5.0]), (5.0, 5.0, 5.0));
        let (m, lo, hi) = stats(&[]);
        assert!(
            m.is_nan() && lo.is_nan() && hi.is_nan(),
            "expected NaNs for no samples, got {m} {lo} {hi}"
        );
    }

    #[test]
    fn round_medians_cut_consecutive_runs() {
        let runs = [5.0, 1.0, 3.0, 10.0, 30.0, 20.0, 99.0];
        assert_eq!(round_medians(&runs, 2), vec![3.0, 20.0]);
        assert_eq!(round_medians(&runs, 7), runs.to_vec());
        assert!(round_medians(&runs, 8).is_empty());
        assert!(round_medians(&[], 0).is_empty());
    }

    #[test]
    fn round_ratios_pair_rounds() {
        assert_eq!(round_ratios(&[2.0, 9.0, 4.0], &[1.0, 3.0]), vec![2.0, 3.0]);
        assert_eq!(
            stats(&round_ratios(&[10.0, 30.0, 20.0], &[10.0, 10.0, 10.0])).0,
            2.0
        );
    }

    #[test]
    fn cells_and_tables() {
        assert_eq!(cell(1.25, 1.0, 2.0, 1), "1.2 (1.0–2.0)");
        let (m, lo, hi) = stats(&[5.0, 7.0, 6.0]);
        assert_eq!(cell(m, lo, hi, 0), "6 (5–7)");
        let t = table(
            &["path", "ns"],
            &[false, true],
            &[vec!["a".into(), "1".into()], vec!["b".into(), "2".into()]],
        );
        assert_eq!(t, "| path | ns |\n|---|---:|\n| a | 1 |\n| b | 2 |\n");
    }

    #[test]
    fn splice_replaces_only_between_markers() {
        let doc = "# T\n\nprose before\n\n<!-- bench:begin a -->\nold a\n<!-- bench:end a -->\n\nWhere we lose: hand-written.\n";
        let out = splice(doc, &[("a", "new a\n".to_owned())]);
        assert_eq!(
            out,
            "# T\n\nprose before\n\n<!-- bench:begin a -->\nnew a\n<!-- bench:end a -->\n\nWhere we lose: hand-written.\n"
        );
        // Idempotent: splicing the same block again changes nothing.
        assert_eq!(splice(&out, &[("a", "new a\n".to_owned())]), out);
    }

    #[test]
    fn splice_appends_missing_blocks() {
        let out = splice("# T\nprose\n", &[("b", "table b".to_owned())]);
        assert_eq!(
            out,
            "# T\nprose\n\n<!-- bench:begin b -->\ntable b\n<!-- bench:end b -->\n"
        );
        assert_eq!(
            splice("", &[("b", "x".to_owned())]),
            "<!-- bench:begin b -->\nx\n<!-- bench:end b -->\n"
        );
    }

    #[test]
    fn splice_keeps_other_blocks() {
        let doc = "<!-- bench:begin a -->\nA\n<!-- bench:end a -->\nmid\n<!-- bench:begin b -->\nB\n<!-- bench:end b -->\n";
        let out = splice(doc, &[("b", "B2".to_owned())]);
        assert_eq!(
            out,
            "<!-- bench:begin a -->\nA\n<!-- bench:end a -->\nmid\n<!-- bench:begin b -->\nB2\n<!-- bench:end b -->\n"
        );
    }
}
