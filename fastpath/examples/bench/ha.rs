//! `bench ha`: 100,000 load-balanced connections replicated to a peer. The sync pair of the
//! replication test (`testkit::ha::SyncPair`: node A is the LB topology's fp, node B a peer
//! namespace on its own sync link, mutual TLS) with fresh daemons per run; hping3 in the
//! client sends SYNs from random sources to the VIP (each a connection through A: its entry
//! and its alias), then the run waits until A's last change is acknowledged (B applied it) and
//! compares B's copy of A's load-balanced entries with A's own, entry for entry.
//!
//! Timing: A's `GetHaStatus` polled every [`POLL`] over the API socket from this process (no
//! process start per poll): the first change is the first poll whose `last_seq` moved, the
//! last ack the first poll where `acked_seq` reached the final `last_seq`. CPU: the daemons'
//! /proc/PID/stat utime + stime over the same window (hping3 start → last ack).

use std::{
    fmt::Write as _,
    fs,
    net::Ipv4Addr,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use fastpath::{
    api::{client, pb},
    testkit::{
        ha::{self as pair, LbTableDiff, Node, NodeTls, SyncPair},
        netns::{
            Daemon, DaemonConfig, HttpServer, LbTopology, TempDir, find_tools, lb_topology,
            unique_pin_dir,
        },
    },
};
use fastpath_common::reason;
use serde::{Deserialize, Serialize};

use crate::lb_compare::process_cpu_s;

/// SYNs per run at full rate: ≥ 100,000 connections must reach A's table. hping3's random
/// sources include martians (0/8, 127/8, 224/3: 7.5-10% of them in runs here, 13.3% if they
/// were uniform), which the datapath drops as Linux does (reason `martian_source`), and a
/// random source can repeat.
const SYNS: u32 = 120_000;
const MIN_SESSIONS: usize = 100_000;
const RUNS: usize = 3;
const VIP: Ipv4Addr = Ipv4Addr::new(10, 200, 250, 1);
const PORT: u16 = 80;
/// Both nodes' conntrack capacity: room for 200k entries and what the runs leave behind.
const CT_CAPACITY: u32 = 1 << 20;
/// How often A's status is read while a burst replicates.
const POLL: Duration = Duration::from_millis(10);
/// hping3's gap between SYNs at "full rate" (`-i u1`: as fast as it sends with a count;
/// `--flood` ignores the count) and at the paced rate, run when full rate loses events.
const FULL_GAP_US: u32 = 1;
const PACED_GAP_US: u32 = 20;

/// One run's measurements.
#[derive(Default, Clone, Debug, Serialize, Deserialize)]
pub struct HaRun {
    pub syns_sent: u32,
    /// SYNs A's datapath dropped for their martian source address.
    #[serde(default)]
    pub martian_dropped: u64,
    /// Connections (and all entries: connections + aliases) on A and, as A's, on B.
    pub tables: LbTableDiff,
    /// A's `last_seq` delta: changes it made for B during the burst.
    pub changes: u64,
    /// B's `received_changes` delta.
    pub received_changes: u64,
    /// First change made (A's `last_seq` moved) → last change acknowledged, seconds.
    pub duration_s: f64,
    pub changes_per_s: f64,
    /// hping3 start → its exit, seconds, and the SYN rate that makes.
    pub hping_s: f64,
    pub syns_per_s: f64,
    /// A's replication lag percentiles (change made → B applied) over its last 4096 acks,
    /// read right after the last ack.
    pub lag_p50_us: u64,
    pub lag_p99_us: u64,
    /// CPU seconds of A's and B's daemons over hping3 start → last ack, as % of one CPU over
    /// that window and per 1000 changes (ms).
    pub a_cpu_percent: f64,
    pub b_cpu_percent: f64,
    pub a_cpu_ms_per_1000: f64,
    pub b_cpu_ms_per_1000: f64,
    /// A's `events_lost` and snapshots sent (resyncs) during the burst.
    pub events_lost: u64,
    pub resyncs: u64,
}

/// One rate's runs and their medians.
#[derive(Default, Debug, Serialize, Deserialize)]
pub struct HaRate {
    pub label: String,
    pub gap_us: u32,
    pub runs: Vec<HaRun>,
}

#[derive(Default, Debug, Serialize, Deserialize)]
pub struct HaReport {
    pub runs_per_rate: usize,
    pub ct_capacity: u32,
    pub poll_ms: u64,
    pub rates: Vec<HaRate>,
}

/// The pair's topology and the files every run shares.
struct Bench {
    bin: std::path::PathBuf,
    _server: HttpServer,
    lb: LbTopology,
    tls: [NodeTls; 2],
    _dir: TempDir,
}

pub fn run(bin: &Path) -> Result<HaReport> {
    find_tools(&["hping3", "nginx", "ethtool"]).context("the HA benchmark")?;
    let mut lb = lb_topology(1).context("building the namespace topology")?;
    SyncPair::add_to(&mut lb).context("adding the peer namespace and the sync link")?;
    lb.checksum_offloads_off()
        .context("turning checksum offloads off")?;
    let server = lb.backend(0).http_server(PORT).context("starting nginx")?;
    let dir = TempDir::new("habench")?;
    let bench = Bench {
        bin: bin.to_owned(),
        _server: server,
        tls: write_tls(&dir),
        lb,
        _dir: dir,
    };
    let mut rates = vec![HaRate {
        label: "full rate (hping3 -i u1)".into(),
        gap_us: FULL_GAP_US,
        runs: Vec::new(),
    }];
    for i in 0..RUNS {
        let r = bench
            .run_once(FULL_GAP_US)
            .with_context(|| format!("full-rate run {}", i + 1))?;
        rates[0].runs.push(r);
        eprint!("h");
    }
    if rates[0].runs.iter().any(|r| r.events_lost > 0) {
        let mut paced = HaRate {
            label: format!("paced (hping3 -i u{PACED_GAP_US}): full rate lost events"),
            gap_us: PACED_GAP_US,
            runs: Vec::new(),
        };
        for i in 0..RUNS {
            let r = bench
                .run_once(PACED_GAP_US)
                .with_context(|| format!("paced run {}", i + 1))?;
            paced.runs.push(r);
            eprint!("h");
        }
        rates.push(paced);
    }
    Ok(HaReport {
        runs_per_rate: RUNS,
        ct_capacity: CT_CAPACITY,
        poll_ms: POLL.as_millis() as u64,
        rates,
    })
}

fn service() -> String {
    format!(
        "[[service]]\nvip = \"{VIP}\"\nport = {PORT}\n[[service.backend]]\naddress = \"{}\"\nport = {PORT}\n",
        LbTopology::backend_v4(0)
    )
}

/// Both nodes' config: the service, a large table, SYN_RECV kept for 10 minutes (the
/// default 60 s could expire the first connections while the tables are compared).
fn node_config(base: DaemonConfig, node: Node, tls: &NodeTls) -> DaemonConfig {
    base.conntrack("capacity", CT_CAPACITY)
        .ct_timeout("tcp_syn_recv", 600)
        .ct_timeout("tcp_syn_sent", 600)
        .services(&service())
        .raw(&SyncPair::ha_toml(node, tls))
}

/// A's stream to B, from A's status.
fn out_of(s: &pb::HaStatus) -> Result<&pb::HaPeerOut> {
    s.peers_out.first().context("A has no peer stream")
}

/// B's view of A's stream, from B's status.
fn in_of(s: &pb::HaStatus) -> Result<&pb::HaPeerIn> {
    s.peers_in
        .iter()
        .find(|p| p.node_id == Node::A.node_id())
        .context("B has no stream from A")
}

impl Bench {
    fn run_once(&self, gap_us: u32) -> Result<HaRun> {
        let b_cfg = node_config(
            SyncPair::peer_config(&unique_pin_dir("habench-b")),
            Node::B,
            &self.tls[1],
        );
        let a_cfg = node_config(
            self.lb.fp_config(&unique_pin_dir("habench-a")),
            Node::A,
            &self.tls[0],
        );
        let ns = |n| SyncPair::ns(&self.lb, n).name();
        let b = Daemon::try_start(&self.bin, ns(Node::B), &b_cfg.pin_dir, &b_cfg.to_toml())
            .context("starting node B")?;
        let a = Daemon::try_start(&self.bin, ns(Node::A), &a_cfg.pin_dir, &a_cfg.to_toml())
            .context("starting node A")?;
        for (d, what) in [(&b, "B at the start"), (&a, "A at the start")] {
            pair::wait_in_sync(d, what, Duration::from_secs(20))?;
        }
        let (a_pid, b_pid) = (
            a.pid().context("A is not running")?,
            b.pid().context("B is not running")?,
        );
        // Declared after the daemons, so dropped before them: its API connections are closed
        // when the daemons are asked to stop.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async {
            let (ta, tb) = (
                client::Target::Unix(a.socket()),
                client::Target::Unix(b.socket()),
            );
            let mut ac = client::connect(&ta)
                .await
                .map_err(|e| anyhow::anyhow!("A's API: {e}"))?;
            let mut bc = client::connect(&tb)
                .await
                .map_err(|e| anyhow::anyhow!("B's API: {e}"))?;
            let status = async |c: &mut client::Client| -> Result<pb::HaStatus> {
                Ok(c.get_ha_status(pb::GetHaStatusRequest {})
                    .await
                    .context("GetHaStatus")?
                    .into_inner())
            };
            let (a0, b0) = (status(&mut ac).await?, status(&mut bc).await?);
            let (o0, i0) = (out_of(&a0)?.clone(), *in_of(&b0)?);
            let cpu0 = (process_cpu_s(a_pid)?, process_cpu_s(b_pid)?);
            let martians0 = a.stats().packets_for_reason(reason::MARTIAN_SOURCE);

            let start = Instant::now();
            let mut hping = pair::syn_burst(self.lb.client(), VIP, PORT, SYNS, gap_us)?;
            let mut hping_done: Option<Instant> = None;
            let mut first_change: Option<Instant> = None;
            // (when, last_seq it acknowledged, CPU then)
            let mut last_ack: Option<(Instant, u64, (f64, f64))> = None;
            let deadline = start + Duration::from_secs(180);
            loop {
                let s = status(&mut ac).await?;
                let o = out_of(&s)?;
                let now = Instant::now();
                if first_change.is_none() && o.last_seq > o0.last_seq {
                    first_change = Some(now);
                }
                if hping_done.is_none() && hping.wait_exit(Duration::ZERO).is_some() {
                    hping_done = Some(now);
                }
                let caught_up = o.acked_seq == o.last_seq && o.queued == 0;
                if caught_up && o.last_seq > o0.last_seq {
                    if last_ack.is_none_or(|(_, seq, _)| seq != o.last_seq) {
                        let cpu = (process_cpu_s(a_pid)?, process_cpu_s(b_pid)?);
                        last_ack = Some((now, o.last_seq, cpu));
                    }
                    // Done when hping3 has been gone a while and nothing new came since.
                    if hping_done.is_some_and(|t| now - t > Duration::from_millis(500))
                        && last_ack.is_some_and(|(t, _, _)| now - t > Duration::from_millis(300))
                    {
                        break;
                    }
                }
                if now > deadline {
                    bail!(
                        "B did not catch up with A within 180 s: A {s:?}\nA's log:\n{}\nB's log:\n{}",
                        a.log(),
                        b.log()
                    );
                }
                tokio::time::sleep(POLL).await;
            }
            let (t_ack, final_seq, cpu1) = last_ack.context("no ack seen")?;
            let first = first_change.context("A made no change")?;
            let hping_end = hping_done.context("hping3 did not finish")?;
            let (a1, b1) = (status(&mut ac).await?, status(&mut bc).await?);
            let (o1, i1) = (out_of(&a1)?, in_of(&b1)?);
            if i1.applied_seq != final_seq {
                bail!(
                    "B applied seq {} where A's last change is {final_seq}",
                    i1.applied_seq
                );
            }
            if o1.rejected > 0 || o1.peer_rejected > 0 || i1.rejected > 0 {
                bail!("changes or acks refused: A {o1:?}, B {i1:?}");
            }
            let tables = pair::wait_tables_agree(&a, &b, "after the burst", Duration::from_secs(30))?;
            let martian_dropped =
                a.stats().packets_for_reason(reason::MARTIAN_SOURCE) - martians0;
            if gap_us == FULL_GAP_US && tables.a_connections < MIN_SESSIONS {
                bail!(
                    "A holds {} connections after {SYNS} SYNs ({martian_dropped} dropped for a martian source), expected at least {MIN_SESSIONS}; A's counters:\n{}",
                    tables.a_connections,
                    a.stats().render_table()
                );
            }
            let changes = final_seq - o0.last_seq;
            let duration_s = (t_ack - first).as_secs_f64();
            let window_s = (t_ack - start).as_secs_f64();
            let hping_s = (hping_end - start).as_secs_f64();
            let (a_cpu, b_cpu) = (cpu1.0 - cpu0.0, cpu1.1 - cpu0.1);
            Ok(HaRun {
                syns_sent: SYNS,
                martian_dropped,
                tables,
                changes,
                received_changes: i1.received_changes - i0.received_changes,
                duration_s,
                changes_per_s: changes as f64 / duration_s,
                hping_s,
                syns_per_s: f64::from(SYNS) / hping_s,
                lag_p50_us: o1.lag_p50_us,
                lag_p99_us: o1.lag_p99_us,
                a_cpu_percent: a_cpu / window_s * 100.0,
                b_cpu_percent: b_cpu / window_s * 100.0,
                a_cpu_ms_per_1000: a_cpu * 1e3 / (changes as f64 / 1e3),
                b_cpu_ms_per_1000: b_cpu * 1e3 / (changes as f64 / 1e3),
                events_lost: a1.events_lost - a0.events_lost,
                resyncs: o1.snapshots - o0.snapshots,
            })
        })
    }
}

