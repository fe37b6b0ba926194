//! `bench ha-mesh`: replication among three active nodes, each a peer of the other two (the
//! cluster test's mesh, `testkit::cluster::ClusterPlan`, without BGP), and the price of
//! replication in new connections per second on one node.
//!
//! ```text
//!   router ── node1 10.9.1.2, node2 10.9.2.2, node3 10.9.3.2 (eth0, fastpath XDP)
//!   the generator (bench_xdp_flows, BPF_PROG_TEST_RUN live frames) sends SYNs to the VIP out
//!   of the router's link to each loaded node: each frame a new flow, so a new full-NAT
//!   connection (an entry and its alias) on that node, replicated to both others; the
//!   translated SYNs go back to the router, which drops them (the backends' prefix is a
//!   blackhole route), so nothing answers and every connection stays in SYN_SENT.
//! ```
//!
//! Replication rows: fresh daemons per run; the generator paces [`RATE`] SYNs/s per loaded
//! node for [`LOAD`]; then every node's status is polled over its API socket until every
//! stream has its last change acknowledged, and each node's copy of each peer's
//! load-balanced entries must equal the peer's own, entry for entry. Changes/s: changes made
//! on all loaded nodes over generator start → last ack. Lag: each stream's percentiles of
//! change made → applied by the peer (its last 4096 acks). CPU: the daemons' utime + stime
//! over generator start → last ack.
//!
//! New connections/s: node 1 alone loaded, the generator at full speed for [`LOAD`], node 1
//! with replication on (its two peers running) and off (no `[ha]`, no peers) in alternate
//! runs; a connection is a SYN that node 1 forwarded to a backend (reason `lb_to_backend`).

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use fastpath::{
    api::{client, pb},
    testkit::{
        bgp::{self, node_addr, node_role, router_addr},
        cluster::ClusterPlan,
        fixture::FlowGenerator,
        ha::{compare_lb_entries, wait_in_sync},
        netns::{Daemon, DaemonConfig, TempDir, Topology, unique_pin_dir},
        packet::Pkt,
        pki::TestCa,
    },
};
use fastpath_common::reason;
use serde::{Deserialize, Serialize};

use crate::{ha::cell, lb_compare::process_cpu_s, route_compare::mac};

const NODES: usize = 3;
const VIP: [u8; 4] = [10, 254, 0, 100];
const PORT: u16 = 80;
/// Backends 10.9.100.1..=16 (Maglev spreads the connections, and with them full-NAT's
/// source ports), all behind the router's blackhole route.
const BACKENDS: u8 = 16;
/// The generator's clients: 10.150.0.0/16, the low 16 bits and the port stamped per flow.
const CLIENT: [u8; 4] = [10, 150, 0, 0];
/// SYNs per second per loaded node in the replication rows (the issue's target rate).
const RATE: u32 = 50_000;
const LOAD: Duration = Duration::from_secs(2);
const ROUNDS: usize = 3;
/// Every node's conntrack capacity: its own connections and both peers', two entries each.
const CT_CAPACITY: u32 = 1 << 21;
/// Frames per generator call, and per live-frames batch.
const CHUNK: u32 = 256;
const GEN_BATCH: u32 = 64;
/// How often the nodes' status is read while they catch up.
const POLL: Duration = Duration::from_millis(10);

/// One replication run's measurements.
#[derive(Default, Clone, Debug, Serialize, Deserialize)]
pub struct MeshRun {
    /// SYNs the generator sent per loaded node per second.
    pub syns_per_s: f64,
    /// Changes made on the loaded nodes (each node's `last_seq` delta, the same towards
    /// both peers), and per second over generator start → last ack.
    pub changes: u64,
    pub changes_per_s: f64,
    /// Generator start → every stream's last change acknowledged, seconds.
    pub duration_s: f64,
    /// The loaded nodes' streams' lag percentiles: the median stream's p50 and the worst
    /// stream's p99, µs.
    pub lag_p50_us: u64,
    pub lag_p99_us: u64,
    /// All daemons' CPU: % of one CPU over the window, and ms per 1000 changes made.
    pub cpu_percent: f64,
    pub cpu_ms_per_1000: f64,
    /// Entries each node holds as its peers' equal the peers' own, for every pair.
    pub tables_agree: bool,
    /// Connections the loaded nodes made (their own, load-balanced), all together.
    pub connections: u64,
    pub events_lost: u64,
    pub resyncs: u64,
}

