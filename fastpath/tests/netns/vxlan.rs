//! End to end: two nodes joined by an underlay link carry a kernel VXLAN overlay (VNI 42), a
//! pod namespace behind each. With the kernel alone, the pods reach each other; with a
//! fastpath daemon on each node (`vxlan = { ... }` on the vxlan device, the underlay with XDP
//! and TC egress, the pod link with `route = true`), the first packets towards the other node
//! take the kernel's overlay path and teach the underlay's TC egress the outer headers, and
//! from then on packets are encapsulated at the pod link's XDP hook and decapsulated at the
//! underlay's: pings in both directions and a 4 MiB download arrive byte for byte, counted as
//! `vxlan_encap` and `vxlan_decap` on both nodes, over IPv4 and IPv6 in the overlay. Then the
//! same with XDP off, the pod link and the underlay doing it at TC ingress (where an inner
//! packet of the other IP version than the underlay's is the kernel's to decapsulate), and
//! both again over an IPv6 underlay. And with Flannel's netfilter rules on both nodes (the
//! kernel tracks what it forwards; the fast path's packets skip the node's netfilter), at
//! both hooks.
//!
//! Routing + NAT over the overlay: node b load-balances a VIP (IPv4 and IPv6) that node a
//! routes into the overlay to its pod; b's vxlan device tracks connections at (generic) XDP,
//! so the kernel decapsulates what arrives for it and the fast path NATs and routes the inner
//! packets to b's pod; the pod's replies are NATed back at b's pod link and encapsulated in
//! the fast path; downloads through the VIP arrive byte for byte.
//!
//! The topology is `testkit::vxlan_cases::two_node_overlay`. Root only (never skipped).
//! Debian packages: iproute2, ethtool, nginx, curl, iputils-ping.

use fastpath::{
    stats::StatsSnapshot,
    testkit::netns::{Daemon, HttpServer, Topology, prepare_test},
    testkit::vxlan_cases::{
        OVERLAY_NODES, Underlay, add_flannel_rules, overlay_daemon_config,
        overlay_nat_daemon_config, two_node_overlay,
    },
};
use fastpath_common::{Hook, Verdict, reason};

use crate::bin;

/// nginx in pod b serving a 4 MiB `blob`; the server lives as long as the value returned.
fn blob_server(topo: &Topology) -> (HttpServer, Vec<u8>) {
    let mut nginx = topo
        .ns("pb")
        .http_server(80)
        .unwrap_or_else(|e| panic!("nginx: {e}"));
    let body = nginx.serve_blob("blob", 4 << 20);
    let _ = nginx.process();
    (nginx, body)
}

fn fast(d: &StatsSnapshot, hook: Hook, code: u32) -> u64 {
    d.get(hook, Verdict::Forward, code).packets
}

/// The nodes' netfilter: none, or Flannel's rules (connection tracking on).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Nodes {
    Bare,
    Flannel,
}

#[test]
fn two_nodes_carry_their_pods_overlay_in_the_fast_path_at_xdp() {
    carries_the_overlay(Hook::Xdp, Underlay::V4, Nodes::Bare);
}

/// The same with XDP off: the pod link routes and encapsulates at TC ingress, the underlay
/// decapsulates there.
#[test]
fn two_nodes_carry_their_pods_overlay_in_the_fast_path_at_tc() {
    carries_the_overlay(Hook::TcIngress, Underlay::V4, Nodes::Bare);
}

#[test]
fn two_nodes_carry_their_pods_overlay_over_an_ipv6_underlay_at_xdp() {
    carries_the_overlay(Hook::Xdp, Underlay::V6, Nodes::Bare);
}

#[test]
fn two_nodes_carry_their_pods_overlay_over_an_ipv6_underlay_at_tc() {
    carries_the_overlay(Hook::TcIngress, Underlay::V6, Nodes::Bare);
}

/// With Flannel's rules on both nodes, at the hook the overlay benchmark compares at TC.
#[test]
fn nodes_with_flannels_netfilter_rules_carry_their_pods_overlay_in_the_fast_path_at_tc() {
    carries_the_overlay(Hook::TcIngress, Underlay::V4, Nodes::Flannel);
}

#[test]
fn nodes_with_flannels_netfilter_rules_carry_their_pods_overlay_in_the_fast_path_at_xdp() {
    carries_the_overlay(Hook::Xdp, Underlay::V4, Nodes::Flannel);
}

