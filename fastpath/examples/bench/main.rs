//! `cargo xtask bench`: ns/packet of datapath paths through BPF_PROG_TEST_RUN, next to the
//! empty-program floor measured in the same run.
//!
//! Method: the fixture cases are the benchmark cases (same input, same seeded maps), so each
//! repeat takes the path the fixture table checks (nothing rewrites the packet, so repeats see
//! the same bytes). Every round runs every configuration once (A B C … A B C …), after one
//! discarded warm-up round; the kernel reports the mean ns/run over `repeat` runs, and we
//! report the median over rounds with the min–max spread. "Over floor" is the median of the
//! per-round differences (case minus floor in the same round), which cancels drift between
//! rounds.
//!
//! The conntrack event drain is measured differently: events/s through the ring to a
//! subscriber, with a producer thread and the daemon's drain running concurrently (see
//! `bench_ct_drain`).
//!
//! The load-balancer comparison (`lb_compare`) runs the real daemon and its competitors in
//! network namespaces and measures them with wrk; see that module.
//!
//! Routing (`route_compare`) and a two-node VXLAN overlay (`overlay_compare`) compare
//! fastpath with the kernel's own forwarding and vxlan devices, side by side in one run.
//!
//! HA replication (`ha`) makes 100k load-balanced connections through node A of a sync pair
//! and measures their replication to node B; see that module.
//!
//! Writes docs/bench/datapath.json and docs/bench/ha.json, the plots docs/bench/*.svg, and
//! the generated blocks of docs/BENCHMARKS.md (see `report`: the prose around them is written
//! by hand and kept). Every comparison is measured side by side in one run; a committed report
//! is a snapshot of the runs that measured its sections, each section's commit and date
//! recorded, not a bound later runs are held to.
//!
//! `bench` measures every section; `bench quick` the per-packet paths and a short
//! load-balancer comparison; `bench SECTION` one section (see [`SECTIONS`]), keeping the other
//! sections' committed results; `--old-object PATH` also times the per-packet paths of another
//! build of the datapath (with the `bench` feature), interleaved with this tree's;
//! `--katran-object PATH` also times Katran's XDP load balancer beside the LB rows among 1k and
//! 1M connections (see `katran`); `bench --render` regenerates the report from the JSON alone.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test code: a panic, with its message, is how a test fails"
)]

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use fastpath::{
    conntrack::monotonic_ns,
    ct_events::{self, EventHub, RecordSource as _, decode},
    ct_gc::{self, GcStats},
    datapath::{CtEventRing, CtTable, open_ct_events_pin},
    testkit::{
        cases::parser_cases,
        enter_fresh_netns,
        fixture::{Case, Fixture, Seed},
        netns::{PREFIX, example_fastpath_bin, sweep_stale},
        packet::{Pkt, tcp_flags},
        route_cases::{ROUTE_NETNS_SETUP, RouteIfaces, route_cases},
    },
};
use fastpath_common::{
    Hook,
    bench::CT_EVENTS_PER_RUN,
    ct::{CtEvent, DEFAULT_TIMEOUTS_S, IFACE_F_CT_XDP, ct_event, ct_stat},
    map_names,
};
use plot::{Bar, Figure, embed};
use report::{cell, stats};
use serde::{Deserialize, Serialize};
use tokio::{
    io::{Interest, unix::AsyncFd},
    sync::broadcast,
};

mod api;
mod ha;
mod ha_mesh;
mod katran;
mod lb_compare;
mod lb_sweep;
mod overlay_compare;
mod plot;
mod report;
mod route_compare;
mod table_kinds;

/// Runs per BPF_PROG_TEST_RUN call (the kernel loops in-kernel and reports the mean).
const REPEAT: u32 = 1_000_000;
/// Measured rounds (after one warm-up round).
const ROUNDS: usize = 21;
/// The acceptance bound for parse-only paths: floor + this many ns.
const PARSE_BUDGET_NS: f64 = 15.0;

/// (case name, what the row shows). Parse-only paths: no stage claims these packets yet.
const BENCH_CASES: &[(&str, &str)] = &[
    ("xdp_plain_ipv4_tcp", "parse: Ethernet + IPv4 + TCP"),
    ("xdp_plain_ipv6_tcp", "parse: Ethernet + IPv6 + TCP"),
    ("xdp_qinq_ipv4_udp", "parse: QinQ (2 tags) + IPv4 + UDP"),
    (
        "xdp_ipv6_ext_chain_4_tcp",
        "parse: IPv6 + 4 extension headers + TCP",
    ),
    ("xdp_arp_request", "parse: ARP → kernel"),
    (
        "tc_ingress_vlan_ipv4_tcp",
        "parse (TC ingress): VLAN + IPv4 + TCP",
    ),
];

#[derive(Default, Serialize, Deserialize)]
struct Row {
    case: String,
    what: String,
    hook: String,
    frame_bytes: usize,
    median_ns: f64,
    min_ns: f64,
    max_ns: f64,
    floor_median_ns: f64,
    over_floor_ns: f64,
    budget_ns: f64,
    within_budget: bool,
}

#[derive(Default, Serialize, Deserialize)]
struct FloorRow {
    hook: String,
    median_ns: f64,
    min_ns: f64,
    max_ns: f64,
}

/// One conntrack measurement at one table size.
#[derive(Clone, Default, Serialize, Deserialize)]
struct CtRow {
    path: String,
    /// Conntrack entries when the measurement starts.
    table_entries: u32,
    /// LB rows: backends of the service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    backends: Option<usize>,
    median_ns: f64,
    /// The mean: what sets a rate (a few slow runs, such as an allocator refilling its
    /// cache, move it and leave the median).
    #[serde(default)]
    mean_ns: f64,
    min_ns: f64,
    max_ns: f64,
    floor_median_ns: f64,
    over_floor_ns: f64,
    /// The old object's rows (`--old-object`): this tree's ns ÷ the old object's, median
    /// (min–max) over rounds measured through both.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    new_over_old: Option<(f64, f64, f64)>,
}

/// Cost of one expiry pass over the table (nothing expired: the walk itself).
#[derive(Default, Serialize, Deserialize)]
struct GcRow {
    table_entries: u32,
    /// What the entries are.
    shape: String,
    median_ms: f64,
    min_ms: f64,
    max_ms: f64,
}

#[derive(Default, Serialize, Deserialize)]
struct Report {
    generated_by: String,
    /// The last section's run.
    machine: Machine,
    /// Each section's run (`bench SECTION` re-measures one).
    #[serde(default)]
    measured: BTreeMap<String, Machine>,
    repeat_per_call: u32,
    rounds: usize,
    floors: Vec<FloorRow>,
    rows: Vec<Row>,
    conntrack: Vec<CtRow>,
    conntrack_gc: Vec<GcRow>,
    /// The conntrack hash beside an open-addressed table (`table_kinds`).
    #[serde(default)]
    table_kinds: Vec<table_kinds::KindRow>,
    /// The L3 stage's ns/packet at FIB sizes.
    #[serde(default)]
    route_paths: Vec<CtRow>,
    /// VXLAN encapsulation and decapsulation, ns/packet.
    #[serde(default)]
    vxlan_paths: Vec<CtRow>,
    conntrack_drain: DrainReport,
    service_updates: Vec<UpdateRow>,
    api_changes: api::ApiReport,
    lb_compare: lb_compare::CompareReport,
    #[serde(default)]
    lb_sweep: lb_sweep::SweepReport,
    route_compare: route_compare::RouteReport,
    overlay_compare: overlay_compare::OverlayReport,
    /// Written to its own file, docs/bench/ha.json.
    #[serde(skip)]
    ha: ha::HaReport,
    #[serde(default)]
    ha_mesh: ha_mesh::MeshReport,
    /// The object `--old-object` named, when the parse section timed one beside this tree's.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    old_object: String,
    /// The parse-only paths of the old object against this tree's, in the same rounds.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    old_vs_new: Vec<ObjectRow>,
    /// The old object's rows of `conntrack`, `route_paths` and `vxlan_paths`, each timed
    /// interleaved with this tree's (same paths, same order).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    old_conntrack: Vec<CtRow>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    old_route_paths: Vec<CtRow>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    old_vxlan_paths: Vec<CtRow>,
    /// Katran's rows (`--katran-object`), timed in the same rounds as the LB rows among 1k
    /// and 1M connections, and the Katran source the object was built from.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    katran: Vec<CtRow>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    katran_source: String,
}

/// One parse-only path timed through two builds of the datapath in the same rounds.
#[derive(Default, Serialize, Deserialize)]
struct ObjectRow {
    what: String,
    hook: String,
    new_median_ns: f64,
    old_median_ns: f64,
    /// Per-round new ÷ old: median, min, max.
    new_over_old: (f64, f64, f64),
    new_over_floor_ns: f64,
    old_over_floor_ns: f64,
}

/// Time from an `apply_services` call to the datapath using the result (the call returns
/// after the service's value write, which the next packet sees).
#[derive(Default, Serialize, Deserialize)]
struct UpdateRow {
    what: String,
    services_in_datapath: usize,
    samples: usize,
    p50_us: f64,
    p99_us: f64,
    max_us: f64,
    target_us: f64,
    met: bool,
}

#[derive(Clone, Default, PartialEq, Serialize, Deserialize)]
struct Machine {
    kernel: String,
    cpu: String,
    cpus: usize,
    commit: String,
    date: String,
}

/// One measured configuration: a case, or the floor program of a hook kind on the same frame.
struct Config<'a> {
    case: &'a Case,
    floor: bool,
    samples: Vec<f64>,
}

/// The sections, in the order a full run measures them. `bench SECTION` (or
/// `bench --only SECTION`) re-measures one and keeps the others' committed results.
const SECTIONS: &[(&str, &str)] = &[
    (
        "parse",
        "ns/packet of the parse-only paths and the empty-program floors",
    ),
    (
        "conntrack",
        "CT hit and miss, the LB rows and the expiry pass",
    ),
    ("lb", "only the LB rows of the conntrack table"),
    (
        "table-kinds",
        "a new connection's and an established packet's table work: the conntrack hash beside an open-addressed array and an LRU hash",
    ),
    (
        "route",
        "ns/packet of the L3 stage with 1k and 1M routes in the FIB",
    ),
    (
        "vxlan",
        "ns/packet of VXLAN encapsulation and decapsulation",
    ),
    ("drain", "conntrack events through the ring to a subscriber"),
    ("updates", "apply_services latency at 1 and 10k services"),
    ("api", "config changes through the gRPC API and the CLI"),
    ("lb-compare", "load balancers compared in namespaces"),
    (
        "lb-sweep",
        "the load balancers over 1, 1k, 10k and 100k services",
    ),
    ("route-compare", "routing vs kernel forwarding"),
    (
        "overlay-compare",
        "VXLAN overlay vs the kernel's vxlan devices",
    ),
    ("ha", "100k connections replicated to a peer"),
    (
        "ha-mesh",
        "replication among three nodes; new connections/s with it on and off",
    ),
];

/// One section's results, to put into the [`Report`].
enum Part {
    /// The floors, the rows, and the old object's name and rows when one was timed.
    Parse(Vec<FloorRow>, Vec<Row>, Option<(String, Vec<ObjectRow>)>),
    /// Each object's rows ([`PerObject`]) and this tree's expiry passes.
    Conntrack(PerObject, Vec<GcRow>),
    TableKinds(Vec<table_kinds::KindRow>),
    Lb(PerObject),
    Route(PerObject),
    Vxlan(PerObject),
    Drain(DrainReport),
    Updates(Vec<UpdateRow>),
    Api(api::ApiReport),
    LbCompare(lb_compare::CompareReport),
    LbSweep(lb_sweep::SweepReport),
    RouteCompare(route_compare::RouteReport),
    OverlayCompare(overlay_compare::OverlayReport),
    Ha(ha::HaReport),
    HaMesh(ha_mesh::MeshReport),
}

