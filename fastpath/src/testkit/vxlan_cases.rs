//! The VXLAN fixtures: packets of the kernel's own vxlan devices, captured in a namespace
//! topology ([`Overlay`]) and kept in `tests/fixtures/vxlan/`, and the settings the datapath
//! needs to do what the kernel did with them.
//!
//! The topology: this thread's namespace is the node — `n0` towards a pod namespace (`p0`,
//! 10.1.0.2), `und0` towards a remote VTEP namespace (`und1`, 192.168.50.2), and `vxlan0`
//! (VNI 42, local 192.168.50.1, 10.2.0.1/24, `noudpcsum`: the fast path sends no outer UDP
//! checksum, as RFC 7348 recommends over IPv4). The remote has its own `vxlan0` (10.2.0.2)
//! with the node's in its FDB, and routes the pods' 10.1.0.0/24 through it. Every MAC
//! address, neighbour and FDB entry is static: no ARP or learning in the captures. Over an
//! IPv6 underlay ([`Underlay::V6`]) the VTEPs are fd00:50::1 and fd00:50::2 and the devices
//! send and accept zero UDP checksums (`udp6zerocsumtx udp6zerocsumrx`, as the fast path
//! sends); the pods and the overlay stay IPv4. Its frames are kept in
//! `tests/fixtures/vxlan6/`.
//!
//! Four frames, each what a link carried:
//! - `decap_in`: a UDP datagram the remote sent to the pod, as its vxlan device encapsulated
//!   it, arriving on the node's underlay;
//! - `decap_out`: the same datagram as the node's kernel decapsulated and routed it, arriving
//!   in the pod;
//! - `encap_in`: a UDP datagram from the pod to the remote, arriving on the node's `n0`;
//! - `encap_out`: the same as the node's kernel routed it into `vxlan0` and encapsulated it,
//!   arriving at the remote.

use std::{path::PathBuf, time::Duration};

use fastpath_common::{
    Hook,
    ct::{IFACE_F_ROUTE, IFACE_F_ROUTE_TC, IFACE_F_VXLAN, IFACE_F_VXLAN_UNDERLAY, IfaceConfig},
    vxlan::VxlanNet,
};

use super::{
    capture::{Direction, PacketSocket},
    fixture::Seed,
    netns::{DaemonConfig, HookedInterface, Netns, NetnsError, Topology, VethEnd, unique_pin_dir},
    packet::{Ipv4, Pkt},
};

pub const N0_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0b, 0];
pub const P0_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0b, 1];
pub const UND0_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0c, 0];
pub const UND1_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0c, 1];
pub const VXLAN0_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0d, 0];
pub const REMOTE_VXLAN_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0d, 1];
pub const POD: [u8; 4] = [10, 1, 0, 2];
pub const REMOTE: [u8; 4] = [10, 2, 0, 2];
pub const LOCAL_VTEP: [u8; 4] = [192, 168, 50, 1];
pub const REMOTE_VTEP: [u8; 4] = [192, 168, 50, 2];
/// The VTEPs over an IPv6 underlay: fd00:50::1 and fd00:50::2.
pub const LOCAL_VTEP6: [u8; 16] = [0xfd, 0, 0, 0x50, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
pub const REMOTE_VTEP6: [u8; 16] = [0xfd, 0, 0, 0x50, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];
pub const VNI: u32 = 42;
pub const VXLAN_PORT: u16 = 4789;
const PAYLOAD: &[u8] = b"fastpath vxlan fixture";

/// The four captured frames (see the module's documentation).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Captures {
    pub decap_in: Vec<u8>,
    pub decap_out: Vec<u8>,
    pub encap_in: Vec<u8>,
    pub encap_out: Vec<u8>,
}

/// The names of the fixture files, in `Captures` order.
pub const FIXTURE_NAMES: [&str; 4] = ["decap_in", "decap_out", "encap_in", "encap_out"];

/// The pod and remote namespaces; the node is the thread's namespace that built them.
pub struct Overlay {
    pub pod: Netns,
    pub remote: Netns,
    pub underlay: Underlay,
}