fn carries_the_overlay(hook: Hook, underlay: Underlay, nodes: Nodes) {
    let tools = ["ethtool", "nginx", "curl", "ping", "bridge"];
    let flannel_tools = ["iptables", "ip6tables", "conntrack"];
    match nodes {
        Nodes::Bare => prepare_test(&tools),
        Nodes::Flannel => prepare_test(&[&tools[..], &flannel_tools[..]].concat()),
    }
    let topo = two_node_overlay(underlay).unwrap_or_else(|e| panic!("building the overlay: {e}"));
    if nodes == Nodes::Flannel {
        add_flannel_rules(&topo).unwrap_or_else(|e| panic!("Flannel's rules: {e}"));
    }
    let [na, nb] = &OVERLAY_NODES;
    // The kernel's overlay alone.
    for to in [nb.pod_addr(), nb.pod_addr6()] {
        topo.ns("pa")
            .run(&["ping", "-c", "2", "-i", "0.2", "-W", "2", &to])
            .unwrap_or_else(|e| panic!("ping {to} over the kernel's overlay: {e}"));
    }
    if nodes == Nodes::Flannel {
        // The rules are live: both nodes' kernels tracked those pings, IPv4 and IPv6.
        for node in ["na", "nb"] {
            for (family, proto, to) in [
                ("ipv4", "icmp", nb.pod_addr()),
                ("ipv6", "icmpv6", nb.pod_addr6()),
            ] {
                let tracked = topo
                    .ns(node)
                    .run(&["conntrack", "-L", "-f", family, "-p", proto])
                    .unwrap_or_else(|e| panic!("conntrack -L on {node}: {e}"));
                assert!(
                    tracked.contains(&format!("dst={to} ")),
                    "node {node}'s kernel did not track the ping to {to}:\n{tracked}"
                );
            }
        }
    }
    let config = |n| overlay_daemon_config(n, hook, underlay);
    let a = Daemon::start(bin(), topo.ns("na"), &config(na));
    let b = Daemon::start(bin(), topo.ns("nb"), &config(nb));
    let (_nginx, body) = blob_server(&topo);
    for inner6 in [false, true] {
        let (pod_a, pod_b) = if inner6 {
            (na.pod_addr6(), nb.pod_addr6())
        } else {
            (na.pod_addr(), nb.pod_addr())
        };
        let family = if inner6 { "IPv6" } else { "IPv4" };
        let (a0, b0) = (a.stats(), b.stats());
        for (from, to) in [("pa", pod_b.as_str()), ("pb", pod_a.as_str())] {
            let out = topo
                .ns(from)
                .run(&["ping", "-c", "10", "-i", "0.1", "-W", "2", to])
                .unwrap_or_else(|e| panic!("ping {to} from {from}: {e}\n{}\n{}", a.log(), b.log()));
            assert!(out.contains("10 received"), "ping {to} from {from}:\n{out}");
        }
        let url = if inner6 {
            format!("http://[{pod_b}]/blob")
        } else {
            format!("http://{pod_b}/blob")
        };
        topo.ns("pa").download_exact(&url, &body);
        let (da, db) = (a.stats().delta(&a0), b.stats().delta(&b0));
        let tables = format!("a:\n{}\nb:\n{}", da.render_table(), db.render_table());
        eprintln!("{family} in the overlay, {underlay:?} underlay, {hook:?}, {nodes:?}:\n{tables}");
        // At TC an inner packet must be of the outer one's IP version to be decapsulated:
        // the others are the kernel's.
        let decapsulates = hook == Hook::Xdp || inner6 == (underlay == Underlay::V6);
        for (node, d) in [("a", &da), ("b", &db)] {
            // 20 pings each way and their replies: most of them through the fast path (the
            // first packets towards a next hop teach the headers).
            let encap = fast(d, hook, reason::VXLAN_ENCAP);
            let decap = fast(d, hook, reason::VXLAN_DECAP);
            assert!(
                encap >= 15
                    && if decapsulates {
                        decap >= 15
                    } else {
                        decap == 0
                    },
                "{family}: node {node} encapsulated {encap} and decapsulated {decap} packets \
                 in the fast path (want most pings; decapsulation: {decapsulates}):\n{tables}"
            );
        }
        // The download's data segments come from b's pod: b encapsulates them, a
        // decapsulates.
        let encap = fast(&db, hook, reason::VXLAN_ENCAP);
        let decap = fast(&da, hook, reason::VXLAN_DECAP);
        assert!(
            encap >= 1000 && (!decapsulates || decap >= 1000),
            "{family}: the download's segments through the fast path: b encapsulated {encap}, \
             a decapsulated {decap}:\n{tables}"
        );
    }
}

/// Node b's load-balanced addresses, which node a routes into the overlay.
const VIP: &str = "10.10.200.100";
const VIP6: &str = "fd00:10:200::100";

