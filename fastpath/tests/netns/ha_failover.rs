//! End to end: failover of an HA pair. Nodes A (active) and B (standby) run fastpath with the
//! same services in front of three real backends ([`ha_topology`]); keepalived (VRRP v3,
//! 0.1 s adverts) holds the VIP and the backends' gateway on A. 1000 long-lived echo
//! connections and one slowly read download run through the VIP; then A dies hard (daemon
//! SIGKILLed, keepalived's VRRP child then parent SIGKILLed, its links down), B takes the VIP,
//! and the connections are checked byte for byte.
//!
//! With conntrack replication (`[ha]`, A and B peers over their sync link, mutual TLS with
//! certificates made per run), every connection must go on with zero resets. Without it
//! (the baselines), B does not know A's connections: in full-NAT mode they are reset, in NAT
//! mode with the stateful firewall they stall. The baselines prove the harness sees a
//! failover that loses state, in the very configurations the acceptance tests use. (NAT mode
//! without the firewall proves nothing: B picks connections up mid-stream through the same
//! Maglev table, and they survive without sync.)
//!
//! Root only (never skipped). Debian packages: iproute2, keepalived, nginx-light, curl,
//! ethtool.

use std::{
    net::SocketAddr,
    path::PathBuf,
    thread,
    time::{Duration, Instant},
};

use fastpath::testkit::{
    ha::{HaTopology, LbMode, Node, test_ha_topology},
    netns::{Daemon, HttpServer, TempDir, prepare_test, unique_pin_dir},
    traffic::{
        ConnError, ConnPool, EchoServers, PoolOptions, SlowDownload, random_bytes, tcp_resets,
    },
};
use rcgen::ExtendedKeyUsagePurpose;

use fastpath::testkit::pki::{CertFiles, TestCa};

use crate::bin;

const BACKENDS: usize = 3;
const CONNECTIONS: usize = 1000;
const HTTP_PORT: u16 = 80;
const ECHO_PORT: u16 = 7000;
/// The bulk transfer: read at 1.6 MB/s, it lasts about 15 s, well past the failover.
const BULK_BYTES: usize = 24 << 20;
/// How long every connection gets to show progress after the failover: VRRP takeover (about
/// 0.35 s) plus TCP's retransmission backoff for segments lost while nobody held the VIP.
const RECOVERY: Duration = Duration::from_secs(15);

/// Each node's full-NAT source ports: disjoint, so the two nodes never hand out the same
/// port to different connections (the standby's own new connections and the replicated
/// ones coexist after a failover).
fn snat_ports(node: Node) -> &'static str {
    match node {
        Node::A => "20000-24999",
        Node::B => "25000-29999",
    }
}

/// The sync certificates of one run: one CA, a certificate per node naming it (server and
/// client use: each node dials its peer and is dialled).
struct SyncPki {
    ca: PathBuf,
    nodes: [CertFiles; 2],
}

