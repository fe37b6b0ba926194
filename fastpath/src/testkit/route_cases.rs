//! The L3 stage's fixtures: IPv4 and IPv6 routed through the real entry points against the
//! kernel FIB of a network namespace [`ROUTE_NETNS_SETUP`] prepares (the test runs it in a
//! namespace of its own). A routed frame leaves with the next hop's and the egress
//! interface's MAC addresses and the TTL / hop limit one lower — the expected frame is built
//! from scratch, so the IPv4 checksum's incremental update is checked byte for byte —, and
//! everything the fast path does not route reaches the kernel unchanged, with its reason.

use fastpath_common::{
    Hook, Verdict,
    ct::{IFACE_F_ROUTE, IFACE_F_ROUTE_TC, IfaceConfig},
    reason,
};

use super::{
    cases::case,
    fixture::{Case, Seed},
    packet::{Ipv6Ext, Pkt, ethertype, tcp_flags as tcp},
};

/// The MAC addresses of the namespace's interfaces `r0`, `r1`, `r2` (see the setup).
pub const R0_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0a, 0];
pub const R1_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0a, 1];
/// The resolved next hops: 10.2.0.1 and fd02::1 on `r1`.
pub const HOP4_MAC: [u8; 6] = [0x02, 0, 0, 0, 2, 1];
pub const HOP6_MAC: [u8; 6] = [0x02, 0, 0, 0, 2, 6];
/// The sender on `r0`'s link.
const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 1, 0x99];
const CLIENT4: [u8; 4] = [10, 1, 0, 1];
const CLIENT6: [u8; 16] = [0xfd, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
/// The MTU of `r1`, the egress interface of the routed cases.
pub const R1_MTU: usize = 1400;

/// Commands (`ip ...`, `sysctl ...`) that give a fresh network namespace the interfaces,
/// routes and neighbours the cases expect: `r0` (where packets arrive), `r1` (MTU 1400, the
/// next hops 10.2.0.1 and fd02::1 resolved, 10.2.0.3 routed to but not resolved) and `r2`
/// (a link without `route = true`), each a veth with its peer up.
pub const ROUTE_NETNS_SETUP: &[&[&str]] = &[
    &["ip", "link", "set", "lo", "up"],
    &["sysctl", "-qw", "net.ipv4.ip_forward=1"],
    &["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"],
    &[
        "ip",
        "link",
        "add",
        "r0",
        "address",
        "02:00:00:00:0a:00",
        "type",
        "veth",
        "peer",
        "name",
        "r0p",
    ],
    &[
        "ip",
        "link",
        "add",
        "r1",
        "address",
        "02:00:00:00:0a:01",
        "type",
        "veth",
        "peer",
        "name",
        "r1p",
    ],
    &[
        "ip",
        "link",
        "add",
        "r2",
        "address",
        "02:00:00:00:0a:02",
        "type",
        "veth",
        "peer",
        "name",
        "r2p",
    ],
    &["ip", "link", "set", "r1", "mtu", "1400"],
    &["ip", "link", "set", "r0p", "up"],
    &["ip", "link", "set", "r1p", "up"],
    &["ip", "link", "set", "r2p", "up"],
    &["ip", "link", "set", "r0", "up"],
    &["ip", "link", "set", "r1", "up"],
    &["ip", "link", "set", "r2", "up"],
    &["ip", "addr", "add", "10.1.0.254/24", "dev", "r0"],
    &["ip", "addr", "add", "10.2.0.254/24", "dev", "r1"],
    &["ip", "addr", "add", "10.4.0.254/24", "dev", "r2"],
    &[
        "ip",
        "-6",
        "addr",
        "add",
        "fd01::fe/64",
        "dev",
        "r0",
        "nodad",
    ],
    &[
        "ip",
        "-6",
        "addr",
        "add",
        "fd02::fe/64",
        "dev",
        "r1",
        "nodad",
    ],
    &[
        "ip",
        "neigh",
        "add",
        "10.2.0.1",
        "lladdr",
        "02:00:00:00:02:01",
        "dev",
        "r1",
        "nud",
        "permanent",
    ],
    &[
        "ip",
        "-6",
        "neigh",
        "add",
        "fd02::1",
        "lladdr",
        "02:00:00:00:02:06",
        "dev",
        "r1",
        "nud",
        "permanent",
    ],
    &[
        "ip",
        "neigh",
        "add",
        "10.4.0.1",
        "lladdr",
        "02:00:00:00:04:01",
        "dev",
        "r2",
        "nud",
        "permanent",
    ],
    &["ip", "route", "add", "10.9.0.0/24", "via", "10.2.0.1"],
    &["ip", "-6", "route", "add", "fd09::/64", "via", "fd02::1"],
    &["ip", "route", "add", "10.3.0.0/24", "via", "10.2.0.3"],
    &["ip", "route", "add", "blackhole", "10.66.0.0/16"],
    &["ip", "-6", "route", "add", "unreachable", "fd66::/64"],
];

/// The interface indexes the setup gave `r0`, `r1`, `r2`.
#[derive(Clone, Copy, Debug)]
pub struct RouteIfaces {
    pub r0: u32,
    pub r1: u32,
    pub r2: u32,
}

/// `r0` and `r1` route in the fast path (`route = true`) at `flag`'s hook (`IFACE_F_ROUTE`:
/// XDP, `IFACE_F_ROUTE_TC`: TC ingress); `r2` is not configured.
pub fn route_seed(ifx: RouteIfaces, flag: u32) -> Seed {
    let routed = |mac| IfaceConfig {
        flags: flag,
        mac,
        ..IfaceConfig::default()
    };
    Seed::default()
        .with_iface_config(ifx.r0, routed(R0_MAC))
        .with_iface_config(ifx.r1, routed(R1_MAC))
}

fn v4(dst: [u8; 4]) -> Pkt {
    v4_from(CLIENT4, dst)
}

fn v4_from(src: [u8; 4], dst: [u8; 4]) -> Pkt {
    Pkt::eth()
        .macs(R0_MAC, CLIENT_MAC)
        .ipv4(src, dst)
        .tcp(40000, 80, tcp::ACK)
        .payload(b"routed by the fast path")
}

/// A TCP/IPv4 packet of `ip_len` bytes (IP header on).
fn v4_sized(dst: [u8; 4], ip_len: usize) -> Pkt {
    Pkt::eth()
        .macs(R0_MAC, CLIENT_MAC)
        .ipv4(CLIENT4, dst)
        .tcp(40000, 80, tcp::ACK)
        .payload(&vec![0x5a; ip_len - 40])
}

fn v6(dst: [u8; 16]) -> Pkt {
    v6_from(CLIENT6, dst)
}

fn v6_from(src: [u8; 16], dst: [u8; 16]) -> Pkt {
    Pkt::eth()
        .macs(R0_MAC, CLIENT_MAC)
        .ipv6(src, dst)
        .udp(40000, 53)
        .payload(b"routed by the fast path")
}

fn v6addr(prefix: u16, host: u8) -> [u8; 16] {
    let mut a = [0u8; 16];
    a[..2].copy_from_slice(&prefix.to_be_bytes());
    a[15] = host;
    a
}

/// Every routing case, arriving on `r0`.
pub fn route_cases(ifx: RouteIfaces) -> Vec<Case> {
    let seed = route_seed(ifx, IFACE_F_ROUTE);
    let tc_seed = route_seed(ifx, IFACE_F_ROUTE_TC);
    let arriving = |mut c: Case| {
        c.arrives_on = Some(ifx.r0);
        c
    };
    let routed = |hook: Hook, what: &str, pkt: Pkt, out_mac: [u8; 6], ttl: u8| {
        let seed = if hook == Hook::Xdp { &seed } else { &tc_seed };
        let mut c = case(
            hook,
            what,
            seed.clone(),
            pkt.build(),
            Verdict::Forward,
            reason::ROUTED,
        );
        c.expect_output = Some(pkt.macs(out_mac, R1_MAC).ttl(ttl).build());
        arriving(c)
    };
    let to_kernel = |what: &str, seed: &Seed, input: Vec<u8>, why: u32| {
        arriving(case(
            Hook::Xdp,
            what,
            seed.clone(),
            input,
            Verdict::Kernel,
            why,
        ))
    };
    let mut cases = vec![
        routed(
            Hook::Xdp,
            "route_v4_to_a_neighbour",
            v4([10, 2, 0, 1]),
            HOP4_MAC,
            63,
        ),
        routed(
            Hook::Xdp,
            "route_v4_via_a_gateway",
            v4([10, 9, 0, 7]).ttl(2),
            HOP4_MAC,
            1,
        ),
        routed(
            Hook::Xdp,
            "route_v6_to_a_neighbour",
            v6(v6addr(0xfd02, 1)),
            HOP6_MAC,
            63,
        ),
        routed(
            Hook::Xdp,
            "route_v6_via_a_gateway",
            v6(v6addr(0xfd09, 5)),
            HOP6_MAC,
            63,
        ),
        routed(
            Hook::TcIngress,
            "route_v4_at_tc",
            v4([10, 9, 0, 7]),
            HOP4_MAC,
            63,
        ),
        routed(
            Hook::TcIngress,
            "route_v6_at_tc",
            v6(v6addr(0xfd09, 5)),
            HOP6_MAC,
            63,
        ),
        routed(
            Hook::Xdp,
            "route_v4_at_the_mtu",
            v4_sized([10, 2, 0, 1], R1_MTU),
            HOP4_MAC,
            63,
        ),
    ];
    for (what, pkt, why) in [
        (
            "ttl_1_v4",
            v4([10, 2, 0, 1]).ttl(1),
            reason::ROUTE_TTL_EXPIRED,
        ),
        (
            "ttl_0_v4",
            v4([10, 2, 0, 1]).ttl(0),
            reason::ROUTE_TTL_EXPIRED,
        ),
        (
            "hop_limit_1_v6",
            v6(v6addr(0xfd02, 1)).ttl(1),
            reason::ROUTE_TTL_EXPIRED,
        ),
        (
            "no_neighbour_v4",
            v4([10, 3, 0, 7]),
            reason::ROUTE_NO_NEIGHBOR,
        ),
        (
            "no_neighbour_v6",
            v6(v6addr(0xfd02, 9)),
            reason::ROUTE_NO_NEIGHBOR,
        ),
        ("local_v4", v4([10, 1, 0, 254]), reason::ROUTE_NOT_FORWARDED),
        (
            "local_v6",
            v6(v6addr(0xfd02, 0xfe)),
            reason::ROUTE_NOT_FORWARDED,
        ),
        (
            "broadcast_v4",
            v4([10, 1, 0, 255]),
            reason::ROUTE_NOT_FORWARDED,
        ),
        (
            "no_route_v4",
            v4([10, 77, 0, 1]),
            reason::ROUTE_NOT_FORWARDED,
        ),
        (
            "no_route_v6",
            v6(v6addr(0xfd77, 1)),
            reason::ROUTE_NOT_FORWARDED,
        ),
        (
            "blackhole_v4",
            v4([10, 66, 1, 1]),
            reason::ROUTE_UNREACHABLE,
        ),
        (
            "unreachable_v6",
            v6(v6addr(0xfd66, 1)),
            reason::ROUTE_UNREACHABLE,
        ),
        (
            "over_the_mtu_v4",
            v4_sized([10, 2, 0, 1], R1_MTU + 1),
            reason::ROUTE_MTU,
        ),
        (
            "ip_options_v4",
            v4([10, 2, 0, 1]).ipv4_options(&[1, 1, 1, 0]),
            reason::ROUTE_IP_OPTIONS,
        ),
        (
            "hop_by_hop_v6",
            v6(v6addr(0xfd02, 1)).ipv6_ext(Ipv6Ext::hop_by_hop()),
            reason::ROUTE_IP_OPTIONS,
        ),
        (
            "fragment_v4",
            v4([10, 2, 0, 1]).ipv4_fragment(0, true),
            reason::ROUTE_FRAGMENT,
        ),
        (
            "egress_not_routed_v4",
            v4([10, 4, 0, 1]),
            reason::ROUTE_EGRESS_NOT_ROUTED,
        ),
        (
            "martian_loopback_source_v4",
            v4_from([127, 0, 0, 1], [10, 2, 0, 1]),
            reason::ROUTE_MARTIAN,
        ),
        (
            "martian_multicast_source_v4",
            v4_from([224, 0, 0, 5], [10, 2, 0, 1]),
            reason::ROUTE_MARTIAN,
        ),
        (
            "martian_zero_source_v4",
            v4_from([0, 0, 0, 0], [10, 2, 0, 1]),
            reason::ROUTE_MARTIAN,
        ),
        (
            "martian_loopback_destination_v4",
            v4([127, 0, 0, 1]),
            reason::ROUTE_MARTIAN,
        ),
        (
            "martian_link_local_source_v6",
            v6_from(v6addr(0xfe80, 1), v6addr(0xfd02, 1)),
            reason::ROUTE_MARTIAN,
        ),
        (
            "martian_link_local_destination_v6",
            v6(v6addr(0xfe80, 1)),
            reason::ROUTE_MARTIAN,
        ),
        (
            "martian_v4_mapped_source_v6",
            v6_from(
                [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 1, 0, 1],
                v6addr(0xfd02, 1),
            ),
            reason::ROUTE_MARTIAN,
        ),
        (
            "martian_multicast_source_v6",
            v6_from(v6addr(0xff02, 1), v6addr(0xfd02, 1)),
            reason::ROUTE_MARTIAN,
        ),
        (
            "not_for_this_mac_v4",
            v4([10, 2, 0, 1]).macs([0x02, 0, 0, 0, 0x0b, 0], CLIENT_MAC),
            reason::ROUTE_NOT_FOR_US,
        ),
        (
            "multicast_mac_v6",
            v6(v6addr(0xfd02, 1)).macs([0x33, 0x33, 0, 0, 0, 1], CLIENT_MAC),
            reason::ROUTE_NOT_FOR_US,
        ),
        (
            "vlan_tagged_v4",
            Pkt::eth()
                .macs(R0_MAC, CLIENT_MAC)
                .vlan(ethertype::VLAN_8021Q, 100)
                .ipv4(CLIENT4, [10, 2, 0, 1])
                .tcp(40000, 80, tcp::ACK),
            reason::ROUTE_NOT_FOR_US,
        ),
    ] {
        cases.push(to_kernel(&format!("route_{what}"), &seed, pkt.build(), why));
    }
    // TCP flag combinations Linux's conntrack calls invalid are not routed, though their
    // destination is (route_v4_to_a_neighbour, the same packet with ACK, is): the kernel's.
    let invalid = |flags: u8| {
        Pkt::eth()
            .macs(R0_MAC, CLIENT_MAC)
            .ipv4(CLIENT4, [10, 2, 0, 1])
            .tcp(40000, 80, flags)
            .payload(b"not routed by the fast path")
    };
    for (what, flags) in [
        ("syn_fin", tcp::SYN | tcp::FIN),
        ("no_flags", 0),
        ("fin_alone", tcp::FIN),
        ("every_flag", 0xff),
    ] {
        cases.push(to_kernel(
            &format!("route_tcp_invalid_flags_{what}_v4"),
            &seed,
            invalid(flags).build(),
            reason::TCP_INVALID_FLAGS,
        ));
    }
    cases.push(arriving(case(
        Hook::TcIngress,
        "route_tcp_invalid_flags_syn_rst_v4_at_tc",
        tc_seed.clone(),
        invalid(tcp::SYN | tcp::RST).build(),
        Verdict::Kernel,
        reason::TCP_INVALID_FLAGS,
    )));
    // One hook routes: XDP where attached, TC ingress where not; the other passes.
    cases.push(arriving(case(
        Hook::TcIngress,
        "route_at_xdp_not_at_tc",
        seed.clone(),
        v4([10, 2, 0, 1]).build(),
        Verdict::Kernel,
        reason::NO_STAGE_IPV4_TCP,
    )));
    cases.push(to_kernel(
        "route_at_tc_not_at_xdp",
        &tc_seed,
        v4([10, 2, 0, 1]).build(),
        reason::NO_STAGE_IPV4_TCP,
    ));
    // Without `route = true` on the arriving interface the stage stays out of the way.
    cases.push(to_kernel(
        "route_off_on_this_interface",
        &Seed::default(),
        v4([10, 2, 0, 1]).build(),
        reason::NO_STAGE_IPV4_TCP,
    ));
    cases
}
