//! A VXLAN overlay between two nodes, side by side in one run: the kernel's vxlan devices
//! alone vs with fastpath's flow cache (a daemon on each node: the first packets towards the
//! other node take the kernel's overlay path and teach the underlay's TC egress the outer
//! headers; later packets are encapsulated at the pod link's XDP hook and decapsulated at the
//! underlay's — or, the third contender, both at TC ingress with XDP off). A fourth, the
//! ceiling, takes the overlay away: each node's kernel routes the other's pod subnet over the
//! underlay unencapsulated, the most any overlay bypass could gain here. The topology is
//! `testkit::vxlan_cases::two_node_overlay`: pod a → node a ⇄ node b → pod b. The contenders alternate in interleaved rounds (the first one alternating),
//! each round running, per contender, from pod a to pod b:
//! - TCP request/response rate: wrk, keep-alive, 16 connections, a 64-byte page from nginx;
//! - TCP throughput: iperf3, one stream;
//!
//! with the whole machine's CPU time per request and per byte received (busy time ÷ requests,
//! ÷ bytes). Both nodes' links (`pod0`, `und0`) run GRO (NAPI) for both contenders: the
//! kernel's overlay aggregates the underlay's segments, and a veth takes XDP redirects only
//! when its peer runs NAPI.
//!
//! With fastpath, every run must show the traffic in the fast path, or the benchmark fails:
//! node a encapsulated and node b decapsulated at least 90% of what pod b received (packets:
//! 0.9 per request; bytes: 90% of iperf3's). At TC, the underlay's GRO aggregates are the
//! kernel's vxlan device's (eBPF on Linux 6.18 cannot clear their tunnel offload state), so
//! node b's share of iperf3's bytes is reported, not required.
//!
//! All of it twice: on bare nodes (no netfilter rules: the kernel's overlay at its leanest),
//! then on nodes with Flannel's netfilter rules (`testkit::vxlan_cases::add_flannel_rules`:
//! the kernel tracks every packet it forwards, sends or receives, as on the Kubernetes nodes
//! ONCache was measured on; the fast path's packets skip the node's netfilter). Each kernel
//! run there must leave its wrk connections in both nodes' connection tracking tables (both
//! flushed before every run), or the benchmark fails.

use std::{fmt::Write as _, fs, time::Instant};

use anyhow::{Context as _, Result, bail};
use fastpath::{
    stats::StatsSnapshot,
    testkit::{
        netns::{Daemon, Netns, TempDir, Topology, find_tools},
        vxlan_cases::{
            OVERLAY_NODES, OverlayNode, Underlay, add_flannel_rules, overlay_daemon_config,
            two_node_overlay,
        },
    },
};
use fastpath_common::{Hook, Verdict, reason};
use serde::{Deserialize, Serialize};

use crate::{
    lb_compare::{Machine, WRK_SCRIPT},
    route_compare::{
        CONNECTIONS, PAGE, ROUNDS, SECS, Spread, interleaved, iperf3_tcp, round_ratios, wrk_rate,
    },
};

const TOOLS: &[&str] = &[
    "iperf3",
    "wrk",
    "nginx",
    "ethtool",
    "ping",
    "bridge",
    "iptables",
    "ip6tables",
    "conntrack",
];

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Contender {
    Kernel,
    /// Encapsulation at the pod link's XDP hook, decapsulation at the underlay's.
    Fastpath,
    /// The same at TC ingress (XDP off).
    FastpathTc,
    /// No overlay: each node's kernel routes the other's pod subnet over the underlay,
    /// unencapsulated (the pods' MTU unchanged). The ceiling of what bypassing the overlay
    /// can gain on these nodes.
    NoOverlay,
}

const CONTENDERS: [Contender; 4] = [
    Contender::Kernel,
    Contender::Fastpath,
    Contender::FastpathTc,
    Contender::NoOverlay,
];

impl Contender {
    fn name(self) -> &'static str {
        match self {
            Contender::Kernel => "kernel vxlan",
            Contender::Fastpath => "kernel vxlan + fastpath flow cache at XDP",
            Contender::FastpathTc => "kernel vxlan + fastpath flow cache at TC ingress",
            Contender::NoOverlay => "no overlay: the kernel routes pod to pod over the underlay",
        }
    }

    /// The hook fastpath encapsulates and decapsulates at.
    fn hook(self) -> Option<Hook> {
        match self {
            Contender::Kernel | Contender::NoOverlay => None,
            Contender::Fastpath => Some(Hook::Xdp),
            Contender::FastpathTc => Some(Hook::TcIngress),
        }
    }
}