fn sync_pki(dir: &TempDir) -> SyncPki {
    let ca = TestCa::new(dir, "fastpath HA test CA", "ha-ca");
    let usages = [
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let cert = |n: Node| {
        ca.leaf(
            dir,
            n.server_name(),
            &[n.server_name(), &HaTopology::sync_addr(n).to_string()],
            &usages,
        )
    };
    SyncPki {
        nodes: [cert(Node::A), cert(Node::B)],
        ca: ca.cert,
    }
}

/// `fastpath ha status --check` on `daemon`'s node: true when it holds its peer's state.
fn in_sync(daemon: &Daemon) -> bool {
    daemon.cli(&["ha", "status", "--check"]).status.success()
}

/// Waits until `in_sync`; panics after `timeout` with `ha status` and the daemon's log.
fn wait_in_sync(daemon: &Daemon, what: &str, timeout: Duration) -> Duration {
    let start = Instant::now();
    while !in_sync(daemon) {
        if start.elapsed() >= timeout {
            let status = daemon.cli(&["ha", "status"]);
            panic!(
                "{what}: `ha status --check` still fails after {timeout:?}; ha status:\n{}{}\nlog:\n{}",
                String::from_utf8_lossy(&status.stdout),
                String::from_utf8_lossy(&status.stderr),
                daemon.log()
            );
        }
        thread::sleep(Duration::from_millis(100));
    }
    start.elapsed()
}

/// The reset counters of the client and every backend, summed: (sent, established reset).
fn resets(ha: &HaTopology) -> (u64, u64) {
    ha.endpoints()
        .into_iter()
        .map(tcp_resets)
        .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
}

/// What one failover run measured.
#[allow(dead_code, reason = "read by the tests that need each part")]
struct Outcome {
    /// From A's links going down to B alone holding the VIP.
    takeover: Duration,
    /// From A's links going down until every connection had progressed or failed (or
    /// [`RECOVERY`] passed).
    recovered: Duration,
    progress: fastpath::testkit::traffic::Progress,
    totals: fastpath::testkit::traffic::PoolTotals,
    /// (sent, established reset) by the client and backends during the failover.
    resets: (u64, u64),
    bulk_ok: bool,
    bulk_len: usize,
    bulk_read_at_crash: usize,
}

/// One run's testbed: the pair with its servers and daemons, keepalived on both (A master).
struct Bed {
    dir: TempDir,
    ha: HaTopology,
    nginx: Vec<HttpServer>,
    echo: EchoServers,
    /// A's, then B's.
    daemons: Vec<Daemon>,
    bulk: Vec<u8>,
}

/// Builds the testbed in `mode` (the stateful firewall on both nodes' interfaces when
/// `firewall`), with `[ha]` sync between A and B when `sync`: the daemons with the nodes'
/// configs, keepalived with the shipped example's scripts (finding the daemon and its pins
/// through its config file), A master, B in sync when `sync`. Nothing else is set by hand:
/// the nodes start with the kernel's default sysctls.
fn bed(mode: LbMode, sync: bool, firewall: bool) -> Bed {
    prepare_test(&["curl", "nginx", "ethtool", "keepalived"]);
    let dir = TempDir::new("ha").expect("temp dir");
    let mut ha = test_ha_topology(BACKENDS);
    ha.checksum_offloads_off()
        .unwrap_or_else(|e| panic!("checksum offloads off: {e}"));

    let bulk = random_bytes(BULK_BYTES);
    let nginx: Vec<HttpServer> = (0..BACKENDS)
        .map(|i| {
            let s = ha
                .backend(i)
                .http_server(HTTP_PORT)
                .unwrap_or_else(|e| panic!("nginx on backend {i}: {e}"));
            std::fs::write(s.root().join("bulk.bin"), &bulk).expect("writing the bulk file");
            s
        })
        .collect();
    let echo = EchoServers::start(
        &(0..BACKENDS)
            .map(|i| {
                (
                    ha.backend(i),
                    SocketAddr::from((HaTopology::backend_addr(i), ECHO_PORT)),
                )
            })
            .collect::<Vec<_>>(),
    )
    .unwrap_or_else(|e| panic!("echo servers: {e}"));

    let pki = sync.then(|| sync_pki(&dir));
    let daemons: Vec<Daemon> = Node::BOTH
        .into_iter()
        .map(|n| {
            let mut config = ha.lb_config(
                &unique_pin_dir(n.role()),
                mode,
                &[HTTP_PORT, ECHO_PORT],
                snat_ports(n),
                None,
            );
            if firewall {
                config = config.stateful_firewall();
            }
            if let Some(pki) = &pki {
                let own = &pki.nodes[if n == Node::A { 0 } else { 1 }];
                config = config.raw(&HaTopology::ha_toml(n, &own.cert, &own.key, &pki.ca));
            }
            Daemon::start(bin(), ha.node(n), &config)
        })
        .collect();
    let track = |d: &Daemon| {
        sync.then(|| {
            format!(
                "{} --config {} ha status --check",
                bin().display(),
                d.config_path().display()
            )
        })
    };
    // keepalived runs under `ip netns exec`, whose private /sys hides the host's bpffs: the
    // script reads the pins from this process's mount namespace (a deployment's keepalived
    // runs in the host's).
    let forwarding = |d: &Daemon| {
        Some(format!(
            "/usr/bin/nsenter --mount=/proc/{}/ns/mnt -- {} --config {} datapath --check",
            std::process::id(),
            bin().display(),
            d.config_path().display()
        ))
    };
    // A first: it wins the first election whatever B's timing.
    ha.start_keepalived(Node::A, track(&daemons[0]), forwarding(&daemons[0]));
    ha.wait_master(Node::A, Duration::from_secs(10));
    ha.start_keepalived(Node::B, track(&daemons[1]), forwarding(&daemons[1]));
    if sync {
        wait_in_sync(&daemons[1], "B before the traffic", Duration::from_secs(30));
    }
    Bed {
        dir,
        ha,
        nginx,
        echo,
        daemons,
        bulk,
    }
}

/// Builds the testbed (see [`bed`]), runs the traffic, crashes A and measures what B made of
/// it. Checks only what must hold either way (the testbed works before the crash, B takes the
/// VIP); the callers judge the outcome.
fn failover(mode: LbMode, sync: bool, firewall: bool) -> Outcome {
    let Bed {
        dir,
        mut ha,
        nginx,
        echo,
        mut daemons,
        bulk,
    } = bed(mode, sync, firewall);

    let vip = SocketAddr::from((HaTopology::VIP, ECHO_PORT));
    let pool = ConnPool::open(ha.client(), vip, CONNECTIONS, PoolOptions::default())
        .unwrap_or_else(|e| panic!("{e}\nA's log:\n{}", daemons[0].log()));
    let start = pool.mark();
    pool.check_progress(&start, Duration::from_secs(30), "before the failover");
    let download = SlowDownload::start(
        ha.client(),
        dir.path(),
        &format!("http://{}:{HTTP_PORT}/bulk.bin", HaTopology::VIP),
        None,
    );
    download.progressed(0, 1 << 20, "before the failover");
    assert_eq!(
        ha.master(),
        Some(Node::A),
        "A holds the VIP before the crash; {}",
        ha.transitions()
    );
    if sync {
        wait_in_sync(
            &daemons[1],
            "B with the connections open",
            Duration::from_secs(30),
        );
    }

    let resets_before = resets(&ha);
    daemons[0].kill9();
    let down = ha.crash(Node::A);
    // From here on, every verified byte went through B.
    let mark = pool.mark();
    let bulk_read_at_crash = download.bytes_read();
    ha.wait_master(Node::B, Duration::from_secs(10));
    let takeover = down.elapsed();
    let progress = pool.wait_progress(&mark, RECOVERY);
    let recovered = down.elapsed();
    let bulk_moved = {
        let deadline = Instant::now() + Duration::from_secs(5);
        while download.bytes_read() < bulk_read_at_crash + (1 << 20) && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(20));
        }
        download.bytes_read() >= bulk_read_at_crash + (1 << 20)
    };
    let resets_after = resets(&ha);

    // A stalled download would hold curl until its own timeout.
    let (status, body) =
        download.finish_within(Duration::from_secs(if bulk_moved { 60 } else { 2 }));
    let bulk_ok = bulk_moved && status.is_some_and(|s| s.success()) && body == bulk;
    let totals = pool.finish();
    let resets = (
        resets_after.0 - resets_before.0,
        resets_after.1 - resets_before.1,
    );
    eprintln!(
        "ha failover ({mode:?}, firewall {firewall}, {}): {} connections, {} bytes verified ({} sent), {} progressed \
         after the crash, {} failed ({}), {} waiting; takeover {} ms, all settled {} ms after \
         links down; bulk {} of {} bytes, intact: {bulk_ok} (curl {status:?}); resets sent {}, \
         established reset {} (client + backends); B's transitions: {}",
        if sync { "with sync" } else { "no sync" },
        totals.connections,
        totals.bytes_verified,
        totals.bytes_sent,
        progress.progressed,
        progress.failed.len(),
        progress.failure_kinds(),
        progress.waiting.len(),
        takeover.as_millis(),
        recovered.as_millis(),
        body.len(),
        bulk.len(),
        resets.0,
        resets.1,
        ha.keepalived(Node::B)
            .map(|k| k.transitions().replace('\n', "; "))
            .unwrap_or_default()
    );
    drop((echo, nginx, daemons));
    Outcome {
        takeover,
        recovered,
        progress,
        totals,
        resets,
        bulk_ok,
        bulk_len: body.len(),
        bulk_read_at_crash,
    }
}

