//! The load balancers over 1, 1k, 10k and 100k services: new connections/s (wrk, a TCP
//! connection per request) and small-UDP packets/s (the in-kernel generator of
//! `route_compare`), with the whole machine's CPU time per connection and per datagram, on the
//! load-balancer comparison's topology (`lb_compare::Bench`). Each contender holds the other
//! services the way it holds many (see `Bench::setup`); only the measured one carries traffic,
//! so what grows is the lookup: kube-proxy's iptables chain is walked rule by rule for every
//! new connection, nftables' verdict map, HAProxy's address tree and fastpath's hash map are
//! looked up.
//!
//! Rounds interleave everything: every round runs every service count and, in each, every
//! contender (the first one rotating). Plain kernel forwarding straight to one backend is the
//! baseline, at one service (it has none).

use std::{fmt::Write as _, time::Duration};

use crate::plot::{Figure, Series};
use anyhow::{Context as _, Result, bail};
use aya::programs::xdp::XdpLinkId;
use fastpath::testkit::{
    fixture::XdpSink,
    netns::{LbTopology, Netns},
    packet::Pkt,
};
use fastpath_common::{Hook, Verdict, reason};
use serde::{Deserialize, Serialize};

use crate::{
    lb_compare::{Bench, Contender, Mode, Running, Samples, UDP_PORT},
    route_compare::{GEN_BATCH, Generator, SECS, Spread, UDP_PAYLOAD, mac, udp_no_ports},
};

/// Service counts swept.
const SERVICES: [usize; 4] = [1, 1_000, 10_000, 100_000];
/// Measured rounds.
const ROUNDS: usize = 3;
/// The contenders, in their first round's order; `Direct` runs at one service only.
const CONTENDERS: [Contender; 6] = [
    Contender::Direct,
    Contender::Fastpath,
    Contender::Iptables,
    Contender::Nftables,
    Contender::Haproxy,
    Contender::FastpathTc,
];

/// One contender at one service count.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct SweepRow {
    contender: String,
    what: String,
    services: usize,
    new_conn_per_s: Spread,
    /// Whole-machine CPU µs per connection (busy CPU time ÷ requests).
    cpu_us_per_conn: Spread,
    /// wrk's request latency (connection, request, response), medians over rounds of each
    /// run's p50 and p99, µs.
    #[serde(default)]
    latency_us: [f64; 2],
    /// Datagrams/s the backends received; `None` where the contender does not balance UDP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    udp_pps: Option<Spread>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cpu_ns_per_datagram: Option<Spread>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    udp_loss_pct: Option<Spread>,
    /// The same generator with the backends' links sinking the datagrams at XDP
    /// (`bench_xdp_sink`): datagrams/s they dropped, whole-machine CPU ns per datagram, loss.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sink_pps: Option<Spread>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sink_cpu_ns_per_datagram: Option<Spread>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sink_loss_pct: Option<Spread>,
    /// Seconds from starting the setup (rules loaded, daemon started) to ready.
    setup_s: Spread,
}

#[derive(Debug, Default, Serialize, Deserialize)]
pub struct SweepReport {
    rounds: usize,
    seconds_per_run: u32,
    services: Vec<usize>,
    rows: Vec<SweepRow>,
}

/// One contender's samples at one service count.
#[derive(Default)]
struct Cell {
    wrk: Samples,
    /// UDP samples by [`Sink`].
    udp: [Udp; 2],
    setup_s: Vec<f64>,
}

/// One contender's UDP samples at one service count, for one [`Sink`].
#[derive(Default)]
struct Udp {
    pps: Vec<f64>,
    cpu_ns: Vec<f64>,
    loss: Vec<f64>,
}

/// Where the backends take the generator's datagrams.
#[derive(Clone, Copy, PartialEq)]
enum Sink {
    /// Their UDP stacks (the discard port has no socket: counted as `Udp NoPorts`).
    Stack = 0,
    /// `bench_xdp_sink` on their links, before any skb exists (counted as the veth's
    /// `xdp_drops`), as a traffic generator's receiving port takes them: what is measured
    /// is the load balancer and the generator.
    Xdp = 1,
}