/// The nodes' netfilter configuration, the same for every contender.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Nodes {
    /// No rules: the kernel's overlay at its leanest.
    Bare,
    /// Flannel's rules: connection tracking on every packet the kernel handles.
    Flannel,
}

const NODES: [Nodes; 2] = [Nodes::Bare, Nodes::Flannel];

impl Nodes {
    fn name(self) -> &'static str {
        match self {
            Nodes::Bare => "nodes without netfilter rules",
            Nodes::Flannel => "nodes with Flannel's netfilter rules (connection tracking)",
        }
    }
}

/// One contender's results.
#[derive(Debug, Serialize, Deserialize)]
pub struct OverlayRow {
    contender: Contender,
    what: String,
    rr_per_s: Spread,
    /// Whole-machine CPU per request, µs.
    rr_cpu_us: Spread,
    tcp_gbit_s: Spread,
    /// Whole-machine CPU per KB (1000 bytes) received, ns.
    tcp_cpu_ns_per_kb: Spread,
}

#[derive(Default, Debug, Serialize, Deserialize)]
pub struct OverlayReport {
    rounds: usize,
    seconds_per_run: u32,
    /// One comparison per node configuration, in [`NODES`] order.
    settings: Vec<OverlaySetting>,
}

/// The contenders on nodes configured as `nodes`.
#[derive(Debug, Serialize, Deserialize)]
pub struct OverlaySetting {
    nodes: Nodes,
    rows: Vec<OverlayRow>,
    /// Each other contender against the kernel's overlay.
    vs_kernel: Vec<VsKernel>,
}

/// One contender ÷ the kernel's overlay: a fastpath one, or the no-overlay ceiling.
#[derive(Debug, Serialize, Deserialize)]
pub struct VsKernel {
    contender: Contender,
    /// Ratio of medians: requests/s, TCP throughput, CPU per request, CPU per byte.
    ratios: [f64; 4],
    /// Per-round ratios (the two contenders' runs in the same round).
    rr_round_ratios: Vec<f64>,
    gbit_round_ratios: Vec<f64>,
    /// The share of pod b's bytes node b decapsulated in the fast path in the iperf3 runs,
    /// % (median): at TC, GRO aggregates are the kernel's.
    decap_share_percent: f64,
}

/// One contender's numbers in one round.
#[derive(Clone, Copy, Default)]
struct Sample {
    rr: f64,
    rr_cpu_us: f64,
    gbit: f64,
    cpu_ns_per_kb: f64,
    /// Bytes node b decapsulated in the fast path ÷ bytes pod b received in the iperf3 run, %.
    decap_share: f64,
}

struct Bed {
    topo: Topology,
    nodes: Nodes,
    dir: TempDir,
    bin: std::path::PathBuf,
    _nginx: fastpath::testkit::netns::HttpServer,
}

/// Both nodes' daemons, and the hook they work at.
struct Daemons([Daemon; 2], Hook);

impl Daemons {
    fn stats(&self) -> [StatsSnapshot; 2] {
        [self.0[0].stats(), self.0[1].stats()]
    }

    /// The fast path's share of a run: what node a encapsulated and node b decapsulated
    /// since `before`, packets and bytes (of the outer frames).
    fn fast_counts(&self, before: &[StatsSnapshot; 2]) -> [(u64, u64); 2] {
        let after = self.stats();
        let count = |i: usize, code: u32| {
            let c = after[i]
                .delta(&before[i])
                .get(self.1, Verdict::Forward, code);
            (c.packets, c.bytes)
        };
        [count(0, reason::VXLAN_ENCAP), count(1, reason::VXLAN_DECAP)]
    }
}