/// The baseline, full-NAT: the same pair without `[ha]`. B has none of A's connections when
/// it takes the VIP; it picks each one up mid-stream (no stateful firewall) but translates it
/// to a source port of its own range, which the backend does not know: the backend answers
/// RST, every connection is reset. If this test fails, either the harness no longer sees a
/// broken failover, or B recovers full-NAT connections without sync.
#[test]
fn without_sync_a_failover_resets_connections() {
    let out = failover(LbMode::FullNat, false, false);
    assert_takeover(&out);
    let reset = out
        .progress
        .failed
        .iter()
        .filter(|(_, e)| *e == ConnError::Reset)
        .count();
    assert!(
        reset == CONNECTIONS && out.resets.0 + out.resets.1 >= CONNECTIONS as u64,
        "without sync, every full-NAT connection must be reset by the failover: {reset} of \
         {CONNECTIONS} reset ({} failed: {}; {} progressed, {} waiting), resets counted {:?}",
        out.progress.failed.len(),
        out.progress.failure_kinds(),
        out.progress.progressed,
        out.progress.waiting.len(),
        out.resets
    );
    assert!(
        !out.bulk_ok,
        "the bulk transfer cannot survive the failover without sync"
    );
}

/// The baseline, NAT mode with the stateful firewall (the configuration the NAT acceptance
/// test runs): B's firewall drops packets of connections it never saw open, so without sync
/// every connection stalls (no reset: nothing answers). Without the firewall, NAT-mode
/// connections survive a failover even without sync — B picks them up mid-stream and the same
/// Maglev table gives the same backend — so only with the firewall does the NAT acceptance
/// test prove that the replicated entries arrived.
#[test]
fn without_sync_a_nat_failover_with_the_firewall_stalls_connections() {
    let out = failover(LbMode::Nat, false, true);
    assert_takeover(&out);
    assert!(
        out.progress.waiting.len() == CONNECTIONS,
        "without sync, B's firewall must stop every NAT connection: {} of {CONNECTIONS} made no \
         progress in {RECOVERY:?} ({} progressed, {} failed: {})",
        out.progress.waiting.len(),
        out.progress.progressed,
        out.progress.failed.len(),
        out.progress.failure_kinds()
    );
    assert!(!out.bulk_ok, "the bulk transfer cannot go on without sync");
}