fn section_names() -> String {
    SECTIONS
        .iter()
        .map(|(name, what)| format!("{name} ({what})"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// What `bench quick` measures: the per-packet paths and a short load-balancer comparison
/// (see [`quick`]).
const QUICK_SECTIONS: &[&str] = &["parse", "conntrack", "route", "vxlan", "lb-compare"];

/// Set by `bench quick`: sections that have a short form (the load-balancer comparison) take
/// it.
static QUICK: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether this is a `bench quick` run.
fn quick() -> bool {
    QUICK.load(Ordering::Relaxed)
}

fn usage() -> String {
    format!(
        "usage: bench [quick | SECTION | --render] [--old-object PATH] [--katran-object PATH]\n\n\
         (nothing)           measure every section (about 30 minutes on 2 CPUs, estimated; each section prints its wall time); rewrite docs/bench/*.json, docs/bench/*.svg and the generated blocks of docs/BENCHMARKS.md\n\
         quick               the per-packet paths ({}) and a short load-balancer comparison (under 10 minutes)\n\
         SECTION             one section (or `--only SECTION`); the other sections' committed results are kept\n\
         --render            regenerate the plots and the report's blocks from docs/bench/*.json alone\n\
         --old-object PATH   also time the parse-only paths of another build of the datapath (fastpath-ebpf built with `--features bench`), interleaved with this tree's in the same rounds\n\
         --katran-object PATH  also time Katran's XDP load balancer (an object built from its source: docs/BENCHMARKS.md, \"Katran\") in the `lb` rows among 1k and 1M connections, in the same rounds; without it the bench times fastpath alone\n\n\
         Sections: {}",
        QUICK_SECTIONS[..QUICK_SECTIONS.len() - 1].join(", "),
        section_names()
    )
}

fn main() -> Result<()> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut old_object = None;
    let mut katran_object = None;
    let mut rest = Vec::new();
    let mut args = std::env::args().skip(1).filter(|a| a != "--");
    while let Some(arg) = args.next() {
        if arg == "--old-object" {
            let path = args.next().with_context(|| {
                format!("--old-object needs the path of an object; {}", usage())
            })?;
            old_object = Some(PathBuf::from(path));
        } else if arg == "--katran-object" {
            let path = args.next().with_context(|| {
                format!(
                    "--katran-object needs the path of Katran's object; {}",
                    usage()
                )
            })?;
            katran_object = Some(PathBuf::from(path));
        } else {
            rest.push(arg);
        }
    }
    let sections: Vec<&str> = match rest.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["--help" | "-h"] => {
            println!("{}", usage());
            return Ok(());
        }
        ["--render"] => {
            let report = Report::load(&root)?;
            write_docs(&root, &report)?;
            return Ok(());
        }
        // `lb` is part of `conntrack`.
        [] => SECTIONS
            .iter()
            .map(|(name, _)| *name)
            .filter(|name| *name != "lb")
            .collect(),
        ["quick"] => {
            QUICK.store(true, Ordering::Relaxed);
            QUICK_SECTIONS.to_vec()
        }
        ["--only", section] | [section] => {
            let Some((name, _)) = SECTIONS.iter().find(|(name, _)| *name == section) else {
                bail!("unknown section {section:?}; {}", usage());
            };
            vec![*name]
        }
        _ => bail!("unknown arguments {rest:?}; {}", usage()),
    };
    let old = match &old_object {
        Some(path) if !sections.iter().any(|s| PER_PACKET_SECTIONS.contains(s)) => bail!(
            "--old-object {} times the per-packet paths ({}): run it with `quick`, one of those sections or a full run",
            path.display(),
            PER_PACKET_SECTIONS.join(", ")
        ),
        Some(path) => Some(OldObject {
            // The file's name in the report (xtask's `--old-rev` names it after the commit).
            name: path
                .file_name()
                .map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned()),
            bytes: fs::read(path).with_context(|| {
                format!(
                    "reading {}; `cargo xtask bench -- quick --old-rev REV` builds the object of a git revision with the benchmark's programs",
                    path.display()
                )
            })?,
        }),
        None => None,
    };
    let katran = match &katran_object {
        Some(path) if !sections.iter().any(|s| ["conntrack", "lb"].contains(s)) => bail!(
            "--katran-object {} times Katran beside the LB rows: run it with `lb`, `conntrack`, `quick` or a full run",
            path.display()
        ),
        Some(path) => Some(katran::KatranObject::read(path)?),
        None => None,
    };
    if std::env::var_os("FP_BENCH_CONTENDERS").is_some() {
        if sections != ["lb-compare"] {
            bail!(
                "FP_BENCH_CONTENDERS is for `bench lb-compare` while developing: other runs measure every contender; unset it"
            );
        }
        let part = measure("lb-compare", None, None)?;
        eprintln!("\nFP_BENCH_CONTENDERS is set: a partial comparison, printed and not written");
        if let Part::LbCompare(r) = &part {
            print!("{}{}", lb_compare::markdown(r), lb_compare::ha_markdown(r));
        }
        return Ok(());
    }
    // Written after every section, over the committed results (if any): a run stopped halfway
    // leaves the sections it measured, each with its commit.
    let mut report = if root.join("docs/bench/datapath.json").exists() {
        Report::load(&root)?
    } else {
        Report::default()
    };
    let started = Instant::now();
    for name in sections {
        let at = Instant::now();
        let machine = machine();
        report.set(name, machine, measure(name, old.as_ref(), katran.as_ref())?);
        if let Some(k) = &katran {
            let rows = k.take_rows();
            if !rows.is_empty() {
                eprintln!("Katran ({}): {} rows", k.name(), rows.len());
                report.katran = rows;
                katran::KATRAN_SOURCE.clone_into(&mut report.katran_source);
            }
        }
        if let Some(o) = old.as_ref().filter(|_| PER_PACKET_SECTIONS.contains(&name)) {
            report.old_object.clone_from(&o.name);
        }
        write_docs(&root, &report)?;
        eprintln!("== {name}: {:.0} s", at.elapsed().as_secs_f64());
    }
    eprintln!("bench: {:.0} s in all", started.elapsed().as_secs_f64());
    Ok(())
}

/// The sections `--old-object` times the old object in.
const PER_PACKET_SECTIONS: &[&str] = &["parse", "conntrack", "lb", "route", "vxlan"];

/// Another build of the datapath, timed beside this tree's (`--old-object`).
struct OldObject {
    name: String,
    bytes: Vec<u8>,
}

impl OldObject {
    fn fixture(&self) -> Result<Fixture> {
        Fixture::with_object(&self.bytes, fastpath::config::DEFAULT_CT_CAPACITY).with_context(|| {
            format!(
                "loading the old object {} (built with the `bench` feature? its maps must have this tree's layouts)",
                self.name
            )
        })
    }
}

/// Measures one section.
fn measure(
    section: &str,
    old: Option<&OldObject>,
    katran: Option<&katran::KatranObject>,
) -> Result<Part> {
    let fixture = || Fixture::new().context("loading the datapath (run as root)");
    let objects = Objects { old, katran };
    eprintln!("== {section}");
    Ok(match section {
        "parse" => {
            let mut old_fx = old.map(OldObject::fixture).transpose()?;
            let (floors, rows, vs) = bench_parse(&mut fixture()?, old_fx.as_mut())?;
            Part::Parse(floors, rows, old.map(|o| (o.name.clone(), vs)))
        }
        "conntrack" => {
            let (rows, gc) = bench_conntrack(&objects)?;
            Part::Conntrack(rows, gc)
        }
        "table-kinds" => Part::TableKinds(table_kinds::bench()?),
        "lb" => Part::Lb(bench_lb(&objects)?),
        "route" => Part::Route(bench_route_paths(&objects)?),
        "vxlan" => Part::Vxlan(bench_vxlan_paths(&objects)?),
        "drain" => Part::Drain(bench_ct_drain(&fixture()?)?),
        "updates" => Part::Updates(bench_service_updates(&mut fixture()?)?),
        "api" => Part::Api(api::run(&daemon_bin_swept()?)?),
        "lb-compare" => Part::LbCompare(lb_compare::run(&daemon_bin_swept()?)?),
        "lb-sweep" => Part::LbSweep(lb_sweep::run(&daemon_bin_swept()?)?),
        "route-compare" => Part::RouteCompare(route_compare::run(&daemon_bin_swept()?)?),
        "overlay-compare" => Part::OverlayCompare(overlay_compare::run(&daemon_bin_swept()?)?),
        "ha" => Part::Ha(ha::run(&daemon_bin_swept()?)?),
        "ha-mesh" => Part::HaMesh(ha_mesh::run(&daemon_bin_swept()?)?),
        other => bail!("unknown section {other:?}; sections: {}", section_names()),
    })
}

impl Report {
    /// The committed results: docs/bench/datapath.json and docs/bench/ha.json.
    fn load(root: &Path) -> Result<Report> {
        let read = |name: &str| -> Result<String> {
            let path = root.join("docs/bench").join(name);
            fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
        };
        let mut report: Report = serde_json::from_str(&read("datapath.json")?)
            .context("parsing docs/bench/datapath.json (written by an older `bench`? run `cargo xtask bench`)")?;
        if report.measured.is_empty() {
            // Written by a full run before sections were recorded: all from that run.
            for (name, _) in SECTIONS {
                report
                    .measured
                    .insert((*name).to_owned(), report.machine.clone());
            }
        }
        report.ha = serde_json::from_str(&read("ha.json")?).context(
            "parsing docs/bench/ha.json (written by an older `bench`? run `cargo xtask bench`)",
        )?;
        Ok(report)
    }

    /// Puts a section's results in, with `machine` as read when its measurement started (the
    /// tree the benchmark was built from: what changes during a long run is not in it).
    fn set(&mut self, section: &str, machine: Machine, part: Part) {
        self.generated_by = "cargo xtask bench".to_owned();
        self.measured.insert(section.to_owned(), machine.clone());
        self.machine = machine;
        match part {
            Part::Parse(floors, rows, old) => {
                self.repeat_per_call = REPEAT;
                self.rounds = ROUNDS;
                self.floors = floors;
                self.rows = rows;
                (self.old_object, self.old_vs_new) = old.unwrap_or_default();
            }
            Part::Conntrack(rows, gc) => {
                self.measured.insert("lb".to_owned(), self.machine.clone());
                (self.conntrack, self.old_conntrack) = this_and_old(rows);
                self.conntrack_gc = gc;
            }
            Part::Lb(rows) => {
                let (rows, old) = this_and_old(rows);
                for (all, rows) in [(&mut self.conntrack, rows), (&mut self.old_conntrack, old)] {
                    all.retain(|r| r.backends.is_none());
                    all.extend(rows);
                }
            }
            Part::Route(rows) => (self.route_paths, self.old_route_paths) = this_and_old(rows),
            Part::Vxlan(rows) => (self.vxlan_paths, self.old_vxlan_paths) = this_and_old(rows),
            Part::TableKinds(k) => self.table_kinds = k,
            Part::Drain(d) => self.conntrack_drain = d,
            Part::Updates(u) => self.service_updates = u,
            Part::Api(a) => self.api_changes = a,
            Part::LbCompare(c) => self.lb_compare = c,
            Part::LbSweep(c) => self.lb_sweep = c,
            Part::RouteCompare(c) => self.route_compare = c,
            Part::OverlayCompare(c) => self.overlay_compare = c,
            Part::Ha(h) => self.ha = h,
            Part::HaMesh(h) => self.ha_mesh = h,
        }
    }
}

/// This tree's rows and the old object's (empty without `--old-object`).
fn this_and_old(rows: PerObject) -> (Vec<CtRow>, Vec<CtRow>) {
    let mut rows = rows.into_iter();
    (
        rows.next().unwrap_or_default(),
        rows.next().unwrap_or_default(),
    )
}

/// Writes the JSON, the plots and the generated blocks of docs/BENCHMARKS.md.
fn write_docs(root: &Path, report: &Report) -> Result<()> {
    let dir = root.join("docs/bench");
    fs::create_dir_all(&dir)?;
    let write = |path: PathBuf, text: &str| {
        fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
    };
    write(
        dir.join("datapath.json"),
        &(serde_json::to_string_pretty(report)? + "\n"),
    )?;
    ha::write_json(&report.ha, &dir.join("ha.json"))?;
    let figures = figures(report);
    // Charts no longer drawn go (a renamed one would linger).
    for entry in fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry?.path();
        let drawn = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| figures.iter().any(|f| f.file == n));
        if path.extension().is_some_and(|e| e == "svg") && !drawn {
            fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
        }
    }
    for f in &figures {
        write(dir.join(&f.file), &f.render()?)?;
    }
    let doc_path = root.join("docs/BENCHMARKS.md");
    let doc = match fs::read_to_string(&doc_path) {
        Ok(doc) => doc,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).with_context(|| format!("reading {}", doc_path.display())),
    };
    write(doc_path, &report::splice(&doc, &blocks(report)))?;
    eprintln!(
        "wrote docs/bench/datapath.json, docs/bench/ha.json, {} charts (docs/bench/*.svg) and the generated blocks of docs/BENCHMARKS.md",
        figures.len()
    );
    Ok(())
}

/// ns/packet of the parse-only paths ([`BENCH_CASES`]) next to the empty-program floors; with
/// `old`, the same paths and floors through the old object too, in the same rounds (each
/// round runs every configuration of both objects once).
fn bench_parse(
    fx: &mut Fixture,
    mut old: Option<&mut Fixture>,
) -> Result<(Vec<FloorRow>, Vec<Row>, Vec<ObjectRow>)> {
    let all = parser_cases();
    let mut picked = Vec::new();
    for (name, what) in BENCH_CASES {
        let Some(case) = all.iter().find(|c| c.name == *name) else {
            let names: Vec<&str> = all.iter().map(|c| c.name.as_str()).collect();
            bail!(
                "benchmark case {name} is not in the fixture table; known: {}",
                names.join(", ")
            );
        };
        picked.push((case, *what));
    }
    // Floors use the first XDP case's and the first TC case's frames.
    let xdp_floor_case = picked
        .iter()
        .find(|(c, _)| c.hook == Hook::Xdp)
        .map(|(c, _)| *c)
        .context("no XDP case")?;
    let tc_floor_case = picked
        .iter()
        .find(|(c, _)| c.hook != Hook::Xdp)
        .map(|(c, _)| *c)
        .context("no TC case")?;

    // Sanity: every picked case passes its fixture check, through each object, before it is
    // timed.
    for (case, _) in &picked {
        fx.evaluate(case)
            .map_err(|e| anyhow::anyhow!("benchmark case fails its fixture check: {e}"))?;
        if let Some(old) = old.as_deref_mut() {
            old.evaluate(case).map_err(|e| {
                anyhow::anyhow!(
                    "benchmark case fails its fixture check through the old object: {e}"
                )
            })?;
        }
    }

    let objects = if old.is_some() { 2 } else { 1 };
    // Per object: the two floors, then the cases.
    let mut configs: Vec<Vec<Config>> = (0..objects)
        .map(|_| {
            let mut c = vec![
                Config {
                    case: xdp_floor_case,
                    floor: true,
                    samples: vec![],
                },
                Config {
                    case: tc_floor_case,
                    floor: true,
                    samples: vec![],
                },
            ];
            c.extend(picked.iter().map(|(case, _)| Config {
                case,
                floor: false,
                samples: vec![],
            }));
            c
        })
        .collect();

    for round in 0..=ROUNDS {
        // Which object goes first rotates round by round.
        for turn in 0..objects {
            let object = (round + turn) % objects;
            let cfgs = &mut configs[object];
            let fx: &mut Fixture = match (object, old.as_deref_mut()) {
                (1, Some(old)) => old,
                _ => &mut *fx,
            };
            for cfg in cfgs.iter_mut() {
                let per_run: Duration = if cfg.floor {
                    fx.run_floor_repeat(cfg.case.hook, &cfg.case.input, REPEAT)?
                        .per_run
                } else {
                    let r = fx.run_repeat(cfg.case, REPEAT)?;
                    if r.verdict != cfg.case.expect_verdict {
                        bail!(
                            "{}: verdict {} during the benchmark, expected {}",
                            cfg.case.name,
                            r.verdict,
                            cfg.case.expect_verdict
                        );
                    }
                    r.per_run
                };
                if round > 0 {
                    cfg.samples.push(per_run.as_nanos() as f64);
                }
            }
        }
        eprint!(".");
    }
    eprintln!();

    let floor_of = |configs: &[Config], hook: Hook| -> Vec<f64> {
        configs
            .iter()
            .find(|c| c.floor && (c.case.hook == Hook::Xdp) == (hook == Hook::Xdp))
            .map(|c| c.samples.clone())
            .unwrap_or_default()
    };
    let rows_of = |configs: &[Config]| -> Vec<Row> {
        configs
            .iter()
            .filter(|c| !c.floor)
            .zip(picked.iter())
            .map(|(cfg, (_, what))| {
                let (median, min, max) = stats(&cfg.samples);
                let floor_samples = floor_of(configs, cfg.case.hook);
                // Paired per round: the machine's speed drifts between rounds (frequency,
                // neighbours), and a case and its floor measured back to back in one round
                // share that state.
                let diffs: Vec<f64> = cfg
                    .samples
                    .iter()
                    .zip(&floor_samples)
                    .map(|(c, f)| c - f)
                    .collect();
                let over = stats(&diffs).0;
                Row {
                    case: cfg.case.name.clone(),
                    what: what.to_string(),
                    hook: cfg.case.hook.name().to_owned(),
                    frame_bytes: cfg.case.input.len(),
                    median_ns: median,
                    min_ns: min,
                    max_ns: max,
                    floor_median_ns: stats(&floor_samples).0,
                    over_floor_ns: over,
                    budget_ns: PARSE_BUDGET_NS,
                    within_budget: over <= PARSE_BUDGET_NS,
                }
            })
            .collect()
    };
    let floors = vec![
        floor_row("xdp", &floor_of(&configs[0], Hook::Xdp)),
        floor_row("tc", &floor_of(&configs[0], Hook::TcIngress)),
    ];
    let rows = rows_of(&configs[0]);
    let mut vs = Vec::new();
    if let [new, old] = &configs[..] {
        let old_rows = rows_of(old);
        for ((n, o), (row, old_row)) in new
            .iter()
            .zip(old)
            .filter(|(n, _)| !n.floor)
            .zip(rows.iter().zip(&old_rows))
        {
            vs.push(ObjectRow {
                what: row.what.clone(),
                hook: row.hook.clone(),
                new_median_ns: row.median_ns,
                old_median_ns: old_row.median_ns,
                new_over_old: stats(&report::round_ratios(&n.samples, &o.samples)),
                new_over_floor_ns: row.over_floor_ns,
                old_over_floor_ns: old_row.over_floor_ns,
            });
        }
    }
    Ok((floors, rows, vs))
}

