//! `bench lb-compare`: fastpath against other ways of balancing one VIP over three nginx
//! backends, through the same namespace topology (client — fp — 3 backends), in one run.
//!
//! Contenders, each set up on fp alone and torn down (and checked gone) before the next:
//! the client talking to backend 0 directly through fp (the baseline, no LB), the fastpath
//! daemon (XDP, NAT mode, Maglev), iptables DNAT with the `statistic` match (kube-proxy's
//! scheme), nftables DNAT through a `numgen random` map, and HAProxy in TCP mode listening on
//! the VIP, and "fastpath + HA sync": the fastpath contender's setup plus `[ha]` on fp,
//! streaming its conntrack changes to a peer daemon (node B) in a peer namespace on its own
//! sync link (the replication test's pair, `testkit::ha::SyncPair`); after each of its runs B
//! must have received and installed A's changes with nothing refused. wrk, single-threaded, runs in the client for a fixed time: new connection per
//! request, keep-alive, and a large file over keep-alive (throughput). Rounds are interleaved
//! (every contender once per round, the starting one rotating); medians over rounds are
//! reported with ratios to the baseline and to fastpath. Every run must show requests answered
//! with no non-2xx responses, socket errors within `MAX_SOCKET_ERROR_FRACTION`, the requests'
//! packets arriving at the backends (spread over all three where the LB picks per connection),
//! and the contender's own counter (datapath counters, rule counters) having seen them, or the
//! benchmark fails.

use std::{fmt::Write as _, fs, net::Ipv4Addr, path::Path, time::Duration};

use crate::plot::{Bar, Figure};
use anyhow::{Context as _, Result, bail};
use fastpath::testkit::{
    ha::{self as pair, Node, NodeTls, SyncPair},
    netns::{
        Daemon, HttpServer, LbTopology, Netns, Spawned, TempDir, find_tools, lb_topology,
        unique_pin_dir,
    },
};
use fastpath_common::reason;
use serde::{Deserialize, Serialize};

/// Backends behind the VIP (one nginx each).
const BACKENDS: usize = 3;
/// The VIP every load-balancing contender serves, port 80 (routed: the client's default route
/// goes through fp).
const VIP: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 100);
const PORT: u16 = 80;
/// Measured rounds; each runs every contender once.
const ROUNDS: usize = 3;
/// Further rounds of the fastpath contender and the HA one alone, new-connection runs only:
/// the HA penalty is a few percent, and one pair's ratio varies by several, so its
/// comparison takes the pairs of all `ROUNDS + HA_EXTRA_ROUNDS` rounds.
const HA_EXTRA_ROUNDS: usize = 6;
/// The pause after each new-connection run of the `HA_EXTRA_ROUNDS`, so that the client's
/// TIME_WAIT ports from one run do not crowd the next (see the client's `tcp_tw_reuse` in
/// [`Bench::new`], the cause of runs that collapsed to 500-9,000 requests/s before).
const HA_EXTRA_PAUSE: Duration = Duration::from_secs(10);
/// Seconds per wrk run.
const DURATION_S: u32 = 3;
/// `bench quick`: rounds, seconds per run and contenders.
const QUICK_ROUNDS: usize = 3;
const QUICK_DURATION_S: u32 = 3;
const QUICK_CONTENDERS: [Contender; 4] = [
    Contender::Direct,
    Contender::Fastpath,
    Contender::Iptables,
    Contender::Haproxy,
];
/// Seconds of discarded load after each setup (ARP, caches, conntrack warm).
const WARMUP_S: u32 = 1;
/// wrk connections for the request-rate runs (one thread: this machine has 2 CPUs, shared by
/// wrk, three nginx, HAProxy and the kernel's packet processing).
const CONNECTIONS: u32 = 16;
/// wrk connections for the throughput run.
const BULK_CONNECTIONS: u32 = 3;
/// The small page of the request-rate runs and the large file of the throughput run.
const PAGE: &str = "page.html";
const BULK: &str = "bulk.bin";
const BULK_BYTES: usize = 16 << 20;
/// A run fails with more socket errors (connect, read, write, timeout) than this fraction of
/// its requests; any non-2xx response fails it.
const MAX_SOCKET_ERROR_FRACTION: f64 = 0.001;
/// Where the LB picks per connection, each backend must receive at least this fraction of the
/// packets of a new-connection run (1/3 expected).
const MIN_BACKEND_SHARE: f64 = 0.15;
/// In a new-connection run of the HA contender, B must receive at least this many changes
/// per request: each connection is at least one change (its events within one 1 ms drain of
/// the event ring make one), except
/// where the client reuses a closed connection's port while its change is pending — the
/// tuple's later connection then replaces the earlier one in the same change, as it did in
/// A's table. Runs here made 0.84 to 1.0 changes per request; the floor says replication
/// carried the connections, while the exact check is that B acknowledged all A made.
const MIN_CHANGES_PER_REQUEST: f64 = 0.5;
/// Tools this section runs (Debian packages of the same names, bar nginx and nft).
const TOOLS: &[&str] = &[
    "wrk",
    "nginx",
    "haproxy",
    "iptables",
    "nft",
    "conntrack",
    "ethtool",
    "curl",
];

/// One way of getting the client's requests to the backends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Contender {
    /// The baseline: the client talks to backend 0 directly, fp only routes.
    Direct,
    Fastpath,
    Iptables,
    Nftables,
    Haproxy,
    /// Fastpath's setup plus `[ha]`, streaming to a peer daemon.
    FastpathHa,
    /// Fastpath's setup with fp's links tracking and balancing at TC ingress (`xdp = "off"`):
    /// no XDP program on the veth links, so no copy of the senders' skbs into XDP frames.
    FastpathTc,
}

impl Contender {
    const ALL: [Contender; 7] = [
        Contender::Direct,
        Contender::Fastpath,
        Contender::Iptables,
        Contender::Nftables,
        Contender::Haproxy,
        Contender::FastpathHa,
        Contender::FastpathTc,
    ];

    /// Short name, for JSON and progress.
    pub(crate) fn key(self) -> &'static str {
        match self {
            Contender::Direct => "direct",
            Contender::Fastpath => "fastpath",
            Contender::Iptables => "iptables",
            Contender::Nftables => "nftables",
            Contender::Haproxy => "haproxy",
            Contender::FastpathHa => "fastpath-ha",
            Contender::FastpathTc => "fastpath-tc",
        }
    }

    /// What runs on fp, for the table.
    pub(crate) fn what(self) -> &'static str {
        match self {
            Contender::Direct => "direct to backend 0 (no LB; fp routes)",
            Contender::Fastpath => "fastpath daemon (XDP, NAT mode, Maglev)",
            Contender::Iptables => "iptables DNAT, `-m statistic --mode random` (kube-proxy)",
            Contender::Nftables => "nftables DNAT, `numgen random mod 3` map",
            Contender::Haproxy => "HAProxy, TCP mode, roundrobin",
            Contender::FastpathHa => {
                "fastpath + HA sync (the same daemon with `[ha]`, streaming to a peer daemon)"
            }
            Contender::FastpathTc => "fastpath daemon (TC ingress, NAT mode, Maglev)",
        }
    }

    /// Where the client sends its requests.
    pub(crate) fn target(self) -> Ipv4Addr {
        match self {
            Contender::Direct => LbTopology::backend_v4(0),
            _ => VIP,
        }
    }

    /// Whether the contender is a fastpath daemon.
    pub(crate) fn is_fastpath(self) -> bool {
        matches!(
            self,
            Contender::Fastpath | Contender::FastpathHa | Contender::FastpathTc
        )
    }

    /// Whether the contender picks a backend per connection (so a new-connection run must
    /// reach all three).
    fn balances(self) -> bool {
        self != Contender::Direct
    }
}

/// The three measurements of one contender in one round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// `Connection: close`: a TCP connection per request.
    NewConnection,
    /// wrk's default: requests over persistent connections.
    KeepAlive,
    /// The large file over persistent connections.
    Throughput,
}

impl Mode {
    const ALL: [Mode; 3] = [Mode::NewConnection, Mode::KeepAlive, Mode::Throughput];

    fn name(self) -> &'static str {
        match self {
            Mode::NewConnection => "new connection per request",
            Mode::KeepAlive => "keep-alive",
            Mode::Throughput => "throughput (large file, keep-alive)",
        }
    }
}

/// What wrk reported for one run (printed by the `done` hook of [`WRK_SCRIPT`]).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub(crate) struct WrkRun {
    pub(crate) requests: u64,
    bytes: u64,
    pub(crate) duration_s: f64,
    connect_errors: u64,
    read_errors: u64,
    write_errors: u64,
    timeouts: u64,
    /// Responses with a status over 399.
    pub(crate) non_2xx: u64,
    /// Request latency percentiles (wrk's: request sent → response read), µs.
    pub(crate) p50_us: u64,
    pub(crate) p99_us: u64,
}

impl WrkRun {
    pub(crate) fn socket_errors(&self) -> u64 {
        self.connect_errors + self.read_errors + self.write_errors + self.timeouts
    }
}

/// wrk's Lua hook: one machine-readable summary line.
pub(crate) const WRK_SCRIPT: &str = r#"done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("FPBENCH requests=%d bytes=%d duration_us=%d connect=%d read=%d write=%d timeout=%d status=%d p50_us=%d p99_us=%d\n",
    summary.requests, summary.bytes, summary.duration, e.connect, e.read, e.write, e.timeout, e.status,
    latency:percentile(50.0), latency:percentile(99.0)))
end
"#;

