//! End to end: two nodes on one link, each with an 802.1Q port of VLAN 100 made by its own
//! fast path (`vlan = 100` at TC ingress and egress; neither kernel has a VLAN device). The
//! plain link works; node a alone tags what it sends and accepts only tagged frames, so nothing gets through: b's
//! kernel drops a's tagged frames (no VLAN device for them) and a drops b's untagged ones
//! (`vlan_not_member`) — the link carries tags. With b's fast path too, pings and downloads
//! pass in both families, byte for byte, every frame through both programs.
//!
//! ```text
//!        a                                       b
//!  +-------------+   802.1Q VLAN 100 on the wire   +-------------+
//!  |    eth0     |---------------------------------|    eth0     |
//!  | .1 / ::1    |  10.212.0.0/24  fd00:212::/64   | .2 / ::2    |
//!  +-------------+                                 +-------------+
//!    vlan = 100                                      vlan = 100
//! ```
//!
//! Root only (never skipped). Debian packages: iproute2, nginx, curl, iputils-ping.

use fastpath::testkit::netns::{
    Daemon, DaemonConfig, HookedInterface, Topology, VethEnd, prepare_test, unique_pin_dir,
};
use fastpath_common::{Hook, Verdict, reason};

use crate::bin;

const A4: &str = "10.212.0.1";
const B4: &str = "10.212.0.2";
const B6: &str = "fd00:212::2";

fn topology() -> Topology {
    let mut topo = Topology::new();
    let build = |topo: &mut Topology| -> Result<(), fastpath::testkit::netns::NetnsError> {
        for role in ["a", "b"] {
            topo.add_ns(role)?;
        }
        topo.veth(
            VethEnd::new("a", "eth0")
                .addr(&format!("{A4}/24"))
                .addr("fd00:212::1/64"),
            VethEnd::new("b", "eth0")
                .addr(&format!("{B4}/24"))
                .addr(&format!("{B6}/64")),
        )?;
        Ok(())
    };
    build(&mut topo).unwrap_or_else(|e| panic!("building the VLAN topology: {e}"));
    topo
}

/// eth0 as an 802.1Q port of VLAN 100, at TC.
fn vlan_port(pin: &str) -> DaemonConfig {
    DaemonConfig::new(&unique_pin_dir(pin))
        .hooks(HookedInterface {
            name: "eth0".into(),
            xdp: "off",
            tc_ingress: true,
            tc_egress: true,
        })
        .interface_key("eth0", "vlan = 100")
        .interface_key("eth0", "conntrack = false")
}

#[test]
fn two_vlan_ports_talk_tagged_and_nothing_else_gets_through() {
    prepare_test(&["nginx", "curl", "ping"]);
    let topo = topology();
    // Untagged at both ends, the link works.
    topo.ns("a")
        .run(&["ping", "-c", "1", "-W", "2", B4])
        .unwrap_or_else(|e| panic!("ping over the plain link: {e}"));
    let a = Daemon::start(bin(), topo.ns("a"), &vlan_port("vlan-a"));

    // Only a tags: nothing passes, either way.
    for (from, to) in [("a", B4), ("b", A4)] {
        let out = topo
            .ns(from)
            .exec(&["ping", "-c", "3", "-i", "0.2", "-W", "1", to])
            .unwrap_or_else(|e| panic!("ping from {from}: {e}"));
        assert!(
            !out.status.success(),
            "ping from {from} to {to} passed with one end tagging:\n{}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    let alone = a.stats();
    assert!(
        alone
            .get(Hook::TcIngress, Verdict::Drop, reason::VLAN_NOT_MEMBER)
            .packets
            >= 1,
        "a must drop b's untagged frames as vlan_not_member:\n{}",
        alone.render_table()
    );

    let b = Daemon::start(bin(), topo.ns("b"), &vlan_port("vlan-b"));
    let mut nginx = topo
        .ns("b")
        .http_server(80)
        .unwrap_or_else(|e| panic!("nginx: {e}"));
    let body = nginx.serve_blob("blob", 4 << 20);
    let _ = nginx.process();
    let (a0, b0) = (a.stats(), b.stats());
    for to in [B4, B6] {
        let out = topo
            .ns("a")
            .run(&["ping", "-c", "5", "-i", "0.2", "-W", "2", to])
            .unwrap_or_else(|e| panic!("ping {to} over VLAN 100: {e}\n{}", b.log()));
        assert!(out.contains("5 received"), "ping {to}:\n{out}");
    }
    topo.ns("b")
        .run(&["ping", "-c", "3", "-i", "0.2", "-W", "2", A4])
        .unwrap_or_else(|e| panic!("ping from b over VLAN 100: {e}"));
    for url in [format!("http://{B4}/blob"), format!("http://[{B6}]/blob")] {
        topo.ns("a").download_exact(&url, &body);
    }
    // Every frame went through both ends' programs, none refused.
    let (da, db) = (a.stats().delta(&a0), b.stats().delta(&b0));
    for (node, d) in [("a", &da), ("b", &db)] {
        // The pings alone are 13 frames each way (segmentation offload makes the downloads'
        // count a matter of the kernel's batching).
        for hook in [Hook::TcIngress, Hook::TcEgress] {
            assert!(
                d.packets_on_hook(hook) >= 13,
                "{node}: too few packets at {}:\n{}",
                hook.name(),
                d.render_table()
            );
        }
        for code in [reason::VLAN_NOT_MEMBER, reason::VLAN_FAILED] {
            assert_eq!(
                d.packets_for_reason(code),
                0,
                "{node}: frames dropped as {} once both ends tag:\n{}",
                reason::name(code),
                d.render_table()
            );
        }
    }
    eprintln!("a:\n{}\nb:\n{}", da.render_table(), db.render_table());
}