/// Conntrack table sizes measured.
const CT_SIZES: [u32; 2] = [1_000, 1_000_000];
/// New flows per miss measurement (each runs once: a repeat would hit the entry it made).
const CT_MISS_FLOWS: u16 = 2_000;
const GC_PASSES: usize = 5;

/// The expiry pass table.
fn gc_markdown(rows: &[GcRow]) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "{GC_PASSES} passes per row\n\n| table entries | entries | median ms | min–max ms |\n|---:|---|---:|---:|"
    );
    for g in rows {
        let _ = writeln!(
            md,
            "| {} | {} | {:.1} | {:.1}–{:.1} |",
            g.table_entries, g.shape, g.median_ms, g.min_ms, g.max_ms
        );
    }
    let _ = writeln!(md);
    md
}

/// [`GC_PASSES`] expiry passes over the table as it is (nothing in it expires); the table
/// must hold at least `size` entries.
fn gc_passes(fx: &Fixture, size: u32, shape: &'static str) -> Result<GcRow> {
    let mut table = CtTable::open_pin(&fx.pin_dir().join(map_names::CT))?;
    let (hub, gc_stats) = (EventHub::new(), GcStats::default());
    let mut ms = vec![];
    for _ in 0..GC_PASSES {
        let t = std::time::Instant::now();
        ct_gc::pass(
            &mut table,
            &DEFAULT_TIMEOUTS_S,
            &hub,
            &gc_stats,
            monotonic_ns(),
        );
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let occupancy = gc_stats
        .occupancy
        .load(std::sync::atomic::Ordering::Relaxed);
    if occupancy < u64::from(size) {
        bail!("expiry pass saw {occupancy} entries, expected at least {size}");
    }
    let (median_ms, min_ms, max_ms) = stats(&ms);
    Ok(GcRow {
        table_entries: size,
        shape: shape.to_owned(),
        median_ms,
        min_ms,
        max_ms,
    })
}

/// The row of the conntrack table's lookup alone (`bench_ct_lookup`).
const CT_LOOKUP_ROW: &str =
    "its hash lookup alone: the conntrack map's lookup of the CT-hit flow's key";

/// CT hit (an established TCP flow's ACK, repeated) and CT miss + insert (a new UDP flow per
/// run, repeat = 1, against a floor also run with repeat = 1) at each table size, and the
/// expiry pass cost.
fn bench_conntrack(objects: &Objects) -> Result<(PerObject, Vec<GcRow>)> {
    let mut fxs = objects.load()?;
    let seed = Seed::iface(1, IFACE_F_CT_XDP); // BPF_PROG_TEST_RUN runs on loopback (ifindex 1)
    let case = |name: &str, input: Vec<u8>| Case::xdp_to_kernel(name, &seed, input);
    let (a, b) = ([10, 255, 0, 1], [10, 255, 0, 2]);
    let hit = case(
        "ct_hit",
        Pkt::eth().ipv4(a, b).tcp(40000, 80, tcp_flags::ACK).build(),
    );
    let misses: Vec<Case> = (0..CT_MISS_FLOWS)
        .map(|i| case("ct_miss", Pkt::eth().ipv4(a, b).udp(10_000 + i, 53).build()))
        .collect();
    // The hit flow's key, for the lookup alone.
    let v4 = |a: [u8; 4]| {
        let mut w = [0u8; 16];
        w[..4].copy_from_slice(&a);
        w
    };
    let key = fastpath_common::ct::ct_key(4, 6, &v4(a), 40000, &v4(b), 80).0;
    let mut rows = objects.rows();
    let mut gc_rows = Vec::new();
    for size in CT_SIZES {
        for fx in &mut fxs {
            fx.ct_clear()?;
            fx.ct_fill(size, monotonic_ns())?;
            fx.run_repeat(&hit, 1)?; // loose pickup creates the flow; every timed run hits it
            let found = fx.run_ct_lookup_repeat(&key, &hit.input, 1)?.verdict;
            if found != fastpath::testkit::fixture::XDP_PASS {
                bail!(
                    "the conntrack lookup benchmark does not find the CT-hit flow's key (verdict {found})"
                );
            }
        }
        // Per object: (hit, lookup, floor) samples, every object once per round, the first
        // one rotating.
        let mut samples = vec![(vec![], vec![], vec![]); fxs.len()];
        let objects = fxs.len();
        for round in 0..ROUNDS {
            for turn in 0..objects {
                let object = (round + turn) % objects;
                let (fx, (hit_ns, lookup_ns, floor)) = (&mut fxs[object], &mut samples[object]);
                floor.push(
                    fx.run_floor_repeat(Hook::Xdp, &hit.input, REPEAT)?
                        .per_run
                        .as_nanos() as f64,
                );
                hit_ns.push(fx.run_repeat(&hit, REPEAT)?.per_run.as_nanos() as f64);
                lookup_ns.push(
                    fx.run_ct_lookup_repeat(&key, &hit.input, REPEAT)?
                        .per_run
                        .as_nanos() as f64,
                );
            }
        }
        for (out, (hit_ns, lookup_ns, floor)) in rows.iter_mut().zip(&samples) {
            out.push(ct_row("CT hit: established TCP flow", size, hit_ns, floor));
            out.push(ct_row(CT_LOOKUP_ROW, size, lookup_ns, floor));
        }
        if let [(new_hit, new_lookup, _), (old_hit, old_lookup, _)] = &samples[..] {
            let old = &mut rows[1];
            let at = old.len() - 2;
            old[at].new_over_old = Some(stats(&report::round_ratios(new_hit, old_hit)));
            old[at + 1].new_over_old = Some(stats(&report::round_ratios(new_lookup, old_lookup)));
        }
        let timed = time_once_each(&mut fxs, "CT miss + insert", misses.iter())?;
        push_rows(
            &mut rows,
            "CT miss + insert: new UDP flow (repeat = 1)",
            size,
            None,
            &timed,
        );

        // The expiry pass is the daemon's: timed with this tree's object only.
        let fx = &mut fxs[0];
        gc_rows.push(gc_passes(fx, size, "plain connections")?);
        // The load balancer's shape: half the entries are aliases, each checked against its
        // connection.
        fx.ct_clear()?;
        fx.ct_fill_lb(size, monotonic_ns())?;
        gc_rows.push(gc_passes(
            fx,
            size,
            "load-balanced: connections and their aliases",
        )?);
        eprint!("c");
    }
    drop(fxs);
    for (out, lb) in rows.iter_mut().zip(bench_lb(objects)?) {
        out.extend(lb);
    }
    Ok((rows, gc_rows))
}

/// Routes added to the FIB for the routing rows (beside the cases' own handful).
const ROUTE_SIZES: [u32; 3] = [0, 1_000, 1_000_000];
/// The routing cases timed (`testkit::route_cases`): (case, what the row shows).
const ROUTE_CASES: &[(&str, &str)] = &[
    (
        "xdp_route_v4_via_a_gateway",
        "route at XDP: IPv4 via a gateway",
    ),
    (
        "xdp_route_v6_via_a_gateway",
        "route at XDP: IPv6 via a gateway",
    ),
    (
        "tc_ingress_route_v4_at_tc",
        "route at TC ingress: IPv4 via a gateway",
    ),
];

/// The L3 stage: the routing cases in a namespace prepared by `ROUTE_NETNS_SETUP` (the
/// datapath asks that namespace's FIB), with 0, 1k and 1M more IPv4 routes (/32s in
/// 10.16.0.0/12 via the cases' gateway). A routed packet comes out rewritten (MACs, TTL), so
/// each run is one run ([`time_once_each`], [`LB_RUNS`] of them, each after the floor also run
/// once), like the LB rows.
fn bench_route_paths(objects: &Objects) -> Result<PerObject> {
    thread::scope(|scope| {
        scope
            .spawn(|| -> Result<PerObject> {
                enter_fresh_netns(ROUTE_NETNS_SETUP);
                let ifindex = |name: &str| {
                    fastpath::sys::ifindex(name)
                        .with_context(|| format!("no {name} in the namespace"))
                };
                let all = route_cases(RouteIfaces {
                    r0: ifindex("r0")?,
                    r1: ifindex("r1")?,
                    r2: ifindex("r2")?,
                });
                let mut picked = Vec::new();
                for (name, what) in ROUTE_CASES {
                    let case = all.iter().find(|c| c.name == *name).with_context(|| {
                        format!("routing case {name} is not in the fixture table")
                    })?;
                    picked.push((case, *what));
                }
                let mut fxs = objects.load()?;
                let mut rows = objects.rows();
                let mut routes = 0;
                for size in ROUTE_SIZES {
                    add_routes(routes, size)?;
                    routes = size;
                    for (case, what) in &picked {
                        // Seeds the maps and checks the case still routes as its table says.
                        for fx in &mut fxs {
                            fx.evaluate(case)
                                .map_err(|e| anyhow::anyhow!("{what}, {size} routes: {e}"))?;
                        }
                        // A flow's later packets: the route cache's answer.
                        let path = format!("{what}, cached (repeat = 1)");
                        let timed =
                            time_once_each(&mut fxs, &path, std::iter::repeat_n(*case, LB_RUNS))?;
                        push_rows(&mut rows, &path, size, None, &timed);
                        // A flow's first packet after a change: a new generation before each run, so
                        // each asks the FIB and caches its answer.
                        let path = format!("{what}, FIB lookup (new generation; repeat = 1)");
                        let timed = time_once_each_after(
                            &mut fxs,
                            &path,
                            std::iter::repeat_n(*case, LB_RUNS),
                            |fx| Ok(fx.bump_generation()?),
                        )?;
                        push_rows(&mut rows, &path, size, None, &timed);
                    }
                    eprint!("r");
                }
                Ok(rows)
            })
            .join()
            .map_err(|_| anyhow::anyhow!("the routing benchmark's thread panicked"))?
    })
}

/// VXLAN in the fast path: the fixture overlay of `testkit::vxlan_cases` (the thread becomes
/// its node; an IPv4 underlay) and the frames kept in `tests/fixtures/vxlan/`, at XDP and at
/// TC ingress. Decapsulation: the remote's encapsulated datagram arriving on the underlay,
/// checked once to come out as the kernel's routed frame. Encapsulation: the pod's datagram
/// arriving on `n0`, after the underlay's TC egress learned the headers from the kernel's
/// frame, checked to be forwarded as an encapsulation. Both rewrite the frame, so each run is
/// one run ([`time_once_each`]).
fn bench_vxlan_paths(objects: &Objects) -> Result<PerObject> {
    use fastpath::testkit::{
        fixture::{CounterDelta, raw_verdict},
        vxlan_cases::{Captures, Overlay, Underlay, node_seed},
    };
    use fastpath_common::{Verdict, reason};
    thread::scope(|scope| {
        scope.spawn(|| -> Result<PerObject> {
        let overlay = Overlay::build(Underlay::V4);
        let kept = Captures::load(Underlay::V4)
            .map_err(|e| anyhow::anyhow!("reading the VXLAN fixture frames: {e}"))?;
        let ifindex = |name: &str| {
            fastpath::sys::ifindex(name).with_context(|| format!("no {name} in the node"))
        };
        let (n0, und0) = (ifindex("n0")?, ifindex("und0")?);
        let mut rows = objects.rows();
        for (hook, at) in [(Hook::Xdp, "XDP"), (Hook::TcIngress, "TC ingress")] {
            let mut fxs = objects.load()?;
            let seed = node_seed(hook, &overlay);
            let case = |name: &str, hook: Hook, verdict: Verdict, input: &[u8], on: u32| Case {
                name: name.into(),
                hook,
                seed: seed.clone(),
                expect_verdict: raw_verdict(hook, verdict),
                expect_output: None,
                expect_counters: Vec::new(),
                input: input.to_vec(),
                arrives_on: Some(on),
            };
            let decap = Case {
                expect_output: Some(kept.decap_out.clone()),
                expect_counters: vec![CounterDelta::new(
                    hook,
                    Verdict::Forward,
                    reason::VXLAN_DECAP,
                    1,
                    kept.decap_in.len() as u64,
                )],
                ..case("decap", hook, Verdict::Forward, &kept.decap_in, und0)
            };
            for fx in &mut fxs {
                fx.evaluate(&decap)
                    .map_err(|e| anyhow::anyhow!("VXLAN decapsulation at {at}: {e}"))?;
            }
            let path = format!("VXLAN decapsulation at {at} (repeat = 1)");
            let timed = time_once_each(&mut fxs, &path, std::iter::repeat_n(&decap, LB_RUNS))?;
            push_rows(&mut rows, &path, 1, None, &timed);
            // The kernel's frame leaving the underlay teaches the headers.
            let learn = case(
                "learn",
                Hook::TcEgress,
                Verdict::Kernel,
                &kept.encap_out,
                und0,
            );
            let encap = case("encap", hook, Verdict::Forward, &kept.encap_in, n0);
            for fx in &mut fxs {
                let learned = fx.run(&learn)?;
                if learned.verdict != learn.expect_verdict {
                    bail!("VXLAN learning at TC egress: verdict {}", learned.verdict);
                }
                let out = fx.run(&encap)?;
                let encapsulated = out
                    .counters
                    .get(hook, Verdict::Forward, reason::VXLAN_ENCAP)
                    .packets;
                if out.verdict != encap.expect_verdict || encapsulated != 1 {
                    bail!(
                        "VXLAN encapsulation at {at}: verdict {}, {encapsulated} counted as encapsulated",
                        out.verdict
                    );
                }
            }
            let path = format!("VXLAN encapsulation at {at} (repeat = 1)");
            let timed = time_once_each(&mut fxs, &path, std::iter::repeat_n(&encap, LB_RUNS))?;
            push_rows(&mut rows, &path, 1, None, &timed);
            eprint!("v");
        }
        drop(overlay);
        Ok(rows)
        })
        .join()
        .map_err(|_| anyhow::anyhow!("the VXLAN benchmark's thread panicked"))?
    })
}

/// Adds the routes `from..to` of the routing rows (10.16.0.0 + i, /32, via 10.2.0.1) to this
/// thread's namespace with one `ip -batch`.
fn add_routes(from: u32, to: u32) -> Result<()> {
    if to <= from {
        return Ok(());
    }
    let mut batch = String::new();
    let base = u32::from(std::net::Ipv4Addr::new(10, 16, 0, 0));
    for i in from..to {
        let _ = writeln!(
            batch,
            "route add {}/32 via 10.2.0.1",
            std::net::Ipv4Addr::from(base + i)
        );
    }
    ip_batch(&batch, &format!("adding routes {from}..{to}"))
}

/// Runs the `ip` commands in `batch` (one a line, without `ip`) in this thread's namespace
/// with one `ip -batch`; `what` says what they do, for the error.
fn ip_batch(batch: &str, what: &str) -> Result<()> {
    let file = std::env::temp_dir().join(format!("fp-bench-ip-batch-{}", std::process::id()));
    fs::write(&file, batch).with_context(|| format!("writing the batch file for {what}"))?;
    let out = Command::new("ip")
        .args(["-batch"])
        .arg(&file)
        .output()
        .context("running ip -batch")?;
    let _ = fs::remove_file(&file);
    if !out.status.success() {
        bail!("ip -batch {what}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// Backend counts of the LB benchmark's one service (Maglev, table auto-sized).
const LB_BACKENDS: [usize; 3] = [1, 16, 1024];
/// Runs per LB measurement: each packet runs once (repeat = 1), against a floor also run once.
const LB_RUNS: usize = 2000;
/// The LB benchmark's VIP (port 80) and client; backends listen on 8080.
const LB_VIP: [u8; 4] = [10, 254, 0, 100];
const LB_CLIENT: [u8; 4] = [10, 253, 0, 1];
/// Ethernet + IPv4 (no options) offsets of the source and destination address and source
/// port in the frames `Pkt` builds.
const IP4_SRC: usize = 14 + 12;
const IP4_DST: usize = 14 + 16;
const L4_SPORT: usize = 14 + 20;
/// The MAC addresses of the LB benchmark's appliance links (see [`LB_NETNS_SETUP`]): `lbc`
/// towards the client, `lbb` towards the backends.
const LB_CLIENT_LINK_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0c, 0];
const LB_BACKEND_LINK_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0c, 1];
/// The client's MAC address, its neighbour entry on `lbc`.
const LB_CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0d, 1];

/// Commands (`ip ...`, `sysctl ...`) that make a fresh network namespace the LB benchmark's
/// appliance: forwarding on; `lbc`, the client's link (10.253.0.254/24, the client
/// 10.253.0.1 resolved), and `lbb`, the backends' link (10.254.0.254/16: every backend, the
/// VIP and the full-NAT source are in it; [`add_lb_neighbours`] resolves the backends), each
/// a veth with its peer up.
const LB_NETNS_SETUP: &[&[&str]] = &[
    &["ip", "link", "set", "lo", "up"],
    &["sysctl", "-qw", "net.ipv4.ip_forward=1"],
    &[
        "ip",
        "link",
        "add",
        "lbc",
        "address",
        "02:00:00:00:0c:00",
        "type",
        "veth",
        "peer",
        "name",
        "lbcp",
    ],
    &[
        "ip",
        "link",
        "add",
        "lbb",
        "address",
        "02:00:00:00:0c:01",
        "type",
        "veth",
        "peer",
        "name",
        "lbbp",
    ],
    &["ip", "link", "set", "lbcp", "up"],
    &["ip", "link", "set", "lbbp", "up"],
    &["ip", "link", "set", "lbc", "up"],
    &["ip", "link", "set", "lbb", "up"],
    &["ip", "addr", "add", "10.253.0.254/24", "dev", "lbc"],
    &["ip", "addr", "add", "10.254.0.254/16", "dev", "lbb"],
    &[
        "ip",
        "neigh",
        "add",
        "10.253.0.1",
        "lladdr",
        "02:00:00:00:0d:01",
        "dev",
        "lbc",
        "nud",
        "permanent",
    ],
];

/// Backend `i` of the LB benchmark's service: 10.254.(1 + i / 250).(1 + i % 250).
fn lb_backend(i: usize) -> [u8; 4] {
    [10, 254, 1 + (i / 250) as u8, 1 + (i % 250) as u8]
}

/// Backend `i`'s MAC address: 02:00:00:fe followed by `i` in two bytes.
fn lb_backend_mac(i: usize) -> [u8; 6] {
    let [hi, lo] = (i as u16).to_be_bytes();
    [0x02, 0, 0, 0xfe, hi, lo]
}

/// Resolves the addresses of the largest service's backends on `lbb` (permanent neighbour
/// entries, so the FIB lookups at XDP find their MAC addresses).
fn add_lb_neighbours() -> Result<()> {
    let mut batch = String::new();
    for i in 0..LB_BACKENDS.into_iter().max().unwrap_or(0) {
        let mac = lb_backend_mac(i).map(|b| format!("{b:02x}")).join(":");
        let _ = writeln!(
            batch,
            "neigh add {} lladdr {mac} dev lbb nud permanent",
            std::net::Ipv4Addr::from(lb_backend(i))
        );
    }
    ip_batch(&batch, "adding the LB backends' neighbours")
}

/// The LB benchmark's appliance links, by ifindex, in the namespace [`LB_NETNS_SETUP`]
/// prepared.
#[derive(Clone, Copy)]
struct LbLinks {
    client: u32,
    backends: u32,
}

impl LbLinks {
    /// `lbc` and `lbb` of this thread's namespace.
    fn of_this_namespace() -> Result<Self> {
        let ifindex = |name: &str| {
            fastpath::sys::ifindex(name)
                .with_context(|| format!("no {name} in the LB benchmark's namespace"))
        };
        Ok(LbLinks {
            client: ifindex("lbc")?,
            backends: ifindex("lbb")?,
        })
    }

    /// Both links as the daemon configures an appliance's (`route = true`, conntrack and
    /// XDP on): connections tracked and packets routed at XDP, each link with its MAC
    /// address and in the XDP redirect device map; with the `[[service]]` tables `services`.
    fn seed(self, services: &str) -> Seed {
        use fastpath_common::ct::{IFACE_F_ROUTE, IfaceConfig};
        let routed = |mac| IfaceConfig {
            flags: IFACE_F_CT_XDP | IFACE_F_ROUTE,
            mac,
            ..IfaceConfig::default()
        };
        Seed::default()
            .with_iface_config(self.client, routed(LB_CLIENT_LINK_MAC))
            .with_iface_config(self.backends, routed(LB_BACKEND_LINK_MAC))
            .with_tx_ports(&[self.client, self.backends])
            .with_services(services)
    }
}

/// The LB stage at each of [`LB_BACKENDS`]: one service, Maglev (auto-sized table), on an
/// appliance that routes at XDP: this function's thread enters a namespace prepared by
/// [`LB_NETNS_SETUP`], whose FIB the datapath asks. See [`bench_lb_service`].
fn bench_lb(objects: &Objects) -> Result<PerObject> {
    thread::scope(|scope| {
        scope
            .spawn(|| -> Result<PerObject> {
                enter_fresh_netns(LB_NETNS_SETUP);
                // One CPU for every run, as a NIC's receive queue keeps a flow on one: the
                // datapath's per-CPU state (flow cache, shared routes) is what a flow's packets
                // meet there, and a run moved to the other CPU would time a cold copy.
                fastpath::testkit::fixture::pin_to_current_cpu();
                add_lb_neighbours()?;
                let links = LbLinks::of_this_namespace()?;
                let mut rows = objects.rows();
                // Fresh maps: the conntrack rows before leave a cleared table of a million
                // (see below).
                let mut fxs = objects.load()?;
                thread::sleep(Duration::from_secs(1));
                for n in LB_BACKENDS {
                    for fx in &mut fxs {
                        fx.ct_clear()?;
                    }
                    bench_lb_service(&mut fxs, &mut rows, links, n, LbMode::Nat, 0, None)?;
                    eprint!("l");
                }
                // NAT and full-NAT among many connections: the table pre-filled as the load
                // balancer fills it (connections and their aliases).
                for mode in [LbMode::Nat, LbMode::FullNat, LbMode::Dsr] {
                    for size in CT_SIZES {
                        // Fresh maps for each: after a table of a million entries was cleared,
                        // the next 2000 inserts took 6.2 µs each instead of 0.9 (whichever mode
                        // ran next, with no insert failure or port retry counted, and still
                        // after 3 s of rest): the table's allocator was still handing the freed
                        // entries back to the kernel.
                        drop(fxs);
                        fxs = objects.load()?;
                        thread::sleep(Duration::from_secs(1));
                        for fx in &mut fxs {
                            fx.ct_fill_lb(size, monotonic_ns())?;
                        }
                        // Katran beside the NAT rows, with as many flows in its LRU.
                        let mut katran = match objects.katran.filter(|_| mode == LbMode::Nat) {
                            Some(k) => Some(katran::KatranLb::new(
                                k,
                                size,
                                LB_VIP,
                                (0..LB_TABLE_BACKENDS).map(lb_backend).collect(),
                                katran::flow_key(LB_CLIENT, LB_VIP, 40000, 80),
                            )?),
                            None => None,
                        };
                        bench_lb_service(
                            &mut fxs,
                            &mut rows,
                            links,
                            LB_TABLE_BACKENDS,
                            mode,
                            size,
                            katran.as_mut(),
                        )?;
                        eprint!("l");
                    }
                }
                Ok(rows)
            })
            .join()
            .map_err(|_| anyhow::anyhow!("the LB benchmark's thread panicked"))?
    })
}

/// How the LB benchmark's service forwards.
#[derive(Clone, Copy, PartialEq, Eq)]
enum LbMode {
    /// The destination translated (the default).
    Nat,
    /// Source and destination translated: backends answer [`LB_SNAT`].
    FullNat,
    /// Nothing translated: the client's packets go to the backend's MAC address (direct
    /// server return, Katran's mode at L2); the backends answer the client directly.
    Dsr,
}

/// Backends of the service measured among many conntrack entries.
const LB_TABLE_BACKENDS: usize = 16;
/// The full-NAT service's source address.
const LB_SNAT: [u8; 4] = [10, 254, 0, 200];

/// One service on 10.254.0.100:80 with `n` backends, on the appliance `links`: the client's
/// packets arrive on `lbc`, the backends' on `lbb`, and each translated packet is routed at
/// XDP (FIB lookup, then the route cache) and redirected out of the other link. The hit rows:
/// the packets of one established connection, each way, each run once (a translated packet
/// would come back translated on a repeat), with the flow's route cached; the handshake and
/// both hit packets are first checked to come out redirected, translated (to the backend
/// Maglev picked, and back from the VIP) and routed (TTL, the next hop's and the egress
/// link's MAC addresses), byte for byte, and every timed hit to have found the route cache.
/// The new-connection row: `LB_RUNS` SYNs from new source ports, each run once: service
/// lookup, Maglev pick, conntrack insert, translation, route (the backend's, shared by its
/// new connections as the daemon's `FibShape` allows here; the FIB's where none holds),
/// redirect. Direct server
/// return has the client → VIP rows only, each packet checked to come out unchanged but for
/// its MAC addresses (the backend's, from `lbb`'s); its next hop is kept in the connection's
/// entry, which no counter shows (the DSR fixture checks it).
fn bench_lb_service(
    fxs: &mut [Fixture],
    rows: &mut PerObject,
    links: LbLinks,
    n: usize,
    mode: LbMode,
    filled: u32,
    mut katran: Option<&mut katran::KatranLb<'_>>,
) -> Result<()> {
    use fastpath::testkit::fixture::{Outcome, XDP_REDIRECT, hexdump_diff, verdict_name};
    use fastpath_common::route::route_stat;

    // As the daemon's watcher says of this namespace (default rules, no multipath route: new
    // connections to a backend share its route).
    let per_dst = fastpath::fibshape::FibShape::now().per_destination();
    for fx in fxs.iter_mut() {
        fx.set_fib_per_destination(per_dst)?;
    }

    let mut toml = format!(
        "[[service]]\nvip = \"{}\"\nport = 80\n",
        std::net::Ipv4Addr::from(LB_VIP)
    );
    if mode == LbMode::FullNat {
        let _ = writeln!(
            toml,
            "mode = \"full_nat\"\nsnat_address = \"{}\"",
            std::net::Ipv4Addr::from(LB_SNAT)
        );
    } else if mode == LbMode::Dsr {
        let _ = writeln!(toml, "mode = \"dsr\"");
    }
    for i in 0..n {
        let _ = write!(
            toml,
            "[[service.backend]]\naddress = \"{}\"\nport = {}\n",
            std::net::Ipv4Addr::from(lb_backend(i)),
            // Direct server return leaves the port as it is: backends listen on the VIP's.
            if mode == LbMode::Dsr { 80 } else { 8080 }
        );
    }
    let seed = links.seed(&toml);
    let case = |input: Vec<u8>, arrives_on: u32| Case {
        name: format!("lb_{n}_backends"),
        hook: Hook::Xdp,
        seed: seed.clone(),
        input,
        arrives_on: Some(arrives_on),
        expect_verdict: XDP_REDIRECT,
        expect_output: None,
        expect_counters: Vec::new(),
    };
    // The client's packets to the VIP, sent to the appliance's MAC address on `lbc`.
    let to_vip = |sport, flags| {
        case(
            Pkt::eth()
                .macs(LB_CLIENT_LINK_MAC, LB_CLIENT_MAC)
                .ipv4(LB_CLIENT, LB_VIP)
                .tcp(sport, 80, flags)
                .build(),
            links.client,
        )
    };
    // Backend `b`'s packets, on `lbb`, to the client (NAT) or to the source full-NAT gave
    // the connection.
    let from_backend = |b: usize, (to, port): ([u8; 4], u16), flags| {
        case(
            Pkt::eth()
                .macs(LB_BACKEND_LINK_MAC, lb_backend_mac(b))
                .ipv4(lb_backend(b), to)
                .tcp(8080, port, flags)
                .build(),
            links.backends,
        )
    };
    // What leaves the appliance: translated, TTL 64 → 63, from the egress link's MAC address
    // to the next hop's. To backend `b` from `from` (the client, or full-NAT's source) ...
    let to_backend_out = |b: usize, (from, sport): ([u8; 4], u16), flags| {
        Pkt::eth()
            .macs(lb_backend_mac(b), LB_BACKEND_LINK_MAC)
            .ipv4(from, lb_backend(b))
            .ttl(63)
            .tcp(sport, 8080, flags)
            .build()
    };
    // Direct server return: the client's packet as it came, to backend `b`'s MAC address.
    let dsr_out = |b: usize, flags| {
        Pkt::eth()
            .macs(lb_backend_mac(b), LB_BACKEND_LINK_MAC)
            .ipv4(LB_CLIENT, LB_VIP)
            .tcp(40000, 80, flags)
            .build()
    };
    // ... and to the client from the VIP.
    let to_client_out = |flags| {
        Pkt::eth()
            .macs(LB_CLIENT_MAC, LB_CLIENT_LINK_MAC)
            .ipv4(LB_VIP, LB_CLIENT)
            .ttl(63)
            .tcp(80, 40000, flags)
            .build()
    };
    let what = format!(
        "{}{n} backend{}, Maglev {} slots{}",
        match mode {
            LbMode::Nat => "",
            LbMode::FullNat => "full-NAT, ",
            LbMode::Dsr => "DSR, ",
        },
        if n == 1 { "" } else { "s" },
        fastpath::maglev::auto_size(n),
        if filled > 0 {
            format!(", {filled} conntrack entries")
        } else {
            String::new()
        }
    );
    let field = |frame: &[u8], at: usize, len: usize| frame.get(at..at + len).map(<[u8]>::to_vec);
    // A run that did not come out redirected as `want` is a benchmark of something else.
    let routed = |step: &str, out: &Outcome, want: &[u8]| -> Result<()> {
        if out.verdict != XDP_REDIRECT || out.output != want {
            bail!(
                "LB benchmark ({what}): {step}: expected XDP_REDIRECT and the frame translated and routed, got {}; expected vs got:\n{}",
                verdict_name(Hook::Xdp, out.verdict),
                hexdump_diff(want, &out.output)
            );
        }
        Ok(())
    };

    // Per object: the connection's handshake through the load balancer, to the backend
    // Maglev picks, and the packets of the connection each way, checked once to come out
    // translated and routed.
    let mut hits: Vec<[Case; 2]> = Vec::new();
    for fx in fxs.iter_mut() {
        // Seeded once, by the SYN's run: the runs after it leave the maps alone (see
        // `Fixture::rerun`), as re-seeding a thousand backends between them would evict the
        // caches the datapath runs from, and would empty the route cache.
        let syn = fx.run(&to_vip(40000, tcp_flags::SYN))?;
        // The backend Maglev picked: the one the SYN is addressed to, or (direct server
        // return) the one whose MAC address it went to.
        let picked = if mode == LbMode::Dsr {
            field(&syn.output, 0, 6)
                .and_then(|m| (0..n).position(|i| lb_backend_mac(i)[..] == m[..]))
        } else {
            field(&syn.output, IP4_DST, 4)
                .and_then(|a| (0..n).position(|i| lb_backend(i)[..] == a[..]))
        };
        let Some(b) = picked else {
            bail!(
                "LB benchmark ({what}): the SYN to the VIP did not come out to a backend (its address; its MAC address for DSR); verdict {}, output {:02x?}",
                verdict_name(Hook::Xdp, syn.verdict),
                syn.output
            );
        };
        if mode == LbMode::Dsr {
            routed("the SYN to the VIP", &syn, &dsr_out(b, tcp_flags::SYN))?;
            let ack = to_vip(40000, tcp_flags::ACK);
            routed(
                "an established connection's packet to the VIP",
                &fx.rerun(&ack)?,
                &dsr_out(b, tcp_flags::ACK),
            )?;
            hits.push([ack.clone(), ack]);
            continue;
        }
        // Where the backend's replies go: the client, or the address and port full-NAT chose
        // (the source of what reaches the backend either way).
        let reply_to = match mode {
            LbMode::Nat | LbMode::Dsr => (LB_CLIENT, 40000),
            LbMode::FullNat => {
                let src = field(&syn.output, IP4_SRC, 4).and_then(|a| <[u8; 4]>::try_from(a).ok());
                let sport = field(&syn.output, L4_SPORT, 2)
                    .and_then(|p| <[u8; 2]>::try_from(p).ok())
                    .map(u16::from_be_bytes);
                match (src, sport) {
                    (Some(a), Some(p)) if a == LB_SNAT => (a, p),
                    _ => bail!(
                        "LB benchmark ({what}): the SYN did not come out from the full-NAT address {LB_SNAT:?}; output {:02x?}",
                        syn.output
                    ),
                }
            }
        };
        routed(
            "the SYN to the VIP",
            &syn,
            &to_backend_out(b, reply_to, tcp_flags::SYN),
        )?;
        let syn_ack = from_backend(b, reply_to, tcp_flags::SYN | tcp_flags::ACK);
        routed(
            "the backend's SYN-ACK",
            &fx.rerun(&syn_ack)?,
            &to_client_out(tcp_flags::SYN | tcp_flags::ACK),
        )?;
        let pair = [
            to_vip(40000, tcp_flags::ACK),
            from_backend(b, reply_to, tcp_flags::ACK),
        ];
        for (c, step, want) in [
            (
                &pair[0],
                "an established connection's packet to the VIP",
                to_backend_out(b, reply_to, tcp_flags::ACK),
            ),
            (
                &pair[1],
                "an established connection's packet from the backend",
                to_client_out(tcp_flags::ACK),
            ),
        ] {
            routed(step, &fx.rerun(c)?, &want)?;
        }
        hits.push(pair);
    }
    let route_stat = |fx: &Fixture, slot: u32| -> Result<u64> {
        Ok(fx
            .route_stats()?
            .get(slot as usize)
            .copied()
            .unwrap_or_default())
    };
    let dsr = mode == LbMode::Dsr;
    let hit_paths: &[&str] = if dsr {
        &["LB hit: client → VIP, direct server return (the backend's MAC address) at XDP"]
    } else {
        &[
            "LB hit: client → VIP, translated to the backend, routed at XDP",
            "LB hit: backend → client, translated back to the VIP, routed at XDP",
        ]
    };
    for (dir, path) in hit_paths.iter().enumerate() {
        let path = format!("{path} ({what}, repeat = 1)");
        // The flow's route learned afresh (a new generation, then one run) so that no timed
        // run finds it expired: a flow's later packets take the route cache's answer.
        let mut hits_before = Vec::new();
        for (fx, pair) in fxs.iter_mut().zip(&hits) {
            fx.bump_generation()?;
            fx.rerun(&pair[dir])?;
            hits_before.push(route_stat(fx, route_stat::HIT)?);
        }
        // Katran beside client → VIP: the same packet, an LRU hit.
        let timed = time_with_katran(
            fxs,
            &path,
            LB_RUNS,
            |o, _| &hits[o][dir],
            katran.as_deref_mut().filter(|_| dir == 0),
            katran::Row::Hit,
        )?;
        for (fx, before) in fxs.iter().zip(hits_before) {
            let cached = route_stat(fx, route_stat::HIT)? - before;
            if !dsr && cached != LB_RUNS as u64 {
                bail!(
                    "{path}: expected all {LB_RUNS} runs to take the route cache's answer, {cached} did"
                );
            }
        }
        push_rows(rows, &path, filled.max(1), Some(n), &timed);
    }

    // New connections: one SYN per source port, each picked by Maglev, inserted, and routed
    // by its backend's route (shared by the backend's new connections, as the daemon allows
    // in this namespace: see `bench_lb_service`), asked of the FIB where none holds.
    let path = if dsr {
        format!(
            "LB new connection: SYN → VIP, Maglev pick + conntrack insert + the backend's route, direct server return at XDP ({what}, {LB_RUNS} connections, repeat = 1)"
        )
    } else {
        format!(
            "LB new connection: SYN → VIP, Maglev pick + conntrack insert + translation + the backend's route, routed at XDP ({what}, {LB_RUNS} connections, repeat = 1)"
        )
    };
    let syns: Vec<Case> = (0..LB_RUNS as u16)
        .map(|i| to_vip(20_000 + i, tcp_flags::SYN))
        .collect();
    let routed = |fx: &Fixture| -> Result<u64> {
        Ok(route_stat(fx, route_stat::MISS)? + route_stat(fx, route_stat::HIT)?)
    };
    let mut before = Vec::new();
    for fx in fxs.iter() {
        before.push((fx.ct_entries()?.len(), routed(fx)?));
    }
    let timed = time_with_katran(
        fxs,
        &path,
        syns.len(),
        |_, i| &syns[i],
        katran,
        katran::Row::NewConnection,
    )?;
    for (fx, (entries, routed_before)) in fxs.iter().zip(&before) {
        let added = fx.ct_entries()?.len() - entries;
        let routed = routed(fx)? - routed_before;
        // Direct server return routes by itself (no route counter).
        if added < LB_RUNS || (!dsr && routed != LB_RUNS as u64) {
            bail!(
                "{path}: expected {LB_RUNS} conntrack entries added and {LB_RUNS} packets routed for {LB_RUNS} new connections, got {added} entries and {routed} routed"
            );
        }
    }
    push_rows(rows, &path, before[0].0 as u32, Some(n), &timed);
    Ok(())
}

/// [`time_interleaved`] with Katran beside when given: checked once on run 0's frame (see
/// `katran::KatranLb::check`), then timed on each run's frame in the same rotation, its samples
/// made into a Katran row (`row`) and left out of the result.
fn time_with_katran<'c>(
    fxs: &mut [Fixture],
    path: &str,
    runs: usize,
    case_of: impl Fn(usize, usize) -> &'c Case,
    katran: Option<&mut katran::KatranLb<'_>>,
    row: katran::Row,
) -> Result<Timed> {
    let Some(k) = katran else {
        return time_interleaved(fxs, path, runs, case_of, |_| Ok(()));
    };
    k.check(row, &case_of(0, 0).input)?;
    let frames = |run: usize| case_of(0, run).input.as_slice();
    let beside = katran::Beside {
        katran: k.katran(),
        frames: &frames,
    };
    let mut timed = time_interleaved_beside(fxs, path, runs, &case_of, |_| Ok(()), Some(&beside))?;
    if let Some((ns, floor)) = timed.pop() {
        k.push_row(row, runs, &ns, &floor);
    }
    Ok(timed)
}

