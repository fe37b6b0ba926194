//! Run to run: a run's medians against the spreads of the results it replaces.
//!
//! The report gives most numbers as a median with a min–max spread over rounds or runs; a
//! fresh run on the same kind of machine should put each median inside the earlier run's
//! spread. This finds every such number in both runs' JSON — objects with `median`, `min`
//! and `max` (or `median_X`, `min_X`, `max_X`), and lists of unnamed runs (each numeric
//! field's median and spread over the runs) — by a label made of the keys and the list
//! items' names, and counts, per section, how many of this run's medians fall inside the
//! earlier run's spread. Rows only one run has (renamed or new) are counted, not compared.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    path::Path,
    process::Command,
};

use anyhow::{Context as _, Result, bail};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::route_compare::Spread;

/// One number whose median moved outside the earlier run's spread.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct Outside {
    pub(crate) metric: String,
    pub(crate) earlier: Spread,
    pub(crate) this: Spread,
}

/// One section of the report, compared.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct SectionRun {
    pub(crate) section: String,
    /// "commit, date" of the earlier and of this run of the section.
    pub(crate) earlier: String,
    pub(crate) this: String,
    pub(crate) compared: usize,
    /// Of those, ratios between contenders measured in the same rounds.
    #[serde(default)]
    pub(crate) ratios: usize,
    pub(crate) inside: usize,
    /// Numbers only one of the runs reports (rows added, renamed or dropped between them).
    pub(crate) only_earlier: usize,
    pub(crate) only_this: usize,
    pub(crate) outside: Vec<Outside>,
    /// Against the spread the earlier results stated (same machine only): numbers that moved
    /// (earlier median not 0), and how many of them stayed within it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) within_stated: Option<(usize, usize)>,
    /// How far its medians other than ratios, and its ratios, moved: only when the section was
    /// measured again on the same machine (count 0 otherwise).
    #[serde(default)]
    pub(crate) medians_moved: Moves,
    #[serde(default)]
    pub(crate) ratios_moved: Moves,
    /// The machine this run of the section was measured on, as the report prints it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) machine: Option<String>,
}

/// How far a set of medians moved between two runs: `|this ÷ earlier − 1|`, in %.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct Moves {
    pub(crate) count: usize,
    pub(crate) p50: f64,
    pub(crate) p90: f64,
    pub(crate) max: f64,
}

impl Moves {
    fn of(mut pct: Vec<f64>) -> Moves {
        pct.sort_by(f64::total_cmp);
        // Nearest rank: the smallest move at least `q` of them do not exceed.
        let rank = |q: f64| {
            let i = ((q * pct.len() as f64).ceil() as usize).clamp(1, pct.len().max(1)) - 1;
            pct.get(i).copied().unwrap_or(0.0)
        };
        Moves {
            count: pct.len(),
            p50: rank(0.5),
            p90: rank(0.9),
            max: pct.last().copied().unwrap_or(0.0),
        }
    }

    /// The largest move, or `was` when there were none.
    fn largest_or(&self, was: f64) -> f64 {
        self.largest().unwrap_or(was)
    }

    /// The largest move, if any.
    fn largest(&self) -> Option<f64> {
        (self.count > 0).then_some(self.max)
    }
}

/// How many recorded run pairs of a section on one machine its stated spread is the largest
/// move of: one calm pair does not shrink it, one wild pair does not widen it for good.
const PAIRS_STATED: usize = 5;

/// Two runs of a section on one machine: the largest move of its medians other than ratios,
/// and of its ratios (`None` where the section has no such number).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Pair {
    /// "commit, date" of the earlier run → of the later one.
    pub(crate) runs: String,
    pub(crate) machine: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) medians_pct: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) ratios_pct: Option<f64>,
}

/// How far a fresh run's medians may move from the report's, in %: the medians other than
/// ratios, and the ratios between contenders.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Tolerance {
    pub(crate) medians_pct: f64,
    pub(crate) ratios_pct: f64,
    /// The run pairs it is the largest move of, oldest first: the last [`PAIRS_STATED`] on
    /// one machine (empty in results from before pairs were recorded).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) pairs: Vec<Pair>,
}

impl Tolerance {
    /// The tolerance after one more pair: the largest move over the last [`PAIRS_STATED`]
    /// pairs on the pair's machine (pairs from another machine are dropped: its speed and its
    /// noise are its own); a kind of number no kept pair has keeps what was stated.
    fn after(&self, pair: Pair) -> Tolerance {
        let mut pairs: Vec<Pair> = self
            .pairs
            .iter()
            .filter(|p| p.machine == pair.machine)
            .cloned()
            .collect();
        pairs.push(pair);
        pairs.drain(..pairs.len().saturating_sub(PAIRS_STATED));
        let largest = |pct: fn(&Pair) -> Option<f64>, was: f64| {
            pairs.iter().filter_map(pct).reduce(f64::max).unwrap_or(was)
        };
        Tolerance {
            medians_pct: largest(|p| p.medians_pct, self.medians_pct),
            ratios_pct: largest(|p| p.ratios_pct, self.ratios_pct),
            pairs,
        }
    }
}

/// The report's stated run-to-run spread: 90% of its medians (other than ratios) and 90% of
/// its ratios reproduce within it on the same machine. Per section (each section's largest
/// move over its last recorded run pairs on one machine); `all` for a section it has none for
/// (and the one figure that results from before per-section spreads state).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct Stated {
    #[serde(flatten)]
    pub(crate) all: Tolerance,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub(crate) sections: BTreeMap<String, Tolerance>,
}

impl Stated {
    /// The tolerance a section is held to.
    pub(crate) fn of(&self, section: &str) -> &Tolerance {
        self.sections.get(section).unwrap_or(&self.all)
    }
}

/// This run's medians against the tolerance the report it replaced stated.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct AgainstStated {
    pub(crate) stated: Stated,
    pub(crate) medians: usize,
    pub(crate) medians_within: usize,
    pub(crate) ratios: usize,
    pub(crate) ratios_within: usize,
}