fn assert_takeover(out: &Outcome) {
    assert!(
        out.takeover < Duration::from_secs(3),
        "B took the VIP {} ms after A's links went down",
        out.takeover.as_millis()
    );
}

/// The acceptance check of replication, NAT mode, with the stateful firewall on: without
/// it, B would pick the connections up mid-stream even without sync (see the baseline above).
#[test]
fn nat_failover_keeps_1000_connections_and_a_bulk_transfer() {
    let out = failover(LbMode::Nat, true, true);
    assert_kept(&out);
}

/// The acceptance check of replication, full-NAT mode (the backends see the floating
/// gateway address with a port A chose; B must translate with A's port).
#[test]
fn full_nat_failover_keeps_1000_connections_and_a_bulk_transfer() {
    let out = failover(LbMode::FullNat, true, false);
    assert_kept(&out);
}

fn assert_kept(out: &Outcome) {
    assert_takeover(out);
    assert!(
        out.progress.failed.is_empty() && out.progress.waiting.is_empty(),
        "every connection must go on after the failover: {} progressed, {} failed ({}; e.g. \
         {:?}), {} made no progress within {RECOVERY:?}",
        out.progress.progressed,
        out.progress.failed.len(),
        out.progress.failure_kinds(),
        &out.progress.failed[..out.progress.failed.len().min(5)],
        out.progress.waiting.len()
    );
    assert!(
        out.totals.failed.is_empty(),
        "connections failed after the check or on close: {} ({})",
        out.totals.failed.len(),
        out.totals.failure_kinds()
    );
    assert!(
        out.bulk_ok,
        "the bulk transfer must go on and arrive intact: {} of {BULK_BYTES} bytes ({} read at \
         the crash)",
        out.bulk_len, out.bulk_read_at_crash
    );
    assert_eq!(
        out.resets,
        (0, 0),
        "TCP resets (sent, established reset) in the client and backends during the failover"
    );
}