fn balances_udp(c: Contender) -> bool {
    c != Contender::Haproxy
}

/// Where `c`'s UDP runs deliver. fastpath at TC ingress hands each translated datagram
/// straight to the backend's ingress (`bpf_redirect_peer`), past the XDP hook of the
/// backend's link, where the sinks are: it runs to the stacks only.
fn sinks(c: Contender) -> &'static [Sink] {
    if c == Contender::FastpathTc {
        &[Sink::Stack]
    } else {
        &[Sink::Stack, Sink::Xdp]
    }
}

pub fn run(bin: &std::path::Path) -> Result<SweepReport> {
    let mut bench = Bench::new(bin)?;
    // fastpath as a load-balancing appliance runs: it routes what it translates at XDP.
    bench.routes_in_fast_path = true;
    // wrk runs as long as the generator, the report's one `seconds_per_run`.
    bench.duration_s = SECS;
    let topo = bench.topology();
    // A veth takes XDP frames only when its receiving end runs NAPI (GRO on): the
    // generator's on fp's client link, fastpath's redirects on the client's and the
    // backends' links. On for every contender alike (a NIC needs nothing of the kind).
    let mut gro = vec![
        (topo.client(), LbTopology::HOST_IF.to_owned()),
        (topo.fp(), LbTopology::FP_CLIENT_IF.to_owned()),
    ];
    for i in 0..topo.backends() {
        gro.push((topo.backend(i), LbTopology::HOST_IF.to_owned()));
    }
    for (ns, dev) in &gro {
        let dev = dev.as_str();
        ns.run(&["ethtool", "-K", dev, "gro", "on"])
            .with_context(|| format!("turning GRO on on {dev}"))?;
    }
    let frame = |to: std::net::Ipv4Addr| -> Result<Vec<u8>> {
        Ok(Pkt::eth()
            .macs(
                mac(topo.fp(), LbTopology::FP_CLIENT_IF)?,
                mac(topo.client(), LbTopology::HOST_IF)?,
            )
            .ipv4(LbTopology::client_v4().octets(), to.octets())
            .udp(40000, UDP_PORT)
            .payload(&[0x5a; UDP_PAYLOAD])
            .build())
    };
    let mut generator = Generator::load()?;
    let mut xdp_sink = XdpSink::load().context("loading the XDP sink")?;
    let mut cells: Vec<Vec<Cell>> = SERVICES
        .iter()
        .map(|_| CONTENDERS.iter().map(|_| Cell::default()).collect())
        .collect();
    for round in 0..ROUNDS {
        for (si, &services) in SERVICES.iter().enumerate() {
            eprintln!(
                "lb-sweep: round {} of {ROUNDS}, {services} services",
                round + 1
            );
            for k in 0..CONTENDERS.len() {
                let ci = (k + round) % CONTENDERS.len();
                let c = CONTENDERS[ci];
                if c == Contender::Direct && services > 1 {
                    continue;
                }
                let cell = &mut cells[si][ci];
                let started = std::time::Instant::now();
                let frame = frame(c.target())?;
                let mut setup_s = 0.0;
                bench
                    .measure_with(
                        c,
                        services,
                        &[Mode::NewConnection],
                        &mut cell.wrk,
                        |running| {
                            if balances_udp(c) {
                                for &sink in sinks(c) {
                                    let _sinks = match sink {
                                        Sink::Xdp => Some(Sinks::attach(&mut xdp_sink, topo)?),
                                        Sink::Stack => None,
                                    };
                                    let (pps, cpu_ns, loss) =
                                        udp_run(topo, &frame, c, running, sink, &mut generator)?;
                                    let udp = &mut cell.udp[sink as usize];
                                    udp.pps.push(pps);
                                    udp.cpu_ns.push(cpu_ns);
                                    udp.loss.push(loss);
                                }
                            }
                            Ok(())
                        },
                        |ready| setup_s = ready.as_secs_f64(),
                    )
                    .with_context(|| {
                        format!(
                            "{} with {services} services (round {})",
                            c.what(),
                            round + 1
                        )
                    })?;
                cell.setup_s.push(setup_s);
                eprintln!(
                    "  {} at {services}: set up in {setup_s:.2} s, {:.0} s in all",
                    c.key(),
                    started.elapsed().as_secs_f64()
                );
            }
        }
    }
    drop(bench);
    let mut rows = Vec::new();
    for (si, &services) in SERVICES.iter().enumerate() {
        for (ci, &c) in CONTENDERS.iter().enumerate() {
            let mut cell = std::mem::take(&mut cells[si][ci]);
            // A run of one mode is filed with the extra runs (see `Bench::measure_running`).
            if cell.wrk.new_connection_extra.is_empty() {
                continue;
            }
            let udp = |v: Vec<f64>| (!v.is_empty()).then(|| Spread::of(v));
            rows.push(SweepRow {
                contender: c.key().to_owned(),
                what: c.what().to_owned(),
                services,
                new_conn_per_s: Spread::of(cell.wrk.new_connection_extra),
                cpu_us_per_conn: Spread::of(
                    cell.wrk.cpu_us_per_request[Mode::NewConnection as usize].clone(),
                ),
                latency_us: {
                    let runs = &cell.wrk.latency_us[Mode::NewConnection as usize];
                    let p =
                        |i: usize| crate::stats(&runs.iter().map(|l| l[i]).collect::<Vec<_>>()).0;
                    [p(0), p(1)]
                },
                udp_pps: udp(std::mem::take(&mut cell.udp[0].pps)),
                cpu_ns_per_datagram: udp(std::mem::take(&mut cell.udp[0].cpu_ns)),
                udp_loss_pct: udp(std::mem::take(&mut cell.udp[0].loss)),
                sink_pps: udp(std::mem::take(&mut cell.udp[1].pps)),
                sink_cpu_ns_per_datagram: udp(std::mem::take(&mut cell.udp[1].cpu_ns)),
                sink_loss_pct: udp(std::mem::take(&mut cell.udp[1].loss)),
                setup_s: Spread::of(cell.setup_s),
            });
        }
    }
    Ok(SweepReport {
        rounds: ROUNDS,
        seconds_per_run: SECS,
        services: SERVICES.to_vec(),
        rows,
    })
}