fn mac(m: [u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// A kernel vxlan device `vxlan0` as the tests make it (VNI 42, port 4789, no learning, no
/// outer UDP checksum) with one peer: a permanent neighbour on the overlay and its FDB entry.
pub struct VxlanDevice<'a> {
    pub mac: &'a str,
    /// This VTEP's address, on `underlay`.
    pub local: &'a str,
    pub underlay: &'a str,
    /// The device's overlay address (CIDR).
    pub addr: &'a str,
    pub peer_addr: &'a str,
    pub peer_mac: &'a str,
    pub peer_vtep: &'a str,
}

impl VxlanDevice<'_> {
    /// The commands that make it, to run in its node's namespace.
    pub fn commands(&self) -> Vec<Vec<String>> {
        let words = |s: &str| s.split_whitespace().map(String::from).collect::<Vec<_>>();
        vec![
            // The fast path sends no outer UDP checksum: the device must not want one.
            words(&format!(
                "ip link add vxlan0 address {} type vxlan id 42 local {} dstport 4789 dev {} nolearning {}",
                self.mac,
                self.local,
                self.underlay,
                if self.local.contains(':') {
                    "udp6zerocsumtx udp6zerocsumrx"
                } else {
                    "noudpcsum"
                }
            )),
            words(&format!("ip addr add {} dev vxlan0", self.addr)),
            words("ip link set vxlan0 up"),
            words(&format!(
                "ip neigh add {} lladdr {} dev vxlan0 nud permanent",
                self.peer_addr, self.peer_mac
            )),
            words(&format!(
                "bridge fdb append {} dev vxlan0 dst {}",
                self.peer_mac, self.peer_vtep
            )),
        ]
    }
}

/// One node of the two-node overlay ([`two_node_overlay`]).
pub struct OverlayNode {
    /// The node's namespace role.
    pub role: &'static str,
    /// Its pod's namespace role.
    pub pod: &'static str,
    /// The pod subnet's third byte: 10.10.`subnet`.0/24, the pod at .2, the node at .1.
    pub subnet: u8,
    /// Its VTEP address, on `und0` (an IPv4 underlay).
    pub underlay: &'static str,
    /// Its VTEP address over an IPv6 underlay.
    pub underlay6: &'static str,
    /// Its `vxlan0` address.
    pub overlay: &'static str,
    /// Its `vxlan0` IPv6 address (the overlay is dual-stack).
    pub overlay6: &'static str,
    /// Its `vxlan0` MAC address.
    pub mac: &'static str,
}

impl OverlayNode {
    /// The pod's address.
    pub fn pod_addr(&self) -> String {
        format!("10.10.{}.2", self.subnet)
    }

    /// The pod's IPv6 address: fd00:10:`subnet`::2/64, the node at ::1.
    pub fn pod_addr6(&self) -> String {
        format!("fd00:10:{}::2", self.subnet)
    }

    /// Its VTEP address over `underlay`.
    pub fn vtep(&self, underlay: Underlay) -> &'static str {
        match underlay {
            Underlay::V4 => self.underlay,
            Underlay::V6 => self.underlay6,
        }
    }
}

/// The IP version of an overlay's underlay: [`two_node_overlay`]'s, and the fixtures'
/// [`Overlay`]'s (whose frames [`Underlay::outer`] and [`Underlay::of`] read).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Underlay {
    /// 192.168.60.0/24 (the fixtures': 192.168.50.0/24).
    V4,
    /// fd00:60::/64 (the fixtures': fd00:50::/64).
    V6,
}

impl Underlay {
    /// The overlay's MTU: 1500 less the outer headers (50 bytes over IPv4, 70 over IPv6).
    pub fn mtu(self) -> u32 {
        match self {
            Underlay::V4 => 1450,
            Underlay::V6 => 1430,
        }
    }
}

/// The two nodes of [`two_node_overlay`].
pub const OVERLAY_NODES: [OverlayNode; 2] = [
    OverlayNode {
        role: "na",
        pod: "pa",
        subnet: 1,
        underlay: "192.168.60.1",
        underlay6: "fd00:60::1",
        overlay: "10.10.255.1",
        overlay6: "fd00:10:ff::1",
        mac: "02:00:00:00:7a:01",
    },
    OverlayNode {
        role: "nb",
        pod: "pb",
        subnet: 2,
        underlay: "192.168.60.2",
        underlay6: "fd00:60::2",
        overlay: "10.10.255.2",
        overlay6: "fd00:10:ff::2",
        mac: "02:00:00:00:7a:02",
    },
];