/// Median, spread and ratios of one metric of one contender.
#[derive(Default, Debug, Serialize, Deserialize)]
pub struct Metric {
    median: f64,
    min: f64,
    max: f64,
    /// median ÷ the baseline's median.
    vs_direct: f64,
    /// median ÷ fastpath's median.
    vs_fastpath: f64,
    samples: Vec<f64>,
}

/// One contender's results over the rounds.
#[derive(Default, Debug, Serialize, Deserialize)]
pub struct ContenderRow {
    contender: String,
    what: String,
    new_connection_rps: Metric,
    /// fastpath and its HA contender: the new-connection req/s of the `ha_extra_rounds`
    /// (empty for the others); the HA comparison pairs them after `new_connection_rps`'s.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    new_connection_extra_rps: Vec<f64>,
    keep_alive_rps: Metric,
    throughput_gbit_s: Metric,
    /// Medians over rounds of wrk's request latency p50 and p99, µs, by mode (new
    /// connection, keep-alive, throughput).
    #[serde(default)]
    latency_us: [[f64; 2]; 3],
    /// Medians over rounds of the whole machine's CPU per request, µs, by mode.
    #[serde(default)]
    cpu_us_per_request: [f64; 3],
    /// Totals over every measured run: socket errors (connect, read, write, timeout) and
    /// non-2xx responses.
    socket_errors: u64,
    non_2xx: u64,
    requests: u64,
    /// The client's retransmitted SYNs and segments, summed over the measured runs: a SYN
    /// lost on the way stalls its connection for a second (the retransmission timeout).
    client_syn_retransmits: u64,
    client_retransmitted_segments: u64,
    /// Packets the host's receive backlogs dropped during the contender's runs (every
    /// namespace's: the counter is per CPU, not per namespace).
    pub(crate) backlog_drops: u64,
    /// CPU time the hypervisor stole during a run, in % of the machine's: median and max.
    steal_percent: [f64; 2],
    /// Median over rounds of fp's kernel conntrack entries right after the new-connection run.
    kernel_conntrack_entries: f64,
    /// Medians over rounds of the CPU the contender's own process (the fastpath daemon,
    /// HAProxy) took during the new-connection, keep-alive and throughput runs, in % of one
    /// CPU; `None` where no process of its own runs (the kernel does the work).
    process_cpu_percent: Option<[f64; 3]>,
    /// The HA contender: node B's CPU, as `process_cpu_percent`, and what was replicated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    peer_process_cpu_percent: Option<[f64; 3]>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ha: Option<HaTotals>,
}

/// The comparison's results and method.
#[derive(Default, Debug, Serialize, Deserialize)]
pub struct CompareReport {
    backends: usize,
    rounds: usize,
    ha_extra_rounds: usize,
    duration_s: u32,
    warmup_s: u32,
    connections: u32,
    bulk_connections: u32,
    bulk_file_bytes: usize,
    load_generator: String,
    haproxy: String,
    iptables: String,
    nftables: String,
    contenders: Vec<ContenderRow>,
}

/// Per-contender samples while the rounds run.
#[derive(Default)]
pub(crate) struct Samples {
    pub(crate) new_connection: Vec<f64>,
    /// Whole-machine CPU time per request (busy CPU seconds ÷ requests), µs, by [`Mode`].
    pub(crate) cpu_us_per_request: [Vec<f64>; 3],
    /// wrk's request latency (p50, p99) per run, µs, by [`Mode`].
    pub(crate) latency_us: [Vec<[f64; 2]>; 3],
    /// New-connection runs of the `HA_EXTRA_ROUNDS` (fastpath and its HA contender only).
    pub(crate) new_connection_extra: Vec<f64>,
    keep_alive: Vec<f64>,
    throughput: Vec<f64>,
    conntrack: Vec<f64>,
    /// CPU of the contender's process (daemon, HAProxy) per run, in % of one CPU, by [`Mode`].
    process_cpu: [Vec<f64>; 3],
    /// HA sync: the peer daemon's CPU per run, by [`Mode`], and what replication did.
    peer_cpu: [Vec<f64>; 3],
    ha: HaTotals,
    /// Packets the host's receive backlogs dropped, summed over the measured runs.
    backlog_drops: u64,
    /// CPU time the hypervisor stole per run, in % of the machine's.
    steal: Vec<f64>,
    /// The client's retransmitted SYNs and segments, summed over the measured runs.
    syn_retransmits: u64,
    retransmitted_segments: u64,
    socket_errors: u64,
    non_2xx: u64,
    requests: u64,
}

/// Replication over the HA contender's measured runs.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct HaTotals {
    /// Changes A made for B (its `last_seq` delta) and B received, summed over the runs.
    changes: u64,
    received_changes: u64,
    /// Medians over the new-connection runs of A's lag percentiles (change made → B applied,
    /// over A's last 4096 acks, read after the run), µs.
    lag_p50_us: f64,
    lag_p99_us: f64,
    /// A's `events_lost` and resyncs (snapshots after the first), summed.
    events_lost: u64,
    resyncs: u64,
    /// Per new-connection run, for the medians above.
    #[serde(skip)]
    lags: Vec<(f64, f64)>,
}

/// What is running on fp for one contender; [`Bench::teardown`] removes it.
pub(crate) enum Running {
    Nothing,
    /// The daemon on fp and, for the HA contender, its peer (node B).
    Daemon(Daemon, Option<Box<Daemon>>),
    Haproxy(Spawned, TempDir),
}

impl Running {
    /// The contender's own process, if it has one.
    fn pid(&self) -> Option<u32> {
        match self {
            Running::Nothing => None,
            Running::Daemon(d, _) => d.pid(),
            Running::Haproxy(p, _) => Some(p.pid()),
        }
    }

    /// The HA contender's pair: node A (on fp) and node B.
    fn pair(&self) -> Option<(&Daemon, &Daemon)> {
        match self {
            Running::Daemon(a, Some(b)) => Some((a, b)),
            _ => None,
        }
    }
}

/// CPU seconds (user + system, all threads) process `pid` has used, from /proc/PID/stat.
pub fn process_cpu_s(pid: u32) -> Result<f64> {
    let path = format!("/proc/{pid}/stat");
    let stat = fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    // Fields after the command name (which may hold spaces, so split after its ')'): state
    // is field 3, utime and stime fields 14 and 15, in clock ticks.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |i: usize| -> Result<u64> {
        fields
            .get(i)
            .and_then(|f| f.parse().ok())
            .with_context(|| format!("no field {} in {path}: {stat:?}", i + 3))
    };
    Ok(ticks_s(ticks(11)? + ticks(12)?))
}

/// Seconds in `ticks` clock ticks (USER_HZ, as /proc counts CPU time).
fn ticks_s(ticks: u64) -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    // Linux's USER_HZ is 100 on every architecture; sysconf only fails on a broken libc.
    ticks as f64 / if hz > 0 { hz as f64 } else { 100.0 }
}

/// The topology, the backends' servers and the files the runs need.
pub(crate) struct Bench {
    bin: std::path::PathBuf,
    /// Seconds per measured run ([`DURATION_S`]; the sweep's `SECS`).
    pub(crate) duration_s: u32,
    /// nginx on every backend, kept running for the runs; dropped before `lb`, so the servers
    /// stop before their namespaces go.
    _servers: Vec<HttpServer>,
    lb: LbTopology,
    /// The HA contender's certificates (A, B), in `dir`.
    tls: [NodeTls; 2],
    dir: TempDir,
    /// The receive backlog raised for the runs; restored when the bench ends.
    _backlog: Backlog,
    /// fastpath routes what it translates at XDP (`route = true` on fp's links) instead of
    /// handing it to the kernel to route. On veth this needs NAPI (GRO) on the links' far
    /// ends, which the caller turns on.
    pub(crate) routes_in_fast_path: bool,
}

/// Packets the per-CPU receive backlog holds during the runs (`net.core.netdev_max_backlog`,
/// a host-wide setting; the kernel's default is 1000).
const BACKLOG: u64 = 10_000;
const BACKLOG_SYSCTL: &str = "/proc/sys/net/core/netdev_max_backlog";

/// `netdev_max_backlog` raised to at least [`BACKLOG`] while it lives, then set back. With
/// both CPUs busy, the backlog where a veth with no XDP program queues what it receives
/// overflowed at the default 1000 packets (/proc/net/softnet_stat had counted 1.4 million
/// drops on this machine over earlier runs of this bench), and every lost SYN stalls its
/// connection for the 1 s retransmission timeout, in whichever contender's run it happens.
/// A box that forwards for a living raises it too.
pub(crate) struct Backlog {
    was: u64,
}

impl Backlog {
    pub(crate) fn raise() -> Result<Backlog> {
        let was: u64 = fs::read_to_string(BACKLOG_SYSCTL)
            .with_context(|| format!("reading {BACKLOG_SYSCTL}"))?
            .trim()
            .parse()
            .with_context(|| format!("parsing {BACKLOG_SYSCTL}"))?;
        fs::write(BACKLOG_SYSCTL, BACKLOG.max(was).to_string())
            .with_context(|| format!("raising {BACKLOG_SYSCTL} to {BACKLOG}"))?;
        Ok(Backlog { was })
    }
}

impl Drop for Backlog {
    fn drop(&mut self) {
        if let Err(e) = fs::write(BACKLOG_SYSCTL, self.was.to_string()) {
            eprintln!("could not set {BACKLOG_SYSCTL} back to {}: {e}", self.was);
        }
    }
}

/// Host-wide counters, read before and after a run.
#[derive(Clone, Copy)]
pub(crate) struct Machine {
    /// Packets the receive backlogs dropped (/proc/net/softnet_stat, summed over CPUs).
    backlog_drops: u64,
    /// CPU time the hypervisor stole, and CPU time nothing ran (/proc/stat, clock ticks,
    /// summed over CPUs).
    pub(crate) steal_ticks: u64,
    pub(crate) idle_ticks: u64,
    /// The CPUs those sum over: /proc/stat's `cpuN` lines.
    pub(crate) cpus: u64,
}