/// This run against an earlier one.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct RunToRun {
    /// Which results this run is compared with.
    pub(crate) earlier: String,
    pub(crate) sections: Vec<SectionRun>,
    /// How far the medians other than ratios, and the ratios, moved.
    #[serde(default)]
    pub(crate) medians_moved: Moves,
    #[serde(default)]
    pub(crate) ratios_moved: Moves,
    /// Against what the earlier results stated, when they stated it (same machine only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) against_stated: Option<AgainstStated>,
    /// Sections measured on another machine than the results they replaced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) other_machine: Option<OtherMachine>,
    /// The spread the earlier results stated, kept when this comparison measures none of its
    /// own (no section on the same machine).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) carried: Option<Stated>,
}

/// Sections whose earlier run was on another machine (CPU model, CPU count or kernel build):
/// a machine's speed is its own, so their moves are reported but hold nothing.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct OtherMachine {
    /// The earlier and this run's machine, as the report prints it (the first such section's).
    pub(crate) earlier: String,
    pub(crate) this: String,
    pub(crate) sections: Vec<String>,
    pub(crate) medians_moved: Moves,
    pub(crate) ratios_moved: Moves,
}

impl RunToRun {
    /// Whether this comparison measured a spread of its own: moves on the same machine.
    fn measured_spread(&self) -> bool {
        self.medians_moved.count + self.ratios_moved.count > 0
    }

    /// The spread this comparison states for the next run on the same machine: per section
    /// measured again on the same machine, the largest move (medians and ratios apart) over
    /// this pair of runs and the pairs before it on that machine ([`Tolerance::after`]); for
    /// the other sections, what the earlier results stated.
    pub(crate) fn stated(&self) -> Option<Stated> {
        if !self.measured_spread() {
            return self.carried.clone();
        }
        let before = self.carried.clone().unwrap_or_default();
        let mut out = Stated {
            all: Tolerance {
                medians_pct: self.medians_moved.largest_or(before.all.medians_pct),
                ratios_pct: self.ratios_moved.largest_or(before.all.ratios_pct),
                pairs: Vec::new(),
            },
            sections: before.sections.clone(),
        };
        for s in &self.sections {
            if s.medians_moved.count + s.ratios_moved.count > 0 {
                let t = before.of(&s.section).after(Pair {
                    runs: format!("{} → {}", s.earlier, s.this),
                    machine: s.machine.clone().unwrap_or_default(),
                    medians_pct: s.medians_moved.largest(),
                    ratios_pct: s.ratios_moved.largest(),
                });
                out.sections.insert(s.section.clone(), t);
            }
        }
        Some(out)
    }

    /// The spread results read back from JSON state (their `run_to_run`), if any.
    pub(crate) fn stated_in(results: &Value) -> Option<Stated> {
        serde_json::from_value::<RunToRun>(results.get("run_to_run")?.clone())
            .ok()?
            .stated()
    }
}

/// The report's top-level keys, by section (`ha` is its own file, put under `ha`).
const KEY_SECTIONS: &[(&str, &str)] = &[
    ("floors", "parse"),
    ("rows", "parse"),
    ("conntrack", "conntrack"),
    ("conntrack_gc", "conntrack"),
    ("route_paths", "route"),
    ("vxlan_paths", "vxlan"),
    ("conntrack_drain", "drain"),
    ("service_updates", "updates"),
    ("api_changes", "api"),
    ("lb_compare", "lb-compare"),
    ("lb_sweep", "lb-sweep"),
    ("route_compare", "route-compare"),
    ("overlay_compare", "overlay-compare"),
    ("ha", "ha"),
];

/// Keys that only hold items: left out of labels.
const CONTAINERS: &[&str] = &["rows", "contenders", "settings", "runs", "rates"];

/// Lists of per-round ratios end with this.
const ROUND_RATIOS: &str = "round_ratios";

/// What names the ratios [`round_ratios`] derives.
const PER_ROUND: &str = "per round";

/// Whether a label names a ratio between contenders measured in the same rounds.
fn is_ratio(metric: &str) -> bool {
    metric.contains(PER_ROUND) || metric.contains(ROUND_RATIOS)
}

/// The contender every ratio is taken of.
const OURS: &str = "fastpath";

/// Numbers no per-round ratio is taken of, and whose run-to-run move is neither held to nor
/// states a spread: losses, 0 or nearly in a clean run, whose ratio says nothing (0.01%
/// against 0.0003% is not 30 times worse; 0.00005% to 0% is not a 100% move).
const NOT_RATIOED: &[&str] = &["loss_pct"];

/// Whether a label's move between runs is a relative one (not a [`NOT_RATIOED`] number).
fn moves_relatively(metric: &str) -> bool {
    !NOT_RATIOED.iter().any(|n| metric.ends_with(n))
}

/// Integer fields that name a list item, with what they count.
const NAMING_COUNTS: &[(&str, &str)] = &[("table_entries", "entries"), ("services", "services")];

