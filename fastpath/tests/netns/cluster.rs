//! Scale-out, end to end: three active fastpath nodes behind a router's ECMP, every one
//! announcing the full-NAT VIP over BGP, replicating its connections to the other two.
//!
//! ```text
//!   client 10.9.200.2 ── router (FRR: BGP, BFD, ECMP over 8 paths, L4 hash) ── backend1..3
//!                          │ 10.9.1.1        │ 10.9.2.1        │ 10.9.3.1      10.9.10j.2
//!                        node1 .2          node2 .2          node3 .2
//!   each node: BIRD (BGP + BFD to the router) and fastpath ([announce] table 100, [ha] mesh),
//!   full-NAT source 10.201.N.1 in its own prefix 10.201.N.0/24, the others' as backups
//! ```
//!
//! 1000 long-lived echo connections and one slowly read download go through the VIP, spread
//! over the three nodes by the router; every echoed byte is checked. Then, in turn: node 1
//! dies hard (daemon and BIRD SIGKILLed, its link down) — the router moves its flows and its
//! source prefix to nodes 2 and 3, which translate them from the replicated state; node 1
//! comes back and announces only once it holds its peers' state; node 2 is drained
//! (`fastpath drain`). Zero resets, zero corrupted streams, the download intact. The
//! control run is the same cluster without replication: node 1's death resets its
//! connections.
//!
//! Root only (never skipped). Debian packages: iproute2, bird2, frr, nginx-light, curl,
//! ethtool.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use fastpath::testkit::{
    bgp::{self, Frr, log_time, node_addr, node_role, router_addr},
    cluster::ClusterPlan,
    netns::{
        Daemon, DaemonConfig, HttpServer, Netns, Spawned, TempDir, Topology, VethEnd, prepare_test,
        unique_pin_dir,
    },
    pki::TestCa,
    traffic::{
        ConnError, ConnPool, EchoServers, PoolOptions, SlowDownload, random_bytes, tcp_resets,
    },
};

use crate::bin;

const VIP: &str = "10.254.0.100";
const TABLE: u32 = 100;
const NODES: usize = 3;
const BACKENDS: usize = 3;
const CONNECTIONS: usize = 1000;
const ECHO_PORT: u16 = 7000;
const HTTP_PORT: u16 = 80;
/// The download, read at 1.6 MB/s: about 60 s, past every step.
const BULK_BYTES: usize = 96 << 20;
/// How long every connection gets to show progress after a step: the routers' convergence
/// plus TCP's retransmission backoff for segments lost meanwhile.
const RECOVERY: Duration = Duration::from_secs(15);
const CLIENT: &str = "10.9.200.2";

/// Node `i`'s full-NAT source prefix and address.
fn source_prefix(i: usize) -> String {
    format!("10.201.{i}.0/24")
}

fn snat_address(i: usize) -> String {
    format!("10.201.{i}.1")
}

fn backend_addr(j: usize) -> String {
    format!("10.9.10{j}.2")
}

/// The cluster's config files, rendered as `config/cluster/` is (certificates in `tls_dir`).
fn plan(tls_dir: &TempDir) -> ClusterPlan {
    ClusterPlan {
        nodes: NODES,
        vip: VIP.into(),
        ports: vec![ECHO_PORT, HTTP_PORT],
        backends: (1..=BACKENDS).map(backend_addr).collect(),
        node_addr,
        router_addr,
        source_prefix,
        snat_address,
        tls_dir: tls_dir.path().display().to_string(),
        table: TABLE,
        sync_port: 7946,
    }
}

/// The nodes the router's route to `dst` goes through, by number.
fn via(router: &Netns, dst: &str) -> Vec<usize> {
    bgp::next_hops(router, dst, &(1..=NODES).map(node_addr).collect::<Vec<_>>())
}

