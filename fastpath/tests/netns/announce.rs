//! Announcements through a real routing daemon: a router namespace running FRR (zebra, bgpd,
//! bfdd; ECMP over up to 8 paths, L4 hashing) and three fastpath nodes, each running BIRD with
//! BFD (100 ms × 3) and a fastpath daemon with `[announce] table = 100` and one service with a
//! TCP health check of a backend behind the router; the nodes replicate their connections to
//! each other (`[ha]`, a mesh over the router). The VIP is in the router's kernel as an ECMP
//! route over the nodes that announce it. The test checks that a node announces only after its
//! health checks settled and its peers' state is here (two nodes without the third wait for
//! `sync_timeout_s`, then announce with the state of the peer that streams); that all withdraw
//! when the backend fails and come back when it answers again; that a stopped daemon withdraws
//! (and says so) before it exits; that BFD takes a silent node out of the ECMP set; and that a
//! restarted daemon announces again.

use std::time::{Duration, Instant};

use fastpath::testkit::{
    bgp::{self, Frr, log_time, node_addr, node_role, router_addr, waited_to_announce},
    netns::{
        Daemon, DaemonConfig, Netns, Spawned, TempDir, Topology, VethEnd, prepare_test,
        unique_pin_dir,
    },
    pki::TestCa,
};
use rcgen::ExtendedKeyUsagePurpose;

use crate::bin;

const VIP: &str = "10.254.0.100";
const TABLE: u32 = 100;
const BACKEND: &str = "10.9.100.2";
const NODES: usize = 3;
/// How long nodes wait for a peer that never connects (`[announce] sync_timeout_s`).
const SYNC_TIMEOUT: Duration = Duration::from_secs(4);

/// The nodes the router's route to the VIP goes through, by number (none: no route).
fn ecmp(router: &Netns) -> Vec<usize> {
    bgp::next_hops(router, VIP, &(1..=NODES).map(node_addr).collect::<Vec<_>>())
}