impl Bed {
    fn new(bin: &std::path::Path, nodes: Nodes) -> Result<Bed> {
        let topo = two_node_overlay(Underlay::V4).context("building the two-node overlay")?;
        if nodes == Nodes::Flannel {
            add_flannel_rules(&topo).context("Flannel's netfilter rules")?;
        }
        for n in &OVERLAY_NODES {
            for dev in ["pod0", "und0"] {
                topo.ns(n.role)
                    .run(&["ethtool", "-K", dev, "gro", "on"])
                    .with_context(|| format!("ethtool on {}'s {dev}", n.role))?;
            }
        }
        let nginx = topo.ns(OVERLAY_NODES[1].pod).http_server(80)?;
        fs::write(nginx.root().join(PAGE), [b'x'; 64]).context("writing the page")?;
        let dir = TempDir::new("ovcmp")?;
        fs::write(dir.join("report.lua"), WRK_SCRIPT).context("writing wrk's script")?;
        Ok(Bed {
            topo,
            nodes,
            dir,
            bin: bin.to_owned(),
            _nginx: nginx,
        })
    }

    fn ns(&self, role: &str) -> &Netns {
        self.topo.ns(role)
    }

    /// With Flannel's rules, empties both nodes' connection tracking tables.
    fn flush_conntrack(&self) -> Result<()> {
        if self.nodes == Nodes::Flannel {
            for n in &OVERLAY_NODES {
                // conntrack -F reports on stderr; an empty table is no error.
                self.ns(n.role)
                    .run(&["conntrack", "-F"])
                    .with_context(|| format!("conntrack -F on {}", n.role))?;
            }
        }
        Ok(())
    }

    /// With Flannel's rules, checks the kernel contender's wrk connections are in both nodes'
    /// connection tracking tables (the baseline paid for them), and the ceiling's in neither.
    fn check_tracked(&self, c: Contender, server: &str) -> Result<()> {
        let untracked = c == Contender::NoOverlay;
        if self.nodes != Nodes::Flannel || !(c == Contender::Kernel || untracked) {
            return Ok(());
        }
        for n in &OVERLAY_NODES {
            let table = self
                .ns(n.role)
                .run(&["conntrack", "-L", "-p", "tcp", "--dport", "80"])
                .with_context(|| format!("conntrack -L on {}", n.role))?;
            let tracked = table
                .lines()
                .filter(|l| l.contains(&format!("dst={server} ")))
                .count();
            let want: usize = CONNECTIONS.parse().context("wrk's connections")?;
            if untracked && tracked > 0 {
                bail!(
                    "{}: node {}'s kernel tracked {tracked} connections to {server}:80: the ceiling must not pay for connection tracking:\n{table}",
                    c.name(),
                    n.role
                );
            }
            if !untracked && tracked < want {
                bail!(
                    "{}: node {}'s kernel tracked {tracked} connections to {server}:80 during wrk's {CONNECTIONS}: Flannel's rules are not in effect:\n{table}",
                    c.name(),
                    n.role
                );
            }
        }
        Ok(())
    }

    fn start(&self, c: Contender) -> Result<Option<Daemons>> {
        if c == Contender::NoOverlay {
            self.route_pods(false)?;
        }
        let Some(hook) = c.hook() else {
            return Ok(None);
        };
        let start = |n: &OverlayNode| {
            let config = overlay_daemon_config(n, hook, Underlay::V4);
            Daemon::try_start(
                &self.bin,
                self.ns(n.role).name(),
                &config.pin_dir,
                &config.to_toml(),
            )
            .with_context(|| format!("starting the fastpath daemon on {}", n.role))
        };
        let [a, b] = &OVERLAY_NODES;
        Ok(Some(Daemons([start(a)?, start(b)?], hook)))
    }

    /// Routes each node's IPv4 route to the other's pod subnet over the overlay (`vxlan0`,
    /// as [`two_node_overlay`] built it) or, for [`Contender::NoOverlay`], straight over
    /// the underlay to the other node, the pods' traffic then exempt from connection tracking
    /// on nodes with Flannel's rules (raw table `NOTRACK`), as the fast path's is.
    fn route_pods(&self, overlay: bool) -> Result<()> {
        let [a, b] = &OVERLAY_NODES;
        for (n, peer) in [(a, b), (b, a)] {
            if self.nodes == Nodes::Flannel {
                let op = if overlay { "-D" } else { "-I" };
                self.ns(n.role)
                    .run(&[
                        "iptables",
                        "-t",
                        "raw",
                        op,
                        "PREROUTING",
                        "-s",
                        "10.10.0.0/16",
                        "-d",
                        "10.10.0.0/16",
                        "-j",
                        "NOTRACK",
                    ])
                    .with_context(|| format!("iptables -t raw {op} on {}", n.role))?;
            }
            let subnet = format!("10.10.{}.0/24", peer.subnet);
            let (via, dev) = if overlay {
                (peer.overlay, "vxlan0")
            } else {
                (peer.underlay, "und0")
            };
            self.ns(n.role)
                .run(&["ip", "route", "replace", &subnet, "via", via, "dev", dev])
                .with_context(|| format!("routing {subnet} on {} via {dev}", n.role))?;
        }
        Ok(())
    }

