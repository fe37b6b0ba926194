//! Routing daemons for the announcement tests: FRR as the router (zebra, bfdd, bgpd; ECMP
//! over up to 8 paths, BFD with every node) and BIRD on each node (learns the announcement
//! table, exports it over BGP with BFD, other nodes' prefixes — metric
//! [`crate::announce::BACKUP_METRIC`] — with its AS prepended once), as `docs/announce.md`
//! configures them. Plus reading times out of a daemon's log.

use std::{path::PathBuf, time::Duration};

use super::netns::{Netns, Spawned, TempDir, Topology, VethEnd, unique_name};

/// FRR's daemons, in the order they start.
pub const FRR_DAEMONS: [&str; 3] = ["zebra", "bfdd", "bgpd"];

/// Panics unless FRR's daemons are installed (`cargo xtask test` installs them).
pub fn require_frr() {
    for d in FRR_DAEMONS {
        assert!(
            std::path::Path::new(&format!("/usr/lib/frr/{d}")).exists(),
            "/usr/lib/frr/{d} not found: install the Debian package frr (cargo xtask test does)"
        );
    }
}

/// Node `i`'s namespace role.
pub fn node_role(i: usize) -> String {
    format!("node{i}")
}

/// Node `i`'s address on its link to the router (`10.9.i.2`).
pub fn node_addr(i: usize) -> String {
    format!("10.9.{i}.2")
}

/// The router's address on its link to node `i` (`10.9.i.1`).
pub fn router_addr(i: usize) -> String {
    format!("10.9.{i}.1")
}

/// Adds nodes `1..=n` to `topo`, each on a link of its own to the `router` namespace
/// (`r-nI` there, `eth0` on the node), its default route through the router; the router
/// forwards, spreading flows over equal-cost paths by their L4 hash.
pub fn add_nodes(topo: &mut Topology, n: usize) {
    let router = topo.ns("router");
    router
        .sysctl("net.ipv4.ip_forward", "1")
        .expect("forwarding");
    router
        .sysctl("net.ipv4.fib_multipath_hash_policy", "1")
        .expect("L4 hashing");
    for i in 1..=n {
        let role = node_role(i);
        topo.add_ns(&role).expect("node");
        topo.veth(
            VethEnd::new("router", &format!("r-n{i}")).addr(&format!("{}/24", router_addr(i))),
            VethEnd::new(&role, "eth0").addr(&format!("{}/24", node_addr(i))),
        )
        .expect("node link");
        topo.ns(&role)
            .ip(&["route", "add", "default", "via", &router_addr(i)])
            .expect("node route");
    }
}

/// The router's neighbours: nodes `1..=n`, node `i` in AS 65000 + `i`.
pub fn node_neighbors(n: usize) -> Vec<Neighbor> {
    (1..=n)
        .map(|i| Neighbor {
            addr: node_addr(i),
            asn: 65000 + i as u32,
        })
        .collect()
}

/// A BGP neighbour of the router: its address and AS.
pub struct Neighbor {
    pub addr: String,
    pub asn: u32,
}

/// FRR in the router namespace, in a pathspace of its own (`-N`): its config and runtime
/// directories are removed on drop, after its daemons.
pub struct Frr {
    daemons: Vec<Spawned>,
    dirs: [PathBuf; 2],
    name: String,
}