/// `bench_xdp_sink` on every backend's link, for as long as the value lives.
struct Sinks<'a> {
    sink: &'a mut XdpSink,
    links: Vec<XdpLinkId>,
}

impl<'a> Sinks<'a> {
    fn attach(sink: &'a mut XdpSink, topo: &LbTopology) -> Result<Sinks<'a>> {
        let mut sinks = Sinks {
            sink,
            links: Vec::new(),
        };
        for i in 0..topo.backends() {
            let sink = &mut *sinks.sink;
            let link = topo.backend(i).in_netns(|| -> Result<XdpLinkId> {
                let ifindex =
                    fastpath::sys::ifindex(LbTopology::HOST_IF).context("no eth0 in a backend")?;
                sink.attach(ifindex)
                    .context("attaching the XDP sink to a backend's link")
            })??;
            sinks.links.push(link);
        }
        Ok(sinks)
    }
}

impl Drop for Sinks<'_> {
    fn drop(&mut self) {
        for link in self.links.drain(..) {
            if let Err(e) = self.sink.detach(link) {
                eprintln!("lb-sweep: detaching an XDP sink: {e}");
            }
        }
    }
}

/// Datagrams a backend's link dropped at XDP (the veth's `xdp_drops`, over its queues).
fn xdp_drops(ns: &Netns) -> Result<u64> {
    let out = ns.run(&["ethtool", "-S", LbTopology::HOST_IF])?;
    let mut n = 0;
    for line in out.lines() {
        if let Some((name, v)) = line.split_once(':')
            && name.trim().ends_with("_xdp_drops")
        {
            n += v
                .trim()
                .parse::<u64>()
                .with_context(|| format!("{line:?}"))?;
        }
    }
    Ok(n)
}

