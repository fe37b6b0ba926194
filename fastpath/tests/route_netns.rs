//! End to end: fp routes between two links in the fast path (`route = true` on both). A
//! client pings, downloads and streams through fp to a server on the other link, over IPv4
//! and IPv6; fp's XDP programs forward the packets (counted as `routed`), the first packet to
//! an unresolved next hop goes to the kernel, which resolves it, and a packet whose TTL runs
//! out at fp gets the kernel's ICMP time exceeded.
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

use std::path::Path;

use fastpath::{
    stats::StatsSnapshot,
    testkit::netns::{Daemon, DaemonConfig, Topology, VethEnd, prepare_test, unique_pin_dir},
};
use fastpath_common::{Hook, Verdict, reason};

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_fastpath"))
}

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

fn routed(s: &StatsSnapshot) -> u64 {
    s.get(Hook::Xdp, Verdict::Forward, reason::ROUTED).packets
}

fn to_kernel(s: &StatsSnapshot, code: u32) -> u64 {
    s.get(Hook::Xdp, Verdict::Kernel, code).packets
}

#[test]
fn fp_routes_ipv4_and_ipv6_between_its_links() {
    prepare_test(&["ethtool", "nginx", "curl", "ping"]);
    let topo = topology();
    let mut nginx = topo
        .ns("server")
        .http_server(80)
        .unwrap_or_else(|e| panic!("nginx: {e}"));
    let body = nginx.serve_blob("blob", 4 << 20);
    let _ = nginx.process();
    let config = DaemonConfig::new(&unique_pin_dir("route"))
        .interface("c0")
        .interface_key("c0", "route = true")
        .interface("s0")
        .interface_key("s0", "route = true");
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
        routed(&after_ping) >= 16,
        "expected most of the 20 echo requests and replies routed at XDP, got {}:\n{}",
        routed(&after_ping),
        after_ping.render_table()
    );
    assert!(
        to_kernel(&after_ping, reason::ROUTE_NO_NEIGHBOR) >= 1,
        "the first packet to an unresolved next hop must go to the kernel:\n{}",
        after_ping.render_table()
    );

    // Downloads, byte for byte, both families.
    for url in [
        format!("http://{SERVER4}/blob"),
        format!("http://[{SERVER6}]/blob"),
    ] {
        topo.ns("client").download_exact(&url, &body);
    }
    let after_curl = daemon.stats().delta(&before);
    let data_packets = routed(&after_curl) - routed(&after_ping);
    assert!(
        data_packets >= 2 * (4 << 20) / 1500,
        "two 4 MiB downloads took {data_packets} routed packets: fewer than their segments, so \
         the kernel forwarded part of them:\n{}",
        after_curl.render_table()
    );

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
        to_kernel(&end, reason::ROUTE_TTL_EXPIRED) >= 2,
        "both expiring pings must be counted under route_ttl_expired:\n{}",
        end.render_table()
    );
    // fp's own addresses are still the kernel's.
    topo.ns("client")
        .run(&["ping", "-c", "1", "-W", "2", FP_CLIENT_SIDE4])
        .unwrap_or_else(|e| panic!("ping fp itself: {e}"));
    let end = daemon.stats().delta(&before);
    assert!(
        to_kernel(&end, reason::ROUTE_NOT_FORWARDED) >= 1,
        "a ping to fp itself goes to the kernel as route_not_forwarded:\n{}",
        end.render_table()
    );
    eprintln!("{}", end.render_table());
}