/// One load's runs.
#[derive(Default, Debug, Serialize, Deserialize)]
pub struct MeshRow {
    pub label: String,
    pub loaded: Vec<usize>,
    pub rate: u32,
    pub runs: Vec<MeshRun>,
}

/// One new-connections run: node 1's connections per second with replication on or off.
#[derive(Default, Clone, Copy, Debug, Serialize, Deserialize)]
pub struct ConnRun {
    pub frames_per_s: f64,
    pub connections_per_s: f64,
}

#[derive(Default, Debug, Serialize, Deserialize)]
pub struct MeshReport {
    pub rounds: usize,
    pub load_s: f64,
    pub ct_capacity: u32,
    pub rows: Vec<MeshRow>,
    pub conns_off: Vec<ConnRun>,
    pub conns_on: Vec<ConnRun>,
}

struct Bed {
    topo: Topology,
    plan: ClusterPlan,
    bin: PathBuf,
    /// The generator, loaded once: its flow count runs on over the whole benchmark, so no
    /// two runs send the same flow.
    generator: FlowGenerator,
    /// Per node: the SYN template and the router's interface towards it.
    frames: Vec<Vec<u8>>,
    links: Vec<String>,
    _dir: TempDir,
}

pub fn run(bin: &Path) -> Result<MeshReport> {
    let mut bed = Bed::new(bin)?;
    let loads: [(&str, Vec<usize>); 2] = [
        ("node 1 loaded, nodes 2 and 3 apply", vec![1]),
        (
            "all three loaded, each applies the other two",
            vec![1, 2, 3],
        ),
    ];
    let mut report = MeshReport {
        rounds: ROUNDS,
        load_s: LOAD.as_secs_f64(),
        ct_capacity: CT_CAPACITY,
        rows: loads
            .iter()
            .map(|(label, loaded)| MeshRow {
                label: (*label).to_owned(),
                loaded: loaded.clone(),
                rate: RATE,
                runs: Vec::new(),
            })
            .collect(),
        ..MeshReport::default()
    };
    for round in 0..ROUNDS {
        for row in &mut report.rows {
            let r = bed
                .replication_run(&row.loaded, RATE)
                .with_context(|| format!("{}, round {}", row.label, round + 1))?;
            eprintln!(
                "{}: {:.0} changes/s, lag p50 {:.1} ms p99 {:.1} ms, {:.1} ms CPU per 1000 changes",
                row.label,
                r.changes_per_s,
                r.lag_p50_us as f64 / 1e3,
                r.lag_p99_us as f64 / 1e3,
                r.cpu_ms_per_1000
            );
            row.runs.push(r);
        }
        // Off and on alternate, the first of the pair swapped each round.
        let order = if round % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for on in order {
            let r = bed.connections_run(on).with_context(|| {
                format!("new connections, replication {on}, round {}", round + 1)
            })?;
            eprintln!(
                "node 1 at full speed, replication {}: {:.0} new connections/s",
                if on { "on" } else { "off" },
                r.connections_per_s
            );
            if on {
                report.conns_on.push(r);
            } else {
                report.conns_off.push(r);
            }
        }
    }
    Ok(report)
}

fn service(i: usize) -> String {
    let mut s = format!(
        "[[service]]\nvip = \"{}\"\nport = {PORT}\nscheduler = \"maglev\"\nmode = \"full_nat\"\nsnat_address = \"10.201.{i}.1\"\n",
        std::net::Ipv4Addr::from(VIP)
    );
    for b in 1..=BACKENDS {
        s += &format!("[[service.backend]]\naddress = \"10.9.100.{b}\"\nport = {PORT}\n");
    }
    s
}

/// The daemons' status over their API sockets, from one runtime.
struct Status {
    rt: tokio::runtime::Runtime,
    clients: Vec<client::Client>,
}

impl Status {
    fn connect(daemons: &[&Daemon]) -> Result<Status> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let clients = rt.block_on(async {
            let mut v = Vec::new();
            for d in daemons {
                v.push(
                    client::connect(&client::Target::Unix(d.socket()))
                        .await
                        .map_err(|e| anyhow::anyhow!("a node's API: {e}"))?,
                );
            }
            anyhow::Ok(v)
        })?;
        Ok(Status { rt, clients })
    }

    fn all(&mut self) -> Result<Vec<pb::HaStatus>> {
        let Status { rt, clients } = self;
        rt.block_on(async {
            let mut v = Vec::new();
            for c in clients.iter_mut() {
                v.push(
                    c.get_ha_status(pb::GetHaStatusRequest {})
                        .await
                        .context("GetHaStatus")?
                        .into_inner(),
                );
            }
            Ok(v)
        })
    }
}