/// The generator for [`SECS`] seconds from the client to `c`'s target, UDP port
/// [`UDP_PORT`]: datagrams/s the backends received at `sink`, whole-machine CPU ns per
/// datagram, and the share lost between fp's client link and the backends.
fn udp_run(
    topo: &LbTopology,
    frame: &[u8],
    c: Contender,
    running: &Running,
    sink: Sink,
    generator: &mut Generator,
) -> Result<(f64, f64, f64)> {
    let received_now = || -> Result<u64> {
        (0..topo.backends())
            .map(|i| match sink {
                Sink::Stack => udp_no_ports(topo.backend(i)),
                Sink::Xdp => xdp_drops(topo.backend(i)),
            })
            .sum()
    };
    let hook = if c == Contender::FastpathTc {
        Hook::TcIngress
    } else {
        Hook::Xdp
    };
    let lb_packets = || -> Result<Option<u64>> {
        Ok(match running {
            // Translated and routed where fp's links track.
            Running::Daemon(d, _) => Some(
                d.stats()
                    .get(hook, Verdict::Forward, reason::LB_TO_BACKEND)
                    .packets,
            ),
            _ => None,
        })
    };
    let lb_before = lb_packets()?;
    let got_before = received_now()?;
    let taken_before = fp_rx_packets(topo.fp())?;
    let (sent, secs, m) = generator.run(topo.client(), LbTopology::HOST_IF, frame)?;
    // The last frames may still be on their way.
    std::thread::sleep(Duration::from_millis(200));
    let taken = fp_rx_packets(topo.fp())? - taken_before;
    let received = received_now()? - got_before;
    if received == 0 || secs <= 0.0 {
        bail!(
            "{}: the backends received none of the {sent} datagrams generated ({taken} taken by fp)",
            c.key()
        );
    }
    if let (Some(b), Some(a)) = (lb_before, lb_packets()?) {
        let lb = a - b;
        if (lb as f64) < 0.9 * received as f64 {
            bail!(
                "fastpath translated and forwarded {lb} packets at {hook:?} while the backends received {received} datagrams: the traffic did not take the fast path"
            );
        }
    }
    let received = received as f64;
    let loss = 100.0 * (taken as f64 - received).max(0.0) / (taken as f64).max(1.0);
    let pps = received / secs;
    let cpu_ns = m.busy_seconds(secs)? * 1e9 / received;
    eprintln!(
        "  {}: {pps:.0} datagrams/s at the backends' {} ({loss:.1}% of what fp took lost, {cpu_ns:.0} ns CPU each)",
        c.key(),
        match sink {
            Sink::Stack => "stacks",
            Sink::Xdp => "XDP sinks",
        }
    );
    Ok((pps, cpu_ns, loss))
}

/// Packets fp's client link received (its XDP program, or the stack, took them).
fn fp_rx_packets(fp: &Netns) -> Result<u64> {
    let path = format!(
        "/sys/class/net/{}/statistics/rx_packets",
        LbTopology::FP_CLIENT_IF
    );
    let out = fp.run(&["cat", &path])?;
    out.trim()
        .parse()
        .with_context(|| format!("{path}: {out:?}"))
}

/// The sweep's tables.
pub fn markdown(r: &SweepReport) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "services {} · {} rounds · wrk and each UDP run {} s after a 1 s warm-up · UDP: {UDP_PAYLOAD}-byte datagrams, one flow, batches of {GEN_BATCH} · VIP port {UDP_PORT}\n",
        r.services
            .iter()
            .map(|n| n.to_string())
            .collect::<Vec<_>>()
            .join(", "),
        r.rounds,
        r.seconds_per_run,
    );
    let _ = writeln!(
        md,
        "| contender | services | new conn/s | p50 / p99 ms | CPU µs/conn | UDP to stacks/s | CPU ns/datagram | loss % | UDP to XDP sinks/s | CPU ns/datagram | loss % | setup s |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    let opt = |s: &Option<Spread>, d: usize| s.as_ref().map_or("—".to_owned(), |s| s.cell(d));
    for row in &r.rows {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.2} / {:.2} | {} | {} | {} | {} | {} | {} | {} | {} |",
            row.what,
            row.services,
            row.new_conn_per_s.cell(0),
            row.latency_us[0] / 1e3,
            row.latency_us[1] / 1e3,
            row.cpu_us_per_conn.cell(1),
            opt(&row.udp_pps, 0),
            opt(&row.cpu_ns_per_datagram, 0),
            opt(&row.udp_loss_pct, 1),
            opt(&row.sink_pps, 0),
            opt(&row.sink_cpu_ns_per_datagram, 0),
            opt(&row.sink_loss_pct, 1),
            row.setup_s.cell(2),
        );
    }
    let _ = writeln!(md);
    md.push_str(&ratios(r));
    md
}

