//! Routing through fp, side by side in one run: the kernel's own forwarding vs fastpath's L3
//! stage (`route = true` on both of fp's links, XDP native). One topology, a client and a
//! server namespace on either side of fp; the contenders alternate in interleaved rounds
//! (the first one alternating), each round running, per contender:
//! - packets/s: an in-kernel generator in the client (BPF_PROG_TEST_RUN of an XDP_TX program
//!   in live-frames mode on its veth: frames as a NIC's driver hands them over, no socket or
//!   skb on the sending side) sends 64-byte UDP datagrams (106-byte frames) to the server's
//!   discard port as fast as the path takes them: datagrams the server's stack received per
//!   second (its `Udp NoPorts` counter);
//! - request/response rate: wrk, keep-alive, 16 connections, a 64-byte page from nginx;
//! - TCP throughput: iperf3, one stream, client → server.
//!
//! With fastpath, every run must show the traffic routed at XDP (fp's `routed` counter grows
//! by at least 90% of the packets the server received), or the benchmark fails. The machine's
//! 2 CPUs run the generator, the server and fp's forwarding: the numbers compare the cost of
//! forwarding on one box. Whole-machine CPU time per received datagram is reported next to the
//! rate (busy time ÷ datagrams; the generator's and receiver's share are the same for all).

use std::{fmt::Write as _, fs, path::Path, time::Duration};

use crate::plot::{Bar, Figure};
use anyhow::{Context as _, Result, bail};
use fastpath::testkit::netns::{
    Daemon, DaemonConfig, HookedInterface, Netns, TempDir, Topology, VethEnd, find_tools,
    unique_pin_dir,
};
use fastpath_common::{Hook, Verdict, reason};
use serde::{Deserialize, Serialize};

use fastpath::testkit::{fixture::Fixture, packet::Pkt};

use crate::lb_compare::{Backlog, Machine, WRK_SCRIPT, parse_wrk};

/// Interleaved rounds (routing and overlay comparisons).
pub(crate) const ROUNDS: usize = 3;
pub(crate) const SECS: u32 = 3;
const SERVER4: &str = "10.221.0.2";
pub(crate) const UDP_PAYLOAD: usize = 64;
/// Frames per live-frames call, and per batch within it.
pub(crate) const GEN_CALL: u32 = 1 << 20;
pub(crate) const GEN_BATCH: u32 = 64;
pub(crate) const CONNECTIONS: &str = "16";
pub(crate) const PAGE: &str = "small.html";
const TOOLS: &[&str] = &["iperf3", "wrk", "nginx", "ethtool", "cat"];

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Contender {
    Kernel,
    /// `route = true`, routed at XDP (native).
    Fastpath,
    /// `route = true` with `xdp = "off"`: routed at TC ingress.
    FastpathTc,
}

const CONTENDERS: [Contender; 3] = [
    Contender::Kernel,
    Contender::Fastpath,
    Contender::FastpathTc,
];

impl Contender {
    fn name(self) -> &'static str {
        match self {
            Contender::Kernel => "kernel forwarding",
            Contender::Fastpath => "fastpath, route at XDP",
            Contender::FastpathTc => "fastpath, route at TC ingress",
        }
    }

    /// The hook fastpath routes at.
    fn hook(self) -> Option<Hook> {
        match self {
            Contender::Kernel => None,
            Contender::Fastpath => Some(Hook::Xdp),
            Contender::FastpathTc => Some(Hook::TcIngress),
        }
    }
}

/// Median and min–max of one metric over the rounds.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct Spread {
    pub(crate) median: f64,
    pub(crate) min: f64,
    pub(crate) max: f64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    samples: Vec<f64>,
}

impl Spread {
    /// Its table cell, `median (min–max)`.
    pub(crate) fn cell(&self, digits: usize) -> String {
        crate::cell(self.median, self.min, self.max, digits)
    }

    pub(crate) fn of(samples: Vec<f64>) -> Spread {
        let (median, min, max) = crate::stats(&samples);
        Spread {
            median,
            min,
            max,
            samples,
        }
    }
}