/// Runs each case once (repeat = 1, maps as they are: see `Fixture::rerun_repeat`) right
/// after the floor program on the same frame, checking its verdict, through every object in
/// turn; returns each object's (case ns, floor ns), paired by index.
fn time_once_each<'a>(
    fxs: &mut [Fixture],
    path: &str,
    cases: impl Iterator<Item = &'a Case>,
) -> Result<Timed> {
    let cases: Vec<&Case> = cases.collect();
    time_interleaved(fxs, path, cases.len(), |_, i| cases[i], |_| Ok(()))
}

/// [`time_once_each`] with `before(fx)` before each pair of runs (untimed).
fn time_once_each_after<'a>(
    fxs: &mut [Fixture],
    path: &str,
    cases: impl Iterator<Item = &'a Case>,
    before: impl FnMut(&mut Fixture) -> Result<()>,
) -> Result<Timed> {
    let cases: Vec<&Case> = cases.collect();
    time_interleaved(fxs, path, cases.len(), |_, i| cases[i], before)
}

/// Per object, (case ns, floor ns) of single runs.
type Timed = Vec<(Vec<f64>, Vec<f64>)>;

/// `runs` single runs of `case_of(object, run)` through every object in turn (run 0 through
/// each object, then run 1, …; which object goes first rotates run by run, so that neither
/// always runs after the other), each right after the floor program on the same frame and
/// `before(fx)` (untimed), checking the verdict.
fn time_interleaved<'c>(
    fxs: &mut [Fixture],
    path: &str,
    runs: usize,
    case_of: impl Fn(usize, usize) -> &'c Case,
    before: impl FnMut(&mut Fixture) -> Result<()>,
) -> Result<Timed> {
    time_interleaved_beside(fxs, path, runs, case_of, before, None)
}