/// Every stream of every node has its last change acknowledged.
fn caught_up(all: &[pb::HaStatus]) -> bool {
    all.iter()
        .flat_map(|s| &s.peers_out)
        .all(|o| o.connected && o.acked_seq == o.last_seq && o.queued == 0)
}

/// A node's changes made: its streams' `last_seq` (each stream numbers every change).
fn last_seq(s: &pb::HaStatus) -> Result<u64> {
    s.peers_out
        .iter()
        .map(|o| o.last_seq)
        .max()
        .context("a node has no peer stream")
}

impl Bed {
    fn new(bin: &Path) -> Result<Bed> {
        let mut topo = Topology::new();
        topo.add_ns("router")?;
        bgp::add_nodes(&mut topo, NODES);
        let router = topo.ns("router");
        router.ip(&["route", "add", "blackhole", "10.9.100.0/24"])?;
        let links: Vec<String> = (1..=NODES).map(|i| format!("r-n{i}")).collect();
        // The veths take XDP frames only where the receiving end runs NAPI: the router's
        // ends get the nodes' XDP_TX, the nodes' ends the generator's frames.
        for l in &links {
            router.run(&["ethtool", "-K", l, "gro", "on"])?;
        }
        // A spare veth for the generator to stay attached to (see
        // `FlowGenerator::hold_in_dispatcher`).
        router.ip(&[
            "link", "add", "gen0", "type", "veth", "peer", "name", "gen1",
        ])?;
        for l in ["gen0", "gen1"] {
            router.ip(&["link", "set", l, "up"])?;
        }
        let mut generator = FlowGenerator::load().context("loading the generator")?;
        router.in_netns(|| -> Result<()> {
            let spare = fastpath::sys::ifindex("gen0").context("the spare veth")?;
            generator
                .hold_in_dispatcher(spare)
                .context("attaching the generator to the spare veth")?;
            Ok(())
        })??;
        for i in 1..=NODES {
            topo.ns(&node_role(i))
                .run(&["ethtool", "-K", "eth0", "gro", "on"])?;
        }
        let frames = (1..=NODES)
            .map(|i| -> Result<Vec<u8>> {
                Ok(Pkt::eth()
                    .macs(
                        mac(topo.ns(&node_role(i)), "eth0")?,
                        mac(router, &links[i - 1])?,
                    )
                    .ipv4(CLIENT, VIP)
                    .tcp(40000, PORT, 0x02)
                    .tcp_options(&[2, 4, 0x05, 0xb4])
                    .build())
            })
            .collect::<Result<_>>()?;
        let dir = TempDir::new("hamesh")?;
        let plan = ClusterPlan {
            nodes: NODES,
            vip: std::net::Ipv4Addr::from(VIP).to_string(),
            ports: vec![PORT],
            backends: Vec::new(),
            node_addr,
            router_addr,
            source_prefix: |i| format!("10.201.{i}.0/24"),
            snat_address: |i| format!("10.201.{i}.1"),
            tls_dir: dir.path().display().to_string(),
            table: 100,
            sync_port: 7946,
        };
        plan.issue_certs(&TestCa::new(&dir, "fastpath-ha-mesh-bench-ca", "ca"), &dir);
        Ok(Bed {
            topo,
            plan,
            bin: bin.to_owned(),
            generator,
            frames,
            links,
            _dir: dir,
        })
    }

    /// Starts node `i`'s daemon, with the mesh's `[ha]` when `replicate`.
    fn start(&self, i: usize, replicate: bool) -> Result<Daemon> {
        let mut config = DaemonConfig::new(&unique_pin_dir(&format!("hamesh{i}")))
            .interface("eth0")
            .conntrack("capacity", CT_CAPACITY)
            .ct_timeout("tcp_syn_sent", 600)
            // The expiry pass walks the whole table (up to 10% of a CPU per daemon, see
            // `ct_gc::REST_FACTOR`); once a minute, it stays out of replication's numbers.
            .conntrack("gc_interval_ms", 60_000)
            .services(&service(i));
        if replicate {
            config = config.raw(&self.plan.ha_table(i));
        }
        let d = Daemon::try_start(
            &self.bin,
            self.topo.ns(&node_role(i)).name(),
            &config.pin_dir,
            &config.to_toml(),
        )
        .with_context(|| format!("starting node {i}"))?;
        // The node's neighbour entry for the router, so the first SYNs are not spent on ARP.
        self.topo
            .ns(&node_role(i))
            .run(&["ping", "-c", "1", "-W", "1", &router_addr(i)])?;
        Ok(d)
    }

