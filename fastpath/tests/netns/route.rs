//! End to end: fp routes between two links in the fast path (`route = true` on both). A
//! client pings and downloads through fp from a server on the other link, over IPv4 and
//! IPv6; fp's programs forward the packets (counted as `routed`), the first packet to an
//! unresolved next hop goes to the kernel, which resolves it, and a packet whose TTL runs
//! out at fp gets the kernel's ICMP time exceeded. Once at XDP, once at TC ingress with XDP
//! off, where fp's links are veths whose peers are in other namespaces: TC hands routed
//! packets straight to the peer's ingress, so fp's own link transmits (almost) none of them.
//!
//! ```text
//!      client                         fp                          server
//!  +-----------+ 10.210.0.0/24 +----------------+ 10.211.0.0/24 +-----------+
//!  |   eth0    |---------------| c0          s0 |---------------|   eth0    |
//!  |  .2 / ::2 | fd00:210::/64 | .1/::1  .1/::1 | fd00:211::/64 |  .2 / ::2 |
//!  +-----------+               +----------------+               +-----------+
//!   default via fp              route = true on c0, s0           default via fp
//! ```
//!
//! The client and the server turn checksum offloads off (XDP sees full checksums, as from a
//! wire) and GRO on: a veth takes XDP redirects only when its peer runs NAPI (an XDP program
//! or GRO there). Root only (never skipped). Debian packages: iproute2, ethtool, nginx, curl,
//! iputils-ping.

use fastpath::{
    datapath,
    stats::StatsSnapshot,
    testkit::netns::{
        Daemon, DaemonConfig, HookedInterface, Netns, Topology, VethEnd, prepare_test,
        unique_pin_dir,
    },
};
use fastpath_common::{Hook, Verdict, reason};

use crate::bin;

const SERVER4: &str = "10.211.0.2";
const SERVER6: &str = "fd00:211::2";
const FP_CLIENT_SIDE4: &str = "10.210.0.1";

fn topology() -> Topology {
    let mut topo = Topology::new();
    let build = |topo: &mut Topology| -> Result<(), fastpath::testkit::netns::NetnsError> {
        for role in ["client", "fp", "server"] {
            topo.add_ns(role)?;
        }
        topo.ns("fp").sysctl("net.ipv4.ip_forward", "1")?;
        topo.ns("fp").sysctl("net.ipv6.conf.all.forwarding", "1")?;
        topo.veth(
            VethEnd::new("client", "eth0")
                .addr("10.210.0.2/24")
                .addr("fd00:210::2/64"),
            VethEnd::new("fp", "c0")
                .addr(&format!("{FP_CLIENT_SIDE4}/24"))
                .addr("fd00:210::1/64"),
        )?;
        topo.veth(
            VethEnd::new("fp", "s0")
                .addr("10.211.0.1/24")
                .addr("fd00:211::1/64"),
            VethEnd::new("server", "eth0")
                .addr(&format!("{SERVER4}/24"))
                .addr(&format!("{SERVER6}/64")),
        )?;
        topo.ns("client").add_route("default", FP_CLIENT_SIDE4)?;
        topo.ns("client").add_route("default", "fd00:210::1")?;
        topo.ns("server").add_route("default", "10.211.0.1")?;
        topo.ns("server").add_route("default", "fd00:211::1")?;
        Ok(())
    };
    build(&mut topo).unwrap_or_else(|e| panic!("building the routing topology: {e}"));
    for role in ["client", "server"] {
        topo.ns(role)
            .run(&[
                "ethtool", "-K", "eth0", "tx", "off", "rx", "off", "gro", "on",
            ])
            .unwrap_or_else(|e| panic!("ethtool in {role}: {e}"));
    }
    topo
}

fn routed(s: &StatsSnapshot, hook: Hook) -> u64 {
    s.get(hook, Verdict::Forward, reason::ROUTED).packets
}

fn to_kernel(s: &StatsSnapshot, hook: Hook, code: u32) -> u64 {
    s.get(hook, Verdict::Kernel, code).packets
}

/// Packets `dev` in `ns` has transmitted (`ip -s link`: what went out through the device, not
/// what a peer redirect put straight into its peer).
fn tx_packets(ns: &Netns, dev: &str) -> u64 {
    let out = ns
        .run(&["ip", "-j", "-s", "link", "show", "dev", dev])
        .unwrap_or_else(|e| panic!("ip -s link show {dev}: {e}"));
    let json: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("ip -j output {out:?}: {e}"));
    json[0]["stats64"]["tx"]["packets"]
        .as_u64()
        .unwrap_or_else(|| panic!("no tx packet count for {dev} in {out}"))
}

#[test]
fn fp_routes_ipv4_and_ipv6_between_its_links() {
    routes_between_links(Hook::Xdp);
}

#[test]
fn fp_routes_ipv4_and_ipv6_between_its_links_at_tc() {
    routes_between_links(Hook::TcIngress);
}