/// One contender's results.
#[derive(Debug, Serialize, Deserialize)]
pub struct RouteRow {
    contender: Contender,
    what: String,
    udp_pps: Spread,
    /// Datagrams fp's first link took but the server did not receive, in % of those taken
    /// (median over rounds): what the path dropped on the way.
    udp_loss_percent: f64,
    /// Whole-machine CPU per received datagram, ns.
    udp_cpu_ns_per_packet: Spread,
    rr_per_s: Spread,
    tcp_gbit_s: Spread,
}

#[derive(Default, Debug, Serialize, Deserialize)]
pub struct RouteReport {
    rounds: usize,
    seconds_per_run: u32,
    rows: Vec<RouteRow>,
    /// Each fastpath contender against the kernel.
    vs_kernel: Vec<VsKernel>,
}

/// One fastpath contender ÷ the kernel.
#[derive(Debug, Serialize, Deserialize)]
pub struct VsKernel {
    contender: Contender,
    /// Ratio of medians: packets/s, request/response rate, TCP throughput, CPU per packet.
    ratios: [f64; 4],
    /// Per-round ratios (the two contenders' runs in the same round): packets/s, requests/s.
    pps_round_ratios: Vec<f64>,
    rr_round_ratios: Vec<f64>,
}

/// One contender's numbers in one round.
#[derive(Clone, Copy, Default)]
struct Sample {
    pps: f64,
    loss_pct: f64,
    cpu_ns: f64,
    rr: f64,
    gbit: f64,
}

/// The in-kernel traffic generator (`Fixture::transmit_live`: BPF_PROG_TEST_RUN of an XDP_TX
/// program in live-frames mode), loaded once so that no verification happens in a run.
pub(crate) struct Generator(Fixture);

impl Generator {
    pub(crate) fn load() -> Result<Generator> {
        Ok(Generator(Fixture::new().context("loading the generator")?))
    }

    /// Sends `frame` out of `iface` of `ns` for [`SECS`] seconds, in calls of [`GEN_CALL`]
    /// frames: frames sent, seconds taken, and the machine's CPU use over those seconds.
    pub(crate) fn run(
        &mut self,
        ns: &Netns,
        iface: &str,
        frame: &[u8],
    ) -> Result<(u64, f64, Machine)> {
        let fx = &mut self.0;
        ns.in_netns(|| -> Result<(u64, f64, Machine)> {
            let ifindex = fastpath::sys::ifindex(iface)
                .with_context(|| format!("no {iface} in {}", ns.name()))?;
            let before = Machine::read()?;
            let started = std::time::Instant::now();
            let mut sent = 0u64;
            while started.elapsed() < Duration::from_secs(u64::from(SECS)) {
                fx.transmit_live(ifindex, frame, GEN_CALL, GEN_BATCH)
                    .context("the live-frames generator")?;
                sent += u64::from(GEN_CALL);
            }
            let secs = started.elapsed().as_secs_f64();
            Ok((sent, secs, Machine::read()?.since(before)))
        })?
    }
}

struct Bed {
    topo: Topology,
    dir: TempDir,
    /// The generator's frame: client → server, UDP to the discard port.
    frame: Vec<u8>,
    generator: std::sync::Mutex<Generator>,
    bin: std::path::PathBuf,
    _nginx: fastpath::testkit::netns::HttpServer,
}