impl Machine {
    pub(crate) fn read() -> Result<Machine> {
        let softnet =
            fs::read_to_string("/proc/net/softnet_stat").context("reading softnet_stat")?;
        let mut backlog_drops = 0;
        for line in softnet.lines() {
            let field = line
                .split_whitespace()
                .nth(1)
                .context("a short softnet_stat line")?;
            backlog_drops += u64::from_str_radix(field, 16).context("softnet_stat's drop count")?;
        }
        let stat = fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
        // cpu user nice system idle iowait irq softirq steal ...
        let cpu: Vec<u64> = stat
            .lines()
            .next()
            .map(|l| {
                l.split_whitespace()
                    .skip(1)
                    .filter_map(|f| f.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        let (Some(&idle_ticks), Some(&steal_ticks)) = (cpu.get(3), cpu.get(7)) else {
            bail!("no idle or steal time in /proc/stat's cpu line: {cpu:?}");
        };
        let cpus = stat
            .lines()
            .filter(|l| {
                l.strip_prefix("cpu")
                    .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()))
            })
            .count()
            .max(1) as u64;
        Ok(Machine {
            backlog_drops,
            steal_ticks,
            idle_ticks,
            cpus,
        })
    }

    /// What happened between `before` and this reading.
    pub(crate) fn since(self, before: Machine) -> Machine {
        Machine {
            backlog_drops: self.backlog_drops - before.backlog_drops,
            steal_ticks: self.steal_ticks - before.steal_ticks,
            idle_ticks: self.idle_ticks - before.idle_ticks,
            cpus: self.cpus,
        }
    }

    /// The CPU seconds the machine was busy (not idle) over `wall_s` seconds of this
    /// interval (one [`Machine::since`]). Fails when the machine was idle for longer than
    /// `wall_s` allows (beyond a tick per CPU of rounding): the interval is not the
    /// `wall_s` seconds timed, and its CPU would be misreported (as 0).
    pub(crate) fn busy_seconds(self, wall_s: f64) -> Result<f64> {
        let cpu_s = wall_s * self.cpus as f64;
        let idle_s = ticks_s(self.idle_ticks);
        if idle_s > cpu_s + ticks_s(self.cpus) {
            bail!(
                "the machine was idle {idle_s:.2} CPU-seconds over {wall_s:.2} s on {} CPUs: the CPU reading spans more than the timed interval",
                self.cpus
            );
        }
        Ok((cpu_s - idle_s).max(0.0))
    }
}

/// Runs the comparison. `bin` is the fastpath binary.
pub fn run(bin: &Path) -> Result<CompareReport> {
    find_tools(TOOLS).context("the load-balancer comparison")?;
    // A development aid: `FP_BENCH_CONTENDERS=direct,fastpath,fastpath-ha` runs only those
    // (the others' rows are empty, their medians NaN).
    let chosen = std::env::var("FP_BENCH_CONTENDERS").ok();
    if let Some(list) = &chosen
        && let Some(bad) = list
            .split(',')
            .find(|k| !Contender::ALL.iter().any(|c| c.key() == *k))
    {
        bail!(
            "FP_BENCH_CONTENDERS names {bad:?}; contenders: {}",
            Contender::ALL.map(Contender::key).join(",")
        );
    }
    let runs = |c: Contender| {
        chosen
            .as_ref()
            .is_none_or(|l| l.split(',').any(|k| k == c.key()))
    };
    // `bench quick`: fastpath against the baseline and the two contenders most deployed
    // (kube-proxy's iptables, HAProxy), fewer and shorter rounds, no extra HA rounds.
    let quick = crate::quick();
    let (rounds, ha_extra_rounds, duration_s) = if quick {
        (QUICK_ROUNDS, 0, QUICK_DURATION_S)
    } else {
        (ROUNDS, HA_EXTRA_ROUNDS, DURATION_S)
    };
    let runs = |c: Contender| !quick || QUICK_CONTENDERS.contains(&c) && runs(c);
    let mut bench = Bench::new(bin)?;
    bench.duration_s = duration_s;
    let mut samples: Vec<Samples> = Contender::ALL.iter().map(|_| Samples::default()).collect();
    for round in 0..rounds {
        for k in 0..Contender::ALL.len() {
            let i = (round + k) % Contender::ALL.len();
            let c = Contender::ALL[i];
            if !runs(c) {
                continue;
            }
            bench
                .measure(c, &Mode::ALL, &mut samples[i])
                .with_context(|| format!("{} (round {})", c.what(), round + 1))?;
        }
    }
    let pair = [Contender::Fastpath, Contender::FastpathHa];
    if pair.iter().all(|&c| runs(c)) {
        for round in 0..ha_extra_rounds {
            for k in 0..pair.len() {
                let c = pair[(round + k) % pair.len()];
                bench
                    .measure(c, &[Mode::NewConnection], &mut samples[c as usize])
                    .with_context(|| format!("{} (HA round {})", c.what(), round + 1))?;
                std::thread::sleep(HA_EXTRA_PAUSE);
            }
        }
    }
    drop(bench);

    // `samples` follows `Contender::ALL`, which is in declaration order.
    let metric = |c: Contender, pick: fn(&Samples) -> &Vec<f64>| {
        let s = pick(&samples[c as usize]);
        let median_of = |other: Contender| crate::stats(pick(&samples[other as usize])).0;
        let (median, min, max) = crate::stats(s);
        Metric {
            median,
            min,
            max,
            vs_direct: median / median_of(Contender::Direct),
            vs_fastpath: median / median_of(Contender::Fastpath),
            samples: s.clone(),
        }
    };
    let contenders = Contender::ALL
        .iter()
        .zip(&samples)
        .filter(|&(&c, _)| runs(c))
        .map(|(&c, s)| ContenderRow {
            contender: c.key().to_owned(),
            what: c.what().to_owned(),
            new_connection_rps: metric(c, |s| &s.new_connection),
            new_connection_extra_rps: s.new_connection_extra.clone(),
            keep_alive_rps: metric(c, |s| &s.keep_alive),
            throughput_gbit_s: metric(c, |s| &s.throughput),
            latency_us: s.latency_us.each_ref().map(|runs| {
                let p = |i: usize| crate::stats(&runs.iter().map(|l| l[i]).collect::<Vec<_>>()).0;
                [p(0), p(1)]
            }),
            cpu_us_per_request: s.cpu_us_per_request.each_ref().map(|v| crate::stats(v).0),
            socket_errors: s.socket_errors,
            non_2xx: s.non_2xx,
            requests: s.requests,
            client_syn_retransmits: s.syn_retransmits,
            client_retransmitted_segments: s.retransmitted_segments,
            backlog_drops: s.backlog_drops,
            steal_percent: {
                let (median, _, max) = crate::stats(&s.steal);
                [median, max]
            },
            kernel_conntrack_entries: crate::stats(&s.conntrack).0,
            process_cpu_percent: (!s.process_cpu[0].is_empty())
                .then(|| s.process_cpu.each_ref().map(|v| crate::stats(v).0)),
            peer_process_cpu_percent: (!s.peer_cpu[0].is_empty())
                .then(|| s.peer_cpu.each_ref().map(|v| crate::stats(v).0)),
            ha: (c == Contender::FastpathHa).then(|| {
                let p50: Vec<f64> = s.ha.lags.iter().map(|l| l.0).collect();
                let p99: Vec<f64> = s.ha.lags.iter().map(|l| l.1).collect();
                HaTotals {
                    lag_p50_us: crate::stats(&p50).0,
                    lag_p99_us: crate::stats(&p99).0,
                    ..s.ha.clone()
                }
            }),
        })
        .collect();
    // The first line a tool prints about its version (some print it on stderr).
    let version = |prog: &str, flag: &str| {
        std::process::Command::new(prog)
            .arg(flag)
            .output()
            .ok()
            .map(|o| {
                let text = [o.stdout, o.stderr].concat();
                String::from_utf8_lossy(&text)
                    .lines()
                    .next()
                    .unwrap_or("")
                    .trim()
                    .to_string()
            })
            .unwrap_or_default()
    };
    Ok(CompareReport {
        backends: BACKENDS,
        rounds,
        ha_extra_rounds,
        duration_s,
        warmup_s: WARMUP_S,
        connections: CONNECTIONS,
        bulk_connections: BULK_CONNECTIONS,
        bulk_file_bytes: BULK_BYTES,
        load_generator: version("wrk", "-v"),
        haproxy: version("haproxy", "-v"),
        iptables: version("iptables", "-V"),
        nftables: version("nft", "-v"),
        contenders,
    })
}

impl Bench {
    /// The topology with checksum offloads off on every interface, nginx on every backend
    /// serving [`PAGE`] and [`BULK`], and wrk's script.
    pub(crate) fn new(bin: &Path) -> Result<Bench> {
        let backlog = Backlog::raise()?;
        let mut lb = lb_topology(BACKENDS).context("building the namespace topology")?;
        // Node B's namespace and the sync link: used by the HA contender only (fastpath does
        // not hook the link; the other contenders do not route over it).
        SyncPair::add_to(&mut lb).context("adding the HA peer namespace and sync link")?;
        // MTU-sized packets with full checksums on every link, as on a wire, for every
        // contender alike: with offloads on, veth hands over partial checksums and 64 KiB GSO
        // packets — the kernel contenders would forward one packet where fastpath, whose XDP
        // turns GSO off on the veth's peer, sees 45, and HAProxy (sending from fp itself)
        // would hand the client 64 KiB packets.
        lb.checksum_offloads_off()
            .context("turning checksum offloads off")?;
        for iface in lb.fp_interfaces() {
            lb.fp()
                .run(&["ethtool", "-K", &iface, "tx", "off", "rx", "off"])
                .context("turning checksum offloads off on fp")?;
        }
        // No TIME_WAIT on the backends. One client address makes every connection, and at
        // about 10k a second it reuses each of its 28k ports within seconds, while a backend
        // keeps a closed connection's tuple in TIME_WAIT for 60 s. A new SYN on such a tuple
        // is accepted only if its sequence number (and timestamp) is past the old one's, and
        // the client derives both from a hash of the tuple it dials: a load balancer's
        // client dials the VIP, the direct contender the backend itself, so after a direct
        // run (for a minute, whoever runs next) half the reused tuples' SYNs were answered
        // with an ACK, reset and sent again after the 1 s retransmission timeout: thousands
        // of retransmitted SYNs per run, for the contenders that ran after it in a round.
        for i in 0..BACKENDS {
            lb.backend(i)
                .sysctl("net.ipv4.tcp_max_tw_buckets", "0")
                .context("turning TIME_WAIT off on a backend")?;
        }
        // The client may reuse its ports' TIME_WAIT for new connections (timestamps keep
        // them apart). wrk closes first now and then (it has read the whole response before
        // nginx's FIN arrives), so the client holds 12,000-14,000 ports of its 28,000 in
        // TIME_WAIT; every connect() searches the range from the same hash-derived start for
        // a free port, and once the TIME_WAIT ports there piled up, wrk's CPU went to that
        // search: whole runs at 500-9,000 requests/s with wrk's CPU busy and the other idle,
        // for every contender.
        lb.client()
            .sysctl("net.ipv4.tcp_tw_reuse", "1")
            .context("letting the client reuse TIME_WAIT ports")?;
        let mut servers = Vec::new();
        let bulk: Vec<u8> = (0..BULK_BYTES).map(|i| (i * 7 + i / 4096) as u8).collect();
        for i in 0..BACKENDS {
            let s = lb
                .backend(i)
                .http_server(PORT)
                .with_context(|| format!("starting nginx on backend {i}"))?;
            fs::write(s.root().join(PAGE), format!("backend {i}\n")).context("writing the page")?;
            fs::write(s.root().join(BULK), &bulk).context("writing the large file")?;
            servers.push(s);
        }
        let dir = TempDir::new("lbcmp")?;
        fs::write(dir.join("report.lua"), WRK_SCRIPT).context("writing wrk's script")?;
        Ok(Bench {
            bin: bin.to_owned(),
            duration_s: DURATION_S,
            _servers: servers,
            lb,
            tls: crate::ha::write_tls(&dir),
            dir,
            _backlog: backlog,
            routes_in_fast_path: false,
        })
    }