impl Drop for Frr {
    fn drop(&mut self) {
        for d in &mut self.daemons {
            d.kill();
        }
        for dir in &self.dirs {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

impl Frr {
    /// Starts FRR in `router` as AS 65000 (router id `router_id`), peering with
    /// `neighbors` over BFD (100 ms × 3), multipath across their ASes.
    pub fn start(router: &Netns, router_id: &str, neighbors: &[Neighbor]) -> Frr {
        let name = unique_name("frr");
        let dirs = [
            PathBuf::from(format!("/etc/frr/{name}")),
            PathBuf::from(format!("/var/run/frr/{name}")),
        ];
        // Routes with plain multipath next hops, not kernel nexthop objects: the kernel
        // flushes a nexthop object whose link loses carrier, and FRR 8.4's zebra then left a
        // node that came back out of the VIP's ECMP group although BGP chose it.
        let mut conf = format!(
            "frr defaults datacenter\nno zebra nexthop kernel enable\nrouter bgp 65000\n bgp router-id {router_id}\n no bgp ebgp-requires-policy\n bgp bestpath as-path multipath-relax\n",
        );
        for n in neighbors {
            conf += &format!(
                " neighbor {} remote-as {}\n neighbor {0} bfd\n neighbor {0} timers connect 1\n",
                n.addr, n.asn
            );
        }
        conf += " address-family ipv4 unicast\n  maximum-paths 8\n exit-address-family\nbfd\n";
        for n in neighbors {
            conf += &format!(
                " peer {}\n  receive-interval 100\n  transmit-interval 100\n  detect-multiplier 3\n",
                n.addr
            );
        }
        for dir in &dirs {
            std::fs::create_dir_all(dir).expect("FRR directory");
        }
        let file = dirs[0].join("frr.conf");
        std::fs::write(&file, conf).expect("frr.conf");
        std::fs::write(dirs[0].join("vtysh.conf"), "").expect("vtysh.conf");
        for p in [&dirs[0], &dirs[1], &file] {
            router
                .run(&["chown", "-R", "frr:frr", &p.display().to_string()])
                .expect("chown");
        }
        let mut daemons = vec![];
        for d in FRR_DAEMONS {
            let pid = dirs[1].join(format!("{d}.pid"));
            daemons.push(
                router
                    .spawn(&[
                        format!("/usr/lib/frr/{d}"),
                        "-N".into(),
                        name.clone(),
                        "-f".into(),
                        file.display().to_string(),
                        "-i".into(),
                        pid.display().to_string(),
                    ])
                    .expect("FRR daemon"),
            );
            // zebra's socket first, for the others to connect to.
            std::thread::sleep(Duration::from_millis(300));
        }
        Frr {
            daemons,
            dirs,
            name,
        }
    }

    /// What `vtysh -c command` prints in `router` (or why it could not run): for failure
    /// messages.
    pub fn show(&self, router: &Netns, command: &str) -> String {
        router
            .run(&["vtysh", "-N", &self.name, "-c", command])
            .unwrap_or_else(|e| format!("vtysh -c {command:?}: {e}"))
    }
}

/// BIRD's configuration for a node at `addr` in AS `asn` peering with the router at
/// `router` (AS 65000) over `iface`: learns kernel table `table`, exports it with BFD, other
/// nodes' prefixes (metric 1000) with its AS prepended once. Short error and retry waits:
/// the default back-off delays a re-join by minutes.
pub fn bird_config(addr: &str, asn: u32, router: &str, iface: &str, table: u32) -> String {
    let backup = crate::announce::BACKUP_METRIC;
    format!(
        "router id {addr};
protocol device {{}}
protocol kernel announce {{ ipv4 {{ import all; export none; }}; kernel table {table}; learn; }}
protocol bfd {{ interface \"{iface}\" {{ min rx interval 100 ms; min tx interval 100 ms; multiplier 3; }}; }}
protocol bgp uplink {{
  local {addr} as {asn}; neighbor {router} as 65000;
  bfd on; hold time 3; connect retry time 1; error wait time 1, 5;
  ipv4 {{
    import none;
    export filter {{
      if proto != \"announce\" then reject;
      if krt_metric = {backup} then bgp_path.prepend({asn});
      accept;
    }};
    next hop self;
  }};
}}
"
    )
}

/// Starts BIRD in `node` in the foreground with `config`, its files in `dir` named `name`.
pub fn start_bird(node: &Netns, dir: &TempDir, name: &str, config: &str) -> Spawned {
    let conf = dir.join(format!("{name}.conf"));
    std::fs::write(&conf, config).expect("bird.conf");
    node.spawn(&[
        "bird".to_string(),
        "-f".into(),
        "-c".into(),
        conf.display().to_string(),
        "-s".into(),
        dir.join(format!("{name}.ctl")).display().to_string(),
    ])
    .expect("bird")
}

/// The next hops (`via` addresses) of the router's route to `dst`, of `candidates`, in
/// their order (none: no route).
pub fn next_hops(router: &Netns, dst: &str, candidates: &[String]) -> Vec<usize> {
    let routes = router.ip(&["route", "show", dst]).unwrap_or_default();
    candidates
        .iter()
        .enumerate()
        .filter(|(_, a)| routes.contains(&format!("via {a} ")))
        .map(|(i, _)| i + 1)
        .collect()
}

/// From a daemon's log: the time of the first line with `needle`, in seconds of its day (the
/// lines start with an RFC 3339 time in UTC, `...THH:MM:SS.ffffffZ`).
pub fn log_time(log: &str, needle: &str) -> f64 {
    let line = log
        .lines()
        .find(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("no {needle:?} in the log:\n{log}"));
    let clock = line
        .split_once('T')
        .and_then(|(_, rest)| rest.split_once('Z'))
        .map(|(clock, _)| clock)
        .unwrap_or_else(|| panic!("no time in {line:?}"));
    clock
        .split(':')
        .map(|f| f.parse::<f64>().expect("a time field"))
        .fold(0.0, |acc, f| acc * 60.0 + f)
}

/// The time from a daemon's announcer start ("settling health") to its first announcement.
pub fn waited_to_announce(log: &str) -> Duration {
    Duration::from_secs_f64(
        log_time(log, "Announcing") - log_time(log, "readiness=\"settling health\""),
    )
}