impl Bed {
    fn new(bin: &Path) -> Result<Bed> {
        let mut topo = Topology::new();
        for role in ["client", "fp", "server"] {
            topo.add_ns(role)?;
        }
        topo.ns("fp").sysctl("net.ipv4.ip_forward", "1")?;
        topo.veth(
            VethEnd::new("client", "eth0").addr("10.220.0.2/24"),
            VethEnd::new("fp", "c0").addr("10.220.0.1/24"),
        )?;
        topo.veth(
            VethEnd::new("fp", "s0").addr("10.221.0.1/24"),
            VethEnd::new("server", "eth0").addr(&format!("{SERVER4}/24")),
        )?;
        topo.ns("client").add_route("default", "10.220.0.1")?;
        topo.ns("server").add_route("default", "10.221.0.1")?;
        // Both contenders alike: full checksums (as from a wire, which XDP needs) and GRO on
        // the outer ends (a veth takes XDP redirects only when its peer runs NAPI).
        for role in ["client", "server"] {
            topo.ns(role)
                .run(&[
                    "ethtool", "-K", "eth0", "tx", "off", "rx", "off", "gro", "on",
                ])
                .with_context(|| format!("ethtool in {role}"))?;
        }
        // The frames of the generator arrive at fp's c0 as XDP frames: it needs NAPI too.
        topo.ns("fp")
            .run(&["ethtool", "-K", "c0", "gro", "on"])
            .context("ethtool in fp")?;
        let frame = Pkt::eth()
            .macs(mac(topo.ns("fp"), "c0")?, mac(topo.ns("client"), "eth0")?)
            .ipv4([10, 220, 0, 2], [10, 221, 0, 2])
            .udp(40000, 9)
            .payload(&[0x5a; UDP_PAYLOAD])
            .build();
        let nginx = topo.ns("server").http_server(80)?;
        fs::write(nginx.root().join(PAGE), [b'x'; 64]).context("writing the page")?;
        let dir = TempDir::new("rtcmp")?;
        fs::write(dir.join("report.lua"), WRK_SCRIPT).context("writing wrk's script")?;
        Ok(Bed {
            topo,
            dir,
            frame,
            generator: std::sync::Mutex::new(Generator::load()?),
            bin: bin.to_owned(),
            _nginx: nginx,
        })
    }

    fn ns(&self, role: &str) -> &Netns {
        self.topo.ns(role)
    }

    fn start(&self, c: Contender) -> Result<Option<Daemon>> {
        let Some(hook) = c.hook() else {
            return Ok(None);
        };
        let mut config = DaemonConfig::new(&unique_pin_dir("rtcmp"));
        for iface in ["c0", "s0"] {
            config = config
                .hooks(HookedInterface {
                    name: iface.into(),
                    xdp: if hook == Hook::Xdp { "native" } else { "off" },
                    tc_ingress: true,
                    tc_egress: false,
                })
                .interface_key(iface, "route = true")
                // Routing alone, as the kernel contender does it (no connection tracking).
                .interface_key(iface, "conntrack = false");
        }
        let daemon = Daemon::try_start(
            &self.bin,
            self.ns("fp").name(),
            &config.pin_dir,
            &config.to_toml(),
        )
        .context("starting the fastpath daemon")?;
        for iface in ["c0", "s0"] {
            let link = self.ns("fp").link_show(iface)?;
            if (hook == Hook::Xdp) != link.contains("prog/xdp") || link.contains("xdpgeneric") {
                bail!(
                    "fastpath's XDP attachment on fp's {iface} is not what {} needs:\n{link}",
                    c.name()
                );
            }
        }
        Ok(Some(daemon))
    }

    /// Stops the daemon (it detaches) and checks fp is back to plain forwarding.
    fn stop(&self, daemon: Option<Daemon>) -> Result<()> {
        drop(daemon);
        for iface in ["c0", "s0"] {
            let link = self.ns("fp").link_show(iface)?;
            if link.contains("prog/xdp") {
                bail!("an XDP program is still on fp's {iface} after the daemon stopped:\n{link}");
            }
        }
        Ok(())
    }