/// Two nodes joined by an underlay link carry a kernel VXLAN overlay (VNI 42), a pod
/// namespace behind each; each node routes the other's pod subnet through its `vxlan0`.
///
/// ```text
///  pod a          node a                               node b               pod b
/// +------+      +-----------------------+           +-----------------------+      +------+
/// | eth0 |------| pod0   vxlan0    und0 |-----------| und0    vxlan0   pod0 |------| eth0 |
/// | .1.2 |      | .1.1  10.10.255.1  .1 | 192.168.  | .2  10.10.255.2  .2.1 |      | .2.2 |
/// +------+      +-----------------------+  60.0/24  +-----------------------+      +------+
///  10.10.1.0/24                                                          10.10.2.0/24
/// ```
///
/// The overlay is dual-stack: IPv6 pod subnets fd00:10:1::/64 and fd00:10:2::/64 and
/// `vxlan0` addresses fd00:10:ff::1 and ::2. The underlay is `underlay`'s: as drawn, or
/// fd00:60::1 and ::2 (the devices then send zero IPv6 UDP checksums, as the fast path does).
/// The pods turn checksum offloads off (XDP sees full checksums, as from a wire) and GRO on
/// (a veth takes XDP redirects only when its peer runs NAPI). The pod links' MTU is the
/// overlay's ([`Underlay::mtu`]).
pub fn two_node_overlay(underlay: Underlay) -> Result<Topology, NetnsError> {
    let mut topo = Topology::new();
    for n in &OVERLAY_NODES {
        topo.add_ns(n.pod)?;
        topo.add_ns(n.role)?;
        topo.ns(n.role).sysctl("net.ipv4.ip_forward", "1")?;
        topo.ns(n.role)
            .sysctl("net.ipv6.conf.all.forwarding", "1")?;
        topo.veth(
            VethEnd::new(n.pod, "eth0")
                .addr(&format!("{}/24", n.pod_addr()))
                .addr(&format!("{}/64", n.pod_addr6())),
            VethEnd::new(n.role, "pod0")
                .addr(&format!("10.10.{}.1/24", n.subnet))
                .addr(&format!("fd00:10:{}::1/64", n.subnet)),
        )?;
        topo.ns(n.pod)
            .add_route("default", &format!("10.10.{}.1", n.subnet))?;
        topo.ns(n.pod)
            .add_route("default", &format!("fd00:10:{}::1", n.subnet))?;
    }
    let [a, b] = &OVERLAY_NODES;
    let prefix = if underlay == Underlay::V4 { 24 } else { 64 };
    topo.veth(
        VethEnd::new(a.role, "und0").addr(&format!("{}/{prefix}", a.vtep(underlay))),
        VethEnd::new(b.role, "und0").addr(&format!("{}/{prefix}", b.vtep(underlay))),
    )?;
    let mtu = underlay.mtu().to_string();
    for (n, peer) in [(a, b), (b, a)] {
        let ns = topo.ns(n.role);
        let overlay = format!("{}/24", n.overlay);
        let dev = VxlanDevice {
            mac: n.mac,
            local: n.vtep(underlay),
            underlay: "und0",
            addr: &overlay,
            peer_addr: peer.overlay,
            peer_mac: peer.mac,
            peer_vtep: peer.vtep(underlay),
        };
        for cmd in dev.commands() {
            ns.run(&cmd)?;
        }
        let overlay6 = format!("{}/64", n.overlay6);
        ns.run(&["ip", "addr", "add", &overlay6, "dev", "vxlan0", "nodad"])?;
        ns.run(&[
            "ip",
            "neigh",
            "add",
            peer.overlay6,
            "lladdr",
            peer.mac,
            "dev",
            "vxlan0",
            "nud",
            "permanent",
        ])?;
        for (subnet, via) in [
            (format!("10.10.{}.0/24", peer.subnet), peer.overlay),
            (format!("fd00:10:{}::/64", peer.subnet), peer.overlay6),
        ] {
            ns.run(&["ip", "route", "add", &subnet, "via", via, "dev", "vxlan0"])?;
        }
        ns.run(&["ip", "link", "set", "pod0", "mtu", &mtu])?;
    }
    for n in &OVERLAY_NODES {
        let pod = topo.ns(n.pod);
        pod.run(&["ip", "link", "set", "eth0", "mtu", &mtu])?;
        pod.run(&[
            "ethtool", "-K", "eth0", "tx", "off", "rx", "off", "gro", "on",
        ])?;
    }
    Ok(topo)
}