    /// Stops the daemons (they detach), puts the overlay's routes back, and checks both
    /// nodes are back to the kernel's overlay alone.
    fn stop(&self, c: Contender, daemons: Option<Daemons>) -> Result<()> {
        drop(daemons);
        if c == Contender::NoOverlay {
            self.route_pods(true)?;
        }
        for n in &OVERLAY_NODES {
            for dev in ["pod0", "und0"] {
                let link = self.ns(n.role).link_show(dev)?;
                if link.contains("prog/xdp") {
                    bail!(
                        "an XDP program is still on {}'s {dev} after the daemon stopped:\n{link}",
                        n.role
                    );
                }
            }
        }
        Ok(())
    }

    /// One round of `c`'s runs.
    fn round(&self, c: Contender, daemons: Option<&Daemons>) -> Result<Sample> {
        let [a, b] = &OVERLAY_NODES;
        let (client, server) = (self.ns(a.pod), self.ns(b.pod));
        let server_addr = b.pod_addr();
        // The first packets towards each node take the kernel's path (and teach the fast
        // path its headers): not part of any measurement.
        client
            .run(&["ping", "-c", "3", "-i", "0.2", "-W", "2", &server_addr])
            .context("ping across the overlay")?;
        let mut s = Sample::default();
        self.flush_conntrack()?;
        // Request/response rate.
        let url = format!("http://{server_addr}/{PAGE}");
        let stats_before = daemons.map(Daemons::stats);
        let before = Machine::read()?;
        let started = Instant::now();
        let (rr, requests) =
            wrk_rate(client, &self.dir.join("report.lua"), &url).with_context(|| c.name())?;
        let busy = Machine::read()?
            .since(before)
            .busy_seconds(started.elapsed().as_secs_f64())?;
        s.rr = rr;
        s.rr_cpu_us = busy * 1e6 / requests.max(1) as f64;
        self.check_tracked(c, &server_addr)?;
        if let (Some(d), Some(b0)) = (daemons, &stats_before) {
            let [(encap, _), (decap, _)] = d.fast_counts(b0);
            let least = (0.9 * requests as f64) as u64;
            if encap < least || decap < least {
                bail!(
                    "{}: {requests} requests, but node a encapsulated {encap} packets and node b decapsulated {decap}: the traffic did not take the fast path",
                    c.name()
                );
            }
        }
        // TCP throughput.
        let stats_before = daemons.map(Daemons::stats);
        let before = Machine::read()?;
        let started = Instant::now();
        let (gbit, bytes) = iperf3_tcp(client, server, &server_addr)?;
        let busy = Machine::read()?
            .since(before)
            .busy_seconds(started.elapsed().as_secs_f64())?;
        s.gbit = gbit;
        s.cpu_ns_per_kb = busy * 1e9 / (bytes / 1000.0).max(1.0);
        if let (Some(d), Some(b0)) = (daemons, &stats_before) {
            let [(_, encap), (_, decap)] = d.fast_counts(b0);
            s.decap_share = 100.0 * decap as f64 / bytes.max(1.0);
            // At TC ingress, the underlay's GRO aggregates are the kernel's vxlan device's.
            let decap_checked = d.1 == Hook::Xdp;
            if (encap as f64) < 0.9 * bytes || (decap_checked && (decap as f64) < 0.9 * bytes) {
                bail!(
                    "{}: pod b received {bytes} bytes, but node a encapsulated {encap} bytes and node b decapsulated {decap}: the traffic did not take the fast path",
                    c.name()
                );
            }
        }
        eprintln!(
            "{}, {}: {:.0} req/s ({:.1} µs CPU each), {:.2} Gbit/s ({:.0} ns CPU per KB)",
            self.nodes.name(),
            c.name(),
            s.rr,
            s.rr_cpu_us,
            s.gbit,
            s.cpu_ns_per_kb
        );
        Ok(s)
    }
}