    /// Sends SYNs to each of `nodes` (1-based) at `rate` per second each (`None`: as fast as
    /// it goes, to the first node only) for [`LOAD`]; the SYNs sent per node per second.
    fn generate(&mut self, nodes: &[usize], rate: Option<u32>) -> Result<f64> {
        let Bed {
            topo,
            generator,
            frames,
            links,
            ..
        } = self;
        topo.ns("router").in_netns(|| -> Result<f64> {
            let ifindexes: Vec<u32> = nodes
                .iter()
                .map(|&i| fastpath::sys::ifindex(&links[i - 1]).context("a router link"))
                .collect::<Result<_>>()?;
            let mut sent = vec![0u64; nodes.len()];
            let start = Instant::now();
            loop {
                let elapsed = start.elapsed();
                if elapsed >= LOAD {
                    break;
                }
                let mut idle = true;
                for (k, &i) in nodes.iter().enumerate() {
                    let due =
                        rate.map_or(u64::MAX, |r| (f64::from(r) * elapsed.as_secs_f64()) as u64);
                    if due.saturating_sub(sent[k]) >= u64::from(CHUNK) {
                        generator
                            .transmit(ifindexes[k], &frames[i - 1], CHUNK, GEN_BATCH)
                            .context("the generator")?;
                        sent[k] += u64::from(CHUNK);
                        idle = false;
                    }
                }
                if idle {
                    thread::sleep(Duration::from_micros(500));
                }
            }
            let secs = start.elapsed().as_secs_f64();
            Ok(sent.iter().sum::<u64>() as f64 / nodes.len() as f64 / secs)
        })?
    }

    fn replication_run(&mut self, loaded: &[usize], rate: u32) -> Result<MeshRun> {
        let daemons: Vec<Daemon> = (1..=NODES)
            .map(|i| self.start(i, true))
            .collect::<Result<_>>()?;
        for (i, d) in daemons.iter().enumerate() {
            wait_in_sync(
                d,
                &format!("node {} at the start", i + 1),
                Duration::from_secs(30),
            )?;
        }
        let pids: Vec<u32> = daemons
            .iter()
            .map(|d| d.pid().context("a node is not running"))
            .collect::<Result<_>>()?;
        let cpu = |pids: &[u32]| -> Result<f64> {
            pids.iter().map(|&p| process_cpu_s(p)).sum::<Result<f64>>()
        };
        let mut status = Status::connect(&daemons.iter().collect::<Vec<_>>())?;
        let before = status.all()?;
        let cpu0 = cpu(&pids)?;
        let start = Instant::now();
        let syns_per_s = self.generate(loaded, Some(rate))?;
        let deadline = Instant::now() + Duration::from_secs(120);
        let (done, cpu1, after) = loop {
            let s = status.all()?;
            if caught_up(&s) {
                break (Instant::now(), cpu(&pids)?, s);
            }
            if Instant::now() > deadline {
                bail!(
                    "the streams did not catch up within 120 s: {s:?}\nnode 1's log:\n{}",
                    daemons[0].log()
                );
            }
            thread::sleep(POLL);
        };
        let mut changes = 0;
        for &i in loaded {
            changes += last_seq(&after[i - 1])? - last_seq(&before[i - 1])?;
        }
        let mut p50s = Vec::new();
        let mut p99 = 0;
        let (mut lost, mut resyncs) = (0, 0);
        for (s, s0) in after.iter().zip(&before) {
            lost += s.events_lost - s0.events_lost;
            for (o, o0) in s.peers_out.iter().zip(&s0.peers_out) {
                resyncs += o.snapshots - o0.snapshots;
                if o.rejected > 0 || o.peer_rejected > 0 {
                    bail!("changes or acks refused: {o:?}");
                }
            }
        }
        for &i in loaded {
            for o in &after[i - 1].peers_out {
                p50s.push(o.lag_p50_us as f64);
                p99 = p99.max(o.lag_p99_us);
            }
        }
        let mut agree = true;
        let mut connections = 0;
        for &i in loaded {
            let mut connections_of_i = 0;
            for k in (1..=NODES).filter(|&k| k != i) {
                let diff = compare_lb_entries(
                    daemons[i - 1].pin_dir(),
                    daemons[k - 1].pin_dir(),
                    i as u32,
                )?;
                if !diff.agree() {
                    eprintln!("node {k}'s copy of node {i}'s entries differs: {diff}");
                    agree = false;
                }
                // Node i's own connections, the same in each of its comparisons.
                connections_of_i = diff.a_connections as u64;
            }
            connections += connections_of_i;
        }
        let window = (done - start).as_secs_f64();
        let cpu_s = cpu1 - cpu0;
        Ok(MeshRun {
            syns_per_s,
            changes,
            changes_per_s: changes as f64 / window,
            duration_s: window,
            lag_p50_us: crate::stats(&p50s).0 as u64,
            lag_p99_us: p99,
            cpu_percent: cpu_s / window * 100.0,
            cpu_ms_per_1000: cpu_s * 1e3 / (changes as f64 / 1e3),
            tables_agree: agree,
            connections,
            events_lost: lost,
            resyncs,
        })
    }

