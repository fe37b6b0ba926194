//! HA replication between two real daemons in network namespaces: node A (the `fp`
//! namespace of the LB topology) balances a client's connections; node B (namespace `peer`,
//! joined to A by its own sync link) receives A's stream. Traffic is real: hping3 SYNs from
//! random sources (each a load-balanced connection: an entry and its alias) and curl
//! requests. After each fault — B restarted mid-stream (SIGKILL), the sync link cut and
//! healed, A's event ring overflowed on purpose (A's daemon stopped while the datapath keeps
//! making connections), a flush on A — the test waits for B to catch up and compares the two
//! tables entry for entry: every load-balanced entry A's datapath made is in B's table marked
//! as A's, with the same key, TCP state, flags and NAT binding, and B holds nothing else of A's.

use std::time::Duration;

use fastpath::testkit::{
    ha::{self, Node, NodeTls, SyncPair},
    netns::{Daemon, LbTopology, Spawned, TempDir, prepare_test, test_lb_topology, unique_pin_dir},
};
use rcgen::ExtendedKeyUsagePurpose;

use fastpath::testkit::pki::TestCa;

const VIP: &str = "10.200.250.1";

use crate::bin;

struct Pair {
    lb: LbTopology,
    a: Daemon,
    b: Daemon,
    _dir: TempDir,
}

/// `node`'s certificate (naming its server name), key and the CA.
fn node_tls(ca: &TestCa, dir: &TempDir, node: Node) -> NodeTls {
    let cert = ca.leaf(
        dir,
        node.server_name(),
        &[node.server_name()],
        &[
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ],
    );
    NodeTls {
        cert: cert.cert,
        key: cert.key,
        ca: ca.cert.clone(),
    }
}

fn service() -> String {
    format!(
        "[[service]]\nvip = \"{VIP}\"\nport = 80\n[[service.backend]]\naddress = \"{}\"\nport = 80\n",
        LbTopology::backend_v4(0)
    )
}

fn start_pair(role: &str) -> Pair {
    prepare_test(&["hping3", "curl", "nginx"]);
    let dir = TempDir::new(role).expect("temp dir");
    let mut lb = test_lb_topology(1);
    SyncPair::add_to(&mut lb).unwrap_or_else(|e| panic!("sync link: {e}"));
    lb.checksum_offloads_off().unwrap_or_else(|e| panic!("{e}"));
    let ca = TestCa::new(&dir, "fastpath-ha-test-ca", "ca");
    let a_cfg = lb
        .fp_config(&unique_pin_dir(&format!("{role}-a")))
        .conntrack("capacity", 1 << 20)
        .services(&service())
        .raw(&SyncPair::ha_toml(Node::A, &node_tls(&ca, &dir, Node::A)));
    let b_cfg = SyncPair::peer_config(&unique_pin_dir(&format!("{role}-b")))
        .conntrack("capacity", 1 << 20)
        .services(&service())
        .raw(&SyncPair::ha_toml(Node::B, &node_tls(&ca, &dir, Node::B)));
    let b = Daemon::start(bin(), SyncPair::ns(&lb, Node::B), &b_cfg);
    let a = Daemon::start(bin(), SyncPair::ns(&lb, Node::A), &a_cfg);
    let pair = Pair {
        lb,
        a,
        b,
        _dir: dir,
    };
    wait_in_sync(&pair.b, "B at the start");
    pair
}

/// The LB entries (a connection and its alias each) `syns` random-source SYNs made on A:
/// those from martian sources (hping3's random addresses include 127/8, 0/8 and multicast)
/// are dropped without an entry, counted under `martian_source`.
fn connections(p: &Pair, syns: u64) -> usize {
    let martians =
        p.a.stats()
            .packets_for_reason(fastpath_common::reason::MARTIAN_SOURCE);
    assert!(
        martians < syns / 5,
        "{martians} of {syns} random-source SYNs counted as martian: about 7% expected"
    );
    2 * (syns - martians) as usize
}

/// Waits until `node`'s `ha status --check` passes.
fn wait_in_sync(node: &Daemon, what: &str) {
    ha::wait_in_sync(node, what, Duration::from_secs(20)).unwrap_or_else(|e| panic!("{e}"));
}

/// Waits until B holds exactly A's load-balanced entries; returns how many there are.
fn wait_tables_agree(p: &Pair, what: &str) -> usize {
    let diff = ha::wait_tables_agree(&p.a, &p.b, what, Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("{e}"));
    eprintln!("{what}: the tables agree on {} entries", diff.a_entries);
    diff.a_entries
}

/// `count` SYNs to the VIP from random sources, `gap_us` apart: each a new connection.
fn syn_burst(lb: &LbTopology, count: u32, gap_us: u32) -> Spawned {
    ha::syn_burst(lb.client(), VIP.parse().expect("VIP"), 80, count, gap_us)
        .unwrap_or_else(|e| panic!("hping3: {e}"))
}

fn wait_exit(mut s: Spawned, what: &str) {
    s.wait_exit(Duration::from_secs(60))
        .unwrap_or_else(|| panic!("{what} did not finish in 60 s"));
}

fn ha_json(node: &Daemon) -> serde_json::Value {
    ha::ha_status(node).unwrap_or_else(|e| panic!("{e}"))
}