/// [`time_interleaved`] with `beside` (Katran) as one more participant of the rotation, its
/// floor the first object's; its samples come last in the result.
fn time_interleaved_beside<'c>(
    fxs: &mut [Fixture],
    path: &str,
    runs: usize,
    case_of: impl Fn(usize, usize) -> &'c Case,
    mut before: impl FnMut(&mut Fixture) -> Result<()>,
    beside: Option<&katran::Beside<'_, '_>>,
) -> Result<Timed> {
    let objects = fxs.len();
    let participants = objects + usize::from(beside.is_some());
    let mut out: Timed = vec![(Vec::with_capacity(runs), Vec::with_capacity(runs)); participants];
    for run in 0..runs {
        for turn in 0..participants {
            let object = (run + turn) % participants;
            if let Some(b) = beside.filter(|_| object == objects) {
                let (ns, floor) = b.time(&mut fxs[0], run)?;
                out[object].0.push(ns);
                out[object].1.push(floor);
                continue;
            }
            let (fx, (ns, floor)) = (&mut fxs[object], &mut out[object]);
            let c = case_of(object, run);
            before(fx)?;
            floor.push(fx.run_floor_repeat(c.hook, &c.input, 1)?.per_run.as_nanos() as f64);
            let r = fx.rerun_repeat(c, 1)?;
            if r.verdict != c.expect_verdict {
                bail!("{path}: verdict {} during the benchmark", r.verdict);
            }
            ns.push(r.per_run.as_nanos() as f64);
        }
    }
    Ok(out)
}