/// Flannel's netfilter rules, as its VXLAN backend installs them on a node, on both nodes of
/// [`two_node_overlay`] (the cluster network 10.10.0.0/16 and fd00:10::/32, each node's pod
/// subnet its own): the FORWARD chain accepts the cluster's traffic (`FLANNEL-FWD`) and
/// POSTROUTING masquerades pods' traffic leaving the cluster (`FLANNEL-POSTRTG`). With a NAT
/// rule loaded, each node's kernel tracks every packet it forwards, sends or receives
/// (netfilter connection tracking), as on the nodes of the Kubernetes clusters ONCache was
/// measured on.
pub fn add_flannel_rules(topo: &Topology) -> Result<(), NetnsError> {
    for n in &OVERLAY_NODES {
        for (tool, cluster, own, multicast) in [
            (
                "iptables",
                "10.10.0.0/16".to_string(),
                format!("10.10.{}.0/24", n.subnet),
                "224.0.0.0/4",
            ),
            (
                "ip6tables",
                "fd00:10::/32".to_string(),
                format!("fd00:10:{}::/64", n.subnet),
                "ff00::/8",
            ),
        ] {
            let rules = [
                "-N FLANNEL-FWD".to_string(),
                "-A FORWARD -j FLANNEL-FWD".into(),
                format!("-A FLANNEL-FWD -s {cluster} -j ACCEPT"),
                format!("-A FLANNEL-FWD -d {cluster} -j ACCEPT"),
                "-t nat -N FLANNEL-POSTRTG".into(),
                "-t nat -A POSTROUTING -j FLANNEL-POSTRTG".into(),
                "-t nat -A FLANNEL-POSTRTG -m mark --mark 0x4000/0x4000 -j RETURN".into(),
                format!("-t nat -A FLANNEL-POSTRTG -s {own} -d {cluster} -j RETURN"),
                format!("-t nat -A FLANNEL-POSTRTG -s {cluster} -d {own} -j RETURN"),
                format!("-t nat -A FLANNEL-POSTRTG ! -s {cluster} -d {own} -j RETURN"),
                format!(
                    "-t nat -A FLANNEL-POSTRTG -s {cluster} ! -d {multicast} -j MASQUERADE --random-fully"
                ),
                format!(
                    "-t nat -A FLANNEL-POSTRTG ! -s {cluster} -d {cluster} -j MASQUERADE --random-fully"
                ),
            ];
            for rule in rules {
                // -w: wait for the xtables lock (iptables-legacy's is the host's).
                let mut cmd = vec![tool.to_string(), "-w".into()];
                cmd.extend(rule.split_whitespace().map(String::from));
                topo.ns(n.role).run(&cmd)?;
            }
        }
    }
    Ok(())
}

/// A node's fastpath daemon in [`two_node_overlay`]: routing on the pod link, the underlay
/// with TC egress (where it learns the kernel's outer headers), the vxlan device's network;
/// no connection tracking. The pod link routes and the underlay decapsulates at `hook`: XDP,
/// or TC ingress (XDP off).
pub fn overlay_daemon_config(n: &OverlayNode, hook: Hook, underlay: Underlay) -> DaemonConfig {
    overlay_config(n, hook, underlay, None)
}

/// [`overlay_daemon_config`] at XDP with routing + NAT over the overlay: the `[[service]]`
/// tables `services` (TOML), connection tracking at the vxlan device's XDP hook (generic
/// mode: NAT and load balancing of the inner packets the kernel decapsulates) and at the pod
/// link's (replies from the pod translated back, then routed and encapsulated there).
pub fn overlay_nat_daemon_config(
    n: &OverlayNode,
    underlay: Underlay,
    services: &str,
) -> DaemonConfig {
    overlay_config(n, Hook::Xdp, underlay, Some(services))
}