fn curl_vip(lb: &LbTopology, n: usize) {
    for _ in 0..n {
        lb.client()
            .http_get(&format!("http://{VIP}/"))
            .unwrap_or_else(|e| panic!("curl through the VIP: {e}"));
    }
}

#[test]
fn replication_heals_after_peer_restart_link_cut_ring_overflow_and_flush() {
    let mut p = start_pair("ha-sync");
    let _nginx =
        p.lb.backend(0)
            .http_server(80)
            .unwrap_or_else(|e| panic!("nginx: {e}"));
    std::fs::write(_nginx.root().join("index.html"), "backend 0").expect("writing the page");

    // Steady state: connections made by real packets reach B as A has them.
    curl_vip(&p.lb, 20);
    wait_exit(syn_burst(&p.lb, 20_000, 20), "the first SYN burst");
    let n = wait_tables_agree(&p, "steady state");
    let want = connections(&p, 20_000);
    assert!(
        n >= want,
        "expected ≥ {want} LB entries (20000 SYNs less the martian-source ones, and their aliases), got {n}"
    );

    // B killed and started again while A makes connections: B adopts what it had, A's
    // snapshot on the new stream brings it up to date.
    let burst = syn_burst(&p.lb, 30_000, 50);
    std::thread::sleep(Duration::from_millis(300));
    p.b.kill9();
    std::thread::sleep(Duration::from_millis(500));
    p.b.restart();
    wait_exit(burst, "the SYN burst across B's restart");
    wait_in_sync(&p.b, "B after its restart");
    let n = wait_tables_agree(&p, "after B's restart mid-stream");
    let want = connections(&p, 50_000);
    assert!(
        n >= want,
        "entries after the restart: {n}, expected ≥ {want}"
    );
    assert!(
        p.b.log()
            .contains("Adopted connections replicated from peers"),
        "B must adopt the entries it had before the restart:\n{}",
        p.b.log()
    );

    // The sync link cut for 5 s (longer than the streams' 2 s keepalive timeout: both ends
    // give the stream up) and healed while A makes connections.
    let connects_before = ha_json(&p.a)["peers_out"][0]["connects"]
        .as_u64()
        .unwrap_or(0);
    let burst = syn_burst(&p.lb, 30_000, 50);
    std::thread::sleep(Duration::from_millis(300));
    p.lb.fp()
        .ip(&["link", "set", SyncPair::SYNC_IF, "down"])
        .expect("link down");
    std::thread::sleep(Duration::from_secs(5));
    p.lb.fp()
        .ip(&["link", "set", SyncPair::SYNC_IF, "up"])
        .expect("link up");
    wait_exit(burst, "the SYN burst across the link cut");
    let n = wait_tables_agree(&p, "after the sync link was cut and healed");
    let want = connections(&p, 80_000);
    assert!(n >= want, "entries after the cut: {n}, expected ≥ {want}");
    let a = ha_json(&p.a);
    assert!(
        a["peers_out"][0]["connects"].as_u64().unwrap_or(0) > connects_before,
        "A's stream must have reconnected after the cut: {a}"
    );

    // The event ring overflowed: A's daemon stopped (SIGSTOP) while its datapath makes 100k
    // connections (200k entries, 100k+ events; the ring holds 74898).
    let pid = p.a.pid().expect("A runs");
    let lost_before = a["events_lost"].as_u64().unwrap_or(0);
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
    wait_exit(
        syn_burst(&p.lb, 100_000, 5),
        "the SYN burst into the stopped daemon",
    );
    // SAFETY: as above.
    unsafe { libc::kill(pid as i32, libc::SIGCONT) };
    let n = wait_tables_agree(&p, "after the event ring overflowed");
    assert!(n >= 300_000, "entries after the overflow: {n}");
    let a = ha_json(&p.a);
    assert!(
        a["events_lost"].as_u64().unwrap_or(0) > lost_before,
        "A must have seen the lost ring events: {a}"
    );

    // A flush on A: B drops A's entries too.
    p.a.cli_ok(&["ct", "flush"]);
    let n = wait_tables_agree(&p, "after a flush on A");
    assert_eq!(n, 0, "after the flush");

    let (a, b) = (ha_json(&p.a), ha_json(&p.b));
    for (who, s) in [("A", &a), ("B", &b)] {
        for peer in s["peers_in"].as_array().into_iter().flatten() {
            assert_eq!(peer["rejected"], 0, "{who} refused changes: {s}");
        }
        for peer in s["peers_out"].as_array().into_iter().flatten() {
            assert_eq!(peer["rejected"], 0, "{who} refused acks: {s}");
            assert_eq!(
                peer["peer_rejected"], 0,
                "{who}'s peer refused changes: {s}"
            );
        }
    }
    eprintln!(
        "HA faults healed: A {}\nB {}",
        p.a.cli_ok(&["ha", "status"]),
        p.b.cli_ok(&["ha", "status"])
    );

    // A node stops promptly on SIGTERM although its peer's stream into it never ends.
    for (who, node) in [("A", &mut p.a), ("B", &mut p.b)] {
        let started = std::time::Instant::now();
        let status = node.stop();
        assert!(status.success(), "{who} stopped with {status}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{who} took {:?} to stop",
            started.elapsed()
        );
    }
}