fn routes_between_links(hook: Hook) {
    prepare_test(&["ethtool", "nginx", "curl", "ping"]);
    let topo = topology();
    let mut nginx = topo
        .ns("server")
        .http_server(80)
        .unwrap_or_else(|e| panic!("nginx: {e}"));
    let body = nginx.serve_blob("blob", 4 << 20);
    let _ = nginx.process();
    let xdp = hook == Hook::Xdp;
    let mut config = DaemonConfig::new(&unique_pin_dir("route"));
    for dev in ["c0", "s0"] {
        config = config
            .hooks(HookedInterface {
                name: dev.into(),
                xdp: if xdp { "auto" } else { "off" },
                tc_ingress: true,
                tc_egress: true,
            })
            .interface_key(dev, "route = true");
    }
    let daemon = Daemon::start(bin(), topo.ns("fp"), &config);
    // The next hops start unresolved: their first packets go to the kernel, which resolves.
    for dev in ["c0", "s0"] {
        topo.ns("fp")
            .run(&["ip", "neigh", "flush", "dev", dev])
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let before = daemon.stats();

    for (server, ttl_word) in [(SERVER4, "ttl=63"), (SERVER6, "ttl=63")] {
        let out = topo
            .ns("client")
            .run(&["ping", "-c", "5", "-i", "0.2", "-W", "2", server])
            .unwrap_or_else(|e| panic!("ping {server} through fp: {e}\n{}", daemon.log()));
        assert!(
            out.contains("5 received") && out.contains(ttl_word),
            "ping {server}: expected 5 replies with {ttl_word} (one hop: fp):\n{out}"
        );
    }
    let after_ping = daemon.stats().delta(&before);
    assert!(
        routed(&after_ping, hook) >= 16,
        "expected most of the 20 echo requests and replies routed at {hook:?}, got {}:\n{}",
        routed(&after_ping, hook),
        after_ping.render_table()
    );
    assert!(
        to_kernel(&after_ping, hook, reason::ROUTE_NO_NEIGHBOR) >= 1,
        "the first packet to an unresolved next hop must go to the kernel:\n{}",
        after_ping.render_table()
    );

    // Downloads, byte for byte, both families.
    let tx_before = tx_packets(topo.ns("fp"), "c0");
    for url in [
        format!("http://{SERVER4}/blob"),
        format!("http://[{SERVER6}]/blob"),
    ] {
        topo.ns("client").download_exact(&url, &body);
    }
    let tx_sent = tx_packets(topo.ns("fp"), "c0") - tx_before;
    let after_curl = daemon.stats().delta(&before);
    let data_packets = routed(&after_curl, hook) - routed(&after_ping, hook);
    assert!(
        data_packets >= 2 * (4 << 20) / 1500,
        "two 4 MiB downloads took {data_packets} routed packets: fewer than their segments, so \
         the kernel forwarded part of them:\n{}",
        after_curl.render_table()
    );
    if !xdp {
        // The downloads' segments went from s0 to the client's end of c0 without c0
        // transmitting them (its few packets: the kernel's ARP/ND and the connections' ends).
        assert!(
            tx_sent * 20 < data_packets,
            "c0 transmitted {tx_sent} packets while TC routed {data_packets}: forwarded \
             packets went out through c0 rather than straight to its peer (bpf_redirect_peer)"
        );
    }

    // The routed packets took their flows' cached FIB answers, bar each flow's first after
    // a generation change or a second: `fastpath stats` reports the cache's counters.
    let route_cache = datapath::pinned_route_stats(daemon.pin_dir())
        .unwrap_or_else(|e| panic!("route cache counters: {e}"));
    let [hits, misses, stale] = [0, 1, 2].map(|i| route_cache[i]);
    assert!(
        hits * 10 >= data_packets * 9 && misses + stale > 0,
        "{data_packets} routed data packets, route cache hit {hits}, miss {misses}, stale \
         {stale}: most packets should have hit their flow's cached answer"
    );
    let printed = daemon.cli_ok(&["stats"]);
    assert!(
        printed.contains(&format!(
            "route cache: hit {hits}, miss {misses}, stale {stale}"
        )),
        "fastpath stats prints the route cache's counters:\n{printed}"
    );
    eprintln!(
        "route cache: hit {hits}, miss {misses}, stale {stale} ({data_packets} data packets)"
    );
    // The daemon's watcher says whether new connections share their backend's route: yes
    // with fp's default rules; no while a rule selects by source.
    assert!(
        printed.contains("new connections share their backend's route"),
        "default rules, no multipath route:\n{printed}"
    );
    let rule = ["rule", "add", "from", "10.99.0.0/16", "lookup", "100"];
    let shared_says = |want: &str| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
        loop {
            let printed = daemon.cli_ok(&["stats"]);
            if printed.contains(want) {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "expected `{want}`:\n{printed}"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    };
    topo.ns("fp").ip(&rule).unwrap_or_else(|e| panic!("{e}"));
    shared_says("new connections ask the FIB each");
    topo.ns("fp")
        .ip(&["rule", "del", "from", "10.99.0.0/16", "lookup", "100"])
        .unwrap_or_else(|e| panic!("{e}"));
    shared_says("new connections share their backend's route");

    // TTL 1: fp's kernel answers with the ICMP error.
    for (server, said) in [
        (SERVER4, "Time to live exceeded"),
        (SERVER6, "Time exceeded: Hop limit"),
    ] {
        // No reply, so ping exits 1: its output says why.
        let out = topo
            .ns("client")
            .exec(&["ping", "-c", "1", "-t", "1", "-W", "2", server])
            .unwrap_or_else(|e| panic!("ping -t 1 {server}: {e}"));
        let out = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.contains(said),
            "ping -t 1 {server}: expected {said:?} from fp:\n{out}"
        );
    }
    let end = daemon.stats().delta(&before);
    assert!(
        to_kernel(&end, hook, reason::ROUTE_TTL_EXPIRED) >= 2,
        "both expiring pings must be counted under route_ttl_expired:\n{}",
        end.render_table()
    );
    // fp's own addresses are still the kernel's.
    topo.ns("client")
        .run(&["ping", "-c", "1", "-W", "2", FP_CLIENT_SIDE4])
        .unwrap_or_else(|e| panic!("ping fp itself: {e}"));
    let end = daemon.stats().delta(&before);
    assert!(
        to_kernel(&end, hook, reason::ROUTE_NOT_FORWARDED) >= 1,
        "a ping to fp itself goes to the kernel as route_not_forwarded:\n{}",
        end.render_table()
    );
    eprintln!("{}", end.render_table());
}