    pub(crate) fn fp(&self) -> &Netns {
        self.lb.fp()
    }

    pub(crate) fn topology(&self) -> &LbTopology {
        &self.lb
    }

    /// One round of contender `c`: set up, check one request goes through, warm up, the three
    /// runs (each checked), tear down (checked).
    /// Sets `c` up, runs `modes` and tears it down. Only a run of every mode is one of the
    /// `ROUNDS`; a new-connection run alone is one of the `HA_EXTRA_ROUNDS`.
    fn measure(&self, c: Contender, modes: &[Mode], s: &mut Samples) -> Result<()> {
        self.measure_with(c, 1, modes, s, |_| Ok(()), |_| ())
    }

    /// [`Bench::measure`] with `services` services configured (the measured one and
    /// `services - 1` others: see [`Bench::setup`]), then `more` while `c` still runs.
    pub(crate) fn measure_with(
        &self,
        c: Contender,
        services: usize,
        modes: &[Mode],
        s: &mut Samples,
        more: impl FnOnce(&Running) -> Result<()>,
        ready: impl FnOnce(Duration),
    ) -> Result<()> {
        let started = std::time::Instant::now();
        let running = self.setup(c, services)?;
        ready(started.elapsed());
        let result = self
            .measure_running(c, &running, modes, s)
            .and_then(|()| more(&running));
        // Torn down whatever happened: the next contender must find fp clean.
        let down = self.teardown(running);
        result.and(down)
    }

    fn measure_running(
        &self,
        c: Contender,
        running: &Running,
        modes: &[Mode],
        s: &mut Samples,
    ) -> Result<()> {
        let extra = modes.len() < Mode::ALL.len();
        let url = |file: &str| format!("http://{}:{PORT}/{file}", c.target());
        self.lb
            .client()
            .run(&["curl", "-sS", "--fail", "--max-time", "5", &url(PAGE)])
            .with_context(|| {
                format!(
                    "one request from the client to {} failed{}",
                    url(PAGE),
                    daemon_log(running)
                )
            })?;
        self.wrk(&url(PAGE), CONNECTIONS, WARMUP_S, true)?;
        for &mode in modes {
            let m = mode as usize;
            let ha_before = running.pair().map(ha_counts).transpose()?;
            let before = self.counters(c, running)?;
            // CPU is read right around wrk: reading the counters (iptables-save of 100k
            // services takes seconds) is neither the contender's work nor idle time of the run.
            let peer_pid = running.pair().and_then(|(_, b)| b.pid());
            let peer_cpu_before = peer_pid.map(process_cpu_s).transpose()?;
            let cpu_before = running.pid().map(process_cpu_s).transpose()?;
            let machine_before = Machine::read()?;
            let started = std::time::Instant::now();
            let run = match mode {
                Mode::NewConnection => self.wrk(&url(PAGE), CONNECTIONS, self.duration_s, true)?,
                Mode::KeepAlive => self.wrk(&url(PAGE), CONNECTIONS, self.duration_s, false)?,
                Mode::Throughput => {
                    self.wrk(&url(BULK), BULK_CONNECTIONS, self.duration_s, false)?
                }
            };
            let wall_s = started.elapsed().as_secs_f64();
            let machine = Machine::read()?.since(machine_before);
            let cpu = |before: Option<f64>, pid: Option<u32>| -> Result<Option<f64>> {
                Ok(match (before, pid) {
                    (Some(b), Some(pid)) => Some((process_cpu_s(pid)? - b) / wall_s * 100.0),
                    _ => None,
                })
            };
            let own = cpu(cpu_before, running.pid())?;
            let peer = cpu(peer_cpu_before, peer_pid)?;
            let after = self.counters(c, running)?;
            let share = |ticks| ticks_s(ticks) / (wall_s * machine.cpus as f64) * 100.0;
            s.backlog_drops += machine.backlog_drops;
            s.steal.push(share(machine.steal_ticks));
            eprintln!(
                "{}, {}: {:.0} req/s; retransmits: client {}, backends {}; machine idle {:.1}%, steal {:.1}%, backlog drops {}; process CPU {:.0}%, peer {:.0}%",
                c.key(),
                mode.name(),
                run.requests as f64 / run.duration_s,
                after.client_retransmits[1] - before.client_retransmits[1],
                after.backend_retransmits - before.backend_retransmits,
                share(machine.idle_ticks),
                share(machine.steal_ticks),
                machine.backlog_drops,
                own.unwrap_or(0.0),
                peer.unwrap_or(0.0),
            );
            s.process_cpu[m].extend(own);
            s.cpu_us_per_request[m]
                .push(machine.busy_seconds(wall_s)? * 1e6 / run.requests.max(1) as f64);
            s.latency_us[m].push([run.p50_us as f64, run.p99_us as f64]);
            s.peer_cpu[m].extend(peer);
            check_run(c, mode, &run, &before, &after)
                .with_context(|| format!("{} run{}", mode.name(), daemon_log(running)))?;
            if let (Some(before), Some(pair)) = (ha_before, running.pair()) {
                check_replication(pair, mode, &run, &before, &mut s.ha)
                    .with_context(|| format!("{} run: HA replication", mode.name()))?;
            }
            s.requests += run.requests;
            s.syn_retransmits += after.client_retransmits[0] - before.client_retransmits[0];
            s.retransmitted_segments += after.client_retransmits[1] - before.client_retransmits[1];
            s.socket_errors += run.socket_errors();
            s.non_2xx += run.non_2xx;
            match mode {
                Mode::NewConnection if extra => s
                    .new_connection_extra
                    .push(run.requests as f64 / run.duration_s),
                Mode::NewConnection => {
                    s.new_connection.push(run.requests as f64 / run.duration_s);
                    s.conntrack.push(self.kernel_conntrack_entries()? as f64);
                }
                Mode::KeepAlive => s.keep_alive.push(run.requests as f64 / run.duration_s),
                Mode::Throughput => s
                    .throughput
                    .push(run.bytes as f64 * 8.0 / run.duration_s / 1e9),
            }
        }
        Ok(())
    }