/// Routing + NAT over the overlay (translation is at XDP: the pod links at XDP, the vxlan
/// device at generic XDP).
#[test]
fn routes_and_nats_over_the_overlay() {
    let hook = Hook::Xdp;
    prepare_test(&["ethtool", "nginx", "curl", "bridge"]);
    let underlay = Underlay::V4;
    let topo = two_node_overlay(underlay).unwrap_or_else(|e| panic!("building the overlay: {e}"));
    let [na, nb] = &OVERLAY_NODES;
    for (subnet, via) in [
        ("10.10.200.0/24", nb.overlay),
        ("fd00:10:200::/64", nb.overlay6),
    ] {
        topo.ns("na")
            .run(&["ip", "route", "add", subnet, "via", via, "dev", "vxlan0"])
            .unwrap_or_else(|e| panic!("route to the VIPs: {e}"));
    }
    let services = format!(
        "[[service]]\nvip = \"{VIP}\"\nport = 80\n[[service.backend]]\naddress = \"{}\"\nport = 80\n\
         [[service]]\nvip = \"{VIP6}\"\nport = 80\n[[service.backend]]\naddress = \"{}\"\nport = 80\n",
        nb.pod_addr(),
        nb.pod_addr6()
    );
    let a = Daemon::start(
        bin(),
        topo.ns("na"),
        &overlay_daemon_config(na, hook, underlay),
    );
    let b = Daemon::start(
        bin(),
        topo.ns("nb"),
        &overlay_nat_daemon_config(nb, underlay, &services),
    );
    let (_nginx, body) = blob_server(&topo);
    for url in [
        format!("http://{VIP}/blob"),
        format!("http://[{VIP6}]/blob"),
    ] {
        let (a0, b0) = (a.stats(), b.stats());
        if let Err(e) = topo.ns("pa").run(&["curl", "-sS", "-o", "/dev/null", &url]) {
            panic!(
                "{url}: {e}\na:\n{}\nb:\n{}",
                a.stats().delta(&a0).render_table(),
                b.stats().delta(&b0).render_table()
            );
        }
        for _ in 0..5 {
            topo.ns("pa").download_exact(&url, &body);
        }
        let (da, db) = (a.stats().delta(&a0), b.stats().delta(&b0));
        let tables = format!("a:\n{}\nb:\n{}", da.render_table(), db.render_table());
        eprintln!("NAT over the overlay to {url}, {hook:?}:\n{tables}");
        // b: what arrives for the VIP is the kernel's to decapsulate, then NATed at the
        // device's XDP hook; the pod's replies are translated back and encapsulated at the
        // pod link's (counted as encapsulated: the last stage's reason). The client took
        // them, byte for byte, as from the VIP.
        let to_backend = fast(&db, Hook::Xdp, reason::LB_TO_BACKEND);
        let encap = fast(&db, hook, reason::VXLAN_ENCAP);
        let decap_b = fast(&db, hook, reason::VXLAN_DECAP);
        let miss_b = db.get(hook, Verdict::Kernel, reason::VXLAN_MISS).packets;
        assert!(
            to_backend >= 50 && encap >= 1000,
            "{url}: b NATed {to_backend} packets to its pod at the vxlan device's XDP hook \
             and encapsulated {encap} of the replies:\n{tables}"
        );
        assert!(
            decap_b == 0 && miss_b >= to_backend,
            "{url}: b decapsulated {decap_b} packets in the fast path (want 0: its device \
             tracks connections) and handed the kernel {miss_b}:\n{tables}"
        );
        // a decapsulates the replies.
        let decap_a = fast(&da, hook, reason::VXLAN_DECAP);
        assert!(
            decap_a >= 1000,
            "{url}: a decapsulated {decap_a} of the replies in the fast path:\n{tables}"
        );
    }
    // Pod to pod, no VIP: b's underlay leaves these to the kernel as well (its device tracks
    // connections), and the device's XDP hook routes the inner packets (the download's ACKs)
    // to b's pod.
    // Three downloads: one may be acknowledged with fewer than 50 ACKs (the pod's GRO
    // aggregates vary run to run).
    let b0 = b.stats();
    for _ in 0..3 {
        topo.ns("pa")
            .download_exact(&format!("http://{}/blob", nb.pod_addr()), &body);
    }
    let db = b.stats().delta(&b0);
    let (routed, decap_b, miss) = (
        fast(&db, hook, reason::ROUTED),
        fast(&db, hook, reason::VXLAN_DECAP),
        db.get(hook, Verdict::Kernel, reason::VXLAN_MISS).packets,
    );
    assert!(
        decap_b == 0 && routed >= 50 && routed * 10 >= miss * 9,
        "pod to pod: b decapsulated {decap_b} packets in the fast path (want 0), left {miss} \
         to the kernel's decapsulation and routed {routed} at XDP (the device's: want nearly \
         all of those):\n{}",
        db.render_table()
    );
}