/// Waits until the router's route goes through exactly `nodes`; the time it took.
fn wait_ecmp(router: &Netns, nodes: &[usize], timeout: Duration, what: &str) -> Duration {
    let start = Instant::now();
    loop {
        if ecmp(router) == nodes {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < timeout,
            "{what}: the router's route to {VIP} went through nodes {:?}, not {nodes:?}, after {timeout:?}:\n{}",
            ecmp(router),
            router.ip(&["route"]).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn backend_server(backend: &Netns) -> Spawned {
    let s = backend
        .spawn(&["socat", "TCP-LISTEN:80,fork,reuseaddr", "SYSTEM:echo ok"])
        .expect("socat");
    backend
        .wait_listening("tcp", 80, Duration::from_secs(5))
        .expect("backend listening");
    s
}

#[test]
fn nodes_announce_their_vip_only_while_ready_and_bfd_takes_a_silent_node_out() {
    prepare_test(&["bird", "socat", "nft"]);
    bgp::require_frr();
    let dir = TempDir::new("announce").expect("temp dir");
    let mut topo = Topology::new();
    topo.add_ns("router").expect("router");
    topo.add_ns("backend").expect("backend");
    topo.veth(
        VethEnd::new("router", "r-b").addr("10.9.100.1/24"),
        VethEnd::new("backend", "eth0").addr(&format!("{BACKEND}/24")),
    )
    .expect("backend link");
    bgp::add_nodes(&mut topo, NODES);
    let (router, backend) = (topo.ns("router"), topo.ns("backend"));
    backend
        .ip(&["route", "add", "default", "via", "10.9.100.1"])
        .expect("backend route");
    let mut server = backend_server(backend);
    let _frr = Frr::start(router, "10.9.0.1", &bgp::node_neighbors(NODES));
    let _birds: Vec<Spawned> = (1..=NODES)
        .map(|i| {
            let conf = bgp::bird_config(
                &node_addr(i),
                65000 + i as u32,
                &router_addr(i),
                "eth0",
                TABLE,
            );
            bgp::start_bird(topo.ns(&node_role(i)), &dir, &format!("bird{i}"), &conf)
        })
        .collect();
    let service = format!(
        "[[service]]\nvip = \"{VIP}\"\nport = 80\n[service.health_check]\nkind = \"tcp\"\ninterval_ms = 200\ntimeout_ms = 100\nfall = 2\nrise = 1\n[[service.backend]]\naddress = \"{BACKEND}\"\nport = 80\n"
    );
    let ca = TestCa::new(&dir, "fastpath-announce-test-ca", "ca");
    let configs: Vec<DaemonConfig> = (1..=NODES)
        .map(|i| {
            let tls = ca.leaf(
                &dir,
                &node_role(i),
                &[&node_addr(i)],
                &[
                    ExtendedKeyUsagePurpose::ServerAuth,
                    ExtendedKeyUsagePurpose::ClientAuth,
                ],
            );
            let mut ha = format!(
                "[ha]\nnode_id = {i}\nlisten = \"{}:7946\"\ntls_cert = {:?}\ntls_key = {:?}\ntls_ca = {:?}\n",
                node_addr(i),
                tls.cert.display().to_string(),
                tls.key.display().to_string(),
                ca.cert.display().to_string(),
            );
            for j in (1..=NODES).filter(|&j| j != i) {
                ha += &format!(
                    "[[ha.peers]]\naddress = \"{}:7946\"\nnode_id = {j}\n",
                    node_addr(j)
                );
            }
            DaemonConfig::new(&unique_pin_dir(&format!("announce{i}")))
                .interface("eth0")
                .services(&service)
                .raw(&format!(
                    "[announce]\ntable = {TABLE}\nsync_timeout_s = {}\n{ha}",
                    SYNC_TIMEOUT.as_secs()
                ))
        })
        .collect();

    // 1. Nodes 1 and 2 without node 3: not in sync with every peer, they announce nothing
    // until `sync_timeout_s`, then announce with each other's state.
    let mut daemons: Vec<Daemon> = (1..=2)
        .map(|i| Daemon::start(bin(), topo.ns(&node_role(i)), &configs[i - 1]))
        .collect();
    let t = wait_ecmp(
        router,
        &[1, 2],
        SYNC_TIMEOUT * 4,
        "two nodes after the sync timeout",
    );
    eprintln!(
        "nodes 1 and 2 announced, {t:?} after both started (sync_timeout_s = {SYNC_TIMEOUT:?})"
    );
    for (i, d) in daemons.iter().enumerate() {
        let waited = waited_to_announce(&d.log());
        eprintln!("node {} waited {waited:?} for its peers", i + 1);
        assert!(
            waited >= SYNC_TIMEOUT - Duration::from_millis(200),
            "node {} announced {waited:?} after it started announcing, without node 3's state:\n{}",
            i + 1,
            d.log()
        );
    }

    // Node 3 joins: in sync with both, it announces: a three-way ECMP route, the blackhole in
    // each node's table.
    daemons.push(Daemon::start(bin(), topo.ns(&node_role(3)), &configs[2]));
    let t = wait_ecmp(router, &[1, 2, 3], Duration::from_secs(30), "start");
    eprintln!("three-way ECMP route {t:?} after node 3 started");
    let check = daemons[2].cli(&["ha", "status", "--check"]);
    assert!(
        check.status.success(),
        "node 3 announced out of sync:\n{}",
        String::from_utf8_lossy(&check.stdout)
    );
    for i in 1..=NODES {
        let table = topo
            .ns(&node_role(i))
            .ip(&["route", "show", "table", &TABLE.to_string()])
            .expect("table");
        assert!(
            table.contains(&format!("blackhole {VIP} proto 249")),
            "node {i}'s table {TABLE}: {table}"
        );
        let log = daemons[i - 1].log();
        let settling = log.find("readiness=\"settling health\"");
        let announcing = log.find("Announcing");
        assert!(
            settling.is_some() && settling < announcing,
            "node {i} announced before its health checks settled:\n{log}"
        );
    }

    // 2. The backend fails: no node has a backend up, all withdraw; it answers again: all
    // announce again.
    server.kill();
    let t = wait_ecmp(router, &[], Duration::from_secs(10), "backend down");
    eprintln!("withdrawn by all {t:?} after the backend stopped answering");
    let _server = backend_server(backend);
    let t = wait_ecmp(router, &[1, 2, 3], Duration::from_secs(10), "backend up");
    eprintln!("announced again by all {t:?} after the backend answered");

    // 3. A stopped daemon withdraws before it exits.
    // Nodes 1 and 3 stay in the set all along: a peer leaving does not make them withdraw.
    let stopping = Instant::now();
    let (status, stop_took, seen) = std::thread::scope(|sc| {
        let watch = sc.spawn(|| {
            let mut seen = vec![];
            while stopping.elapsed() < Duration::from_secs(4) {
                let now = ecmp(router);
                if seen.last() != Some(&now) {
                    seen.push(now);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            seen
        });
        let status = daemons[1].stop();
        let took = stopping.elapsed();
        (status, took, watch.join().expect("router watch"))
    });
    assert!(
        seen.iter().all(|s| s.contains(&1) && s.contains(&3)),
        "nodes 1 and 3 left the set while node 2 stopped: {seen:?}"
    );
    assert!(status.success(), "node 2's daemon exited with {status}");
    let t = wait_ecmp(router, &[1, 3], Duration::from_secs(5), "node 2 stopped");
    let log = daemons[1].log();
    let withdrawn =
        log_time(&log, "Withdrew every announcement") - log_time(&log, "SIGTERM received");
    eprintln!(
        "node 2 withdrew {withdrawn:.3} s after SIGTERM; its stop took {stop_took:?}; the router's sets meanwhile: {seen:?} (then {t:?} to [1, 3])"
    );
    let table = topo
        .ns(&node_role(2))
        .ip(&["route", "show", "table", &TABLE.to_string()])
        .expect("table");
    assert!(!table.contains(VIP), "node 2 left its route: {table}");
    assert!(
        daemons[1].log().contains("Withdrew every announcement"),
        "{}",
        daemons[1].log()
    );

    // 4. A node that goes silent (every packet dropped, as if it died) leaves the set by BFD.
    let node3 = topo.ns(&node_role(3));
    for cmd in [
        "add table inet silent",
        "add chain inet silent in { type filter hook input priority -500; policy drop; }",
        "add chain inet silent out { type filter hook output priority -500; policy drop; }",
    ] {
        node3
            .run(&["nft", cmd])
            .unwrap_or_else(|e| panic!("nft {cmd}: {e}"));
    }
    let t = wait_ecmp(router, &[1], Duration::from_secs(3), "node 3 silent");
    eprintln!("silent node 3 out of the ECMP set after {t:?} (BFD 100 ms x 3)");
    assert!(
        t <= Duration::from_millis(1000),
        "BFD took {t:?} to take out a silent node"
    );

    // 5. Node 2's daemon restarts: node 3 is silent, so after the sync timeout it announces
    // with node 1's state, and joins the set.
    daemons[1].restart();
    let t = wait_ecmp(router, &[1, 2], Duration::from_secs(30), "node 2 restarted");
    eprintln!("restarted node 2 back in the ECMP set {t:?} after its start");
    let waited = waited_to_announce(&daemons[1].log());
    assert!(
        waited >= SYNC_TIMEOUT - Duration::from_millis(200),
        "restarted node 2 announced {waited:?} after it started announcing, without silent node 3's state"
    );

    // 6. Node 1's interface goes down: its datapath cannot forward, and it withdraws (its
    // table empties) although its daemon runs.
    let node1 = topo.ns(&node_role(1));
    node1
        .ip(&["link", "set", "eth0", "down"])
        .expect("link down");
    let down = Instant::now();
    loop {
        let table = node1
            .ip(&["route", "show", "table", &TABLE.to_string()])
            .expect("table");
        if table.trim().is_empty() {
            break;
        }
        assert!(
            down.elapsed() < Duration::from_secs(2),
            "node 1 kept its routes with its interface down: {table}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let log = daemons[0].log();
    assert!(log.contains("readiness=\"datapath down\""), "{log}");
    eprintln!(
        "node 1 withdrew {:?} after its interface went down",
        down.elapsed()
    );
}