    /// wrk in the client, one thread, `connections` connections for `secs` seconds; with
    /// `close`, every request asks for `Connection: close`.
    fn wrk(&self, url: &str, connections: u32, secs: u32, close: bool) -> Result<WrkRun> {
        let script = self.dir.join("report.lua");
        let (c, d) = (connections.to_string(), format!("{secs}s"));
        let mut args = vec![
            "wrk",
            "-t1",
            "-c",
            &c,
            "-d",
            &d,
            "--timeout",
            "3s",
            "-s",
            script.to_str().context("non-UTF-8 temp path")?,
        ];
        if close {
            args.extend(["-H", "Connection: close"]);
        }
        args.push(url);
        let out = self
            .lb
            .client()
            .exec_timeout(&args, Duration::from_secs(u64::from(secs) + 30))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            bail!(
                "`{}` failed ({}): {}{}",
                args.join(" "),
                out.status,
                stdout.trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        parse_wrk(&stdout).with_context(|| format!("`{}` printed:\n{stdout}", args.join(" ")))
    }

    /// Sets `c` up on fp with `services` services: the measured one ([`VIP`], TCP [`PORT`]
    /// over the backends; and UDP [`UDP_PORT`] where the contender balances UDP) and
    /// `services - 1` others ([`other_vip`], TCP [`PORT`]), each the way that contender
    /// holds many services; the measured one comes last where the contender matches in order.
    fn setup(&self, c: Contender, services: usize) -> Result<Running> {
        let fp = self.fp();
        let backends: Vec<Ipv4Addr> = (0..BACKENDS).map(LbTopology::backend_v4).collect();
        let others = services.saturating_sub(1);
        match c {
            Contender::Direct => Ok(Running::Nothing),
            Contender::Fastpath | Contender::FastpathHa | Contender::FastpathTc => {
                // The others: one backend each, weighted round robin (a one-slot selection
                // table: 100k Maglev tables of the auto size, 251 slots, would not fit the
                // datapath's 4 Mi slots).
                let mut toml = String::new();
                for i in 0..others {
                    let _ = write!(
                        toml,
                        "[[service]]\nvip = \"{}\"\nport = {PORT}\nscheduler = \"wrr\"\n[[service.backend]]\naddress = \"{}\"\nport = {PORT}\n",
                        other_vip(i),
                        backends[0]
                    );
                }
                for port in [PORT, UDP_PORT] {
                    let _ = write!(toml, "[[service]]\nvip = \"{VIP}\"\nport = {port}\n");
                    if port == UDP_PORT {
                        toml.push_str("protocol = \"udp\"\n");
                    }
                    for b in &backends {
                        let _ = write!(
                            toml,
                            "[[service.backend]]\naddress = \"{b}\"\nport = {port}\n"
                        );
                    }
                }
                let pin_dir = unique_pin_dir("lbcmp");
                let mut config = if c == Contender::FastpathTc {
                    self.lb.fp_config_tc(&pin_dir)
                } else {
                    self.lb.fp_config(&pin_dir)
                }
                .services(&toml);
                if self.routes_in_fast_path {
                    for iface in self.lb.fp_interfaces() {
                        config = config.interface_key(&iface, "route = true");
                    }
                }
                // The HA contender: node B first (same service, attached to its end of the
                // sync link), then A with `[ha]`; B must hold A's snapshot before the runs.
                let peer = if c == Contender::FastpathHa {
                    config = config.raw(&SyncPair::ha_toml(Node::A, &self.tls[0]));
                    let b = SyncPair::peer_config(&unique_pin_dir("lbcmp-b"))
                        .services(&toml)
                        .raw(&SyncPair::ha_toml(Node::B, &self.tls[1]));
                    let b = Daemon::try_start(
                        &self.bin,
                        SyncPair::ns(&self.lb, Node::B).name(),
                        &b.pin_dir,
                        &b.to_toml(),
                    )
                    .context("starting the HA peer daemon (node B)")?;
                    // B stands for a second machine: it gets only CPU time nothing else here
                    // wants (SCHED_IDLE, every thread; threads it starts later inherit it).
                    let pid = b.pid().map(|p| p.to_string()).unwrap_or_default();
                    let chrt = std::process::Command::new("chrt")
                        .args(["--idle", "--all-tasks", "--pid", "0", &pid])
                        .output()
                        .context("running chrt")?;
                    if !chrt.status.success() {
                        bail!(
                            "chrt --idle on node B's daemon failed: {}",
                            String::from_utf8_lossy(&chrt.stderr)
                        );
                    }
                    Some(Box::new(b))
                } else {
                    None
                };
                let daemon =
                    Daemon::try_start(&self.bin, fp.name(), &config.pin_dir, &config.to_toml())
                        .context("starting the fastpath daemon")?;
                if let Some(b) = &peer {
                    pair::wait_in_sync(b, "node B before the runs", Duration::from_secs(20))?;
                }
                if !daemon.log().contains("Services applied") {
                    bail!(
                        "the fastpath daemon did not apply the service; its log:\n{}",
                        daemon.log()
                    );
                }
                // The report describes native XDP (`auto` must not have fallen back), or none.
                for iface in self.lb.fp_interfaces() {
                    let link = fp.link_show(&iface)?;
                    if c == Contender::FastpathTc {
                        if link.contains("prog/xdp") {
                            bail!(
                                "fastpath attached XDP on fp's {iface} with xdp = \"off\":\n{link}"
                            );
                        }
                    } else if !link.contains("prog/xdp") || link.contains("xdpgeneric") {
                        bail!(
                            "fastpath did not attach native XDP on fp's {iface}:\n{link}\ndaemon log:\n{}",
                            daemon.log()
                        );
                    }
                }
                Ok(Running::Daemon(daemon, peer))
            }
            Contender::Iptables => {
                // kube-proxy's layout, loaded with one iptables-restore: PREROUTING jumps to
                // the services chain, one rule per service (the measured service's last),
                // which jumps to the service's chain, whose rules DNAT to backend i with
                // probability 1/(n - i) (the last takes the rest). The others share the
                // measured TCP service's chain: only the matching service's chain is walked.
                let mut rules = format!(
                    "*nat\n:{IPT_SERVICES} - [0:0]\n:{IPT_CHAIN} - [0:0]\n:{IPT_CHAIN_UDP} - [0:0]\n-A PREROUTING -j {IPT_SERVICES}\n"
                );
                for i in 0..others {
                    let _ = writeln!(
                        rules,
                        "-A {IPT_SERVICES} -d {}/32 -p tcp --dport {PORT} -j {IPT_CHAIN}",
                        other_vip(i)
                    );
                }
                for (proto, port, chain) in
                    [("tcp", PORT, IPT_CHAIN), ("udp", UDP_PORT, IPT_CHAIN_UDP)]
                {
                    let _ = writeln!(
                        rules,
                        "-A {IPT_SERVICES} -d {VIP}/32 -p {proto} --dport {port} -j {chain}"
                    );
                    for (i, b) in backends.iter().enumerate() {
                        let mut rule = format!("-A {chain}");
                        if i + 1 < BACKENDS {
                            let _ = write!(
                                rule,
                                " -m statistic --mode random --probability {:.10}",
                                1.0 / (BACKENDS - i) as f64
                            );
                        }
                        // A port in the target needs the protocol named, as kube-proxy does.
                        let _ = writeln!(rule, " -p {proto} -j DNAT --to-destination {b}:{port}");
                        rules.push_str(&rule);
                    }
                }
                rules.push_str("COMMIT\n");
                let path = self.dir.join("rules.iptables");
                fs::write(&path, rules).context("writing the iptables rules")?;
                fp.run(&[
                    "iptables-restore",
                    "-w",
                    "--noflush",
                    path.to_str().context("non-UTF-8 temp path")?,
                ])
                .context("loading the iptables rules")?;
                conntrack_checksum_off(fp)?;
                Ok(Running::Nothing)
            }
            Contender::Nftables => {
                // kube-proxy's nftables layout: one verdict map from (address, protocol,
                // port) to the service's chain, which picks a backend with numgen.
                let mut elements = Vec::with_capacity(others + 2);
                for i in 0..others {
                    elements.push(format!("{} . tcp . {PORT} : goto svc_tcp", other_vip(i)));
                }
                elements.push(format!("{VIP} . tcp . {PORT} : goto svc_tcp"));
                elements.push(format!("{VIP} . udp . {UDP_PORT} : goto svc_udp"));
                // The backends listen on the service's port: only the address changes.
                let map = backends
                    .iter()
                    .enumerate()
                    .map(|(i, b)| format!("{i} : {b}"))
                    .collect::<Vec<_>>()
                    .join(", ");
                let ruleset = format!(
                    "table ip {NFT_TABLE} {{\n  map services {{\n    type ipv4_addr . inet_proto . inet_service : verdict\n    elements = {{ {} }}\n  }}\n  chain prerouting {{\n    type nat hook prerouting priority dstnat; policy accept;\n    counter ip daddr . meta l4proto . th dport vmap @services\n  }}\n  chain svc_tcp {{\n    dnat to numgen random mod {BACKENDS} map {{ {map} }}\n  }}\n  chain svc_udp {{\n    dnat to numgen random mod {BACKENDS} map {{ {map} }}\n  }}\n}}\n",
                    elements.join(",\n      "),
                );
                let path = self.dir.join("ruleset.nft");
                fs::write(&path, ruleset).context("writing the nftables ruleset")?;
                fp.run(&["nft", "-f", path.to_str().context("non-UTF-8 temp path")?])
                    .context("loading the nftables ruleset")?;
                conntrack_checksum_off(fp)?;
                Ok(Running::Nothing)
            }
            Contender::Haproxy => {
                fp.add_addr("lo", &format!("{VIP}/32"))
                    .context("adding the VIP to fp's loopback for HAProxy")?;
                let dir = TempDir::new("haproxy")?;
                // Many services: one listener on every local address (the others' addresses
                // are made local by a route) and the service picked by destination address
                // from a list HAProxy keeps as a tree (`dst -f`). All share one backend
                // section: only the lookup grows with the count.
                let (bind, pick) = if others == 0 {
                    (format!("{VIP}:{PORT}"), "default_backend nginx".to_owned())
                } else {
                    fp.ip(&["route", "add", "local", OTHER_VIPS, "dev", "lo"])
                        .context("making the other VIPs local on fp for HAProxy")?;
                    let list: String = (0..others)
                        .map(|i| format!("{}\n", other_vip(i)))
                        .chain([format!("{VIP}\n")])
                        .collect();
                    let path = dir.join("vips.lst");
                    fs::write(&path, list).context("writing HAProxy's VIP list")?;
                    (
                        format!(":{PORT}"),
                        format!("use_backend nginx if {{ dst -f {} }}", path.display()),
                    )
                };
                let mut cfg = format!(
                    "global\n    maxconn 4096\ndefaults\n    mode tcp\n    timeout connect 5s\n    timeout client 30s\n    timeout server 30s\nfrontend vip\n    bind {bind}\n    {pick}\nbackend nginx\n    balance roundrobin\n"
                );
                for (i, b) in backends.iter().enumerate() {
                    let _ = writeln!(cfg, "    server b{i} {b}:{PORT}");
                }
                let path = dir.join("haproxy.cfg");
                fs::write(&path, cfg).context("writing haproxy.cfg")?;
                let mut process = fp
                    .spawn(&[
                        "haproxy",
                        "-db",
                        "-f",
                        path.to_str().context("non-UTF-8 temp path")?,
                    ])
                    .context("starting haproxy")?;
                if let Err(e) = fp.wait_listening("tcp", PORT, Duration::from_secs(10)) {
                    let log = process.log();
                    process.kill();
                    bail!("haproxy did not listen on {VIP}:{PORT}: {e}; its output:\n{log}");
                }
                Ok(Running::Haproxy(process, dir))
            }
        }
    }

    /// Removes whatever `running` and the rules left on fp, flushes fp's kernel conntrack
    /// table, and fails unless fp is back to plain routing: no ruleset, no XDP program, no
    /// pins, no VIP, nothing listening on the port.
    fn teardown(&self, running: Running) -> Result<()> {
        let fp = self.fp();
        let pins = match running {
            Running::Nothing => None,
            Running::Daemon(daemon, peer) => {
                let pins = daemon.pin_dir().to_owned();
                // SIGTERM: the daemon detaches; the guard runs `fastpath detach` if it did not.
                drop(daemon);
                if let Some(b) = peer {
                    let b_pins = b.pin_dir().to_owned();
                    drop(b);
                    if b_pins.exists() {
                        bail!("the HA peer's pins are still under {}", b_pins.display());
                    }
                }
                Some(pins)
            }
            Running::Haproxy(mut process, _dir) => {
                process.kill();
                fp.ip(&["addr", "del", &format!("{VIP}/32"), "dev", "lo"])
                    .context("removing the VIP from fp's loopback")?;
                let local = fp.ip(&["route", "show", "table", "local", OTHER_VIPS])?;
                if !local.trim().is_empty() {
                    fp.ip(&["route", "del", "local", OTHER_VIPS, "dev", "lo"])
                        .context("removing the other VIPs' local route")?;
                }
                None
            }
        };
        fp.run(&["nft", "flush", "ruleset"])
            .context("flushing fp's nftables ruleset")?;
        fp.run(&["conntrack", "-F"])
            .context("flushing fp's conntrack table")?;

        let ruleset = fp.run(&["nft", "list", "ruleset"])?;
        if !ruleset.trim().is_empty() {
            bail!("fp still has a ruleset after the flush:\n{ruleset}");
        }
        for iface in self.lb.fp_interfaces() {
            if fp.xdp_attached(&iface)? {
                bail!("an XDP program is still attached to fp's {iface} after the daemon stopped");
            }
        }
        if let Some(pins) = pins.filter(|p| p.exists()) {
            bail!("the daemon's pins are still under {}", pins.display());
        }
        let lo = fp.ip(&["-4", "addr", "show", "dev", "lo"])?;
        if lo.contains(&VIP.to_string()) {
            bail!("the VIP is still on fp's loopback:\n{lo}");
        }
        let listening = fp.run(&["ss", "-Hltn", "sport", "=", &format!(":{PORT}")])?;
        if !listening.trim().is_empty() {
            bail!("something still listens on fp's port {PORT}:\n{listening}");
        }
        Ok(())
    }

    /// The counters a run is checked against.
    fn counters(&self, c: Contender, running: &Running) -> Result<Counters> {
        let mut backend_packets = Vec::new();
        for i in 0..BACKENDS {
            backend_packets.push(rx_packets(self.lb.backend(i))?);
        }
        let contender = match (c, running) {
            (c, Running::Daemon(d, _)) if c.is_fastpath() => Some(
                fastpath::datapath::pinned_stats(d.pin_dir())
                    .context("reading the daemon's counters")?
                    .packets_for_reason(reason::LB_TO_BACKEND),
            ),
            (Contender::Iptables, _) => {
                let rules = self.fp().run(&["iptables-save", "-c", "-t", "nat"])?;
                Some(iptables_dnat_packets(&rules))
            }
            (Contender::Nftables, _) => {
                let chain =
                    self.fp()
                        .run(&["nft", "list", "chain", "ip", NFT_TABLE, "prerouting"])?;
                Some(
                    nft_counter_packets(&chain)
                        .with_context(|| format!("no counter in the nftables chain:\n{chain}"))?,
                )
            }
            _ => None,
        };
        Ok(Counters {
            backend_packets,
            contender,
            client_retransmits: tcp_retransmits(self.lb.client())?,
            backend_retransmits: (0..BACKENDS)
                .map(|i| Ok(tcp_retransmits(self.lb.backend(i))?[1]))
                .sum::<Result<u64>>()?,
        })
    }

    /// fp's kernel conntrack entries (`conntrack -C`).
    fn kernel_conntrack_entries(&self) -> Result<u64> {
        let out = self.fp().run(&["conntrack", "-C"])?;
        out.trim()
            .parse()
            .with_context(|| format!("`conntrack -C` printed {out:?}"))
    }
}

/// Turns conntrack's software checksum check off in `ns` (once DNAT rules have loaded
/// nf_conntrack, so the sysctl exists). A NIC verifies receive checksums in hardware and
/// conntrack then skips its own check; veth cannot, so the check is turned off instead, not
/// to charge the iptables and nftables contenders for what a NIC does.
fn conntrack_checksum_off(ns: &Netns) -> Result<()> {
    ns.sysctl("net.netfilter.nf_conntrack_checksum", "0")
        .context("turning conntrack's checksum check off in fp")
}

/// The TCP retransmissions `ns` counted so far: [SYNs, segments].
fn tcp_retransmits(ns: &Netns) -> Result<[u64; 2]> {
    let keys = ["TcpExtTCPSynRetrans", "TcpRetransSegs"];
    // -a: absolute values, -z: zeros too, -s: leave nstat's history file alone.
    let out = ns.run(&[&["nstat", "-a", "-z", "-s"][..], &keys[..]].concat())?;
    let value = |key: &str| -> Result<u64> {
        out.lines()
            .find_map(|l| {
                let mut f = l.split_whitespace();
                (f.next() == Some(key)).then(|| f.next()?.parse().ok())?
            })
            .with_context(|| format!("no {key} in `nstat` output:\n{out}"))
    };
    Ok([value(keys[0])?, value(keys[1])?])
}

/// The iptables contender's services chain (kube-proxy's KUBE-SERVICES) and per-service
/// chains.
const IPT_SERVICES: &str = "FPBENCH-SERVICES";
const IPT_CHAIN: &str = "FPBENCH-SVC";
const IPT_CHAIN_UDP: &str = "FPBENCH-SVC-UDP";
/// The measured service's UDP port (the backends' discard port: nothing listens, so their
/// stacks count the datagrams as `Udp NoPorts`).
pub(crate) const UDP_PORT: u16 = fastpath_common::bench::SINK_UDP_PORT;
/// Where the other services' VIPs are: 10.64.0.0/10, [`other_vip`].
const OTHER_VIPS: &str = "10.64.0.0/10";

/// The VIP of the `i`th other service (not measured) in a many-service setup.
fn other_vip(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 64, 0, 1)) + i as u32)
}
/// The nftables contender's table.
const NFT_TABLE: &str = "fpbench";