/// The row of `contender` at `services`.
fn row<'a>(r: &'a SweepReport, contender: &str, services: usize) -> Option<&'a SweepRow> {
    r.rows
        .iter()
        .find(|x| x.contender == contender && x.services == services)
}

/// Ratios of medians measured in the same rounds, per service count: fastpath against
/// iptables DNAT and HAProxy.
fn ratios(r: &SweepReport) -> String {
    let ratio = |a: Option<&Spread>, b: Option<&Spread>| match (a, b) {
        (Some(a), Some(b)) => format!("{:.2}", a.median / b.median),
        _ => "—".to_owned(),
    };
    let mut rows = Vec::new();
    for &n in &r.services {
        let (Some(fp), Some(ipt), Some(ha)) = (
            row(r, "fastpath", n),
            row(r, "iptables", n),
            row(r, "haproxy", n),
        ) else {
            continue;
        };
        let tc = row(r, "fastpath-tc", n);
        rows.push(vec![
            n.to_string(),
            ratio(fp.sink_pps.as_ref(), ipt.sink_pps.as_ref()),
            ratio(fp.udp_pps.as_ref(), ipt.udp_pps.as_ref()),
            ratio(Some(&fp.new_conn_per_s), Some(&ha.new_conn_per_s)),
            ratio(Some(&fp.new_conn_per_s), Some(&ipt.new_conn_per_s)),
            ratio(tc.map(|t| &t.new_conn_per_s), Some(&ha.new_conn_per_s)),
            ratio(tc.and_then(|t| t.udp_pps.as_ref()), ipt.udp_pps.as_ref()),
        ]);
    }
    if rows.is_empty() {
        return String::new();
    }
    let mut md = crate::report::table(
        &[
            "services",
            "fastpath ÷ iptables: UDP to XDP sinks",
            "UDP to stacks",
            "fastpath ÷ HAProxy: new conn/s",
            "fastpath ÷ iptables: new conn/s",
            "fastpath-tc ÷ HAProxy: new conn/s",
            "fastpath-tc ÷ iptables: UDP to stacks",
        ],
        &[true; 7],
        &rows,
    );
    md.push('\n');
    md
}

/// The sweep's chart: one line per contender over the service counts, datagrams/s to the XDP
/// sinks (the load balancer's own path).
pub fn figures(r: &SweepReport) -> Vec<Figure> {
    if r.rows.is_empty() {
        return Vec::new();
    }
    let series: Vec<Series> = CONTENDERS
        .iter()
        .filter_map(|c| {
            let points: Vec<(f64, f64, f64, f64)> = r
                .rows
                .iter()
                .filter(|row| row.contender == c.key())
                .filter_map(|row| {
                    row.sink_pps
                        .as_ref()
                        .map(|s| (row.services as f64, s.median, s.min, s.max))
                })
                .collect();
            (!points.is_empty()).then(|| Series {
                name: if *c == Contender::Direct {
                    "kernel forwarding, no LB".to_owned()
                } else {
                    c.key().to_owned()
                },
                points,
                ours: c.is_fastpath(),
            })
        })
        .collect();
    vec![Figure::lines(
        "sweep_udp_sink_pps.svg",
        "Small UDP datagrams/s to XDP sinks (the load balancer's path) over the number of services",
        "services",
        "datagrams/s",
        &series,
    )]
}