/// The results at a git revision, named for the report: docs/bench/datapath.json with
/// docs/bench/ha.json as `ha`.
pub(crate) fn at_revision(root: &Path, rev: &str) -> Result<(String, Value)> {
    let git = |args: &[&str]| -> Result<Vec<u8>> {
        let out = Command::new("git")
            .arg("-C")
            .arg(root)
            .args(args)
            .output()
            .context("running git")?;
        if !out.status.success() {
            bail!(
                "`git {}` failed: {}; name a commit whose tree has the benchmark results (e.g. HEAD)",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(out.stdout)
    };
    let show = |file: &str| -> Result<Value> {
        serde_json::from_slice(&git(&["show", &format!("{rev}:docs/bench/{file}")])?)
            .with_context(|| format!("parsing docs/bench/{file} at {rev}"))
    };
    let commit = String::from_utf8_lossy(&git(&["rev-parse", "--short", rev])?)
        .trim()
        .to_owned();
    let mut results = show("datapath.json")?;
    let ha = show("ha.json")?;
    match results.as_object_mut() {
        Some(m) => {
            m.insert("ha".to_owned(), ha);
        }
        None => bail!("docs/bench/datapath.json at {rev} is not a JSON object"),
    }
    Ok((format!("the results committed at {commit}"), results))
}

/// Compares `this` run's results with `earlier` ones, for `sections` (all when `None`).
/// `stated`: the run-to-run spread the earlier results stated, to check this run against.
pub(crate) fn compare(
    earlier_name: &str,
    earlier: &Value,
    this: &Value,
    sections: Option<&[&str]>,
    stated: Option<Stated>,
) -> RunToRun {
    let (old, new) = (by_section(earlier), by_section(this));
    let mut out = RunToRun {
        earlier: earlier_name.to_owned(),
        ..RunToRun::default()
    };
    // Each compared median's move in %, ratios apart; on the same machine and on another.
    let (mut moved, mut ratios_moved) = (Vec::new(), Vec::new());
    let (mut elsewhere, mut ratios_elsewhere) = (Vec::new(), Vec::new());
    let mut other: Option<OtherMachine> = None;
    // Against the stated spread: (within, tested) for the medians and for the ratios.
    let (mut medians_within, mut ratios_within) = ((0, 0), (0, 0));
    let mut names: Vec<&str> = Vec::new();
    for (_, section) in KEY_SECTIONS {
        if !names.contains(section) && sections.is_none_or(|s| s.contains(section)) {
            names.push(section);
        }
    }
    for section in names {
        let empty = BTreeMap::new();
        let o = old.get(section).unwrap_or(&empty);
        let n = new.get(section).unwrap_or(&empty);
        let mut s = SectionRun {
            section: section.to_owned(),
            earlier: measured(earlier, section),
            this: measured(this, section),
            machine: machine_of(this, section),
            only_earlier: o.keys().filter(|k| !n.contains_key(*k)).count(),
            only_this: n.keys().filter(|k| !o.contains_key(*k)).count(),
            ..SectionRun::default()
        };
        // Both runs' results hold the same measurement of the section (a run of some sections
        // compared with results it kept the others of): its numbers did not move, they were
        // not measured again, and they test and state no spread.
        let kept = !earlier["measured"][section].is_null()
            && earlier["measured"][section] == this["measured"][section];
        let same = match (machine_of(earlier, section), machine_of(this, section)) {
            (Some(was), Some(now)) if was != now => {
                let o = other.get_or_insert_with(|| OtherMachine {
                    earlier: was,
                    this: now,
                    ..OtherMachine::default()
                });
                o.sections.push(section.to_owned());
                false
            }
            _ => true,
        };
        // Measured again on the same machine: held to the stated spread, and states the next.
        let held = same && !kept;
        let (mut section_moved, mut section_ratios_moved) = (Vec::new(), Vec::new());
        for (metric, was) in o {
            let Some(now) = n.get(metric) else { continue };
            s.compared += 1;
            s.ratios += usize::from(is_ratio(metric));
            if was.median != 0.0 && moves_relatively(metric) {
                let pct = 100.0 * (now.median / was.median - 1.0).abs();
                if let Some(t) = stated.as_ref().filter(|_| held) {
                    let t = t.of(section);
                    let (tolerance, total) = if is_ratio(metric) {
                        (t.ratios_pct, &mut ratios_within)
                    } else {
                        (t.medians_pct, &mut medians_within)
                    };
                    let ok = usize::from(pct <= tolerance);
                    let (within, tested) = s.within_stated.get_or_insert((0, 0));
                    *tested += 1;
                    *within += ok;
                    total.0 += ok;
                    total.1 += 1;
                }
                match (kept, same, is_ratio(metric)) {
                    (true, ..) => {}
                    (false, true, true) => section_ratios_moved.push(pct),
                    (false, true, false) => section_moved.push(pct),
                    (false, false, true) => ratios_elsewhere.push(pct),
                    (false, false, false) => elsewhere.push(pct),
                }
            }
            if was.min <= now.median && now.median <= was.max {
                s.inside += 1;
            } else {
                s.outside.push(Outside {
                    metric: metric.clone(),
                    earlier: was.clone(),
                    this: now.clone(),
                });
            }
        }
        moved.extend_from_slice(&section_moved);
        ratios_moved.extend_from_slice(&section_ratios_moved);
        s.medians_moved = Moves::of(section_moved);
        s.ratios_moved = Moves::of(section_ratios_moved);
        if s.compared + s.only_earlier + s.only_this > 0 {
            out.sections.push(s);
        }
    }
    if let Some(mut o) = other {
        o.medians_moved = Moves::of(elsewhere);
        o.ratios_moved = Moves::of(ratios_elsewhere);
        out.other_machine = Some(o);
    }
    // A spread stated for the same machine is tested only by numbers from the same machine.
    let tested = !(moved.is_empty() && ratios_moved.is_empty());
    out.carried = stated.clone();
    out.against_stated = stated.filter(|_| tested).map(|stated| AgainstStated {
        medians: medians_within.1,
        medians_within: medians_within.0,
        ratios: ratios_within.1,
        ratios_within: ratios_within.0,
        stated,
    });
    out.medians_moved = Moves::of(moved);
    out.ratios_moved = Moves::of(ratios_moved);
    out
}

/// The machine a section was measured on, as the report prints it, if recorded.
fn machine_of(results: &Value, section: &str) -> Option<String> {
    let m = &results["measured"][section];
    Some(format!(
        "{} ({} CPUs), kernel {}",
        m["cpu"].as_str()?,
        m["cpus"].as_u64()?,
        m["kernel"].as_str()?
    ))
}

/// "commit, date" a section was measured at, from the results' `measured` map.
fn measured(results: &Value, section: &str) -> String {
    let m = &results["measured"][section];
    match (m["commit"].as_str(), m["date"].as_str()) {
        (Some(c), Some(d)) => format!("{c}, {d}"),
        _ => "not recorded".to_owned(),
    }
}

/// Every spread in the results, by section and label.
fn by_section(results: &Value) -> BTreeMap<&'static str, BTreeMap<String, Spread>> {
    let mut out: BTreeMap<&'static str, BTreeMap<String, Spread>> = BTreeMap::new();
    for (key, section) in KEY_SECTIONS {
        if let Some(v) = results.get(*key) {
            walk(v, key, out.entry(section).or_default());
        }
    }
    out
}

fn join(label: &str, part: &str) -> String {
    if part.is_empty() || CONTAINERS.contains(&part) {
        label.to_owned()
    } else if label.is_empty() {
        part.to_owned()
    } else {
        format!("{label} / {part}")
    }
}

fn walk(v: &Value, label: &str, out: &mut BTreeMap<String, Spread>) {
    match v {
        Value::Object(m) => walk_object(m, label, out),
        Value::Array(items) => walk_list(items, label, out),
        _ => {}
    }
}

fn walk_object(m: &Map<String, Value>, label: &str, out: &mut BTreeMap<String, Spread>) {
    for (k, x) in m {
        let Some(unit) = k.strip_prefix("median") else {
            continue;
        };
        let get = |bound: &str| m.get(&format!("{bound}{unit}")).and_then(Value::as_f64);
        if let (Some(median), Some(min), Some(max)) = (x.as_f64(), get("min"), get("max")) {
            let unit = unit.trim_start_matches('_');
            let name = if unit.is_empty() {
                label.to_owned()
            } else {
                join(label, unit)
            };
            out.insert(name, Spread::new(median, min, max));
        }
    }
    for (k, x) in m {
        if k.ends_with(ROUND_RATIOS) {
            // Per-round ratios between contenders: their median and spread.
            let samples = numbers(Some(x));
            if !samples.is_empty() {
                out.insert(join(label, k), Spread::of(samples));
            }
        } else if x.is_object() || x.is_array() {
            walk(x, &join(label, k), out);
        }
    }
}

/// The numbers of a JSON array (none when `v` is not one).
fn numbers(v: Option<&Value>) -> Vec<f64> {
    v.and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_f64).collect())
        .unwrap_or_default()
}

