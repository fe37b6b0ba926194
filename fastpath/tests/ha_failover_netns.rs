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
    path::{Path, PathBuf},
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

#[path = "support/pki.rs"]
mod pki;
use pki::{CertFiles, TestCa};

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_fastpath"))
}

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

/// Builds the testbed in `mode` (the stateful firewall on both nodes' interfaces when
/// `firewall`), with `[ha]` sync between A and B when `sync`, runs the
/// traffic, crashes A and measures what B made of it. Checks only what must hold either way
/// (the testbed works before the crash, B takes the VIP); the callers judge the outcome.
fn failover(mode: LbMode, sync: bool, firewall: bool) -> Outcome {
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
    let mut daemons: Vec<Daemon> = Node::BOTH
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
                "{} --socket {} ha status --check",
                bin().display(),
                d.socket().display()
            )
        })
    };
    // A first: it wins the first election whatever B's timing.
    ha.start_keepalived(Node::A, track(&daemons[0]));
    ha.wait_master(Node::A, Duration::from_secs(10));
    ha.start_keepalived(Node::B, track(&daemons[1]));
    if sync {
        wait_in_sync(&daemons[1], "B before the traffic", Duration::from_secs(30));
    }

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
