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
//! Writes docs/bench/datapath.json and regenerates docs/BENCHMARKS.md.

use std::{fmt::Write as _, fs, path::PathBuf, process::Command, time::Duration};

use anyhow::{Context as _, Result, bail};
use fastpath::{
    conntrack::monotonic_ns,
    ct_events::EventHub,
    ct_gc::{self, GcStats},
    datapath::CtTable,
    testkit::{
        cases::parser_cases,
        fixture::{Case, Fixture, Seed, raw_verdict},
        packet::{Pkt, tcp_flags},
    },
};
use fastpath_common::{
    Hook, Verdict,
    ct::{DEFAULT_TIMEOUTS_S, IFACE_F_CT_XDP},
    map_names,
};
use serde::Serialize;

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

#[derive(Serialize)]
struct Row {
    case: String,
    what: String,
    hook: &'static str,
    frame_bytes: usize,
    median_ns: f64,
    min_ns: f64,
    max_ns: f64,
    floor_median_ns: f64,
    over_floor_ns: f64,
    budget_ns: f64,
    within_budget: bool,
}

#[derive(Serialize)]
struct FloorRow {
    hook: &'static str,
    median_ns: f64,
    min_ns: f64,
    max_ns: f64,
}

/// One conntrack measurement at one table size.
#[derive(Serialize)]
struct CtRow {
    path: &'static str,
    table_entries: u32,
    median_ns: f64,
    min_ns: f64,
    max_ns: f64,
    floor_median_ns: f64,
    over_floor_ns: f64,
}

/// Cost of one expiry pass over the table (nothing expired: the walk itself).
#[derive(Serialize)]
struct GcRow {
    table_entries: u32,
    median_ms: f64,
    min_ms: f64,
    max_ms: f64,
}

#[derive(Serialize)]
struct Report {
    generated_by: &'static str,
    machine: Machine,
    repeat_per_call: u32,
    rounds: usize,
    floors: Vec<FloorRow>,
    rows: Vec<Row>,
    conntrack: Vec<CtRow>,
    conntrack_gc: Vec<GcRow>,
}

#[derive(Serialize)]
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