/// Each object's rows, this tree's first (see [`Objects`]).
type PerObject = Vec<Vec<CtRow>>;

/// Appends one row per object from its [`Timed`] samples.
fn push_rows(rows: &mut PerObject, path: &str, size: u32, backends: Option<usize>, timed: &Timed) {
    for (out, (ns, floor)) in rows.iter_mut().zip(timed) {
        out.push(CtRow {
            backends,
            ..ct_row(path, size, ns, floor)
        });
    }
    if let ([(new, _), (old, _)], [_, old_rows]) = (&timed[..], &mut rows[..])
        && let Some(row) = old_rows.last_mut()
    {
        let medians = |s| report::round_medians(s, SINGLE_RUN_ROUNDS);
        row.new_over_old = Some(stats(&report::round_ratios(&medians(new), &medians(old))));
    }
}

/// Rounds that single runs ([`time_interleaved`]) are cut into to compare two objects: each
/// round's median through one object against the same round's through the other.
const SINGLE_RUN_ROUNDS: usize = 10;

/// The builds of the datapath a per-packet section times, side by side: this tree's, and
/// `--old-object`'s when given.
struct Objects<'a> {
    old: Option<&'a OldObject>,
    /// `--katran-object`: timed beside the LB rows among many connections.
    katran: Option<&'a katran::KatranObject>,
}

impl Objects<'_> {
    /// A fresh fixture of each object, this tree's first.
    fn load(&self) -> Result<Vec<Fixture>> {
        let mut fxs = vec![Fixture::new().context("loading the datapath (run as root)")?];
        if let Some(o) = self.old {
            fxs.push(o.fixture()?);
        }
        Ok(fxs)
    }

    /// An empty row list per object.
    fn rows(&self) -> PerObject {
        vec![Vec::new(); 1 + usize::from(self.old.is_some())]
    }
}

/// Events per drain round: a whole number of producer calls.
const DRAIN_EVENTS: u64 = 8 * 1024 * 1024;
/// Measured rounds of each measurement (after one warm-up round of each).
const DRAIN_ROUNDS: usize = 7;
/// The acceptance target: events/s delivered to one subscriber, with zero loss.
const DRAIN_TARGET_EPS: f64 = 1_000_000.0;
/// Tokio worker threads in the drain rounds: the daemon's (fastpath/src/main.rs).
const DRAIN_WORKERS: usize = 2;
/// Bytes one event takes in the ring: the kernel's 8-byte record header plus the event,
/// rounded up to 8.
const RING_RECORD_BYTES: u64 = (8 + size_of::<CtEvent>() as u64).next_multiple_of(8);

/// Events/s over the measured rounds.
#[derive(Default, Serialize, Deserialize)]
struct RateRow {
    median_events_per_s: f64,
    min_events_per_s: f64,
    max_events_per_s: f64,
}

/// Conntrack event ring drain: events/s delivered to a subscriber, with zero loss.
#[derive(Default, Serialize, Deserialize)]
struct DrainReport {
    events_per_round: u64,
    rounds: usize,
    ring_bytes: u32,
    /// Flow control: produced − delivered never exceeds this (half the ring's records).
    in_flight_limit: u64,
    /// Events per BPF_PROG_TEST_RUN call of the producer (one run per call).
    producer_events_per_call: u32,
    tokio_workers: usize,
    /// Baseline: the producer's own rate, timed alone (the ring is emptied between its
    /// batches, untimed).
    producer_alone: RateRow,
    /// The daemon's path, concurrently with the producer: `ct_events::drain_next` (the
    /// ring's wakeup or the drain timer) → EventHub → one subscriber task.
    delivered: RateRow,
    /// Median over drain rounds of the producer's kernel-measured time per event (inside
    /// BPF_PROG_TEST_RUN: ring reserve, write, submit).
    producer_kernel_ns_per_event: f64,
    /// Median delivered ÷ median producer alone.
    delivered_over_producer: f64,
    target_events_per_s: f64,
    target_met: bool,
    /// Totals over every round (warm-ups included); the benchmark fails unless all are zero.
    events_lost: u64,
    lagged: u64,
    malformed: u64,
    out_of_order: u64,
}

/// What the consumer side saw in one round.
#[derive(Default)]
struct Seen {
    received: u64,
    /// The first event out of sequence: (expected sequence number, the event's).
    out_of_order: Option<(u64, u64)>,
    lagged: u64,
    malformed: u64,
    /// When the last event arrived.
    done: Option<Instant>,
}

impl Seen {
    /// Counts one event, checking it is the next of the producer's sequence
    /// (`fastpath_common::bench`); publishes the count for the producer's flow control.
    fn take(&mut self, ev: &CtEvent, first_seq: u64, delivered: &AtomicU64) {
        let want = first_seq + self.received;
        let in_order = ev.ts_ns == want
            && ev.key.port_lo == want as u16
            && ev.key.port_hi == (want >> 16) as u16
            && ev.kind == ct_event::NEW;
        if !in_order && self.out_of_order.is_none() {
            self.out_of_order = Some((want, ev.ts_ns));
        }
        self.received += 1;
        delivered.store(self.received, Ordering::Release);
    }

    /// Fails unless the round delivered every event, in order, and nothing was lost.
    fn check(&self, what: &str, round: usize, lost_in_ring: u64) -> Result<()> {
        if lost_in_ring != 0 || self.lagged != 0 || self.malformed != 0 {
            bail!(
                "{what}, round {round}: events lost in the ring {lost_in_ring}, lagged {}, malformed {}; with the flow control every one must be zero",
                self.lagged,
                self.malformed
            );
        }
        if self.received != DRAIN_EVENTS {
            bail!(
                "{what}, round {round}: the consumer received {} events, the producer emitted {DRAIN_EVENTS}",
                self.received
            );
        }
        if let Some((want, got)) = self.out_of_order {
            bail!(
                "{what}, round {round}: expected event {want} next, got {got}: events out of order or missing"
            );
        }
        Ok(())
    }
}

/// Ring drain throughput: the producer (`bench_ct_events` through BPF_PROG_TEST_RUN, on this
/// thread) alone, then against the daemon's drain and one subscriber, interleaved round by
/// round. Every round must deliver every event, in order, with nothing lost.
fn bench_ct_drain(fx: &Fixture) -> Result<DrainReport> {
    // Earlier sections left their events in the ring.
    fx.ct_drain_events()?;
    let (mut ring, ring_bytes) = open_ct_events_pin(&fx.pin_dir().join(map_names::CT_EVENTS))?;
    let per_call = u64::from(CT_EVENTS_PER_RUN);
    // Half the ring, in whole producer calls.
    let in_flight_limit = u64::from(ring_bytes) / RING_RECORD_BYTES / 2 / per_call * per_call;
    if !DRAIN_EVENTS.is_multiple_of(per_call) {
        bail!(
            "drain benchmark: producer calls of {per_call} events must divide the round ({DRAIN_EVENTS})"
        );
    }
    if in_flight_limit >= ct_events::BROADCAST_CAPACITY as u64 {
        bail!(
            "drain benchmark: the in-flight limit ({in_flight_limit}) must stay below the broadcast capacity ({}), or the subscriber could lag",
            ct_events::BROADCAST_CAPACITY
        );
    }
    let lost = || -> Result<u64> { Ok(fx.ct_stats()?.0[ct_stat::EVENTS_LOST as usize]) };
    let mut next_seq = 0u64; // FP_BENCH_SEQ starts at 0 in the fixture's fresh maps
    let (mut lost_total, mut alone, mut delivered, mut kernel_ns) = (0, vec![], vec![], vec![]);
    for round in 0..=DRAIN_ROUNDS {
        let before = lost()?;
        let (seen, eps) = producer_alone(fx, &mut ring, next_seq, in_flight_limit)?;
        next_seq += DRAIN_EVENTS;
        let lost_now = lost()? - before;
        seen.check("producer alone", round, lost_now)?;
        lost_total += lost_now;
        if round > 0 {
            alone.push(eps);
        }

        let before = lost()?;
        let (back, seen, r) = drain_round(fx, ring, next_seq, in_flight_limit)?;
        ring = back;
        next_seq += DRAIN_EVENTS;
        let lost_now = lost()? - before;
        seen.check("drain to a subscriber", round, lost_now)?;
        lost_total += lost_now;
        if round > 0 {
            delivered.push(r.events_per_s);
            kernel_ns.push(r.kernel_ns_per_event);
        }
        eprint!("d");
    }
    let rate = |s: &[f64]| {
        let (median, min, max) = stats(s);
        RateRow {
            median_events_per_s: median,
            min_events_per_s: min,
            max_events_per_s: max,
        }
    };
    let (producer_alone, delivered) = (rate(&alone), rate(&delivered));
    Ok(DrainReport {
        events_per_round: DRAIN_EVENTS,
        rounds: DRAIN_ROUNDS,
        ring_bytes,
        in_flight_limit,
        producer_events_per_call: CT_EVENTS_PER_RUN,
        tokio_workers: DRAIN_WORKERS,
        delivered_over_producer: delivered.median_events_per_s / producer_alone.median_events_per_s,
        target_events_per_s: DRAIN_TARGET_EPS,
        target_met: delivered.median_events_per_s >= DRAIN_TARGET_EPS,
        producer_kernel_ns_per_event: stats(&kernel_ns).0,
        producer_alone,
        delivered,
        // Every round passed `Seen::check`, so these are the zeros it verified.
        events_lost: lost_total,
        lagged: 0,
        malformed: 0,
        out_of_order: 0,
    })
}

/// Runs the producer once: one run of `bench_ct_events` per call, because an XDP test run
/// with repeat > 1 swaps the XDP dispatcher in and out around its loop, an RCU grace period
/// each time (16 ms per call on this machine). Returns the kernel-measured time.
fn produce_once(fx: &Fixture) -> Result<Duration> {
    Ok(fx.run_ct_event_producer(1)?.per_run)
}

/// The baseline: `DRAIN_EVENTS` events numbered from `first_seq`, produced in batches of
/// `in_flight_limit` with nothing else running; only the producer calls are timed. Between
/// batches this thread empties the ring (checking every event).
fn producer_alone(
    fx: &Fixture,
    ring: &mut CtEventRing,
    first_seq: u64,
    in_flight_limit: u64,
) -> Result<(Seen, f64)> {
    let (mut seen, delivered) = (Seen::default(), AtomicU64::new(0));
    let (mut produced, mut busy) = (0u64, Duration::ZERO);
    while produced < DRAIN_EVENTS {
        let batch = in_flight_limit.min(DRAIN_EVENTS - produced);
        let start = Instant::now();
        for _ in 0..batch / u64::from(CT_EVENTS_PER_RUN) {
            produce_once(fx)?;
        }
        busy += start.elapsed();
        produced += batch;
        while ring.pop_with(|record| match decode(record) {
            Some(ev) => seen.take(&ev, first_seq, &delivered),
            None => seen.malformed += 1,
        }) {}
    }
    Ok((seen, produced as f64 / busy.as_secs_f64()))
}

/// One round's measurements.
struct DrainRound {
    events_per_s: f64,
    kernel_ns_per_event: f64,
}

/// Produces `DRAIN_EVENTS` events numbered from `first_seq` on this thread while another
/// thread runs the daemon's drain and one subscriber (`to_subscriber`); gives the ring back
/// with what the subscriber saw. Flow control keeps produced − delivered ≤ `in_flight_limit`.
fn drain_round(
    fx: &Fixture,
    ring: CtEventRing,
    first_seq: u64,
    in_flight_limit: u64,
) -> Result<(CtEventRing, Seen, DrainRound)> {
    let delivered = Arc::new(AtomicU64::new(0));
    let d = delivered.clone();
    let consumer = thread::spawn(move || to_subscriber(ring, first_seq, d));
    let per_call = u64::from(CT_EVENTS_PER_RUN);
    let start = Instant::now();
    let (mut produced, mut kernel) = (0u64, Duration::ZERO);
    while produced < DRAIN_EVENTS && !consumer.is_finished() {
        // Events published but not yet received count as in flight too, so the subscriber
        // cannot lag either: the limit is below the broadcast's capacity.
        let mut waits = 0u32;
        while produced + per_call - delivered.load(Ordering::Acquire) > in_flight_limit
            && !consumer.is_finished()
        {
            waits += 1;
            if waits < 64 {
                thread::yield_now();
            } else {
                // Leave the CPU to the consumer (this machine may have fewer CPUs than busy
                // threads here); it has half the ring to work through.
                thread::sleep(Duration::from_micros(20));
            }
        }
        kernel += produce_once(fx)?;
        produced += per_call;
    }
    // A consumer that stopped early (lag, a bad record) reports it through `Seen`.
    let (ring, seen) = consumer
        .join()
        .map_err(|_| anyhow::anyhow!("the drain benchmark's consumer thread panicked"))??;
    let elapsed = seen
        .done
        .map_or(Duration::ZERO, |t| t.saturating_duration_since(start));
    let round = DrainRound {
        events_per_s: seen.received as f64 / elapsed.as_secs_f64(),
        kernel_ns_per_event: kernel.as_nanos() as f64 / produced.max(1) as f64,
    };
    Ok((ring, seen, round))
}