/// Packet counts a run is checked with, read before and after it.
struct Counters {
    /// Packets each backend's interface received.
    backend_packets: Vec<u64>,
    /// The contender's own count: the datapath's packets to backends (fastpath), packets that
    /// matched the DNAT rules (iptables, nftables: connections, as NAT sees a connection's first
    /// packet only).
    contender: Option<u64>,
    /// The client's retransmitted SYNs and segments (TcpExtTCPSynRetrans, TcpRetransSegs).
    client_retransmits: [u64; 2],
    /// Segments the backends retransmitted (their SYN-ACKs and responses), summed.
    backend_retransmits: u64,
}

/// Fails unless the run answered requests, with no non-2xx response and few socket errors,
/// and its packets reached the backends (all of them, where the LB picks per new connection)
/// through the contender.
fn check_run(
    c: Contender,
    mode: Mode,
    run: &WrkRun,
    before: &Counters,
    after: &Counters,
) -> Result<()> {
    let min_requests = if mode == Mode::Throughput { 3 } else { 100 };
    if run.requests < min_requests {
        bail!(
            "wrk completed {} requests in {:.1} s (expected at least {min_requests}): {run:?}",
            run.requests,
            run.duration_s
        );
    }
    if run.non_2xx > 0 {
        bail!("{} responses had a status over 399: {run:?}", run.non_2xx);
    }
    let allowed = (run.requests as f64 * MAX_SOCKET_ERROR_FRACTION).floor() as u64;
    if run.socket_errors() > allowed {
        bail!(
            "{} socket errors for {} requests (at most {allowed} allowed): {run:?}",
            run.socket_errors(),
            run.requests
        );
    }
    let got: Vec<u64> = after
        .backend_packets
        .iter()
        .zip(&before.backend_packets)
        .map(|(a, b)| a.saturating_sub(*b))
        .collect();
    let total: u64 = got.iter().sum();
    if total < run.requests {
        bail!(
            "the backends received {total} packets ({got:?}) for {} requests",
            run.requests
        );
    }
    if c.balances() && mode == Mode::NewConnection {
        for (i, n) in got.iter().enumerate() {
            if (*n as f64) < total as f64 * MIN_BACKEND_SHARE {
                bail!(
                    "backend {i} received {n} of {total} packets ({got:?}): the connections were not spread over the {BACKENDS} backends"
                );
            }
        }
    }
    if !c.balances() && got[0] < run.requests {
        bail!(
            "backend 0 received {} packets for {} requests sent to it directly",
            got[0],
            run.requests
        );
    }
    if let (Some(b), Some(a)) = (before.contender, after.contender) {
        let seen = a.saturating_sub(b);
        // Keep-alive connections open once per connection; new-connection runs once per request.
        let want = match mode {
            Mode::NewConnection => run.requests,
            _ if c.is_fastpath() => run.requests,
            _ => 1,
        };
        if seen < want {
            bail!(
                "the {} counter grew by {seen}, expected at least {want} for {} requests: the traffic did not go through it",
                c.key(),
                run.requests
            );
        }
    }
    Ok(())
}