/// The counts that tell a list's rows apart ("1000 services").
fn counts(m: &Map<String, Value>) -> Vec<String> {
    NAMING_COUNTS
        .iter()
        .filter_map(|(key, what)| Some(format!("{} {what}", m.get(*key)?.as_u64()?)))
        .collect()
}

/// A list item's name: its strings, and its counts.
fn item_name(m: &Map<String, Value>) -> String {
    let mut parts: Vec<String> = m
        .values()
        .filter_map(Value::as_str)
        .map(str::to_owned)
        .collect();
    parts.extend(counts(m));
    parts.join(", ")
}

fn walk_list(items: &[Value], label: &str, out: &mut BTreeMap<String, Spread>) {
    let objects: Vec<&Map<String, Value>> = items.iter().filter_map(Value::as_object).collect();
    if objects.is_empty() || objects.len() != items.len() {
        return;
    }
    let names: Vec<String> = objects.iter().map(|m| item_name(m)).collect();
    if objects.len() > 1 && names.iter().all(String::is_empty) {
        // Runs of one configuration: each number's median and spread over the runs.
        let keys: BTreeSet<&String> = objects.iter().flat_map(|m| m.keys()).collect();
        for key in keys {
            let samples: Vec<f64> = objects
                .iter()
                .filter_map(|m| m.get(key.as_str()).and_then(Value::as_f64))
                .collect();
            if samples.len() == objects.len() {
                out.insert(join(label, key), Spread::of(samples));
            }
        }
        return;
    }
    round_ratios(&objects, label, out);
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for (m, name) in objects.iter().zip(&names) {
        let nth = seen.entry(name).or_default();
        *nth += 1;
        let name = if *nth > 1 {
            format!("{name} #{nth}")
        } else {
            name.clone()
        };
        walk_object(m, &join(label, &name), out);
    }
}

fn contender(m: &Map<String, Value>) -> Option<&str> {
    m.get("contender").and_then(Value::as_str)
}

/// Rows of contenders measured round by round (`samples` in round order): fastpath's
/// per-round ratio to each other contender with the same counts (services), for every
/// number both report — the ratios the report's claims are made of, which drift between
/// runs cancels.
fn round_ratios(rows: &[&Map<String, Value>], label: &str, out: &mut BTreeMap<String, Spread>) {
    for ours in rows.iter().filter(|m| contender(m) == Some(OURS)) {
        let at = counts(ours);
        for other in rows.iter().filter(|m| counts(m) == at) {
            let Some(name) = contender(other).filter(|c| *c != OURS) else {
                continue;
            };
            let row = join(
                label,
                &[&at[..], &[format!("{OURS} ÷ {name} {PER_ROUND}")]]
                    .concat()
                    .join(", "),
            );
            for (key, x) in *ours {
                if !moves_relatively(key) {
                    continue;
                }
                let samples = |v: Option<&Value>| numbers(v.and_then(|v| v.get("samples")));
                let ratios: Vec<f64> = samples(Some(x))
                    .iter()
                    .zip(&samples(other.get(key)))
                    .filter(|(_, d)| **d != 0.0)
                    .map(|(n, d)| n / d)
                    .collect();
                if !ratios.is_empty() {
                    out.insert(join(&row, key), Spread::of(ratios));
                }
            }
        }
    }
}

/// Decimals for a table cell: fewer as numbers grow.
fn digits(x: f64) -> usize {
    match x.abs() {
        x if x >= 100.0 => 0,
        x if x >= 10.0 => 1,
        _ => 2,
    }
}

/// A stated spread, said in a sentence.
fn spread_text(stated: &Stated) -> String {
    if stated.sections.is_empty() {
        format!(
            "±{:.1}% for medians, ±{:.1}% for ratios",
            stated.all.medians_pct, stated.all.ratios_pct
        )
    } else {
        "per section, in the table below".to_owned()
    }
}

/// A tolerance as a table cell: medians / ratios, for the kinds of number the section has.
fn tolerance_cell(t: &Tolerance, (medians, ratios): (bool, bool)) -> String {
    let pct = |has: bool, p: f64| {
        if has {
            format!("±{p:.1}%")
        } else {
            "—".to_owned()
        }
    };
    format!(
        "{} / {}",
        pct(medians, t.medians_pct),
        pct(ratios, t.ratios_pct)
    )
}

/// The pairs of runs a tolerance is stated over, as a table cell: their commits.
fn pairs_cell(pairs: &[Pair]) -> String {
    if pairs.is_empty() {
        return "—".to_owned();
    }
    // "commit, date → commit, date": the commits.
    let commits = |runs: &str| {
        runs.split(" → ")
            .map(|run| run.split(',').next().unwrap_or(run))
            .collect::<Vec<_>>()
            .join(" → ")
    };
    pairs
        .iter()
        .map(|p| commits(&p.runs))
        .collect::<Vec<_>>()
        .join("; ")
}