/// The daemon's drain on a runtime like the daemon's: the drain loop in the runtime's main
/// future (as in `daemon::run`), one subscriber task receiving every event.
fn to_subscriber(
    ring: CtEventRing,
    first_seq: u64,
    delivered: Arc<AtomicU64>,
) -> Result<(CtEventRing, Seen)> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(DRAIN_WORKERS)
        .enable_all()
        .build()
        .context("starting the drain benchmark's runtime")?;
    rt.block_on(async move {
        let hub = EventHub::new();
        let mut rx = hub.subscribe();
        let subscriber = tokio::spawn(async move {
            let mut seen = Seen::default();
            while seen.received < DRAIN_EVENTS {
                match rx.recv().await {
                    Ok(ev) => seen.take(&ev, first_seq, &delivered),
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        seen.lagged += n;
                        break;
                    }
                    Err(broadcast::error::RecvError::Closed) => break,
                }
            }
            seen.done = Some(Instant::now());
            seen
        });
        // SAFETY: the RingBuf owns its fd and keeps it open while the AsyncFd owns it.
        let mut ring = unsafe { AsyncFd::register_with_interest(ring, Interest::READABLE) }
            .map_err(|e| anyhow::Error::from(std::io::Error::from(e)))?;
        tokio::pin!(subscriber);
        let mut timer = ct_events::drain_timer(ct_events::DRAIN_EVERY);
        let mut seen = loop {
            tokio::select! {
                seen = &mut subscriber => break seen.context("the subscriber task failed")?,
                drained = ct_events::drain_next(&mut ring, &mut timer, &hub) => {
                    drained.context("waiting for the event ring")?;
                }
            }
        };
        seen.malformed = hub.stats.malformed.load(Ordering::Relaxed);
        Ok((ring.into_inner(), seen))
    })
}

fn ct_row(path: impl Into<String>, size: u32, samples: &[f64], floor: &[f64]) -> CtRow {
    let (median_ns, min_ns, max_ns) = stats(samples);
    let diffs: Vec<f64> = samples.iter().zip(floor).map(|(c, f)| c - f).collect();
    CtRow {
        path: path.into(),
        table_entries: size,
        backends: None,
        median_ns,
        mean_ns: samples.iter().sum::<f64>() / samples.len().max(1) as f64,
        min_ns,
        max_ns,
        floor_median_ns: stats(floor).0,
        over_floor_ns: stats(&diffs).0,
        new_over_old: None,
    }
}

fn floor_row(hook: &'static str, samples: &[f64]) -> FloorRow {
    let (median_ns, min_ns, max_ns) = stats(samples);
    FloorRow {
        hook: hook.to_owned(),
        median_ns,
        min_ns,
        max_ns,
    }
}

/// The daemon built beside this example, after removing (and naming) what earlier runs of
/// the namespace benchmarks left behind.
fn daemon_bin_swept() -> Result<PathBuf> {
    let bin = example_fastpath_bin()?;
    let swept = sweep_stale(PREFIX).context("removing leftovers of earlier runs")?;
    if !swept.is_empty() {
        eprintln!("removed leftovers of earlier runs: {}", swept.join(", "));
    }
    Ok(bin)
}

/// The old object's conntrack, LB, routing and VXLAN rows beside this tree's, timed through
/// both in the same run (`--old-object`); empty when the last run timed no old object.
fn old_vs_new_markdown(r: &Report) -> String {
    let pairs: Vec<(&CtRow, &CtRow)> = [
        (&r.conntrack, &r.old_conntrack),
        (&r.route_paths, &r.old_route_paths),
        (&r.vxlan_paths, &r.old_vxlan_paths),
    ]
    .into_iter()
    .flat_map(|(new, old)| new.iter().zip(old))
    .collect();
    if pairs.is_empty() {
        return String::new();
    }
    let rows = pairs.iter().map(|(new, old)| OldNewRow {
        path: new.path.clone(),
        beside: new.table_entries.to_string(),
        medians: (old.median_ns, new.median_ns),
        means: (old.mean_ns > 0.0 && new.mean_ns > 0.0).then_some((old.mean_ns, new.mean_ns)),
        over_floor: (old.over_floor_ns, new.over_floor_ns),
        new_over_old: old.new_over_old.unwrap_or((f64::NAN, f64::NAN, f64::NAN)),
    });
    let mut md = format!(
        "Old object: `{}` · every row timed through both objects in turn, in the same run\n\n",
        r.old_object
    );
    md.push_str(&old_new_table("table entries", true, rows));
    md
}

/// Katran's rows (`--katran-object`) and the Katran source; empty when the last `lb` run
/// timed no Katran.
fn katran_markdown(r: &Report) -> String {
    if r.katran.is_empty() {
        return String::new();
    }
    let rows: Vec<Vec<String>> = r
        .katran
        .iter()
        .map(|k| {
            vec![
                k.path.clone(),
                k.table_entries.to_string(),
                cell(k.median_ns, k.min_ns, k.max_ns, 1),
                format!("{:.1}", k.mean_ns),
                format!("{:.1}", k.floor_median_ns),
                format!("{:+.1}", k.over_floor_ns),
            ]
        })
        .collect();
    let mut md = report::table(
        &[
            "path",
            "flows in LRU",
            "median ns (min–max)",
            "mean ns",
            "floor ns",
            "over floor ns",
        ],
        &[false, true, true, true, true, true],
        &rows,
    );
    let _ = write!(
        md,
        "\nVersions: Katran {} (balancer.bpf.c and its consts and maps at that commit, the other headers as the build notes say; IPIP encapsulation, fallback LRU); timed in the same rounds as the rows \"among 1000 / 1000000 conntrack entries\" above, floor = the same empty XDP program.\n",
        r.katran_source
    );
    md
}

/// One path timed through the old object and this tree's: (old, new) pairs.
struct OldNewRow {
    path: String,
    /// The second column's value (the hook, or the table's entries).
    beside: String,
    medians: (f64, f64),
    /// Both means over all calls, where a row has them (the repeat = 1 rows: what sets a
    /// rate, which a few slow calls move and the median does not show).
    means: Option<(f64, f64)>,
    over_floor: (f64, f64),
    /// This tree's ns ÷ the old object's, median (min–max) over rounds.
    new_over_old: (f64, f64, f64),
}

/// The old-vs-new table: path, `beside` (right-aligned when `numeric`), both medians, both
/// means and their ratio (when rows have them), both costs over the floor, and new ÷ old per
/// round.
fn old_new_table(beside: &str, numeric: bool, rows: impl Iterator<Item = OldNewRow>) -> String {
    let rows: Vec<OldNewRow> = rows.collect();
    let with_means = rows.iter().any(|o| o.means.is_some());
    let rows: Vec<Vec<String>> = rows
        .into_iter()
        .map(|o| {
            let (m, lo, hi) = o.new_over_old;
            let mut row = vec![
                o.path,
                o.beside,
                format!("{:.1}", o.medians.0),
                format!("{:.1}", o.medians.1),
            ];
            if with_means {
                row.extend(match o.means {
                    Some((old, new)) => [
                        format!("{old:.1}"),
                        format!("{new:.1}"),
                        format!("{:.3}", new / old),
                    ],
                    None => ["—".into(), "—".into(), "—".into()],
                });
            }
            row.extend([
                format!("{:+.1}", o.over_floor.0),
                format!("{:+.1}", o.over_floor.1),
                cell(m, lo, hi, 3),
            ]);
            row
        })
        .collect();
    let mut head = vec!["path", beside, "old median ns", "new median ns"];
    if with_means {
        head.extend(["old mean ns", "new mean ns", "new ÷ old mean"]);
    }
    head.extend([
        "old over floor ns",
        "new over floor ns",
        "new ÷ old per round",
    ]);
    let mut numeric_cols = vec![false, numeric];
    numeric_cols.resize(head.len(), true);
    let mut md = report::table(&head, &numeric_cols, &rows);
    md.push('\n');
    md
}

/// The generated blocks of docs/BENCHMARKS.md, by marker name (see `report::splice`). Each
/// holds data only: run parameters, tables, versions and figures; headings and method are
/// written by hand around them.
fn blocks(r: &Report) -> Vec<(&'static str, String)> {
    let with_figures = |mut md: String, figures: Vec<Figure>| {
        md.push_str(&embed(&figures));
        md
    };
    vec![
        ("machine", measured_markdown(r)),
        ("parse", parse_markdown(r)),
        (
            "conntrack",
            with_figures(conntrack_markdown(r), conntrack_figures(r)),
        ),
        ("route-paths", route_paths_markdown(r)),
        (
            "vxlan-paths",
            with_figures(vxlan_paths_markdown(r), route_figures(r)),
        ),
        ("old-vs-new", old_vs_new_markdown(r)),
        ("katran", katran_markdown(r)),
        ("table-kinds", table_kinds::markdown(&r.table_kinds)),
        ("gc", gc_markdown(&r.conntrack_gc)),
        ("drain", drain_markdown(&r.conntrack_drain)),
        ("updates", updates_markdown(&r.service_updates)),
        ("api", api::markdown(&r.api_changes)),
        (
            "lb-compare",
            with_figures(
                lb_compare::markdown(&r.lb_compare),
                lb_compare::figures(&r.lb_compare),
            ),
        ),
        ("lb-ha", lb_compare::ha_markdown(&r.lb_compare)),
        (
            "lb-sweep",
            with_figures(
                lb_sweep::markdown(&r.lb_sweep),
                lb_sweep::figures(&r.lb_sweep),
            ),
        ),
        (
            "route-compare",
            with_figures(
                route_compare::markdown(&r.route_compare),
                route_compare::figures(&r.route_compare),
            ),
        ),
        (
            "overlay-compare",
            overlay_compare::markdown(&r.overlay_compare),
        ),
        ("ha", ha::markdown(&r.ha)),
        ("ha-mesh", ha_mesh::markdown(&r.ha_mesh)),
    ]
}

/// The parse-only paths, their floors and, with `--old-object`, the old object's rows.
fn parse_markdown(r: &Report) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "repeat {} per call · {} rounds · floor = empty program of the same hook on the same frame\n",
        thousands(u64::from(r.repeat_per_call)),
        r.rounds
    );
    let _ = writeln!(md, "| floor | median ns | min–max ns |\n|---|---:|---:|");
    for f in &r.floors {
        let _ = writeln!(
            md,
            "| empty {} program | {:.1} | {:.1}–{:.1} |",
            f.hook, f.median_ns, f.min_ns, f.max_ns
        );
    }
    let _ = writeln!(md);
    let _ = writeln!(
        md,
        "| path | hook | frame B | median ns | min–max ns | over floor ns | ÷ floor |\n|---|---|---:|---:|---:|---:|---:|"
    );
    for row in &r.rows {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.1} | {:.1}–{:.1} | {:+.1} | {:.2} |",
            row.what,
            row.hook,
            row.frame_bytes,
            row.median_ns,
            row.min_ns,
            row.max_ns,
            row.over_floor_ns,
            row.median_ns / row.floor_median_ns,
        );
    }
    let _ = writeln!(md);
    if !r.old_vs_new.is_empty() {
        let _ = writeln!(
            md,
            "old object: `{}` · same rounds · new ÷ old = median (min–max) of per-round ratios\n",
            r.old_object
        );
        let rows = r.old_vs_new.iter().map(|o| OldNewRow {
            path: o.what.clone(),
            beside: o.hook.clone(),
            medians: (o.old_median_ns, o.new_median_ns),
            means: None,
            over_floor: (o.old_over_floor_ns, o.new_over_floor_ns),
            new_over_old: o.new_over_old,
        });
        md.push_str(&old_new_table("hook", false, rows));
    }
    md
}

/// `n` with thousands separated by commas, for run parameters.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, d) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(d);
    }
    out
}

/// A list of counts for run parameters: "1, 16, 1,024".
fn counts(ns: impl IntoIterator<Item = u64>) -> String {
    ns.into_iter().map(thousands).collect::<Vec<_>>().join(", ")
}

/// The conntrack rows (hit, miss, lookup alone, the LB rows).
fn conntrack_markdown(r: &Report) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "CT hit and lookup: repeat {} per call, {} rounds · CT miss: {} new flows · LB: backends {}, table {} entries, {} calls per row · repeat = 1 rows: floor also repeat = 1\n",
        thousands(u64::from(r.repeat_per_call)),
        r.rounds,
        thousands(u64::from(CT_MISS_FLOWS)),
        counts(LB_BACKENDS.iter().map(|&n| n as u64)),
        counts(CT_SIZES.iter().map(|&n| u64::from(n))),
        thousands(LB_RUNS as u64),
    );
    let _ = writeln!(
        md,
        "| path | table entries | median ns | mean ns | min–max ns | floor ns | over floor ns |\n|---|---:|---:|---:|---:|---:|---:|"
    );
    for c in &r.conntrack {
        let _ = writeln!(
            md,
            "| {} | {} | {:.1} | {:.1} | {:.1}–{:.1} | {:.1} | {:+.1} |",
            c.path,
            c.table_entries,
            c.median_ns,
            c.mean_ns,
            c.min_ns,
            c.max_ns,
            c.floor_median_ns,
            c.over_floor_ns
        );
    }
    let _ = writeln!(md);
    md
}

