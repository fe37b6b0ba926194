//! End to end: two nodes joined by an underlay link carry a kernel VXLAN overlay (VNI 42), a
//! pod namespace behind each. With the kernel alone, the pods reach each other; with a
//! fastpath daemon on each node (`vxlan = { ... }` on the vxlan device, the underlay with XDP
//! and TC egress, the pod link with `route = true`), the first packets towards the other node
//! take the kernel's overlay path and teach the underlay's TC egress the outer headers, and
//! from then on packets are encapsulated at the pod link's XDP hook and decapsulated at the
//! underlay's: pings in both directions and a 4 MiB download arrive byte for byte, counted as
//! `vxlan_encap` and `vxlan_decap` on both nodes.
//!
//! ```text
//!  pod a          node a                               node b               pod b
//! +------+      +-----------------------+           +-----------------------+      +------+
//! | eth0 |------| pod0   vxlan0    und0 |-----------| und0    vxlan0   pod0 |------| eth0 |
//! | .1.2 |      | .1.1  10.10.255.1  .1 | 192.168.  | .2  10.10.255.2  .2.1 |      | .2.2 |
//! +------+      +-----------------------+  60.0/24  +-----------------------+      +------+
//!  10.10.1.0/24                                                          10.10.2.0/24
//! ```
//!
//! The pods turn checksum offloads off (XDP sees full checksums, as from a wire) and GRO on (a
//! veth takes XDP redirects only when its peer runs NAPI). The pod links' MTU is the overlay's
//! (1450). Root only (never skipped). Debian packages: iproute2, ethtool, nginx, curl,
//! iputils-ping.

use std::path::Path;

use fastpath::{
    stats::StatsSnapshot,
    testkit::netns::{
        Daemon, DaemonConfig, HookedInterface, Topology, VethEnd, prepare_test, unique_pin_dir,
    },
    testkit::vxlan_cases::VxlanDevice,
};
use fastpath_common::{Hook, Verdict, reason};

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_fastpath"))
}

const POD_A: &str = "10.10.1.2";
const POD_B: &str = "10.10.2.2";

/// Node `n` (1 or 2): its pod subnet's third byte, underlay address, overlay address and
/// vxlan device MAC.
struct Node {
    role: &'static str,
    pod: &'static str,
    subnet: u8,
    underlay: &'static str,
    overlay: &'static str,
    mac: &'static str,
}

const NODES: [Node; 2] = [
    Node {
        role: "na",
        pod: "pa",
        subnet: 1,
        underlay: "192.168.60.1",
        overlay: "10.10.255.1",
        mac: "02:00:00:00:7a:01",
    },
    Node {
        role: "nb",
        pod: "pb",
        subnet: 2,
        underlay: "192.168.60.2",
        overlay: "10.10.255.2",
        mac: "02:00:00:00:7a:02",
    },
];

fn topology() -> Topology {
    let mut topo = Topology::new();
    let build = |topo: &mut Topology| -> Result<(), fastpath::testkit::netns::NetnsError> {
        for n in &NODES {
            topo.add_ns(n.pod)?;
            topo.add_ns(n.role)?;
            topo.ns(n.role).sysctl("net.ipv4.ip_forward", "1")?;
            topo.veth(
                VethEnd::new(n.pod, "eth0").addr(&format!("10.10.{}.2/24", n.subnet)),
                VethEnd::new(n.role, "pod0").addr(&format!("10.10.{}.1/24", n.subnet)),
            )?;
            topo.ns(n.pod)
                .add_route("default", &format!("10.10.{}.1", n.subnet))?;
        }
        topo.veth(
            VethEnd::new("na", "und0").addr(&format!("{}/24", NODES[0].underlay)),
            VethEnd::new("nb", "und0").addr(&format!("{}/24", NODES[1].underlay)),
        )?;
        for (n, peer) in [(&NODES[0], &NODES[1]), (&NODES[1], &NODES[0])] {
            let ns = topo.ns(n.role);
            let overlay = format!("{}/24", n.overlay);
            let dev = VxlanDevice {
                mac: n.mac,
                local: n.underlay,
                underlay: "und0",
                addr: &overlay,
                peer_addr: peer.overlay,
                peer_mac: peer.mac,
                peer_vtep: peer.underlay,
            };
            for cmd in dev.commands() {
                ns.run(&cmd)?;
            }
            ns.run(&[
                "ip",
                "route",
                "add",
                &format!("10.10.{}.0/24", peer.subnet),
                "via",
                peer.overlay,
                "dev",
                "vxlan0",
            ])?;
            ns.run(&["ip", "link", "set", "pod0", "mtu", "1450"])?;
        }
        for n in &NODES {
            topo.ns(n.pod)
                .run(&["ip", "link", "set", "eth0", "mtu", "1450"])?;
            topo.ns(n.pod).run(&[
                "ethtool", "-K", "eth0", "tx", "off", "rx", "off", "gro", "on",
            ])?;
        }
        Ok(())
    };
    build(&mut topo).unwrap_or_else(|e| panic!("building the overlay topology: {e}"));
    topo
}