/// Waits until the router's routes to the VIP and to each node's source prefix go through
/// `vip` and `sources[i - 1]`; the time it took.
fn wait_routes(
    c: &Cluster,
    vip: &[usize],
    sources: [&[usize]; NODES],
    timeout: Duration,
    what: &str,
) -> Duration {
    let router = c.router();
    let start = Instant::now();
    let now = || {
        (
            via(router, VIP),
            (1..=NODES)
                .map(|i| via(router, &source_prefix(i)))
                .collect::<Vec<_>>(),
        )
    };
    loop {
        let (v, s) = now();
        if v == vip && s.iter().zip(sources).all(|(got, want)| got == want) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < timeout,
            "{what}: after {timeout:?} the router's routes go through nodes {v:?} for the VIP and {s:?} for the source prefixes, not {vip:?} and {sources:?}:\n{}\n{}\n{}",
            router.ip(&["route"]).unwrap_or_default(),
            c.frr.show(router, "show ip bgp"),
            c.frr.show(router, "show ip route")
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The cluster: router, client, backends with their servers, and per node its BIRD and its
/// daemon.
struct Cluster {
    dir: TempDir,
    topo: Topology,
    frr: Frr,
    birds: Vec<Option<Spawned>>,
    bird_configs: Vec<String>,
    daemons: Vec<Daemon>,
    _echo: EchoServers,
    _nginx: Vec<HttpServer>,
    bulk: Vec<u8>,
}

impl Cluster {
    fn router(&self) -> &Netns {
        self.topo.ns("router")
    }

    fn node(&self, i: usize) -> &Netns {
        self.topo.ns(&node_role(i))
    }

    /// The client's and the backends' namespaces, by role.
    fn endpoints(&self) -> Vec<String> {
        std::iter::once("client".to_string())
            .chain((1..=BACKENDS).map(|j| format!("backend{j}")))
            .collect()
    }

    /// TCP resets sent and established connections reset, by the client and the backends.
    fn resets(&self) -> (u64, u64) {
        self.endpoints()
            .iter()
            .map(|r| tcp_resets(self.topo.ns(r)))
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    }

    /// tcpdump of every TCP reset of the clients' connections: any at the client (all its
    /// traffic is), those of the full-NAT sources at the backends (the nodes' own health
    /// probes come from the nodes' addresses, and a probe that times out under load may end
    /// in a reset: not a client's connection).
    fn watch_resets(&self) -> Vec<Spawned> {
        self.endpoints()
            .iter()
            .map(|r| {
                let filter = if r == "client" {
                    "tcp[tcpflags] & tcp-rst != 0"
                } else {
                    "tcp[tcpflags] & tcp-rst != 0 and net 10.201.0.0/16"
                };
                self.topo
                    .ns(r)
                    .spawn(&["tcpdump", "-i", "eth0", "-n", "-l", "-tt", filter])
                    .expect("tcpdump")
            })
            .collect()
    }

    /// The connections node `i` carries as their first node (its datapath's own entries).
    fn own_connections(&self, i: usize) -> usize {
        fastpath::testkit::ha::lb_entries(self.daemons[i - 1].pin_dir(), 0)
            .unwrap_or_else(|e| panic!("{e}"))
            .connections
    }

    /// Node `i` dies hard: its daemon and BIRD SIGKILLed, its link down. Returns when the
    /// link went down.
    fn kill(&mut self, i: usize) -> Instant {
        self.daemons[i - 1].kill9();
        if let Some(mut b) = self.birds[i - 1].take() {
            b.kill();
        }
        self.node(i)
            .ip(&["link", "set", "eth0", "down"])
            .expect("link down");
        Instant::now()
    }

    /// Node `i` comes back as from a reboot: what a reboot loses (the datapath left
    /// attached, the announcement routes) removed, then link up, its route, BIRD, its daemon.
    fn revive(&mut self, i: usize) {
        let node = self.node(i);
        let pin_dir = self.daemons[i - 1].pin_dir();
        let out = std::process::Command::new(bin())
            .args(["--netns", node.name(), "detach", "--pin-dir"])
            .arg(pin_dir)
            .output()
            .expect("fastpath detach");
        assert!(
            out.status.success(),
            "fastpath detach: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        node.ip(&["route", "flush", "table", &TABLE.to_string()])
            .expect("flushing the announcement table");
        node.ip(&["link", "set", "eth0", "up"]).expect("link up");
        node.ip(&["route", "replace", "default", "via", &router_addr(i)])
            .expect("route");
        self.birds[i - 1] = Some(bgp::start_bird(
            node,
            &self.dir,
            &format!("bird{i}-again"),
            &self.bird_configs[i - 1],
        ));
        self.daemons[i - 1].restart();
    }
}

/// Builds the cluster, replicating among the nodes when `replicate`, and waits until every
/// node announces the VIP and its own source prefix.
fn cluster(replicate: bool) -> Cluster {
    prepare_test(&["bird", "curl", "nginx", "ethtool"]);
    bgp::require_frr();
    let dir = TempDir::new("cluster").expect("temp dir");
    let mut topo = Topology::new();
    for ns in ["router", "client"] {
        topo.add_ns(ns).expect("namespace");
    }
    topo.veth(
        VethEnd::new("router", "r-c").addr("10.9.200.1/24"),
        VethEnd::new("client", "eth0").addr(&format!("{CLIENT}/24")),
    )
    .expect("client link");
    let mut ends = vec![("client".to_string(), "10.9.200.1".to_string())];
    for j in 1..=BACKENDS {
        let role = format!("backend{j}");
        topo.add_ns(&role).expect("backend");
        topo.veth(
            VethEnd::new("router", &format!("r-b{j}")).addr(&format!("10.9.10{j}.1/24")),
            VethEnd::new(&role, "eth0").addr(&format!("{}/24", backend_addr(j))),
        )
        .expect("backend link");
        ends.push((role, format!("10.9.10{j}.1")));
    }
    for (role, gw) in &ends {
        topo.ns(role)
            .ip(&["route", "add", "default", "via", gw])
            .expect("default route");
    }
    bgp::add_nodes(&mut topo, NODES);
    // The client and the backends send full checksums and check what they receive, as
    // hosts behind a wire do.
    for (role, _) in &ends {
        topo.ns(role)
            .run(&["ethtool", "-K", "eth0", "tx", "off", "rx", "off"])
            .expect("checksum offloads off");
    }
    let router = topo.ns("router");

    let bulk = random_bytes(BULK_BYTES);
    let nginx: Vec<HttpServer> = (1..=BACKENDS)
        .map(|j| {
            let s = topo
                .ns(&format!("backend{j}"))
                .http_server(HTTP_PORT)
                .unwrap_or_else(|e| panic!("nginx on backend {j}: {e}"));
            std::fs::write(s.root().join("bulk.bin"), &bulk).expect("the bulk file");
            s
        })
        .collect();
    let backends: Vec<String> = (1..=BACKENDS).map(|j| format!("backend{j}")).collect();
    let echo = EchoServers::start(
        &(1..=BACKENDS)
            .map(|j| {
                (
                    topo.ns(&backends[j - 1]),
                    SocketAddr::new(backend_addr(j).parse().expect("address"), ECHO_PORT),
                )
            })
            .collect::<Vec<_>>(),
    )
    .unwrap_or_else(|e| panic!("echo servers: {e}"));

    let frr = Frr::start(router, "10.9.0.1", &bgp::node_neighbors(NODES));
    let plan = plan(&dir);
    let bird_configs: Vec<String> = (1..=NODES).map(|i| plan.bird(i)).collect();
    let birds = (1..=NODES)
        .map(|i| {
            Some(bgp::start_bird(
                topo.ns(&node_role(i)),
                &dir,
                &format!("bird{i}"),
                &bird_configs[i - 1],
            ))
        })
        .collect();

    if replicate {
        plan.issue_certs(&TestCa::new(&dir, "fastpath-cluster-test-ca", "ca"), &dir);
    }
    let daemons = (1..=NODES)
        .map(|i| {
            let config = DaemonConfig::new(&unique_pin_dir(&format!("cluster{i}")))
                .interface("eth0")
                .services(&plan.services(i))
                .raw(&plan.cluster_tables(i, replicate));
            Daemon::start(bin(), topo.ns(&node_role(i)), &config)
        })
        .collect();
    let c = Cluster {
        dir,
        topo,
        frr,
        birds,
        bird_configs,
        daemons,
        _echo: echo,
        _nginx: nginx,
        bulk,
    };
    let t = wait_routes(
        &c,
        &[1, 2, 3],
        [&[1], &[2], &[3]],
        Duration::from_secs(40),
        "start",
    );
    eprintln!(
        "cluster up: VIP over nodes 1, 2, 3, each source prefix via its node, {t:?} after the last daemon started"
    );
    c
}

/// The traffic: `CONNECTIONS` echo connections and the download, all through the VIP and
/// progressing, spread over every node.
fn traffic(c: &Cluster) -> (ConnPool, SlowDownload) {
    let vip = SocketAddr::new(VIP.parse().expect("VIP"), ECHO_PORT);
    let pool = ConnPool::open(
        c.topo.ns("client"),
        vip,
        CONNECTIONS,
        PoolOptions::default(),
    )
    .unwrap_or_else(|e| panic!("{e}\nnode 1's log:\n{}", c.daemons[0].log()));
    pool.check_progress(&pool.mark(), Duration::from_secs(30), "before any change");
    let download = SlowDownload::start(
        c.topo.ns("client"),
        c.dir.path(),
        &format!("http://{VIP}:{HTTP_PORT}/bulk.bin"),
        None,
    );
    download.progressed(0, 1 << 20, "before any change");
    let spread: Vec<usize> = (1..=NODES).map(|i| c.own_connections(i)).collect();
    eprintln!("connections by the node that carried their first packet: {spread:?}");
    assert!(
        spread.iter().all(|&n| n >= CONNECTIONS / 10),
        "the router spread the connections unevenly over the nodes: {spread:?}"
    );
    (pool, download)
}

/// Waits until every connection of `pool` progressed since `mark`; panics with what did not.
fn all_progress(pool: &ConnPool, mark: &fastpath::testkit::traffic::Mark, when: &str) {
    let p = pool.wait_progress(mark, RECOVERY);
    assert!(
        p.failed.is_empty() && p.waiting.is_empty(),
        "{when}: {} progressed, {} failed ({}; e.g. {:?}), {} made no progress within {RECOVERY:?}",
        p.progressed,
        p.failed.len(),
        p.failure_kinds(),
        &p.failed[..p.failed.len().min(5)],
        p.waiting.len()
    );
}

/// Waits until every node in `nodes` is in sync with its peers.
fn wait_in_sync(c: &Cluster, nodes: &[usize], what: &str) {
    for &i in nodes {
        fastpath::testkit::ha::wait_in_sync(&c.daemons[i - 1], what, Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("node {i}: {e}"));
    }
}

#[test]
fn a_cluster_keeps_every_connection_through_a_death_a_rejoin_and_a_drain() {
    let mut c = cluster(true);
    let (pool, download) = traffic(&c);
    wait_in_sync(&c, &[1, 2, 3], "with the connections open");
    let rst_dumps = c.watch_resets();
    std::thread::sleep(Duration::from_millis(500));
    let client_before = tcp_resets(c.topo.ns("client"));

    // 1. Node 1 dies hard: its flows rehash to nodes 2 and 3, its source prefix goes to its
    // backups, and they translate node 1's connections from the replicated state.
    let down = c.kill(1);
    let mark = pool.mark();
    let detected = wait_routes(
        &c,
        &[2, 3],
        [&[2, 3], &[2], &[3]],
        Duration::from_secs(5),
        "node 1 dead",
    );
    all_progress(&pool, &mark, "after node 1 died");
    let recovered = down.elapsed();
    eprintln!(
        "node 1 killed: out of the router's ECMP set and its source prefix on nodes 2 and 3 {detected:?} after its link went down; every connection progressed again within {recovered:?}"
    );
    assert!(
        detected <= Duration::from_millis(1000),
        "the router took {detected:?} to drop dead node 1"
    );

    // 2. Node 1 comes back: it announces only once it holds its peers' state, then carries
    // its flows and its source prefix again.
    let revived = Instant::now();
    c.revive(1);
    let t = wait_routes(
        &c,
        &[1, 2, 3],
        [&[1], &[2], &[3]],
        Duration::from_secs(40),
        "node 1 back",
    );
    // Its peers' snapshots arrived (the first after its start, for each) before it announced.
    let run = c.daemons[0].log();
    let announced = log_time(&run, "Announcing");
    for peer in [2, 3] {
        let synced = log_time(&run, &format!("its state is here node={peer} "));
        assert!(
            synced <= announced,
            "node 1 announced {:.3} s before node {peer}'s snapshot arrived:\n{run}",
            synced - announced
        );
    }
    let mark = pool.mark();
    all_progress(&pool, &mark, "after node 1 rejoined");
    eprintln!(
        "node 1 back in the set {t:?} after its restart began ({:?} in all), every connection progressing",
        revived.elapsed()
    );

    // 3. Node 2 is drained: its announcements go, its flows move to nodes 1 and 3, and the
    // drain reports done once no packet arrives.
    let draining = Instant::now();
    let out = c.daemons[1].cli(&["drain", "--quiet", "2", "--deadline", "60"]);
    let drain_took = draining.elapsed();
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success() && said.contains("drained: no load-balanced packet for 2.0 s"),
        "fastpath drain: {}\n{said}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    wait_routes(
        &c,
        &[1, 3],
        [&[1], &[1, 3], &[3]],
        Duration::from_secs(1),
        "node 2 drained",
    );
    let status = c.daemons[1].cli(&["cluster", "status"]);
    let status = String::from_utf8_lossy(&status.stdout).to_string();
    assert!(status.contains("announcements: drained"), "{status}");
    let mark = pool.mark();
    all_progress(&pool, &mark, "after node 2 was drained");
    eprintln!(
        "node 2 drained in {drain_took:?}: {}\ncluster status:\n{status}",
        said.lines().last().unwrap_or_default()
    );

    let client_after = tcp_resets(c.topo.ns("client"));
    let (status, body) = download.finish_within(Duration::from_secs(120));
    let totals = pool.finish_intact("on close");
    assert!(
        status.is_some_and(|s| s.success()) && body == c.bulk,
        "the download must arrive intact: {} of {BULK_BYTES} bytes, curl {status:?}",
        body.len()
    );
    std::thread::sleep(Duration::from_millis(300));
    let seen: Vec<String> = rst_dumps
        .iter()
        .zip(c.endpoints())
        .flat_map(|(d, r)| {
            d.log()
                .lines()
                .filter(|l| l.contains("Flags [R"))
                .map(|l| format!("{r}: {l}"))
                .collect::<Vec<_>>()
        })
        .collect();
    let client = (
        client_after.0 - client_before.0,
        client_after.1 - client_before.1,
    );
    assert!(
        seen.is_empty() && client == (0, 0),
        "TCP resets of the clients' connections: {} seen; the client's stack sent {} and had {} established connections reset:\n{}",
        seen.len(),
        client.0,
        client.1,
        seen.join("\n")
    );
    eprintln!(
        "cluster: {} connections, {} bytes verified, download of {} bytes intact, 0 resets",
        totals.connections,
        totals.bytes_verified,
        body.len()
    );
}

/// The control run: the same cluster without replication. Node 1's connections land on
/// nodes that never saw them; in full-NAT they pick each one up mid-stream with a source port
/// of their own, which the backend does not know: it answers RST. If this test fails, the
/// harness no longer sees a membership change that loses state.
#[test]
fn without_replication_a_dead_node_resets_its_connections() {
    let mut c = cluster(false);
    let (pool, download) = traffic(&c);
    let on_node1 = c.own_connections(1);
    let resets_before = c.resets();
    c.kill(1);
    let mark = pool.mark();
    wait_routes(
        &c,
        &[2, 3],
        [&[2, 3], &[2], &[3]],
        Duration::from_secs(5),
        "node 1 dead",
    );
    let p = pool.wait_progress(&mark, RECOVERY);
    let resets_after = c.resets();
    let reset = p
        .failed
        .iter()
        .filter(|(_, e)| *e == ConnError::Reset)
        .count();
    eprintln!(
        "without replication: node 1 carried {on_node1} connections; after its death {} progressed, {} failed ({}), {} waiting; resets (sent, established reset) {:?}",
        p.progressed,
        p.failed.len(),
        p.failure_kinds(),
        p.waiting.len(),
        (
            resets_after.0 - resets_before.0,
            resets_after.1 - resets_before.1
        )
    );
    assert!(
        reset >= on_node1 / 2 && resets_after.0 > resets_before.0,
        "without replication, node 1's {on_node1} connections must be reset when it dies: {reset} reset"
    );
    drop(download);
    drop(pool);
}