/// The L3 stage's rows.
fn route_paths_markdown(r: &Report) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "routes added {} · {} calls per row, repeat = 1 (floor also repeat = 1)\n",
        counts(ROUTE_SIZES.iter().map(|&n| u64::from(n))),
        thousands(LB_RUNS as u64)
    );
    let _ = writeln!(
        md,
        "| path | routes added | median ns | min–max ns | floor ns | over floor ns |\n|---|---:|---:|---:|---:|---:|"
    );
    for c in &r.route_paths {
        let _ = writeln!(
            md,
            "| {} | {} | {:.1} | {:.1}–{:.1} | {:.1} | {:+.1} |",
            c.path,
            c.table_entries,
            c.median_ns,
            c.min_ns,
            c.max_ns,
            c.floor_median_ns,
            c.over_floor_ns
        );
    }
    if r.route_paths.is_empty() {
        let _ = writeln!(
            md,
            "| not measured yet: `cargo xtask bench -- route` | | | | | |"
        );
    }
    md.push('\n');
    md
}

/// VXLAN encapsulation and decapsulation rows.
fn vxlan_paths_markdown(r: &Report) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "{} calls per row, repeat = 1 (floor also repeat = 1)\n\n| path | median ns | min–max ns | floor ns | over floor ns |\n|---|---:|---:|---:|---:|",
        thousands(LB_RUNS as u64)
    );
    for c in &r.vxlan_paths {
        let _ = writeln!(
            md,
            "| {} | {:.1} | {:.1}–{:.1} | {:.1} | {:+.1} |",
            c.path, c.median_ns, c.min_ns, c.max_ns, c.floor_median_ns, c.over_floor_ns
        );
    }
    if r.vxlan_paths.is_empty() {
        let _ = writeln!(
            md,
            "| not measured yet: `cargo xtask bench -- vxlan` | | | | |"
        );
    }
    md.push('\n');
    md
}

/// Every chart of the report: the headline comparisons only (the tables carry the rest).
fn figures(r: &Report) -> Vec<Figure> {
    let mut all = conntrack_figures(r);
    all.extend(route_figures(r));
    all.extend(lb_compare::figures(&r.lb_compare));
    all.extend(lb_sweep::figures(&r.lb_sweep));
    all.extend(route_compare::figures(&r.route_compare));
    all
}

/// The XDP floor's median, ns.
fn xdp_floor(r: &Report) -> f64 {
    r.floors
        .iter()
        .find(|f| f.hook == "xdp")
        .map_or(f64::NAN, |f| f.median_ns)
}

/// Conntrack and LB paths: their cost over the empty program measured with them (repeat = 1
/// rows carry the kernel's per-call timing in their floor), against the floor itself: a bar
/// left of the line costs less than 2× the floor in all.
fn conntrack_figures(r: &Report) -> Vec<Figure> {
    let bars: Vec<Bar> = r
        .conntrack
        .iter()
        .map(|c| {
            let what = c.path.split(':').next().unwrap_or(&c.path);
            let label = match c.backends {
                Some(n) => {
                    let dir = if c.path.contains("backend → client") {
                        " back"
                    } else {
                        ""
                    };
                    format!("{what}{dir}, {n} backend{}", if n == 1 { "" } else { "s" })
                }
                None => format!("{what}, {} entries", c.table_entries),
            };
            Bar::new(label, (c.over_floor_ns, f64::NAN, f64::NAN), true)
        })
        .collect();
    vec![Figure::bars(
        "ns_conntrack_lb.svg",
        "Conntrack and LB paths: ns/packet over the empty-program floor",
        "ns over the floor",
        &bars,
        Some(("the floor, i.e. 2× the floor in all", xdp_floor(r))),
    )]
}

/// The L3 stage and VXLAN paths over the empty program measured with them.
fn route_figures(r: &Report) -> Vec<Figure> {
    let bars: Vec<Bar> = r
        .route_paths
        .iter()
        .chain(&r.vxlan_paths)
        .map(|c| {
            let what = c.path.split(" (").next().unwrap_or(&c.path);
            Bar::new(
                if what.starts_with("VXLAN") {
                    what.to_owned()
                } else {
                    format!("{what}, +{} routes", c.table_entries)
                },
                (c.over_floor_ns, f64::NAN, f64::NAN),
                true,
            )
        })
        .collect();
    if bars.is_empty() {
        return Vec::new();
    }
    vec![Figure::bars(
        "ns_route.svg",
        "L3 stage and VXLAN: ns/packet over the empty-program floor",
        "ns over the floor",
        &bars,
        None,
    )]
}

/// The machine, and which commit each section was measured at (one line when a full run
/// measured them all).
fn measured_markdown(r: &Report) -> String {
    let m = &r.machine;
    let mut md = format!("Machine: {} ({} CPUs), kernel {}", m.cpu, m.cpus, m.kernel);
    let runs: Vec<(&String, &Machine)> = r.measured.iter().collect();
    let one_run = runs
        .iter()
        .all(|(_, s)| s.commit == m.commit && s.date == m.date && s.kernel == m.kernel);
    if one_run {
        let _ = writeln!(md, ", commit {}, {}.\n", m.commit, m.date);
        return md;
    }
    let same_tree = runs
        .iter()
        .all(|(_, s)| s.commit == m.commit && s.kernel == m.kernel);
    let _ = writeln!(
        md,
        ".\n\n{}\n\n| section | commit | date | kernel |\n|---|---|---|---|",
        if same_tree {
            format!(
                "Every section was measured at commit {} (by one full run, or sections re-run at that commit); the date is each section's start:",
                m.commit
            )
        } else {
            "Sections were measured in separate runs (`cargo xtask bench SECTION` re-measures one):"
                .to_owned()
        }
    );
    for (section, s) in runs {
        let _ = writeln!(
            md,
            "| {section} | {} | {} | {} |",
            s.commit, s.date, s.kernel
        );
    }
    md.push('\n');
    md
}

/// The "Conntrack event drain" subsection.
/// `[[service]]` TOML for `n` services on 10.100.x.y:80, each with `backends` backends.
fn services_toml(n: usize, backends: usize, weight_of: impl Fn(usize, usize) -> u32) -> String {
    let mut s = String::from("[[interface]]\nname = \"lo\"\n");
    for i in 0..n {
        let _ = write!(
            s,
            "[[service]]\nvip = \"10.100.{}.{}\"\nport = 80\n",
            i / 250,
            i % 250 + 1
        );
        // Every service has backends of its own (no two tables alike).
        for b in 0..backends {
            let k = i * backends + b + 1;
            let _ = write!(
                s,
                "[[service.backend]]\naddress = \"10.{}.{}.{}\"\nport = 8080\nweight = {}\n",
                101 + (k >> 16),
                (k >> 8) & 255,
                k & 255,
                weight_of(i, b)
            );
        }
    }
    s
}

fn parse_services(toml: &str) -> Result<Vec<fastpath::config::ServiceConfig>> {
    Ok(fastpath::config::Config::parse_with(
        std::path::Path::new("bench"),
        toml,
        fastpath::config::InterfaceCheck::Skip,
    )?
    .services)
}

/// Config call → datapath effective: one backend's weight changed (alone, and among 10k
/// services), and 10k services applied at once.
fn bench_service_updates(fx: &mut Fixture) -> Result<Vec<UpdateRow>> {
    const CHANGES: usize = 200;
    let mut rows = Vec::new();
    let timed = |what: String, present: usize, samples: Vec<f64>, target_us: f64| {
        let mut v = samples;
        v.sort_by(f64::total_cmp);
        let pct = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
        let (p50, p99, max) = (pct(0.5), pct(0.99), v[v.len() - 1]);
        UpdateRow {
            what,
            services_in_datapath: present,
            samples: v.len(),
            p50_us: p50,
            p99_us: p99,
            max_us: max,
            target_us,
            met: p99 <= target_us,
        }
    };
    // One service of 100 backends: backend 0 drained and back, alternately.
    let base = parse_services(&services_toml(1, 100, |_, _| 1))?;
    let drained = parse_services(&services_toml(1, 100, |_, b| u32::from(b != 0)))?;
    fx.apply_services(&base)?;
    let mut us = Vec::new();
    for i in 0..CHANGES {
        let t = Instant::now();
        let applied = fx.apply_services(if i % 2 == 0 { &drained } else { &base })?;
        us.push(t.elapsed().as_secs_f64() * 1e6);
        if applied.services != 1 {
            bail!("expected one service written per change, got {applied:?}");
        }
    }
    rows.push(timed(
        "one backend's weight changed (1 service, 100 backends, Maglev 16381 slots)".into(),
        1,
        us,
        1000.0,
    ));
    fx.apply_services(&[])?;
    eprint!("u");

    // 10k services of 2 backends: all at once, then one change among them.
    let n = 10_000;
    let all = parse_services(&services_toml(n, 2, |_, _| 1))?;
    let all_flipped = parse_services(&services_toml(n, 2, |_, b| 1 + b as u32))?;
    let mut whole = Vec::new();
    for round in 0..5 {
        let t = Instant::now();
        let applied = fx.apply_services(if round % 2 == 0 { &all } else { &all_flipped })?;
        whole.push(t.elapsed().as_secs_f64() * 1e6);
        if applied.services != n {
            bail!("expected {n} services written, got {applied:?}");
        }
    }
    rows.push(timed(
        format!("{n} services written at once (2 backends each, Maglev 251 slots)"),
        n,
        whole,
        100_000.0,
    ));
    // The last round applied `all`.
    let mut one_changed = all.clone();
    one_changed[4321].backends[0].weight = toml::Spanned::new(0..0, 0);
    let mut us = Vec::new();
    for i in 0..CHANGES / 4 {
        let t = Instant::now();
        let applied = fx.update_services(if i % 2 == 0 { &one_changed } else { &all }, &[4321])?;
        us.push(t.elapsed().as_secs_f64() * 1e6);
        if applied.services != 1 || applied.unchanged != n - 1 {
            bail!(
                "expected one service written and {} unchanged, got {applied:?}",
                n - 1
            );
        }
    }
    rows.push(timed(
        format!("one backend's weight changed among {n} services (the daemon's health-change path: that service only)"),
        n,
        us,
        1000.0,
    ));
    fx.apply_services(&[])?;
    eprint!("u");
    Ok(rows)
}

fn updates_markdown(rows: &[UpdateRow]) -> String {
    let mut md = String::from(
        "| change | services in the datapath | samples | p50 µs | p99 µs | max µs | goal (p99) µs |\n|---|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.0} | {:.0} | {:.0} | ≤ {:.0} |",
            r.what, r.services_in_datapath, r.samples, r.p50_us, r.p99_us, r.max_us, r.target_us,
        );
    }
    md.push('\n');
    md
}

fn drain_markdown(d: &DrainReport) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "{} events per producer call · ring {} KiB · {} tokio workers · in flight ≤ {} events · {} events per round · {} rounds\n",
        d.producer_events_per_call,
        thousands(u64::from(d.ring_bytes) / 1024),
        d.tokio_workers,
        thousands(d.in_flight_limit),
        thousands(d.events_per_round),
        d.rounds
    );
    let _ = writeln!(
        md,
        "| measurement | median events/s | min–max events/s |\n|---|---:|---:|"
    );
    for (what, r) in [
        ("producer alone (baseline)", &d.producer_alone),
        ("delivered to one EventHub subscriber", &d.delivered),
    ] {
        let _ = writeln!(
            md,
            "| {what} | {} | {}–{} |",
            mega(r.median_events_per_s),
            mega(r.min_events_per_s),
            mega(r.max_events_per_s)
        );
    }
    let _ = writeln!(md);
    let _ = writeln!(
        md,
        "| delivered ÷ producer alone | producer ns/event in BPF_PROG_TEST_RUN | lost in the ring | lagged | malformed | out of order |\n|---:|---:|---:|---:|---:|---:|\n| {:.2} | {:.1} | {} | {} | {} | {} |\n",
        d.delivered_over_producer,
        d.producer_kernel_ns_per_event,
        d.events_lost,
        d.lagged,
        d.malformed,
        d.out_of_order,
    );
    md
}

/// Events/s in millions, for tables.
fn mega(eps: f64) -> String {
    format!("{:.2} M", eps / 1e6)
}

/// The commit the running benchmark was built from (see [`machine`]).
static BUILT_FROM: std::sync::OnceLock<String> = std::sync::OnceLock::new();

fn machine() -> Machine {
    let sh = |cmd: &str, args: &[&str]| {
        Command::new(cmd)
            .args(args)
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    };
    let cpu = fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    Machine {
        kernel: sh("uname", &["-r"]),
        cpu,
        cpus: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
        // The tree as the run started, right after xtask built this binary from it: edits and
        // commits during a long run are not in what it measures. Uncommitted changes outside
        // docs/ are flagged: the numbers are not HEAD's.
        commit: BUILT_FROM
            .get_or_init(|| {
                let head = sh("git", &["rev-parse", "--short", "HEAD"]);
                let changed = sh(
                    "git",
                    &[
                        "status",
                        "--porcelain",
                        "--untracked-files=no",
                        "--",
                        ".",
                        ":!docs",
                    ],
                );
                if changed.is_empty() {
                    head
                } else {
                    format!("{head} + uncommitted changes")
                }
            })
            .clone(),
        date: sh("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_parameters_group_thousands() {
        let got: Vec<String> = [0, 7, 999, 1_000, 21_000, 1_000_000, 8_388_608]
            .into_iter()
            .map(thousands)
            .collect();
        assert_eq!(
            got,
            ["0", "7", "999", "1,000", "21,000", "1,000,000", "8,388,608"],
            "expected commas every three digits from the right"
        );
        assert_eq!(counts([1, 16, 1_024]), "1, 16, 1,024");
    }

    #[test]
    fn blocks_carry_no_headings_and_embed_every_chart() {
        // Headings belong to the hand-written text around the blocks.
        let r = Report::default();
        let blocks = blocks(&r);
        for (name, md) in &blocks {
            assert!(
                !md.lines().any(|l| l.starts_with('#')),
                "block {name}: expected no heading, got {md:?}"
            );
        }
        let charts = figures(&r);
        assert!(!charts.is_empty(), "expected the conntrack chart at least");
        for f in &charts {
            assert!(
                blocks
                    .iter()
                    .any(|(_, md)| md.contains(&format!("(bench/{})", f.file))),
                "chart {} is written but embedded in no block",
                f.file
            );
        }
    }
}