/// Parses [`WRK_SCRIPT`]'s summary line.
pub(crate) fn parse_wrk(stdout: &str) -> Result<WrkRun> {
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("FPBENCH "))
        .context("no FPBENCH summary line: wrk did not run its `done` hook")?;
    let mut run = WrkRun::default();
    for field in line.split_whitespace() {
        let (key, value) = field
            .split_once('=')
            .with_context(|| format!("bad field {field:?}"))?;
        let v: u64 = value
            .parse()
            .with_context(|| format!("bad number in {field:?}"))?;
        match key {
            "requests" => run.requests = v,
            "bytes" => run.bytes = v,
            "duration_us" => run.duration_s = v as f64 / 1e6,
            "connect" => run.connect_errors = v,
            "read" => run.read_errors = v,
            "write" => run.write_errors = v,
            "timeout" => run.timeouts = v,
            "status" => run.non_2xx = v,
            "p50_us" => run.p50_us = v,
            "p99_us" => run.p99_us = v,
            other => bail!("unknown field {other:?}"),
        }
    }
    if run.duration_s <= 0.0 {
        bail!("wrk reported no duration");
    }
    Ok(run)
}

/// Packets the interface `eth0` of `ns` received.
fn rx_packets(ns: &Netns) -> Result<u64> {
    let json = ns.ip(&["-j", "-s", "link", "show", "dev", LbTopology::HOST_IF])?;
    let v: serde_json::Value = serde_json::from_str(&json).context("parsing `ip -j -s link`")?;
    v.get(0)
        .and_then(|l| l.pointer("/stats64/rx/packets"))
        .and_then(serde_json::Value::as_u64)
        .with_context(|| format!("no rx packet count in `ip -j -s link`: {json}"))
}

/// Sum of the packet counters of the DNAT rules in `iptables-save -c` output.
fn iptables_dnat_packets(rules: &str) -> u64 {
    rules
        .lines()
        .filter(|l| l.contains(&format!("-A {IPT_CHAIN} ")) && l.contains("-j DNAT"))
        .filter_map(|l| l.strip_prefix('[')?.split(':').next()?.parse::<u64>().ok())
        .sum()
}

/// The packets of the first `counter packets N` in `nft list` output.
fn nft_counter_packets(chain: &str) -> Option<u64> {
    let rest = chain.split("counter packets ").nth(1)?;
    rest.split_whitespace().next()?.parse().ok()
}

/// The daemon's log, for errors, when it runs.
fn daemon_log(running: &Running) -> String {
    match running {
        Running::Daemon(d, None) => format!("; fastpath daemon log:\n{}", d.log()),
        Running::Daemon(a, Some(b)) => format!(
            "; fastpath daemon (node A) log:\n{}\nnode B's log:\n{}",
            a.log(),
            b.log()
        ),
        _ => String::new(),
    }
}

/// What the HA pair's status says about A's stream to B.
#[derive(Clone, Copy, Debug)]
struct HaCounts {
    /// A: the newest change's seq, acknowledged seq, refused acks, changes B refused,
    /// events lost, snapshots sent.
    last_seq: u64,
    acked_seq: u64,
    rejected: u64,
    peer_rejected: u64,
    events_lost: u64,
    snapshots: u64,
    lag_p50_us: u64,
    lag_p99_us: u64,
    /// B: A's entries installed now, changes received from A, changes refused, applied seq.
    installed: u64,
    received_changes: u64,
    b_rejected: u64,
    applied_seq: u64,
}

fn ha_counts((a, b): (&Daemon, &Daemon)) -> Result<HaCounts> {
    let (sa, sb) = (pair::ha_status(a)?, pair::ha_status(b)?);
    let out = &sa["peers_out"][0];
    let inb = sb["peers_in"]
        .as_array()
        .and_then(|v| {
            v.iter()
                .find(|p| p["node_id"].as_u64() == Some(u64::from(Node::A.node_id())))
        })
        .with_context(|| format!("B has no stream from A: {sb}"))?;
    let n = |v: &serde_json::Value, k: &str| -> Result<u64> {
        v[k].as_u64()
            .with_context(|| format!("no {k} in ha status: {v}"))
    };
    Ok(HaCounts {
        last_seq: n(out, "last_seq")?,
        acked_seq: n(out, "acked_seq")?,
        rejected: n(out, "rejected")?,
        peer_rejected: n(out, "peer_rejected")?,
        events_lost: n(&sa, "events_lost")?,
        snapshots: n(out, "snapshots")?,
        lag_p50_us: n(out, "lag_p50_us")?,
        lag_p99_us: n(out, "lag_p99_us")?,
        installed: n(inb, "installed")?,
        received_changes: n(inb, "received_changes")?,
        b_rejected: n(inb, "rejected")?,
        applied_seq: n(inb, "applied_seq")?,
    })
}

/// After an HA contender's run (outside its timing): waits until B acknowledged A's last
/// change, then fails unless B received changes in the run (at least one per request in a
/// new-connection run: each request is a connection), holds A's entries, and nobody refused
/// anything. Adds the run's replication to `totals`.
fn check_replication(
    pair: (&Daemon, &Daemon),
    mode: Mode,
    run: &WrkRun,
    before: &HaCounts,
    totals: &mut HaTotals,
) -> Result<()> {
    // Caught up: B applied and acknowledged everything A made, and A made nothing new for a
    // while — its replication thread (nice 10) may still be turning the run's last events
    // into changes when wrk exits.
    const QUIET: Duration = Duration::from_millis(500);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut last: Option<(u64, std::time::Instant)> = None;
    let after = loop {
        let now = ha_counts(pair)?;
        let since = match last {
            Some((seq, at)) if seq == now.last_seq => at,
            _ => std::time::Instant::now(),
        };
        last = Some((now.last_seq, since));
        if now.acked_seq == now.last_seq
            && now.applied_seq == now.last_seq
            && since.elapsed() >= QUIET
        {
            break now;
        }
        if std::time::Instant::now() >= deadline {
            bail!("B did not catch up with A within 20 s of the run: {now:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let received = after.received_changes - before.received_changes;
    let want = match mode {
        Mode::NewConnection => (run.requests as f64 * MIN_CHANGES_PER_REQUEST).ceil() as u64,
        _ => 1,
    };
    if received < want {
        bail!(
            "B received {received} changes from A during a run of {} requests (expected at least {want}): {before:?} → {after:?}",
            run.requests
        );
    }
    if after.installed == 0 {
        bail!("B holds none of A's entries after the run: {after:?}");
    }
    if after.rejected > 0 || after.peer_rejected > 0 || after.b_rejected > 0 {
        bail!("changes or acks refused: {after:?}");
    }
    totals.changes += after.last_seq - before.last_seq;
    totals.received_changes += received;
    totals.events_lost += after.events_lost - before.events_lost;
    totals.resyncs += after.snapshots - before.snapshots;
    if mode == Mode::NewConnection {
        totals
            .lags
            .push((after.lag_p50_us as f64, after.lag_p99_us as f64));
    }
    Ok(())
}

/// The "Load balancers compared" tables.
pub fn markdown(r: &CompareReport) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "VIP {VIP}:{PORT} over {} nginx backends · {} rounds · wrk {} s per run after a {} s warm-up · {} connections (new-connection, keep-alive) · {} connections fetching a {} MiB file (throughput) · netdev_max_backlog {BACKLOG}\n\nVersions: {}; {}; {}; {}.\n",
        r.backends,
        r.rounds,
        r.duration_s,
        r.warmup_s,
        r.connections,
        r.bulk_connections,
        r.bulk_file_bytes >> 20,
        r.load_generator,
        r.haproxy,
        r.iptables,
        r.nftables
    );
    let _ = writeln!(
        md,
        "| contender | new conn req/s | keep-alive req/s | throughput Gbit/s | ÷ direct (new / keep-alive / throughput) | ÷ fastpath (new / keep-alive / throughput) | socket errors / non-2xx / requests | client retransmits: SYNs / segments | backlog drops / steal % (median, max) | kernel conntrack entries after a new-conn run | LB process CPU % of one CPU (new / keep-alive / throughput) |\n|---|---:|---:|---:|---|---|---:|---:|---:|---:|---|"
    );
    for c in &r.contenders {
        let cell = |m: &Metric, digits: usize| crate::cell(m.median, m.min, m.max, digits);
        let ratios = |pick: fn(&Metric) -> f64| {
            [
                &c.new_connection_rps,
                &c.keep_alive_rps,
                &c.throughput_gbit_s,
            ]
            .iter()
            .map(|m| format!("{:.2}", pick(m)))
            .collect::<Vec<_>>()
            .join(" / ")
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} / {} / {} | {} / {} | {} / {:.1}, {:.1} | {:.0} | {} |",
            c.what,
            cell(&c.new_connection_rps, 0),
            cell(&c.keep_alive_rps, 0),
            cell(&c.throughput_gbit_s, 2),
            ratios(|m| m.vs_direct),
            ratios(|m| m.vs_fastpath),
            c.socket_errors,
            c.non_2xx,
            c.requests,
            c.client_syn_retransmits,
            c.client_retransmitted_segments,
            c.backlog_drops,
            c.steal_percent[0],
            c.steal_percent[1],
            c.kernel_conntrack_entries,
            c.process_cpu_percent.map_or_else(
                || "— (kernel only)".to_string(),
                |p| format!("{:.0} / {:.0} / {:.0}", p[0], p[1], p[2])
            )
        );
    }
    let _ = writeln!(
        md,
        "\n| contender | new conn p50 / p99 ms | keep-alive p50 / p99 ms | CPU µs/request: new conn / keep-alive |\n|---|---:|---:|---:|"
    );
    for c in &r.contenders {
        let ms = |l: [f64; 2]| format!("{:.2} / {:.2}", l[0] / 1e3, l[1] / 1e3);
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.1} / {:.1} |",
            c.what,
            ms(c.latency_us[0]),
            ms(c.latency_us[1]),
            c.cpu_us_per_request[0],
            c.cpu_us_per_request[1]
        );
    }
    let _ = writeln!(md);
    md
}