/// Connections per pool in the partial-failure tests.
const POOL: usize = 200;

/// `POOL` echo connections from the client to the VIP; panics with A's log if one fails.
fn open_pool(bed: &Bed, when: &str) -> ConnPool {
    let vip = SocketAddr::from((HaTopology::VIP, ECHO_PORT));
    let pool = ConnPool::open(bed.ha.client(), vip, POOL, PoolOptions::default())
        .unwrap_or_else(|e| panic!("{when}: {e}\nA's log:\n{}", bed.daemons[0].log()));
    pool.check_progress(&pool.mark(), Duration::from_secs(30), when);
    pool
}

/// Panics unless every connection of `pools` progressed since `marks` within [`RECOVERY`],
/// then ends them and panics unless none failed. Returns (connections, bytes verified).
fn all_carried_on(
    pools: Vec<ConnPool>,
    marks: &[fastpath::testkit::traffic::Mark],
    when: &str,
) -> (usize, u64) {
    let (mut conns, mut bytes) = (0, 0);
    for (pool, mark) in pools.into_iter().zip(marks) {
        let p = pool.wait_progress(mark, RECOVERY);
        assert!(
            p.failed.is_empty() && p.waiting.is_empty(),
            "{when}: {} progressed, {} failed ({}), {} made no progress within {RECOVERY:?}",
            p.progressed,
            p.failed.len(),
            p.failure_kinds(),
            p.waiting.len()
        );
        let totals = pool.finish_intact(&format!("{when}: on close"));
        conns += totals.connections;
        bytes += totals.bytes_verified;
    }
    (conns, bytes)
}