/// "median (min–max)" of `pick` over `runs`.
pub fn cell<T>(runs: &[T], digits: usize, pick: impl Fn(&T) -> f64) -> String {
    let v: Vec<f64> = runs.iter().map(pick).collect();
    let (median, min, max) = crate::stats(&v);
    format!("{median:.digits$} ({min:.digits$}–{max:.digits$})")
}

/// The "HA replication" block: the run's parameters and its table (the method is written
/// by hand around the block).
pub fn markdown(r: &HaReport) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "{} SYNs per run to {VIP}:{PORT} · conntrack capacity {} · status polled every {} ms · {} runs per rate, medians (min–max)\n",
        r.rates
            .first()
            .and_then(|rate| rate.runs.first())
            .map_or(0, |run| run.syns_sent),
        r.ct_capacity,
        r.poll_ms,
        r.runs_per_rate
    );
    let _ = writeln!(
        md,
        "| rate | SYNs/s sent | martian sources dropped | connections on A / on B | entries on A / on B | B = A entry for entry | changes replicated | first change → last ack s | changes/s | lag p50 / p99 ms | A CPU % / ms per 1000 changes | B CPU % / ms per 1000 changes | events lost | resyncs |\n|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for rate in &r.rates {
        let runs = &rate.runs;
        let all_agree = runs.iter().all(|x| x.tables.agree());
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} / {} | {} / {} | {} | {} | {} | {} | {} / {} | {} / {} | {} / {} | {} | {} |",
            rate.label,
            cell(runs, 0, |x| x.syns_per_s),
            cell(runs, 0, |x| x.martian_dropped as f64),
            cell(runs, 0, |x| x.tables.a_connections as f64),
            cell(runs, 0, |x| x.tables.b_connections as f64),
            cell(runs, 0, |x| x.tables.a_entries as f64),
            cell(runs, 0, |x| x.tables.b_entries as f64),
            if all_agree { "yes, every run" } else { "NO" },
            cell(runs, 0, |x| x.changes as f64),
            cell(runs, 2, |x| x.duration_s),
            cell(runs, 0, |x| x.changes_per_s),
            cell(runs, 1, |x| x.lag_p50_us as f64 / 1e3),
            cell(runs, 1, |x| x.lag_p99_us as f64 / 1e3),
            cell(runs, 0, |x| x.a_cpu_percent),
            cell(runs, 1, |x| x.a_cpu_ms_per_1000),
            cell(runs, 0, |x| x.b_cpu_percent),
            cell(runs, 1, |x| x.b_cpu_ms_per_1000),
            cell(runs, 0, |x| x.events_lost as f64),
            cell(runs, 0, |x| x.resyncs as f64),
        );
    }
    md.push('\n');
    md
}

/// `[ha]` certificates for the pair, from a CA made for this run.
pub fn write_tls(dir: &TempDir) -> [NodeTls; 2] {
    let ca = fastpath::testkit::pki::TestCa::new(dir, "fastpath-ha-bench-ca", "ca");
    Node::BOTH.map(|node| {
        let leaf = ca.leaf(
            dir,
            node.server_name(),
            &[node.server_name()],
            &[
                rcgen::ExtendedKeyUsagePurpose::ServerAuth,
                rcgen::ExtendedKeyUsagePurpose::ClientAuth,
            ],
        );
        NodeTls {
            cert: leaf.cert,
            key: leaf.key,
            ca: ca.cert.clone(),
        }
    })
}

/// Writes the report's JSON (the full run's docs/bench/ha.json).
pub fn write_json(r: &HaReport, path: &Path) -> Result<()> {
    fs::write(path, serde_json::to_string_pretty(r)? + "\n")
        .with_context(|| format!("writing {}", path.display()))
}