fn overlay_config(
    n: &OverlayNode,
    hook: Hook,
    underlay: Underlay,
    services: Option<&str>,
) -> DaemonConfig {
    let xdp = hook == Hook::Xdp;
    let hooks = |name: &str, tc_egress: bool| HookedInterface {
        name: name.into(),
        xdp: if xdp { "auto" } else { "off" },
        tc_ingress: !xdp,
        tc_egress,
    };
    let mut config = DaemonConfig::new(&unique_pin_dir(&format!("vxlan-{}", n.role)))
        .hooks(hooks("pod0", false))
        .interface_key("pod0", "route = true")
        .hooks(hooks("und0", true))
        .interface_key("und0", "conntrack = false")
        .hooks(HookedInterface {
            name: "vxlan0".into(),
            xdp: if services.is_some() { "generic" } else { "off" },
            tc_ingress: false,
            tc_egress: false,
        })
        .interface_key(
            "vxlan0",
            &format!(
                "vxlan = {{ vni = 42, local = \"{}\", underlay = \"und0\" }}",
                n.vtep(underlay)
            ),
        );
    match services {
        Some(toml) => config = config.services(toml),
        None => config = config.interface_key("pod0", "conntrack = false"),
    }
    config
}

/// The node's interfaces as the daemon configures them, routing at `hook` (XDP, or TC
/// ingress with XDP off), in the node namespace [`Overlay::build`] put this thread in.
/// Panics if an interface is missing.
pub fn node_seed(hook: Hook, overlay: &Overlay) -> Seed {
    let ifindex = |name: &str| {
        crate::sys::ifindex(name).unwrap_or_else(|| panic!("no interface {name} in the node"))
    };
    let route = if hook == Hook::Xdp {
        IFACE_F_ROUTE
    } else {
        IFACE_F_ROUTE_TC
    };
    let mut seed = Seed::default()
        .with_iface_config(
            ifindex("n0"),
            IfaceConfig {
                flags: route,
                mac: N0_MAC,
                ..IfaceConfig::default()
            },
        )
        .with_iface(ifindex("und0"), IFACE_F_VXLAN_UNDERLAY)
        .with_iface_config(
            ifindex("vxlan0"),
            IfaceConfig {
                flags: IFACE_F_VXLAN | IFACE_F_ROUTE | IFACE_F_ROUTE_TC,
                mac: VXLAN0_MAC,
                ..IfaceConfig::default()
            },
        );
    seed.vxlan_nets = vec![(VNI, overlay.net())];
    seed.config.flags |= fastpath_common::stats::CONFIG_F_VXLAN;
    seed
}