    /// One round of `c`'s three runs.
    fn round(&self, c: Contender, daemon: Option<&Daemon>) -> Result<Sample> {
        let mut s = Sample::default();
        let hook = c.hook().unwrap_or(Hook::Xdp);
        let routed = |d: &Daemon| {
            d.stats()
                .get(hook, Verdict::Forward, reason::ROUTED)
                .packets
        };
        // Packets/s.
        let routed_before = daemon.map(routed).unwrap_or(0);
        let got_before = udp_no_ports(self.ns("server"))?;
        let taken_before = xdp_xmit(self.ns("client"))?;
        let (generated, secs, m) = self
            .generator
            .lock()
            .map_err(|_| anyhow::anyhow!("the generator's lock is poisoned"))?
            .run(self.ns("client"), "eth0", &self.frame)?;
        // What fp's c0 took: the generator runs faster than the path, and a full receive
        // ring refuses the rest at once (generator overrun, not loss on the path).
        let sent = xdp_xmit(self.ns("client"))? - taken_before;
        // The last frames may still be on their way.
        std::thread::sleep(Duration::from_millis(200));
        let received = (udp_no_ports(self.ns("server"))? - got_before) as f64;
        if received <= 0.0 || secs <= 0.0 || sent == 0 {
            bail!(
                "{}: {received} datagrams arrived of {sent} fp took ({generated} generated)",
                c.name()
            );
        }
        let lost = (sent as f64 - received).max(0.0);
        let sent = sent as f64;
        s.pps = received / secs;
        s.loss_pct = 100.0 * lost / sent;
        s.cpu_ns = m.busy_seconds(secs)? * 1e9 / received;
        if let Some(d) = daemon {
            let got = routed(d) - routed_before;
            if (got as f64) < 0.9 * received {
                bail!(
                    "{} routed {got} packets while the server received {received} datagrams: the traffic did not take the fast path",
                    c.name()
                );
            }
        }
        // Request/response rate.
        let url = format!("http://{SERVER4}/{PAGE}");
        s.rr = wrk_rate(self.ns("client"), &self.dir.join("report.lua"), &url)
            .with_context(|| c.name())?
            .0;
        // TCP throughput.
        s.gbit = iperf3_tcp(self.ns("client"), self.ns("server"), SERVER4)?.0;
        eprintln!(
            "{}: {:.0} datagrams/s received ({:.1}% lost, {:.0} ns CPU each), {:.0} req/s, {:.2} Gbit/s",
            c.name(),
            s.pps,
            s.loss_pct,
            s.cpu_ns,
            s.rr,
            s.gbit
        );
        Ok(s)
    }
}

/// wrk, keep-alive, [`CONNECTIONS`] connections, one thread, [`SECS`] seconds from `client`
/// to `url` with [`WRK_SCRIPT`] at `script`: requests/s and requests done. Fails on any socket
/// error or non-2xx answer.
pub(crate) fn wrk_rate(client: &Netns, script: &Path, url: &str) -> Result<(f64, u64)> {
    let secs = format!("{SECS}s");
    let out = client.exec_timeout(
        &[
            "wrk",
            "-t1",
            "-c",
            CONNECTIONS,
            "-d",
            &secs,
            "-s",
            script.to_str().context("non-UTF-8 temp path")?,
            url,
        ],
        Duration::from_secs(u64::from(SECS) + 30),
    )?;
    let run = parse_wrk(&String::from_utf8_lossy(&out.stdout))?;
    if run.socket_errors() > 0 || run.non_2xx > 0 {
        bail!("wrk saw errors: {run:?}");
    }
    Ok((run.requests as f64 / run.duration_s, run.requests))
}