/// A node's daemon: routing on the pod link, the underlay with XDP and TC egress, the vxlan
/// device's network.
fn config(n: &Node) -> DaemonConfig {
    let hooks = |name: &str, xdp: &'static str, tc_egress: bool| HookedInterface {
        name: name.into(),
        xdp,
        tc_ingress: false,
        tc_egress,
    };
    DaemonConfig::new(&unique_pin_dir(&format!("vxlan-{}", n.role)))
        .hooks(hooks("pod0", "auto", false))
        .interface_key("pod0", "route = true")
        .interface_key("pod0", "conntrack = false")
        .hooks(hooks("und0", "auto", true))
        .interface_key("und0", "conntrack = false")
        .hooks(hooks("vxlan0", "off", false))
        .interface_key(
            "vxlan0",
            &format!(
                "vxlan = {{ vni = 42, local = \"{}\", underlay = \"und0\" }}",
                n.underlay
            ),
        )
}

fn fast(d: &StatsSnapshot, code: u32) -> u64 {
    d.get(Hook::Xdp, Verdict::Forward, code).packets
}

#[test]
fn two_nodes_carry_their_pods_overlay_in_the_fast_path() {
    prepare_test(&["ethtool", "nginx", "curl", "ping", "bridge"]);
    let topo = topology();
    // The kernel's overlay alone.
    topo.ns("pa")
        .run(&["ping", "-c", "2", "-i", "0.2", "-W", "2", POD_B])
        .unwrap_or_else(|e| panic!("ping over the kernel's overlay: {e}"));
    let a = Daemon::start(bin(), topo.ns("na"), &config(&NODES[0]));
    let b = Daemon::start(bin(), topo.ns("nb"), &config(&NODES[1]));
    let mut nginx = topo
        .ns("pb")
        .http_server(80)
        .unwrap_or_else(|e| panic!("nginx: {e}"));
    let body = nginx.serve_blob("blob", 4 << 20);
    let _ = nginx.process();
    let (a0, b0) = (a.stats(), b.stats());
    for (from, to) in [("pa", POD_B), ("pb", POD_A)] {
        let out = topo
            .ns(from)
            .run(&["ping", "-c", "10", "-i", "0.1", "-W", "2", to])
            .unwrap_or_else(|e| panic!("ping {to} from {from}: {e}\n{}\n{}", a.log(), b.log()));
        assert!(out.contains("10 received"), "ping {to} from {from}:\n{out}");
    }
    topo.ns("pa")
        .download_exact(&format!("http://{POD_B}/blob"), &body);
    let (da, db) = (a.stats().delta(&a0), b.stats().delta(&b0));
    for (node, d) in [("a", &da), ("b", &db)] {
        // 20 pings each way and their replies: most of them, and the download's segments,
        // through the fast path (the first packets towards a next hop teach the headers).
        for code in [reason::VXLAN_ENCAP, reason::VXLAN_DECAP] {
            assert!(
                fast(d, code) >= 15,
                "node {node}: too few packets counted {}:\n{}",
                reason::name(code),
                d.render_table()
            );
        }
    }
    // The download's data segments come from b's pod: b encapsulates them, a decapsulates.
    assert!(
        fast(&db, reason::VXLAN_ENCAP) >= 1000 && fast(&da, reason::VXLAN_DECAP) >= 1000,
        "the download's segments through the fast path:\na:\n{}\nb:\n{}",
        da.render_table(),
        db.render_table()
    );
    eprintln!("a:\n{}\nb:\n{}", da.render_table(), db.render_table());
}