/// Only the master's daemon dies (SIGKILL; its links and keepalived stay up). Its datapath
/// forwards alone, so nothing may move: A keeps the VIP (its in-sync script fails, 150 →
/// 90, but B has `nopreempt` and A's forwarding script passes), the connections go on, new
/// ones open through A. When A's daemon is back, its snapshot brings B the connections opened
/// meanwhile; then A dies hard and B carries every connection — those opened while A's
/// daemon was dead included. Full-NAT: a connection B did not receive would be reset.
#[test]
fn a_dead_daemon_on_the_master_moves_nothing_and_a_later_crash_keeps_every_connection() {
    let mut bed = bed(LbMode::FullNat, true, false);
    let early = open_pool(&bed, "before A's daemon dies");
    wait_in_sync(
        &bed.daemons[1],
        "B with the first connections",
        Duration::from_secs(30),
    );
    let resets_before = resets(&bed.ha);

    bed.daemons[0].kill9();
    // Several rounds of both track scripts (1 s apart).
    thread::sleep(Duration::from_secs(4));
    assert_eq!(
        bed.ha.master(),
        Some(Node::A),
        "A's datapath forwards without its daemon: A keeps the VIP; {}",
        bed.ha.transitions()
    );
    early.check_progress(
        &early.mark(),
        Duration::from_secs(10),
        "with A's daemon dead",
    );
    let late = open_pool(&bed, "opened while A's daemon is dead");

    bed.daemons[0].restart();
    wait_in_sync(
        &bed.daemons[1],
        "B after A's daemon came back",
        Duration::from_secs(30),
    );
    let on_b = fastpath::testkit::ha::lb_entries(bed.daemons[1].pin_dir(), Node::A.node_id())
        .unwrap_or_else(|e| panic!("{e}"))
        .connections;
    assert!(
        on_b >= 2 * POOL,
        "B holds {on_b} of A's connections, not the {} opened before and while A's daemon was dead",
        2 * POOL
    );

    bed.daemons[0].kill9();
    let down = bed.ha.crash(Node::A);
    bed.ha.wait_master(Node::B, Duration::from_secs(10));
    let takeover = down.elapsed();
    let marks = [early.mark(), late.mark()];
    let (conns, bytes) = all_carried_on(vec![early, late], &marks, "after A's crash");
    let after = resets(&bed.ha);
    assert_eq!(
        (after.0 - resets_before.0, after.1 - resets_before.1),
        (0, 0),
        "TCP resets (sent, established reset) in the client and backends"
    );
    eprintln!(
        "daemon-only death on the master: A kept the VIP; {conns} connections ({POOL} opened while A's daemon was dead), B held {on_b} of A's after its restart, took over {} ms after A's links went down; {bytes} bytes verified, 0 resets",
        takeover.as_millis()
    );
}

/// The master's datapath is detached (its daemon killed, then `fastpath detach`, as an
/// operator removes a datapath left running): A can no longer forward, so it must not keep
/// the VIP. `fastpath detach` unpins the links but holds them while the VIP is A's; A's
/// forwarding script fails, keepalived puts A in FAULT, B takes the VIP, and only then does
/// A stop forwarding. NAT with the stateful firewall: B carries the connections only with
/// the replicated entries.
#[test]
fn a_detached_datapath_on_the_master_hands_the_vip_to_the_standby() {
    let mut bed = bed(LbMode::Nat, true, true);
    let pool = open_pool(&bed, "before the detach");
    wait_in_sync(
        &bed.daemons[1],
        "B with the connections",
        Duration::from_secs(30),
    );
    let resets_before = resets(&bed.ha);

    let each_before: Vec<_> = bed.ha.endpoints().into_iter().map(tcp_resets).collect();
    bed.daemons[0].kill9();
    let mark = pool.mark();
    let started = Instant::now();
    let out = std::process::Command::new(bin())
        .args([
            "--netns",
            bed.ha.node(Node::A).name(),
            "detach",
            "--pin-dir",
        ])
        .arg(bed.daemons[0].pin_dir())
        .output()
        .expect("running fastpath detach");
    let detach_took = started.elapsed();
    assert!(
        out.status.success(),
        "fastpath detach: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !bed.daemons[0].pin_dir().exists(),
        "fastpath detach removes the pins"
    );
    bed.ha.wait_master(Node::B, Duration::from_secs(5));
    let transitions = bed.ha.transitions();
    assert!(
        transitions.contains("FAULT"),
        "A must go to FAULT (its forwarding script failed): {transitions}"
    );
    let (conns, bytes) = all_carried_on(vec![pool], &[mark], "after A's datapath was detached");
    let after = resets(&bed.ha);
    let each_after: Vec<_> = bed.ha.endpoints().into_iter().map(tcp_resets).collect();
    assert_eq!(
        (after.0 - resets_before.0, after.1 - resets_before.1),
        (0, 0),
        "TCP resets (sent, established reset) in the client and backends (each, before and after: {each_before:?} {each_after:?}); A's detach said:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!(
        "detached datapath on the master: `fastpath detach` handed the VIP over in {} ms; B master, {conns} connections carried on, {bytes} bytes verified, 0 resets",
        detach_took.as_millis()
    );
}