fn main() -> Result<()> {
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

    let mut fx = Fixture::new().context("loading the datapath (run as root)")?;
    // Sanity: every picked case passes its fixture check before it is timed.
    for (case, _) in &picked {
        fx.evaluate(case)
            .map_err(|e| anyhow::anyhow!("benchmark case fails its fixture check: {e}"))?;
    }

    let mut configs: Vec<Config> = vec![
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
    configs.extend(picked.iter().map(|(c, _)| Config {
        case: c,
        floor: false,
        samples: vec![],
    }));

    for round in 0..=ROUNDS {
        for cfg in configs.iter_mut() {
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
        eprint!(".");
    }
    eprintln!();

    let floor_of = |hook: Hook| -> Vec<f64> {
        let floor_hook_is_xdp = hook == Hook::Xdp;
        configs
            .iter()
            .find(|c| c.floor && (c.case.hook == Hook::Xdp) == floor_hook_is_xdp)
            .map(|c| c.samples.clone())
            .unwrap_or_default()
    };
    let floors = vec![
        floor_row("xdp", &floor_of(Hook::Xdp)),
        floor_row("tc", &floor_of(Hook::TcIngress)),
    ];
    let mut rows = Vec::new();
    for (cfg, (_, what)) in configs.iter().filter(|c| !c.floor).zip(picked.iter()) {
        let (median, min, max) = stats(&cfg.samples);
        let floor_samples = floor_of(cfg.case.hook);
        let floor = stats(&floor_samples).0;
        // Paired per round: the machine's speed drifts between rounds (frequency, neighbours),
        // and a case and its floor measured back to back in one round share that state.
        let diffs: Vec<f64> = cfg
            .samples
            .iter()
            .zip(&floor_samples)
            .map(|(c, f)| c - f)
            .collect();
        let over = stats(&diffs).0;
        rows.push(Row {
            case: cfg.case.name.clone(),
            what: what.to_string(),
            hook: cfg.case.hook.name(),
            frame_bytes: cfg.case.input.len(),
            median_ns: median,
            min_ns: min,
            max_ns: max,
            floor_median_ns: floor,
            over_floor_ns: over,
            budget_ns: PARSE_BUDGET_NS,
            within_budget: over <= PARSE_BUDGET_NS,
        });
    }

    let (conntrack, conntrack_gc) = bench_conntrack(&mut fx)?;
    let report = Report {
        generated_by: "cargo xtask bench",
        machine: machine(),
        repeat_per_call: REPEAT,
        rounds: ROUNDS,
        floors,
        rows,
        conntrack,
        conntrack_gc,
    };
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    fs::create_dir_all(root.join("docs/bench"))?;
    fs::write(
        root.join("docs/bench/datapath.json"),
        serde_json::to_string_pretty(&report)? + "\n",
    )?;
    let md = markdown(&report);
    fs::write(root.join("docs/BENCHMARKS.md"), &md)?;
    print!("{md}");
    eprintln!("wrote docs/bench/datapath.json and docs/BENCHMARKS.md");
    Ok(())
}

/// Conntrack table sizes measured.
const CT_SIZES: [u32; 2] = [1_000, 1_000_000];
/// New flows per miss measurement (each runs once: a repeat would hit the entry it made).
const CT_MISS_FLOWS: u16 = 2_000;
const GC_PASSES: usize = 5;

/// CT hit (an established TCP flow's ACK, repeated) and CT miss + insert (a new UDP flow per
/// run, repeat = 1, against a floor also run with repeat = 1) at each table size, and the
/// expiry pass cost.
fn bench_conntrack(fx: &mut Fixture) -> Result<(Vec<CtRow>, Vec<GcRow>)> {
    let seed = Seed::iface(1, IFACE_F_CT_XDP); // BPF_PROG_TEST_RUN runs on loopback (ifindex 1)
    let case = |name: &str, input: Vec<u8>| Case {
        name: name.into(),
        hook: Hook::Xdp,
        seed: seed.clone(),
        input,
        expect_verdict: raw_verdict(Hook::Xdp, Verdict::Kernel),
        expect_output: None,
        expect_counters: vec![],
    };
    let (a, b) = ([10, 255, 0, 1], [10, 255, 0, 2]);
    let hit = case(
        "ct_hit",
        Pkt::eth().ipv4(a, b).tcp(40000, 80, tcp_flags::ACK).build(),
    );
    let misses: Vec<Case> = (0..CT_MISS_FLOWS)
        .map(|i| case("ct_miss", Pkt::eth().ipv4(a, b).udp(10_000 + i, 53).build()))
        .collect();
    let mut rows = Vec::new();
    let mut gc_rows = Vec::new();
    for size in CT_SIZES {
        fx.ct_clear()?;
        fx.ct_fill(size, monotonic_ns())?;
        fx.run_repeat(&hit, 1)?; // loose pickup creates the flow; every timed run hits it
        let (mut hit_ns, mut hit_floor) = (vec![], vec![]);
        for _ in 0..ROUNDS {
            hit_floor.push(
                fx.run_floor_repeat(Hook::Xdp, &hit.input, REPEAT)?
                    .per_run
                    .as_nanos() as f64,
            );
            hit_ns.push(fx.run_repeat(&hit, REPEAT)?.per_run.as_nanos() as f64);
        }
        rows.push(ct_row(
            "CT hit: established TCP flow",
            size,
            &hit_ns,
            &hit_floor,
        ));
        let (mut miss_ns, mut miss_floor) = (vec![], vec![]);
        for m in &misses {
            miss_floor.push(
                fx.run_floor_repeat(Hook::Xdp, &m.input, 1)?
                    .per_run
                    .as_nanos() as f64,
            );
            miss_ns.push(fx.run_repeat(m, 1)?.per_run.as_nanos() as f64);
        }
        rows.push(ct_row(
            "CT miss + insert: new UDP flow (repeat = 1)",
            size,
            &miss_ns,
            &miss_floor,
        ));

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
        gc_rows.push(GcRow {
            table_entries: size,
            median_ms,
            min_ms,
            max_ms,
        });
        eprint!("c");
    }
    fx.ct_clear()?;
    Ok((rows, gc_rows))
}

fn ct_row(path: &'static str, size: u32, samples: &[f64], floor: &[f64]) -> CtRow {
    let (median_ns, min_ns, max_ns) = stats(samples);
    let diffs: Vec<f64> = samples.iter().zip(floor).map(|(c, f)| c - f).collect();
    CtRow {
        path,
        table_entries: size,
        median_ns,
        min_ns,
        max_ns,
        floor_median_ns: stats(floor).0,
        over_floor_ns: stats(&diffs).0,
    }
}

fn floor_row(hook: &'static str, samples: &[f64]) -> FloorRow {
    let (median_ns, min_ns, max_ns) = stats(samples);
    FloorRow {
        hook,
        median_ns,
        min_ns,
        max_ns,
    }
}

/// (median, min, max).
fn stats(samples: &[f64]) -> (f64, f64, f64) {
    let mut s = samples.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    if s.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    let n = s.len();
    let median = if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    };
    (median, s[0], s[n - 1])
}

fn markdown(r: &Report) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# fastpath benchmarks\n");
    let _ = writeln!(
        md,
        "Regenerated by `cargo xtask bench` (as root); raw numbers in [`bench/datapath.json`](bench/datapath.json).\n"
    );
    let m = &r.machine;
    let _ = writeln!(
        md,
        "Machine: {} ({} CPUs), kernel {}, commit {}, {}.\n",
        m.cpu, m.cpus, m.kernel, m.commit, m.date
    );
    let _ = writeln!(md, "## Datapath ns/packet (BPF_PROG_TEST_RUN)\n");
    let _ = writeln!(
        md,
        "Each configuration runs {} times per call, in {} interleaved rounds after a warm-up; the table gives the median of the per-call means and the min–max over rounds; \"over floor\" is the median over rounds of (path − floor) measured back to back in the same round. The floor is an empty program of the same kind (XDP_PASS / TC_ACT_OK) on the same frame, measured in the same rounds: it is the cost of BPF_PROG_TEST_RUN itself.\n",
        r.repeat_per_call, r.rounds
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
        "| path | hook | frame B | median ns | min–max ns | over floor ns | target (floor + {:.0} ns) |\n|---|---|---:|---:|---:|---:|---|",
        PARSE_BUDGET_NS
    );
    for row in &r.rows {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.1} | {:.1}–{:.1} | {:+.1} | {} |",
            row.what,
            row.hook,
            row.frame_bytes,
            row.median_ns,
            row.min_ns,
            row.max_ns,
            row.over_floor_ns,
            if row.within_budget { "met" } else { "MISSED" }
        );
    }
    let _ = writeln!(md);
    let _ = writeln!(
        md,
        "Every path above parses the packet into the per-CPU packet context, passes the conntrack stage (the interface does not track here: see the Conntrack section for tracked packets), counts the packet once in the per-CPU stats map under (hook, verdict, reason) and hands it to the kernel: no forwarding stage exists yet.\n"
    );
    let missed: Vec<String> = r
        .rows
        .iter()
        .filter(|row| !row.within_budget)
        .map(|row| format!("{} ({:+.1} ns)", row.what, row.over_floor_ns))
        .collect();
    let _ = writeln!(md, "## Conntrack\n");
    let _ = writeln!(
        md,
        "XDP with the conntrack stage on (the interface tracks at XDP). CT hit: an established TCP flow's ACK, {} runs per call, {} interleaved rounds, paired with the empty-program floor. CT miss + insert: {} new UDP flows, each run once (repeat = 1, so its floor is also measured with repeat = 1, which includes the kernel's per-call timing overhead). Table pre-filled with that many established connections.\n",
        r.repeat_per_call, r.rounds, CT_MISS_FLOWS
    );
    let _ = writeln!(
        md,
        "| path | table entries | median ns | min–max ns | floor ns | over floor ns |\n|---|---:|---:|---:|---:|---:|"
    );
    for c in &r.conntrack {
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
    let _ = writeln!(md);
    let _ = writeln!(
        md,
        "Expiry pass (the daemon's GC: batched walk of the whole table, nothing expired), {GC_PASSES} passes:\n"
    );
    let _ = writeln!(
        md,
        "| table entries | median ms | min–max ms |\n|---:|---:|---:|"
    );
    for g in &r.conntrack_gc {
        let _ = writeln!(
            md,
            "| {} | {:.1} | {:.1}–{:.1} |",
            g.table_entries, g.median_ms, g.min_ms, g.max_ms
        );
    }
    let _ = writeln!(md);
    let _ = writeln!(md, "## Where we lose\n");
    if missed.is_empty() {
        let _ = writeln!(
            md,
            "Every path above is within floor + {PARSE_BUDGET_NS:.0} ns in this run.\n"
        );
    } else {
        let _ = writeln!(
            md,
            "Over the floor + {PARSE_BUDGET_NS:.0} ns target in this run: {}. Every IP packet now goes through the per-CPU packet context that the conntrack stage reads (the addresses are copied out of the packet byte by byte: BPF has no unaligned loads) and through the stage's per-interface check, even where the interface does not track; ARP, which stops in the parser, shows the parse-and-count cost alone. Each IPv6 extension header adds one bounded-loop iteration.\n",
            missed.join("; ")
        );
    }
    let _ = writeln!(md, "## How to reproduce\n\n```sh\ncargo xtask bench\n```\n");
    let _ = writeln!(
        md,
        "Noise: this shared 2-CPU VM alternates between a fast state (empty-program floor 29–31 ns) and a slow one (34–36 ns) that lasts minutes; in the slow state every path\u{2019}s cost over the floor grows by about half, so rows near the target flip between met and missed from run to run. Compare medians measured in one run, never across runs."
    );
    md
}

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
        commit: sh("git", &["rev-parse", "--short", "HEAD"]),
        date: sh("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
    }
}