impl Overlay {
    /// Moves this thread to a fresh namespace, the node, and builds the topology around it,
    /// the VTEPs on `underlay`. Panics on any failure. Needs root.
    pub fn build(underlay: Underlay) -> Overlay {
        let pod = Netns::create("vx-pod").unwrap_or_else(|e| panic!("{e}"));
        let remote = Netns::create("vx-remote").unwrap_or_else(|e| panic!("{e}"));
        super::enter_fresh_netns(&[]);
        let (n0, p0, und0, und1) = (mac(N0_MAC), mac(P0_MAC), mac(UND0_MAC), mac(UND1_MAC));
        let (vx0, vx1) = (mac(VXLAN0_MAC), mac(REMOTE_VXLAN_MAC));
        // The VTEPs' addresses, their prefix length and the `ip` family flag of their
        // neighbours.
        let (local, remote_vtep, prefix, family) = match underlay {
            Underlay::V4 => (
                std::net::Ipv4Addr::from(LOCAL_VTEP).to_string(),
                std::net::Ipv4Addr::from(REMOTE_VTEP).to_string(),
                24,
                "-4",
            ),
            Underlay::V6 => (
                std::net::Ipv6Addr::from(LOCAL_VTEP6).to_string(),
                std::net::Ipv6Addr::from(REMOTE_VTEP6).to_string(),
                64,
                "-6",
            ),
        };
        let (local_cidr, remote_cidr) = (
            format!("{local}/{prefix}"),
            format!("{remote_vtep}/{prefix}"),
        );
        let (local, remote_vtep) = (local.as_str(), remote_vtep.as_str());
        // An IPv6 VTEP address is usable at once (no duplicate address detection).
        let nodad: &[&str] = if underlay == Underlay::V6 {
            &["nodad"]
        } else {
            &[]
        };
        let node = [
            vec!["ip", "link", "set", "lo", "up"],
            vec!["sysctl", "-qw", "net.ipv4.ip_forward=1"],
            vec![
                "ip",
                "link",
                "add",
                "n0",
                "address",
                &n0,
                "type",
                "veth",
                "peer",
                "name",
                "p0",
                "address",
                &p0,
                "netns",
                pod.name(),
            ],
            vec![
                "ip",
                "link",
                "add",
                "und0",
                "address",
                &und0,
                "type",
                "veth",
                "peer",
                "name",
                "und1",
                "address",
                &und1,
                "netns",
                remote.name(),
            ],
            vec!["ip", "addr", "add", "10.1.0.1/24", "dev", "n0"],
            [
                &["ip", "addr", "add", &local_cidr, "dev", "und0"][..],
                nodad,
            ]
            .concat(),
            vec!["ip", "link", "set", "n0", "up"],
            vec!["ip", "link", "set", "und0", "up"],
            vec![
                "ip",
                family,
                "neigh",
                "add",
                remote_vtep,
                "lladdr",
                &und1,
                "dev",
                "und0",
                "nud",
                "permanent",
            ],
            vec![
                "ip",
                "neigh",
                "add",
                "10.1.0.2",
                "lladdr",
                &p0,
                "dev",
                "n0",
                "nud",
                "permanent",
            ],
        ];
        super::run_commands(&node.iter().map(Vec::as_slice).collect::<Vec<_>>());
        let node_vxlan = VxlanDevice {
            mac: &vx0,
            local,
            underlay: "und0",
            addr: "10.2.0.1/24",
            peer_addr: "10.2.0.2",
            peer_mac: &vx1,
            peer_vtep: remote_vtep,
        };
        for cmd in node_vxlan.commands() {
            super::run_commands(&[&cmd.iter().map(String::as_str).collect::<Vec<_>>()]);
        }
        for cmd in [
            vec!["addr", "add", "10.1.0.2/24", "dev", "p0"],
            vec!["link", "set", "p0", "up"],
            vec!["route", "add", "default", "via", "10.1.0.1"],
            vec![
                "neigh",
                "add",
                "10.1.0.1",
                "lladdr",
                &n0,
                "dev",
                "p0",
                "nud",
                "permanent",
            ],
        ] {
            pod.ip(&cmd).unwrap_or_else(|e| panic!("{e}"));
        }
        for cmd in [
            [&["addr", "add", &remote_cidr, "dev", "und1"][..], nodad].concat(),
            vec!["link", "set", "und1", "up"],
            vec![
                family,
                "neigh",
                "add",
                local,
                "lladdr",
                &und0,
                "dev",
                "und1",
                "nud",
                "permanent",
            ],
        ] {
            remote.ip(&cmd).unwrap_or_else(|e| panic!("{e}"));
        }
        let remote_vxlan = VxlanDevice {
            mac: &vx1,
            local: remote_vtep,
            underlay: "und1",
            addr: "10.2.0.2/24",
            peer_addr: "10.2.0.1",
            peer_mac: &vx0,
            peer_vtep: local,
        };
        for cmd in remote_vxlan.commands() {
            remote.run(&cmd).unwrap_or_else(|e| panic!("{e}"));
        }
        remote
            .ip(&[
                "route",
                "add",
                "10.1.0.0/24",
                "via",
                "10.2.0.1",
                "dev",
                "vxlan0",
            ])
            .unwrap_or_else(|e| panic!("{e}"));
        Overlay {
            pod,
            remote,
            underlay,
        }
    }

    /// The node's VXLAN network as the daemon would configure it (ifindexes of this thread's
    /// namespace).
    pub fn net(&self) -> VxlanNet {
        let idx = |n: &str| crate::sys::ifindex(n).unwrap_or_else(|| panic!("no {n}"));
        let (local, family) = match self.underlay {
            Underlay::V4 => {
                let mut local = [0; 16];
                local[..4].copy_from_slice(&LOCAL_VTEP);
                (local, 4)
            }
            Underlay::V6 => (LOCAL_VTEP6, 6),
        };
        VxlanNet {
            ifindex: idx("vxlan0"),
            underlay: idx("und0"),
            port: VXLAN_PORT,
            port_min: 32768,
            port_max: 60999,
            family,
            _pad: 0,
            local,
        }
    }