pub fn run(bin: &std::path::Path) -> Result<OverlayReport> {
    find_tools(TOOLS).context("the overlay comparison")?;
    let settings = NODES
        .iter()
        .map(|&nodes| setting(bin, nodes))
        .collect::<Result<_>>()?;
    Ok(OverlayReport {
        rounds: ROUNDS,
        seconds_per_run: SECS,
        settings,
    })
}

/// The interleaved rounds of every contender on nodes configured as `nodes`.
fn setting(bin: &std::path::Path, nodes: Nodes) -> Result<OverlaySetting> {
    let bed = Bed::new(bin, nodes)?;
    let what = format!("overlay comparison, {}", nodes.name());
    let samples = interleaved(&what, &CONTENDERS, |c| {
        let daemons = bed.start(c)?;
        let s = bed.round(c, daemons.as_ref());
        bed.stop(c, daemons)?;
        s
    })?;
    let col = |i: usize, f: fn(&Sample) -> f64| -> Vec<f64> { samples[i].iter().map(f).collect() };
    let rows: Vec<OverlayRow> = CONTENDERS
        .iter()
        .enumerate()
        .map(|(i, &c)| OverlayRow {
            contender: c,
            what: c.name().to_owned(),
            rr_per_s: Spread::of(col(i, |s| s.rr)),
            rr_cpu_us: Spread::of(col(i, |s| s.rr_cpu_us)),
            tcp_gbit_s: Spread::of(col(i, |s| s.gbit)),
            tcp_cpu_ns_per_kb: Spread::of(col(i, |s| s.cpu_ns_per_kb)),
        })
        .collect();
    let vs_kernel = (1..CONTENDERS.len())
        .map(|i| {
            let ratio = |f: fn(&OverlayRow) -> f64| f(&rows[i]) / f(&rows[0]);
            let per_round = |f: fn(&Sample) -> f64| round_ratios(&samples[i], &samples[0], f);
            VsKernel {
                contender: CONTENDERS[i],
                ratios: [
                    ratio(|r| r.rr_per_s.median),
                    ratio(|r| r.tcp_gbit_s.median),
                    ratio(|r| r.rr_cpu_us.median),
                    ratio(|r| r.tcp_cpu_ns_per_kb.median),
                ],
                rr_round_ratios: per_round(|s| s.rr),
                gbit_round_ratios: per_round(|s| s.gbit),
                decap_share_percent: crate::stats(&col(i, |s| s.decap_share)).0,
            }
        })
        .collect();
    Ok(OverlaySetting {
        nodes,
        rows,
        vs_kernel,
    })
}

pub fn markdown(r: &OverlayReport) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "{} rounds · {} s per run · wrk keep-alive, {CONNECTIONS} connections, pod a → pod b · iperf3, one TCP stream\n",
        r.rounds, r.seconds_per_run,
    );
    for setting in &r.settings {
        setting_markdown(&mut md, setting);
    }
    md
}

/// One node configuration's table and ratios.
fn setting_markdown(md: &mut String, r: &OverlaySetting) {
    let _ = writeln!(md, "On {}:\n", r.nodes.name());
    let _ = writeln!(
        md,
        "| contender | requests/s | CPU µs/request | TCP Gbit/s | CPU ns/KB |\n|---|---:|---:|---:|---:|"
    );
    for row in &r.rows {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} |",
            row.what,
            row.rr_per_s.cell(0),
            row.rr_cpu_us.cell(1),
            row.tcp_gbit_s.cell(2),
            row.tcp_cpu_ns_per_kb.cell(0)
        );
    }
    let med = |v: &[f64]| crate::stats(v).0;
    let _ = writeln!(
        md,
        "\n| ÷ kernel vxlan | requests/s (per-round median) | TCP Gbit/s (per-round median) | CPU per request | CPU per byte | node b's decapsulated share of pod b's iperf3 bytes |\n|---|---:|---:|---:|---:|---:|"
    );
    for v in &r.vs_kernel {
        let share = if v.contender.hook().is_some() {
            format!("{:.0}%", v.decap_share_percent)
        } else {
            "—".to_owned()
        };
        let _ = writeln!(
            md,
            "| {} | **{:.2}** ({:.2}) | **{:.2}** ({:.2}) | {:.2} | {:.2} | {share} |",
            v.contender.name(),
            v.ratios[0],
            med(&v.rr_round_ratios),
            v.ratios[1],
            med(&v.gbit_round_ratios),
            v.ratios[2],
            v.ratios[3]
        );
    }
    md.push('\n');
}