    /// Node 1's new connections per second at the generator's full speed, replication `on`
    /// (its peers running) or off.
    fn connections_run(&mut self, on: bool) -> Result<ConnRun> {
        let daemons: Vec<Daemon> = if on {
            (1..=NODES)
                .map(|i| self.start(i, true))
                .collect::<Result<_>>()?
        } else {
            vec![self.start(1, false)?]
        };
        if on {
            for d in &daemons {
                wait_in_sync(d, "a node at the start", Duration::from_secs(30))?;
            }
        }
        let n1 = &daemons[0];
        let before = n1.stats().packets_for_reason(reason::LB_TO_BACKEND);
        let start = Instant::now();
        let frames_per_s = self.generate(&[1], None)?;
        let secs = start.elapsed().as_secs_f64();
        let made = n1.stats().packets_for_reason(reason::LB_TO_BACKEND) - before;
        Ok(ConnRun {
            frames_per_s,
            connections_per_s: made as f64 / secs,
        })
    }
}

/// The "HA mesh" block: the replication rows, then new connections/s on ÷ off.
pub fn markdown(r: &MeshReport) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "3 nodes, each a peer of the other two · {} s of SYNs per run · conntrack capacity {} · {} rounds, medians (min–max)\n",
        r.load_s, r.ct_capacity, r.rounds
    );
    let _ = writeln!(
        md,
        "| load | SYNs/s per loaded node | changes made | changes/s | SYNs start → last ack s | lag p50 / p99 ms | daemons' CPU % (all 3) / ms per 1000 changes | copies = originals | events lost | resyncs |\n|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"
    );
    for row in &r.rows {
        let runs = &row.runs;
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} / {} | {} / {} | {} | {} | {} |",
            row.label,
            cell(runs, 0, |x| x.syns_per_s),
            cell(runs, 0, |x| x.changes as f64),
            cell(runs, 0, |x| x.changes_per_s),
            cell(runs, 2, |x| x.duration_s),
            cell(runs, 1, |x| x.lag_p50_us as f64 / 1e3),
            cell(runs, 1, |x| x.lag_p99_us as f64 / 1e3),
            cell(runs, 0, |x| x.cpu_percent),
            cell(runs, 1, |x| x.cpu_ms_per_1000),
            if runs.iter().all(|x| x.tables_agree) {
                "yes, every run"
            } else {
                "NO"
            },
            cell(runs, 0, |x| x.events_lost as f64),
            cell(runs, 0, |x| x.resyncs as f64),
        );
    }
    let ratios: Vec<f64> = r
        .conns_on
        .iter()
        .zip(&r.conns_off)
        .map(|(on, off)| on.connections_per_s / off.connections_per_s)
        .collect();
    let _ = writeln!(
        md,
        "\n| node 1 at full speed | SYNs/s sent | new connections/s |\n|---|---:|---:|\n| replication off | {} | {} |\n| replication on (2 peers) | {} | {} |\n| on ÷ off, per round | | {} |",
        cell(&r.conns_off, 0, |x| x.frames_per_s),
        cell(&r.conns_off, 0, |x| x.connections_per_s),
        cell(&r.conns_on, 0, |x| x.frames_per_s),
        cell(&r.conns_on, 0, |x| x.connections_per_s),
        cell(&ratios, 2, |x| *x),
    );
    md
}