/// One comparison in a line: the sections measured again on the same machine, how far their
/// medians / ratios moved at most, and how many stayed within the spread stated before.
pub(crate) fn summary(r: &RunToRun, this: &str) -> String {
    let moved: Vec<String> = r
        .sections
        .iter()
        .filter(|s| s.medians_moved.count + s.ratios_moved.count > 0)
        .map(|s| {
            let pct = |m: &Moves| m.largest().map_or("—".to_owned(), |p| format!("{p:.1}%"));
            let within = s.within_stated.map_or(String::new(), |(k, n)| {
                format!(", {k} of {n} within the stated")
            });
            format!(
                "{} moved {} / {}{within}",
                s.section,
                pct(&s.medians_moved),
                pct(&s.ratios_moved)
            )
        })
        .collect();
    format!(
        "{this} against {}: {}",
        r.earlier,
        if moved.is_empty() {
            "no section measured again on the same machine".to_owned()
        } else {
            moved.join("; ")
        }
    )
}

/// The report's "Run to run" section.
pub(crate) fn markdown(r: &RunToRun) -> String {
    let mut md = String::new();
    let compared: usize = r.sections.iter().map(|s| s.compared).sum();
    let inside: usize = r.sections.iter().map(|s| s.inside).sum();
    let _ = writeln!(
        md,
        "## Run to run\n\nThis run against {}: for every number the report gives as a median with a min–max spread (over rounds, or over runs), whether this run's median lies inside the earlier run's spread. {inside} of {compared} do ({:.0}%). A section measured at another commit in the earlier run may differ for a reason: the code changed in between.\n",
        r.earlier,
        if compared == 0 {
            0.0
        } else {
            100.0 * inside as f64 / compared as f64
        }
    );
    // The same counts for the ratios between contenders alone, and how far medians moved.
    let (mut ratios, mut ratios_outside, mut near, mut ratios_near) = (0, 0, 0, 0);
    for s in &r.sections {
        for o in &s.outside {
            let within_10 =
                (o.this.median - o.earlier.median).abs() <= 0.1 * o.earlier.median.abs();
            near += usize::from(within_10);
            if is_ratio(&o.metric) {
                ratios_outside += 1;
                ratios_near += usize::from(within_10);
            }
        }
        ratios += s.ratios;
    }
    let _ = writeln!(
        md,
        "Of the {compared}, {ratios} are fastpath's per-round ratios to another contender measured in the same round (what the report's claims are made of; drift of the whole machine between runs cancels in them): {} of those lie inside the earlier spread. Of the medians outside, {near} moved by 10% or less ({ratios_near} of the {ratios_outside} ratios).\n",
        ratios - ratios_outside
    );
    let (m, q) = (&r.medians_moved, &r.ratios_moved);
    // How far two sets of moves went, as one clause; `ratios` names the second set.
    let moves = |m: &Moves, q: &Moves, ratios: &str| {
        format!(
            "the {} medians other than ratios by {:.1}% (median), {:.1}% (90th percentile), {:.1}% at most; the {} {ratios} by {:.1}%, {:.1}%, {:.1}%",
            m.count, m.p50, m.p90, m.max, q.count, q.p50, q.p90, q.max
        )
    };
    if m.count + q.count > 0 {
        let _ = writeln!(
            md,
            "How far they moved, |this ÷ earlier − 1| (where the earlier median is not 0; loss percentages, 0 or nearly in a clean run, are left out: a relative move says nothing of them){}: {}.\n",
            if r.other_machine.is_some() {
                ", in the sections measured on the same machine"
            } else {
                ""
            },
            moves(m, q, "ratios")
        );
    }
    if let Some(o) = &r.other_machine {
        let _ = writeln!(
            md,
            "**Another machine.** {} ran on {} where the results they replaced ran on {}. The machines offered to this project differ in speed (the empty-program floor and every other absolute number with them), so absolute numbers reproduce only on the same machine (CPU model, CPU count and kernel build as recorded) and these are held to no spread. How far they moved, |this ÷ earlier − 1|: {}.\n",
            o.sections.join(", "),
            o.this,
            o.earlier,
            moves(
                &o.medians_moved,
                &o.ratios_moved,
                "ratios between contenders, which the report's claims are made of,"
            )
        );
    }
    let stated = r.stated();
    if let Some(stated) = &stated {
        let whence = if r.measured_spread() {
            "a run-to-run spread measured instead: per section, the largest move of its medians, and of its ratios, over the last pairs of runs recorded on this machine (up to 5: the pair compared here and those before it, named in the table below; one calm pair does not narrow it, and a section not measured again keeps the spread stated before)"
        } else {
            "the run-to-run spread the results before stated (measured between two runs on one machine), kept because this comparison, on another machine, measures none of its own"
        };
        let _ = writeln!(
            md,
            "**Stated spread.** A cell's min–max is the spread within one run, over its rounds; between runs the machine's speed drifts, so a fresh run on the same machine is held to {whence}. A fresh run on the same machine matches this report when 90% of its medians and 90% of its ratios between contenders are within their section's spread ({}).\n",
            spread_text(stated)
        );
    }
    if r.against_stated.is_none()
        && let (Some(_), Some(carried)) = (&r.other_machine, &r.carried)
    {
        let _ = writeln!(
            md,
            "The spread the earlier results stated ({}) is for a fresh run on their machine; this run, on another, does not test it.\n",
            spread_text(carried)
        );
    }
    if let Some(a) = &r.against_stated {
        let pct = |k: usize, n: usize| {
            if n == 0 {
                0.0
            } else {
                100.0 * k as f64 / n as f64
            }
        };
        let verdict = |k: usize, n: usize| {
            if pct(k, n) >= 90.0 {
                "met"
            } else {
                "**missed**"
            }
        };
        let _ = writeln!(
            md,
            "Against the spread the earlier results stated ({}): {} of {} medians ({:.1}%: {}) and {} of {} ratios ({:.1}%: {}) are within it; 90% is the bar.\n",
            spread_text(&a.stated),
            a.medians_within,
            a.medians,
            pct(a.medians_within, a.medians),
            verdict(a.medians_within, a.medians),
            a.ratios_within,
            a.ratios,
            pct(a.ratios_within, a.ratios),
            verdict(a.ratios_within, a.ratios),
        );
    }
    let _ = writeln!(
        md,
        "| section | earlier run | this run | medians compared | inside the earlier spread | only in the earlier run | only in this run |\n|---|---|---|---:|---:|---:|---:|"
    );
    for s in &r.sections {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} |",
            s.section, s.earlier, s.this, s.compared, s.inside, s.only_earlier, s.only_this
        );
    }
    if let Some(stated) = &stated {
        let _ = writeln!(
            md,
            "\nThe run-to-run spread, per section: the one the earlier results stated, how many of this run's numbers (medians and ratios) stayed within it, and the one stated for a fresh run of this report (medians / ratios between contenders; — where the section has none), with the pairs of runs (earlier → later commit) it is the largest move over.\n\n| section | stated before | within it | stated for a fresh run | over the pairs |\n|---|---:|---:|---:|---|"
        );
        for s in &r.sections {
            let has = (s.compared > s.ratios, s.ratios > 0);
            let (before, within) = match (&r.against_stated, s.within_stated) {
                (Some(a), Some((within, tested))) => (
                    tolerance_cell(a.stated.of(&s.section), has),
                    format!("{within} of {tested}"),
                ),
                _ => ("—".to_owned(), "—".to_owned()),
            };
            let t = stated.of(&s.section);
            let _ = writeln!(
                md,
                "| {} | {before} | {within} | {} | {} |",
                s.section,
                tolerance_cell(t, has),
                pairs_cell(&t.pairs)
            );
        }
    }
    let outside: Vec<(&str, &Outside)> = r
        .sections
        .iter()
        .flat_map(|s| s.outside.iter().map(move |o| (s.section.as_str(), o)))
        .collect();
    if !outside.is_empty() {
        let _ = writeln!(
            md,
            "\nMedians outside the earlier run's spread:\n\n| section | number | earlier median (min–max) | this median (min–max) | change |\n|---|---|---:|---:|---:|"
        );
        for (section, o) in outside {
            let change = if o.earlier.median == 0.0 {
                "—".to_owned()
            } else {
                format!("{:+.1}%", 100.0 * (o.this.median / o.earlier.median - 1.0))
            };
            let _ = writeln!(
                md,
                "| {section} | {} | {} | {} | {change} |",
                o.metric,
                o.earlier.cell(digits(o.earlier.median)),
                o.this.cell(digits(o.this.median)),
            );
        }
    }
    md
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn medians_inside_and_outside_the_earlier_spread() {
        let earlier = json!({
            "measured": {"parse": {"commit": "aaa", "date": "d1"}},
            "floors": [{"hook": "xdp", "median_ns": 5.0, "min_ns": 5.0, "max_ns": 6.0}],
            "rows": [{"case": "a", "median_ns": 17.0, "min_ns": 16.0, "max_ns": 18.0},
                     {"case": "gone", "median_ns": 1.0, "min_ns": 1.0, "max_ns": 1.0}],
            "ha": {"rates": [{"label": "full", "runs": [{"x": 1.0}, {"x": 3.0}, {"x": 2.0}]}]},
        });
        let this = json!({
            "measured": {"parse": {"commit": "bbb", "date": "d2"}},
            "floors": [{"hook": "xdp", "median_ns": 6.0, "min_ns": 5.0, "max_ns": 6.0}],
            "rows": [{"case": "a", "median_ns": 19.0, "min_ns": 18.0, "max_ns": 20.0},
                     {"case": "new", "median_ns": 1.0, "min_ns": 1.0, "max_ns": 1.0}],
            "ha": {"rates": [{"label": "full", "runs": [{"x": 2.5}, {"x": 9.0}, {"x": 1.0}]}]},
        });
        let r = compare("the earlier run", &earlier, &this, None, None);
        let cps = |samples: [f64; 3]| {
            let (median, min, max) = crate::stats(&samples);
            json!({"median": median, "min": min, "max": max, "samples": samples})
        };
        let sweep = |scale: f64| {
            json!({"lb_sweep": {"rows": [
                {"contender": "fastpath", "services": 1, "cps": cps([20.0, 30.0, 28.0].map(|x| x * scale))},
                {"contender": "haproxy", "services": 1, "cps": cps([10.0, 20.0, 14.0].map(|x| x * scale))},
            ]}, "route_compare": {"vs_kernel": [{"contender": "fastpath", "pps_round_ratios": [1.2 * scale, 1.3, 1.1]}]}})
        };
        // Everything 20% faster: the medians leave their spreads, the ratios do not.
        let stated = stated_all(10.0, 1.0);
        let drift = compare("slower", &sweep(1.0), &sweep(1.2), None, Some(stated));
        let outside: Vec<&str> = drift
            .sections
            .iter()
            .flat_map(|s| s.outside.iter().map(|o| o.metric.as_str()))
            .collect();
        assert_eq!(outside, ["lb_sweep / fastpath, 1 services / cps"]);
        let sweep_run = &drift.sections[0];
        assert_eq!(sweep_run.section, "lb-sweep");
        // fastpath's, HAProxy's and their per-round ratio (2, 1.5, 2 both times).
        assert_eq!((sweep_run.compared, sweep_run.inside), (3, 2));
        // Moved: fastpath's and HAProxy's cps by 20%; the ratios by 0% (fastpath ÷ HAProxy)
        // and 8.3% (route-compare's per-round ratios: median 1.2, then 1.3).
        assert_eq!(drift.medians_moved.count, 2);
        assert!((drift.medians_moved.p90 - 20.0).abs() < 1e-9);
        assert_eq!(drift.ratios_moved.count, 2);
        assert!(drift.ratios_moved.p50.abs() < 1e-9);
        assert!((drift.ratios_moved.max - 100.0 * (1.3 / 1.2 - 1.0)).abs() < 1e-9);
        // Per section: lb-sweep's two cps moved 20% (over 10%), its ratio 0% (within 1%).
        assert_eq!(sweep_run.within_stated, Some((1, 3)));
        assert_eq!(drift.sections[1].within_stated, Some((0, 1)));
        let a = drift.against_stated.as_ref().unwrap();
        assert_eq!((a.medians_within, a.medians), (0, 2));
        assert_eq!((a.ratios_within, a.ratios), (1, 2));
        let text = markdown(&drift);
        assert!(
            text.contains(
                "0 of 2 medians (0.0%: **missed**) and 1 of 2 ratios (50.0%: **missed**)"
            ),
            "{text}"
        );
        // What this comparison states for the next run: each section's largest moves (route-
        // compare has no medians: it keeps the earlier 10%), and reading it back from JSON.
        let next = drift.stated().unwrap();
        assert!((next.of("lb-sweep").medians_pct - 20.0).abs() < 1e-9);
        assert!(next.of("lb-sweep").ratios_pct.abs() < 1e-9);
        let route_ratio = 100.0 * (1.3 / 1.2 - 1.0);
        assert!((next.of("route-compare").ratios_pct - route_ratio).abs() < 1e-9);
        assert_eq!(next.of("route-compare").medians_pct, 10.0);
        assert!((next.all.ratios_pct - route_ratio).abs() < 1e-9);
        let json = json!({ "run_to_run": serde_json::to_value(&drift).unwrap() });
        assert_eq!(RunToRun::stated_in(&json).unwrap().sections, next.sections);
        assert!(
            text.contains("| lb-sweep | ±10.0% / ±1.0% | 1 of 3 | ±20.0% / ±0.0% | not recorded → not recorded |"),
            "{text}"
        );
        assert!(
            text.contains(
                "| route-compare | — / ±1.0% | 0 of 1 | — / ±8.3% | not recorded → not recorded |"
            ),
            "{text}"
        );
        assert_eq!(drift.sections[1].section, "route-compare");
        assert_eq!(
            (drift.sections[1].compared, drift.sections[1].inside),
            (1, 1)
        );
        let parse = &r.sections[0];
        assert_eq!(parse.section, "parse");
        assert_eq!(
            (parse.earlier.as_str(), parse.this.as_str()),
            ("aaa, d1", "bbb, d2")
        );
        assert_eq!((parse.compared, parse.inside), (2, 1));
        assert_eq!((parse.only_earlier, parse.only_this), (1, 1));
        assert_eq!(parse.outside[0].metric, "rows / a / ns");
        assert_eq!(parse.outside[0].this.median, 19.0);
        let ha = r.sections.iter().find(|s| s.section == "ha").unwrap();
        // Runs 1, 2, 3 then 1, 2.5, 9: median 2.5 inside 1–3.
        assert_eq!((ha.compared, ha.inside), (1, 1));
        assert!(
            markdown(&r).contains(
                "| parse | rows / a / ns | 17.0 (16.0–18.0) | 19.0 (18.0–20.0) | +11.8% |"
            )
        );
    }

    /// One spread stated for every section: medians and ratios, in %.
    fn stated_all(medians_pct: f64, ratios_pct: f64) -> Stated {
        Stated {
            all: Tolerance {
                medians_pct,
                ratios_pct,
                pairs: Vec::new(),
            },
            ..Stated::default()
        }
    }

    /// Results of two sections: parse (one row of `ns`) measured on `parse_cpu`, and
    /// route-compare (per-round ratios of `ratio`) measured on `route_cpu` at `route_date`.
    fn parse_and_route(
        parse_cpu: &str,
        route_cpu: &str,
        route_date: &str,
        ns: f64,
        ratio: f64,
    ) -> Value {
        json!({
            "measured": {
                "parse": {"cpu": parse_cpu, "cpus": 2, "kernel": "6.18", "commit": "c", "date": "d"},
                "route-compare": {"cpu": route_cpu, "cpus": 2, "kernel": "6.18", "commit": "c", "date": route_date},
            },
            "rows": [{"case": "a", "median_ns": ns, "min_ns": ns, "max_ns": ns}],
            "route_compare": {"vs_kernel": [{"contender": "fastpath", "pps_round_ratios": [ratio, ratio, ratio]}]},
        })
    }

    #[test]
    fn another_machine_tests_nothing_and_carries_the_stated_spread() {
        let run = |cpu: &str, ns: f64, ratio: f64| {
            parse_and_route(cpu, "same", &ratio.to_string(), ns, ratio)
        };
        let stated = stated_all(10.0, 1.0);
        // parse on a machine 5x slower, route-compare's ratio on the same machine, 0.5% off.
        let r = compare(
            "earlier",
            &run("fast", 10.0, 1.2),
            &run("slow", 50.0, 1.206),
            None,
            Some(stated.clone()),
        );
        let o = r.other_machine.as_ref().unwrap();
        assert_eq!(o.sections, ["parse"]);
        assert_eq!(
            (o.earlier.as_str(), o.this.as_str()),
            ("fast (2 CPUs), kernel 6.18", "slow (2 CPUs), kernel 6.18")
        );
        assert!((o.medians_moved.max - 400.0).abs() < 1e-9);
        // Only the same machine's ratio is held to the stated spread, and it is within it.
        let a = r.against_stated.as_ref().unwrap();
        assert_eq!(
            (a.medians, a.medians_within, a.ratios, a.ratios_within),
            (0, 0, 1, 1)
        );
        let of = |name: &str| r.sections.iter().find(|s| s.section == name).unwrap();
        assert_eq!(of("route-compare").within_stated, Some((1, 1)));
        assert_eq!(of("parse").within_stated, None);
        // No median moved on the same machine: their spread is the earlier one; route-compare's
        // ratios are held next to how far they moved here.
        let next = r.stated().unwrap();
        assert_eq!(next.all.medians_pct, 10.0);
        assert!((next.of("route-compare").ratios_pct - 0.5).abs() < 1e-9);
        assert!(!next.sections.contains_key("parse"));
        // Everything on another machine: nothing tested, the earlier spread carried over.
        let mut slow = run("slow", 50.0, 1.5);
        slow["measured"]["route-compare"]["cpu"] = json!("slow");
        let r = compare(
            "earlier",
            &run("fast", 10.0, 1.2),
            &slow,
            None,
            Some(stated),
        );
        assert!(r.against_stated.is_none());
        assert_eq!(r.other_machine.as_ref().unwrap().sections.len(), 2);
        let json = json!({ "run_to_run": serde_json::to_value(&r).unwrap() });
        assert_eq!(RunToRun::stated_in(&json).unwrap().all.ratios_pct, 1.0);
        let text = markdown(&r);
        assert!(text.contains("**Another machine.** parse, route-compare ran on slow (2 CPUs), kernel 6.18 where the results they replaced ran on fast (2 CPUs), kernel 6.18."), "{text}");
        assert!(
            text.contains(
                "kept because this comparison, on another machine, measures none of its own"
            ),
            "{text}"
        );
        assert!(
            text.contains("this run, on another, does not test it"),
            "{text}"
        );
        assert!(
            !text.contains("How far they moved, |this ÷ earlier − 1| (where"),
            "{text}"
        );
    }

    #[test]
    fn a_loss_percentage_neither_moves_relatively_nor_states_a_spread() {
        let run = |ns: f64, loss: f64| {
            let mut r = parse_and_route("c", "c", "d", ns, 1.0);
            // Measured at another time (not kept from the earlier results).
            r["measured"]["parse"]["date"] = json!(ns.to_string());
            r["rows"][0]["loss_pct"] = json!({"median": loss, "min": loss, "max": loss});
            r
        };
        let stated = stated_all(10.0, 10.0);
        // A loss of 0.00005% gone to 0 (a "100% move") and a time 2% slower.
        let r = compare(
            "earlier",
            &run(10.0, 0.00005),
            &run(10.2, 0.0),
            None,
            Some(stated),
        );
        let parse = r.sections.iter().find(|s| s.section == "parse").unwrap();
        assert_eq!(
            parse.compared, 2,
            "the loss is still compared against its range"
        );
        assert_eq!(parse.within_stated, Some((1, 1)), "only the time is held");
        assert!(
            (parse.medians_moved.max - 2.0).abs() < 1e-9,
            "{:?}",
            parse.medians_moved
        );
        assert!((r.stated().unwrap().of("parse").medians_pct - 2.0).abs() < 1e-9);
    }

    #[test]
    fn a_section_not_measured_again_keeps_its_stated_spread() {
        let run = |when: &str, ns: f64, ratio: f64| parse_and_route("c", "c", when, ns, ratio);
        let stated = Stated {
            all: Tolerance {
                medians_pct: 10.0,
                ratios_pct: 1.0,
                pairs: Vec::new(),
            },
            sections: BTreeMap::from([(
                "parse".to_owned(),
                Tolerance {
                    medians_pct: 3.0,
                    ratios_pct: 0.0,
                    pairs: Vec::new(),
                },
            )]),
        };
        // Only route-compare measured again (its ratio 2% off); parse's results kept as they were.
        let r = compare(
            "earlier",
            &run("d1", 10.0, 1.0),
            &run("d2", 10.0, 1.02),
            None,
            Some(stated),
        );
        let of = |name: &str| r.sections.iter().find(|s| s.section == name).unwrap();
        assert_eq!(of("parse").within_stated, None);
        assert_eq!(of("parse").medians_moved.count, 0);
        assert_eq!(of("route-compare").within_stated, Some((0, 1)));
        let a = r.against_stated.as_ref().unwrap();
        assert_eq!((a.medians, a.ratios, a.ratios_within), (0, 1, 0));
        let next = r.stated().unwrap();
        assert_eq!(next.of("parse").medians_pct, 3.0);
        assert!((next.of("route-compare").ratios_pct - 2.0).abs() < 1e-9);
        let text = markdown(&r);
        assert!(text.contains("| parse | — | — | ±3.0% / — | — |"), "{text}");
        assert!(
            text.contains("| route-compare | — / ±1.0% | 0 of 1 | — / ±2.0% | c → c |"),
            "{text}"
        );
    }

    #[test]
    fn the_stated_spread_is_the_largest_move_over_the_last_pairs_on_one_machine() {
        // Results of route-compare measured at `commit` on `cpu`: one per-round ratio.
        let run = |cpu: &str, commit: &str, ratio: f64| {
            let mut r = parse_and_route(cpu, cpu, commit, 10.0, ratio);
            r["measured"]["route-compare"]["commit"] = json!(commit);
            r
        };
        // Compares each run with the one before, each held to what the one before stated.
        let chain = |runs: &[(&str, &str, f64)], mut stated: Option<Stated>| {
            for w in runs.windows(2) {
                let [(c0, a, r0), (c1, b, r1)] = [w[0], w[1]];
                stated =
                    compare("earlier", &run(c0, a, r0), &run(c1, b, r1), None, stated).stated();
            }
            stated.unwrap()
        };
        let ratios = |s: &Stated| s.of("route-compare").ratios_pct;
        // Moves of 10%, then 1%: the calm pair does not narrow the spread.
        let s = chain(&[("m", "a", 1.0), ("m", "b", 1.1), ("m", "c", 1.111)], None);
        assert!((ratios(&s) - 10.0).abs() < 1e-6, "{s:?}");
        let pairs = &s.of("route-compare").pairs;
        assert_eq!(
            pairs.iter().map(|p| p.runs.as_str()).collect::<Vec<_>>(),
            ["a, a → b, b", "b, b → c, c"]
        );
        assert_eq!(pairs[0].machine, "m (2 CPUs), kernel 6.18");
        assert_eq!(pairs[0].medians_pct, None, "route-compare has no medians");
        // Five calm pairs later the wild one is no longer among the last five.
        let mut runs = vec![("m", "c", 1.111)];
        for (i, commit) in ["d", "e", "f", "g", "h"].into_iter().enumerate() {
            runs.push(("m", commit, 1.111 * (1.0 + 0.01 * (i % 2) as f64)));
        }
        let s = chain(&runs, Some(s));
        assert_eq!(s.of("route-compare").pairs.len(), PAIRS_STATED);
        assert_eq!(s.of("route-compare").pairs[0].runs, "c, c → d, d");
        assert!((ratios(&s) - 1.0).abs() < 1e-6, "{s:?}");
        // On another machine nothing is measured; back on one, the earlier machine's pairs go.
        let s = chain(
            &[("m", "h", 1.0), ("n", "i", 2.0), ("n", "j", 2.04)],
            Some(s),
        );
        assert_eq!(s.of("route-compare").pairs.len(), 1);
        assert!((ratios(&s) - 2.0).abs() < 1e-6, "{s:?}");
    }
}