/// iperf3, one TCP stream for [`SECS`] seconds, `client` → `addr` (in `server`): Gbit/s and
/// bytes the server received.
pub(crate) fn iperf3_tcp(client: &Netns, server: &Netns, addr: &str) -> Result<(f64, f64)> {
    let mut listener = server
        .spawn(&["iperf3", "-s", "-1", "-B", addr])
        .context("starting iperf3 -s")?;
    server.wait_listening("tcp", 5201, Duration::from_secs(10))?;
    let secs = SECS.to_string();
    let cmd = ["iperf3", "-c", addr, "-t", &secs, "-J"];
    let out = client.exec_timeout(&cmd, Duration::from_secs(u64::from(SECS) + 30))?;
    let _ = listener.wait_exit(Duration::from_secs(5));
    listener.kill();
    if !out.status.success() {
        bail!(
            "{cmd:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("parsing iperf3 -J")?;
    let field = |name: &str| {
        v.pointer(&format!("/end/sum_received/{name}"))
            .and_then(serde_json::Value::as_f64)
            .with_context(|| format!("no end.sum_received.{name} in iperf3's TCP report"))
    };
    Ok((field("bits_per_second")? / 1e9, field("bytes")?))
}

/// The MAC address of `dev` in `ns`.
pub(crate) fn mac(ns: &Netns, dev: &str) -> Result<[u8; 6]> {
    let json = ns.ip(&["-j", "link", "show", "dev", dev])?;
    let v: serde_json::Value = serde_json::from_str(&json).context("parsing `ip -j link`")?;
    let text = v
        .pointer("/0/address")
        .and_then(serde_json::Value::as_str)
        .with_context(|| format!("no address for {dev}: {json}"))?;
    let bytes: Vec<u8> = text
        .split(':')
        .map(|b| u8::from_str_radix(b, 16))
        .collect::<Result<_, _>>()
        .with_context(|| format!("MAC address {text:?}"))?;
    <[u8; 6]>::try_from(bytes.as_slice()).with_context(|| format!("MAC address {text:?}"))
}

/// Frames the client's eth0 handed to its peer (fp's c0) from XDP (`ethtool -S`: the
/// `tx_queue_N_xdp_xmit` counters, summed).
fn xdp_xmit(ns: &Netns) -> Result<u64> {
    let stats = ns.run(&["ethtool", "-S", "eth0"])?;
    let counters: Vec<u64> = stats
        .lines()
        .filter_map(|l| l.trim().split_once(':'))
        .filter(|(k, _)| k.starts_with("tx_queue_") && k.ends_with("_xdp_xmit"))
        .filter_map(|(_, v)| v.trim().parse().ok())
        .collect();
    if counters.is_empty() {
        bail!("no tx_queue_N_xdp_xmit counter in `ethtool -S eth0`:\n{stats}");
    }
    Ok(counters.iter().sum())
}

/// Datagrams `ns`'s stack received for a port nothing listens on (/proc/net/snmp, `Udp:
/// NoPorts`): the generator's, counted where they end.
pub(crate) fn udp_no_ports(ns: &Netns) -> Result<u64> {
    let snmp = ns.run(&["cat", "/proc/net/snmp"])?;
    let mut udp = snmp.lines().filter(|l| l.starts_with("Udp: "));
    let (Some(names), Some(values)) = (udp.next(), udp.next()) else {
        bail!("no Udp lines in /proc/net/snmp");
    };
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .find(|(n, _)| *n == "NoPorts")
        .and_then(|(_, v)| v.parse().ok())
        .context("no Udp NoPorts in /proc/net/snmp")
}

/// [`ROUNDS`] interleaved rounds, every contender once per round (the first one alternating):
/// each contender's samples, in `contenders` order.
pub(crate) fn interleaved<C: Copy, S>(
    what: &str,
    contenders: &[C],
    mut run: impl FnMut(C) -> Result<S>,
) -> Result<Vec<Vec<S>>> {
    let n = contenders.len();
    let mut samples: Vec<Vec<S>> = (0..n).map(|_| Vec::new()).collect();
    for round in 0..ROUNDS {
        eprintln!("{what}, round {} of {ROUNDS}", round + 1);
        for k in 0..n {
            let i = (k + round) % n;
            samples[i].push(run(contenders[i])?);
        }
    }
    Ok(samples)
}

pub fn run(bin: &Path) -> Result<RouteReport> {
    find_tools(TOOLS).context("the routing comparison")?;
    let _backlog = Backlog::raise()?;
    let bed = Bed::new(bin)?;
    let n = CONTENDERS.len();
    let samples = interleaved("routing comparison", &CONTENDERS, |c| {
        let daemon = bed.start(c)?;
        let s = bed.round(c, daemon.as_ref());
        bed.stop(daemon)?;
        s
    })?;
    let col = |i: usize, f: fn(&Sample) -> f64| -> Vec<f64> { samples[i].iter().map(f).collect() };
    let rows: Vec<RouteRow> = CONTENDERS
        .iter()
        .enumerate()
        .map(|(i, &c)| RouteRow {
            contender: c,
            what: c.name().to_owned(),
            udp_pps: Spread::of(col(i, |s| s.pps)),
            udp_loss_percent: crate::stats(&col(i, |s| s.loss_pct)).0,
            udp_cpu_ns_per_packet: Spread::of(col(i, |s| s.cpu_ns)),
            rr_per_s: Spread::of(col(i, |s| s.rr)),
            tcp_gbit_s: Spread::of(col(i, |s| s.gbit)),
        })
        .collect();
    let vs_kernel = (1..n)
        .map(|i| {
            let ratio = |f: fn(&RouteRow) -> f64| f(&rows[i]) / f(&rows[0]);
            let per_round = |f: fn(&Sample) -> f64| round_ratios(&samples[i], &samples[0], f);
            VsKernel {
                contender: CONTENDERS[i],
                ratios: [
                    ratio(|r| r.udp_pps.median),
                    ratio(|r| r.rr_per_s.median),
                    ratio(|r| r.tcp_gbit_s.median),
                    ratio(|r| r.udp_cpu_ns_per_packet.median),
                ],
                pps_round_ratios: per_round(|s| s.pps),
                rr_round_ratios: per_round(|s| s.rr),
            }
        })
        .collect();
    Ok(RouteReport {
        rounds: ROUNDS,
        seconds_per_run: SECS,
        rows,
        vs_kernel,
    })
}

pub fn markdown(r: &RouteReport) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "{} rounds · {} s per run · UDP: {UDP_PAYLOAD}-byte datagrams, batches of {GEN_BATCH} · wrk keep-alive, {CONNECTIONS} connections · iperf3, one TCP stream\n",
        r.rounds, r.seconds_per_run
    );
    let _ = writeln!(
        md,
        "| contender | UDP datagrams/s | loss | CPU ns/datagram | requests/s | TCP Gbit/s |\n|---|---:|---:|---:|---:|---:|"
    );
    for row in &r.rows {
        let _ = writeln!(
            md,
            "| {} | {} | {:.1}% | {} | {} | {} |",
            row.what,
            row.udp_pps.cell(0),
            row.udp_loss_percent,
            row.udp_cpu_ns_per_packet.cell(0),
            row.rr_per_s.cell(0),
            row.tcp_gbit_s.cell(2)
        );
    }
    let med = |v: &[f64]| crate::stats(v).0;
    let _ = writeln!(
        md,
        "\n| ÷ kernel | datagrams/s (per-round median) | requests/s (per-round median) | TCP Gbit/s | CPU per datagram |\n|---|---:|---:|---:|---:|"
    );
    for v in &r.vs_kernel {
        let _ = writeln!(
            md,
            "| {} | **{:.2}** ({:.2}) | **{:.2}** ({:.2}) | {:.2} | {:.2} |",
            v.contender.name(),
            v.ratios[0],
            med(&v.pps_round_ratios),
            v.ratios[1],
            med(&v.rr_round_ratios),
            v.ratios[2],
            v.ratios[3]
        );
    }
    md.push('\n');
    md
}

/// Per round, `f` of a contender's sample ÷ `f` of the baseline's sample of the same round.
pub fn round_ratios<S>(of: &[S], base: &[S], f: fn(&S) -> f64) -> Vec<f64> {
    of.iter().zip(base).map(|(x, b)| f(x) / f(b)).collect()
}

/// The routing comparison's chart: datagrams/s.
pub fn figures(r: &RouteReport) -> Vec<Figure> {
    let bars: Vec<Bar> = r
        .rows
        .iter()
        .map(|row| {
            let s = &row.udp_pps;
            Bar::new(
                row.what.as_str(),
                (s.median, s.min, s.max),
                row.contender != Contender::Kernel,
            )
        })
        .collect();
    if bars.is_empty() {
        return Vec::new();
    }
    vec![Figure::bars(
        "route_pps.svg",
        "Routing: 64-byte UDP datagrams/s",
        "datagrams/s",
        &bars,
        None,
    )]
}