/// fastpath with HA sync off and on, and their new-connection req/s over every round of the
/// pair, the extra ones included.
struct HaPair<'a> {
    plain: &'a ContenderRow,
    sync: &'a ContenderRow,
    ha: &'a HaTotals,
    plain_new: Vec<f64>,
    sync_new: Vec<f64>,
}

impl<'a> HaPair<'a> {
    /// The pair, where the run had both contenders.
    fn of(r: &'a CompareReport) -> Option<Self> {
        let find = |key: &str| r.contenders.iter().find(|c| c.contender == key);
        let (plain, sync) = (find("fastpath")?, find("fastpath-ha")?);
        let new_conn = |c: &ContenderRow| {
            [
                c.new_connection_rps.samples.as_slice(),
                &c.new_connection_extra_rps,
            ]
            .concat()
        };
        Some(HaPair {
            plain,
            sync,
            ha: sync.ha.as_ref()?,
            plain_new: new_conn(plain),
            sync_new: new_conn(sync),
        })
    }

    /// Sync on ÷ off: the ratio of the medians, and (median, min, max) of the per-round ratios.
    fn ratios(&self) -> (f64, (f64, f64, f64)) {
        let per_round: Vec<f64> = self
            .sync_new
            .iter()
            .zip(&self.plain_new)
            .map(|(a, b)| a / b)
            .collect();
        (
            crate::stats(&self.sync_new).0 / crate::stats(&self.plain_new).0,
            crate::stats(&per_round),
        )
    }
}

/// HA sync on against off: the two fastpath rows side by side, and what was replicated.
pub fn ha_markdown(r: &CompareReport) -> String {
    let Some(pair) = HaPair::of(r) else {
        return "Not measured in this run (`bench quick` leaves the HA contender out; a full run or `bench lb-compare` measures it).\n\n".to_owned();
    };
    let HaPair {
        plain,
        sync,
        ha,
        plain_new,
        sync_new,
    } = &pair;
    let mut md = String::new();
    let _ = writeln!(
        md,
        "{} rounds + {} rounds of the pair alone (new connections, {} s pause after each run) · new conn over {} pairs, keep-alive over {} · B must receive ≥ {MIN_CHANGES_PER_REQUEST} changes per request\n",
        r.rounds,
        r.ha_extra_rounds,
        HA_EXTRA_PAUSE.as_secs(),
        sync_new.len(),
        r.rounds
    );
    let (ratio, (pr_median, pr_min, pr_max)) = pair.ratios();
    let cell = |m: &Metric| crate::cell(m.median, m.min, m.max, 0);
    let cpu = |p: Option<[f64; 3]>| {
        p.map_or_else(
            || "—".to_string(),
            |p| format!("{:.0} / {:.0} / {:.0}", p[0], p[1], p[2]),
        )
    };
    let _ = writeln!(
        md,
        "| | new conn req/s | keep-alive req/s | node A (fp) daemon CPU % of one CPU (new / keep-alive / throughput) | node B daemon CPU % (new / keep-alive / throughput) |\n|---|---:|---:|---|---|"
    );
    for (what, c, n) in [
        ("fastpath, sync off", plain, plain_new),
        ("fastpath, sync on", sync, sync_new),
    ] {
        let (median, min, max) = crate::stats(n);
        let _ = writeln!(
            md,
            "| {what} | {median:.0} ({min:.0}–{max:.0}) | {} | {} | {} |",
            cell(&c.keep_alive_rps),
            cpu(c.process_cpu_percent),
            cpu(c.peer_process_cpu_percent)
        );
    }
    let _ = writeln!(
        md,
        "\n| new conn req/s, on ÷ off: ratio of medians | per round: median (min–max) | changes made by A / received by B | lag p50 / p99 ms | events lost | resyncs |\n|---:|---:|---:|---:|---:|---:|\n| **{ratio:.3}** | {pr_median:.3} ({pr_min:.3}–{pr_max:.3}) | {} / {} | {:.2} / {:.2} | {} | {} |\n",
        ha.changes,
        ha.received_changes,
        ha.lag_p50_us / 1e3,
        ha.lag_p99_us / 1e3,
        ha.events_lost,
        ha.resyncs
    );
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contenders_are_listed_in_declaration_order() {
        // `run` indexes its samples with `Contender as usize`.
        for (i, c) in Contender::ALL.iter().enumerate() {
            assert_eq!(*c as usize, i, "{c:?} out of place in Contender::ALL");
        }
    }

    #[test]
    fn reads_this_process_cpu_time() {
        let spent = process_cpu_s(std::process::id()).expect("/proc/self/stat");
        assert!(spent >= 0.0 && spent.is_finite(), "CPU seconds {spent}");
    }

    #[test]
    fn parses_the_wrk_summary() {
        let run = parse_wrk("Running 5s test\nFPBENCH requests=120 bytes=3400 duration_us=5000000 connect=0 read=1 write=0 timeout=2 status=0\n")
            .expect("a valid summary");
        assert_eq!(
            (run.requests, run.bytes, run.socket_errors()),
            (120, 3400, 3)
        );
        assert!((run.duration_s - 5.0).abs() < 1e-9);
        assert!(parse_wrk("no summary").is_err());
    }

    #[test]
    fn reads_rule_counters() {
        let save = "*nat\n:PREROUTING ACCEPT [0:0]\n[7:420] -A PREROUTING -d 10.200.0.100/32 -p tcp -j FPBENCH-SVC\n[3:180] -A FPBENCH-SVC -m statistic --mode random --probability 0.3333333333 -j DNAT --to-destination 10.200.10.2:80\n[4:240] -A FPBENCH-SVC -j DNAT --to-destination 10.200.12.2:80\n";
        assert_eq!(iptables_dnat_packets(save), 7);
        let nft = "table ip fpbench {\n\tchain prerouting {\n\t\tip daddr 10.200.0.100 tcp dport 80 counter packets 42 bytes 2520 dnat to numgen random mod 3 map { 0 : 10.200.10.2 }\n\t}\n}\n";
        assert_eq!(nft_counter_packets(nft), Some(42));
    }

    #[test]
    fn busy_time_is_the_timed_interval_less_idle_and_refuses_a_wider_reading() {
        let hz = ticks_s(1).recip();
        let over = |idle_s: f64| Machine {
            backlog_drops: 0,
            steal_ticks: 0,
            idle_ticks: (idle_s * hz).round() as u64,
            cpus: 2,
        };
        // 5 s on 2 CPUs, 3 CPU-seconds idle: 7 busy.
        let busy = over(3.0)
            .busy_seconds(5.0)
            .expect("idle within the interval");
        assert!((busy - 7.0).abs() < 1e-6, "busy {busy}");
        // Idle for 12 CPU-seconds: the reading covered more than the 5 s timed (as when the
        // counters were read inside it); it was reported as 0 busy before.
        let err = over(12.0)
            .busy_seconds(5.0)
            .expect_err("a reading wider than 5 s");
        assert!(err.to_string().contains("spans more than"), "{err}");
        // A tick per CPU of rounding is not an error.
        let idle = over(10.0);
        let rounded = Machine {
            idle_ticks: idle.idle_ticks + 1,
            ..idle
        };
        assert_eq!(rounded.busy_seconds(5.0).expect("rounding"), 0.0);
    }
}

/// The comparison's chart: requests/s with a new connection each.
pub fn figures(r: &CompareReport) -> Vec<Figure> {
    let bars: Vec<Bar> = r
        .contenders
        .iter()
        .map(|c| {
            let m = &c.new_connection_rps;
            Bar::new(
                c.contender.as_str(),
                (m.median, m.min, m.max),
                c.contender.starts_with("fastpath"),
            )
        })
        .collect();
    if bars.is_empty() {
        return Vec::new();
    }
    vec![Figure::bars(
        "lb_new_connections.svg",
        "Load balancers: requests/s, a new connection per request",
        "requests/s",
        &bars,
        None,
    )]
}