    /// Sends the two datagrams through the kernel's path and captures the four frames.
    pub fn capture(&self) -> Captures {
        let wait = Duration::from_secs(3);
        let und0 = PacketSocket::open("und0").unwrap_or_else(|e| panic!("und0: {e}"));
        let n0 = PacketSocket::open("n0").unwrap_or_else(|e| panic!("n0: {e}"));
        let p0 = self
            .pod
            .in_netns(|| PacketSocket::open("p0"))
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|e| panic!("p0: {e}"));
        let und1 = self
            .remote
            .in_netns(|| PacketSocket::open("und1"))
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|e| panic!("und1: {e}"));
        // Remote → pod: sent by the remote's IP stack (raw, header included), so its vxlan
        // device encapsulates it.
        let to_pod = udp(REMOTE, POD, 40000, 7, 0x1111).build();
        self.remote
            .in_netns(|| send_ipv4(&to_pod[14..], POD))
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|e| panic!("sending to the pod: {e}"));
        let decap_in = und0
            .capture(Direction::Arriving, wait, |f| vxlan_of(f, POD))
            .expect("the remote's VXLAN datagram on the node's underlay");
        let decap_out = p0
            .capture(Direction::Arriving, wait, |f| inner_udp_to(f, POD))
            .expect("the decapsulated datagram in the pod");
        // Pod → remote: a frame as the pod's stack would send it, injected on p0.
        let from_pod = udp(POD, REMOTE, 7, 40000, 0x2222)
            .macs(N0_MAC, P0_MAC)
            .build();
        p0.send(&from_pod)
            .unwrap_or_else(|e| panic!("sending from the pod: {e}"));
        let encap_in = n0
            .capture(Direction::Arriving, wait, |f| inner_udp_to(f, REMOTE))
            .expect("the pod's datagram on the node's n0");
        let encap_out = und1
            .capture(Direction::Arriving, wait, |f| vxlan_of(f, REMOTE))
            .expect("the node's VXLAN datagram at the remote");
        Captures {
            decap_in,
            decap_out,
            encap_in,
            encap_out,
        }
    }
}

/// An Ethernet/IPv4/UDP frame with the fixtures' payload (DF set).
fn udp(src: [u8; 4], dst: [u8; 4], sport: u16, dport: u16, id: u16) -> Pkt {
    let mut h = Ipv4::new(src, dst);
    h.id = id;
    h.flags_frag = 0x4000;
    Pkt::eth().ipv4_with(h).udp(sport, dport).payload(PAYLOAD)
}

/// Sends an IPv4 packet (header included) from this thread's namespace.
fn send_ipv4(packet: &[u8], dst: [u8; 4]) -> std::io::Result<()> {
    use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
    // SAFETY: a plain socket(2) call; the fd is owned right below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_in is plain old data; all zeroes is valid.
    let mut sin: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    sin.sin_family = libc::AF_INET as u16;
    sin.sin_addr.s_addr = u32::from_ne_bytes(dst);
    // SAFETY: the buffer and the address are valid for the lengths given.
    let n = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            packet.as_ptr().cast(),
            packet.len(),
            0,
            (&raw const sin).cast::<libc::sockaddr>(),
            size_of::<libc::sockaddr_in>() as u32,
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Whether `f` is IPv4/UDP to `dst` (an inner frame).
fn inner_udp_to(f: &[u8], dst: [u8; 4]) -> bool {
    f.len() >= 42 && f[12..14] == [0x08, 0x00] && f[23] == 17 && f[30..34] == dst
}

/// The outer headers' layout of a VXLAN frame over `underlay`: where the outer UDP header
/// and the inner frame start.
#[derive(Clone, Copy, Debug)]
pub struct Outer {
    pub udp: usize,
    pub inner: usize,
}

impl Underlay {
    /// Where the outer UDP header and the inner frame of a VXLAN frame start.
    pub fn outer(self) -> Outer {
        let udp = match self {
            Underlay::V4 => 14 + 20,
            Underlay::V6 => 14 + 40,
        };
        Outer {
            udp,
            inner: udp + 8 + 8,
        }
    }

    /// The outer frame's EtherType.
    fn ethertype(self) -> [u8; 2] {
        match self {
            Underlay::V4 => [0x08, 0x00],
            Underlay::V6 => [0x86, 0xdd],
        }
    }

    /// The underlay of a VXLAN frame, by its outer EtherType.
    pub fn of(f: &[u8]) -> Option<Underlay> {
        [Underlay::V4, Underlay::V6]
            .into_iter()
            .find(|u| f.get(12..14) == Some(&u.ethertype()[..]))
    }
}

/// Whether `f` is VXLAN (port 4789, over either underlay) carrying UDP to `inner_dst`.
fn vxlan_of(f: &[u8], inner_dst: [u8; 4]) -> bool {
    let Some(u) = Underlay::of(f) else {
        return false;
    };
    let o = u.outer();
    let next_header = if u == Underlay::V4 { 23 } else { 20 };
    f.len() >= o.inner + 42
        && f[next_header] == 17
        && f[o.udp + 2..o.udp + 4] == VXLAN_PORT.to_be_bytes()
        && inner_udp_to(&f[o.inner..], inner_dst)
}

/// An outer frame with the fields the kernel varies per packet zeroed: the UDP source port
/// (from the flow hash, whose seed is random per boot) and, over IPv4, the identification
/// and header checksum. (Over IPv6 the flow label is the device's, 0 unless configured, and
/// the UDP checksum zero.)
pub fn outer_masked(f: &[u8]) -> Vec<u8> {
    let mut m = f.to_vec();
    let u = Underlay::of(f).unwrap_or(Underlay::V4);
    let sport = u.outer().udp;
    let masked: &[usize] = match u {
        Underlay::V4 => &[18, 19, 24, 25, sport, sport + 1],
        Underlay::V6 => &[sport, sport + 1],
    };
    for &i in masked {
        if let Some(b) = m.get_mut(i) {
            *b = 0;
        }
    }
    m
}

/// Where the fixture files of `underlay` live.
pub fn fixture_dir(underlay: Underlay) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(match underlay {
        Underlay::V4 => "tests/fixtures/vxlan",
        Underlay::V6 => "tests/fixtures/vxlan6",
    })
}

/// A frame as the fixture files hold it: hex, 16 bytes per line.
pub fn to_hex(f: &[u8]) -> String {
    f.chunks(16)
        .map(|c| {
            c.iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(" ")
                + "\n"
        })
        .collect()
}

/// A frame from its fixture file's text.
pub fn from_hex(text: &str) -> Result<Vec<u8>, String> {
    text.split_whitespace()
        .map(|b| u8::from_str_radix(b, 16).map_err(|e| format!("{b:?}: {e}")))
        .collect()
}

impl Captures {
    /// The frames kept in the fixture files of `underlay`.
    pub fn load(underlay: Underlay) -> Result<Captures, String> {
        let mut f = FIXTURE_NAMES.iter().map(|name| {
            let path = fixture_dir(underlay).join(format!("{name}.hex"));
            std::fs::read_to_string(&path)
                .map_err(|e| format!("{}: {e}", path.display()))
                .and_then(|t| from_hex(&t).map_err(|e| format!("{}: {e}", path.display())))
        });
        let mut next = || f.next().unwrap_or_else(|| Err("missing".into()));
        Ok(Captures {
            decap_in: next()?,
            decap_out: next()?,
            encap_in: next()?,
            encap_out: next()?,
        })
    }

    /// Writes the fixture files of `underlay`.
    pub fn save(&self, underlay: Underlay) -> std::io::Result<()> {
        let dir = fixture_dir(underlay);
        std::fs::create_dir_all(&dir)?;
        for (name, f) in FIXTURE_NAMES.iter().zip(self.frames()) {
            std::fs::write(dir.join(format!("{name}.hex")), to_hex(f))?;
        }
        Ok(())
    }

    pub fn frames(&self) -> [&[u8]; 4] {
        [
            &self.decap_in,
            &self.decap_out,
            &self.encap_in,
            &self.encap_out,
        ]
    }
}
