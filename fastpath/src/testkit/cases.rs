//! The parser fixture table: every header combination the parse stage accepts, every way it
//! refuses a frame, and the `drop_malformed` switch, on XDP and (a sampling of) TC.
//!
//! Contract: each case states the exact raw verdict and the exact counter change (one packet,
//! bytes = frame length, which is also the skb length in TC). No stage rewrites packets yet,
//! so every expected output is the input unchanged.

use fastpath_common::{Hook, Verdict, reason};

use super::{
    fixture::{Case, CounterDelta, Seed, raw_verdict},
    packet::{Ipv6Ext, Pkt, ethertype, icmp_type, proto, tcp_flags},
};

const A4: [u8; 4] = [10, 0, 0, 1];
const B4: [u8; 4] = [10, 0, 0, 2];
const A6: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
const B6: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];
/// A third address for routing headers.
const C6: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3];

/// One packet counted once under (hook, verdict, reason); output = input.
pub fn case(
    hook: Hook,
    what: &str,
    seed: Seed,
    input: Vec<u8>,
    verdict: Verdict,
    reason: u32,
) -> Case {
    let bytes = input.len() as u64;
    Case {
        name: format!("{}_{what}", hook.name()),
        hook,
        seed,
        expect_verdict: raw_verdict(hook, verdict),
        expect_output: None,
        expect_counters: vec![CounterDelta::new(hook, verdict, reason, 1, bytes)],
        input,
        arrives_on: None,
    }
}

/// Default config; the kernel gets the packet with `reason`.
fn kernel(hook: Hook, what: &str, pkt: Pkt, reason: u32) -> Case {
    case(
        hook,
        what,
        Seed::default(),
        pkt.build(),
        Verdict::Kernel,
        reason,
    )
}

/// `drop_malformed` on; the packet is dropped with `reason`.
fn dropped(hook: Hook, what: &str, pkt: Pkt, reason: u32) -> Case {
    case(
        hook,
        what,
        Seed::drop_malformed(),
        pkt.build(),
        Verdict::Drop,
        reason,
    )
}

/// `drop_malformed` on, yet the kernel gets the packet: `reason` is not a malformation.
fn kernel_despite_drop_malformed(hook: Hook, what: &str, pkt: Pkt, reason: u32) -> Case {
    case(
        hook,
        what,
        Seed::drop_malformed(),
        pkt.build(),
        Verdict::Kernel,
        reason,
    )
}

/// A name and the frame up to (not including) L3.
type Encap = (&'static str, fn() -> Pkt);
/// A name, what to add on top of an [`Encap`], and the reason an unclaimed packet gets.
type L3L4 = (&'static str, fn(Pkt) -> Pkt, u32);

/// Outer encapsulations of the header matrix.
const ENCAPS: [Encap; 3] = [
    ("plain", Pkt::eth),
    ("vlan", || Pkt::eth().vlan(ethertype::VLAN_8021Q, 100)),
    ("qinq", || {
        Pkt::eth()
            .vlan(ethertype::VLAN_8021AD, 10)
            .vlan(ethertype::VLAN_8021Q, 100)
    }),
];

/// L3/L4 combinations of the header matrix.
const L3L4S: [L3L4; 6] = [
    (
        "ipv4_tcp",
        |p| p.ipv4(A4, B4).tcp(40000, 80, tcp_flags::SYN),
        reason::NO_STAGE_IPV4_TCP,
    ),
    (
        "ipv4_udp",
        |p| p.ipv4(A4, B4).udp(5353, 53).payload(b"query"),
        reason::NO_STAGE_IPV4_UDP,
    ),
    (
        "ipv4_icmp",
        |p| p.ipv4(A4, B4).icmp_echo(0x42, 1).payload(b"ping"),
        reason::NO_STAGE_IPV4_ICMP,
    ),
    (
        "ipv6_tcp",
        |p| {
            p.ipv6(A6, B6)
                .tcp(40000, 443, tcp_flags::ACK | tcp_flags::PSH)
                .payload(b"GET /")
        },
        reason::NO_STAGE_IPV6_TCP,
    ),
    (
        "ipv6_udp",
        |p| p.ipv6(A6, B6).udp(4789, 4789).payload(&[0; 16]),
        reason::NO_STAGE_IPV6_UDP,
    ),
    (
        "ipv6_icmpv6",
        |p| p.ipv6(A6, B6).icmpv6_echo(0x42, 1).payload(b"ping"),
        reason::NO_STAGE_IPV6_ICMP,
    ),
];

/// Every (encapsulation × L3/L4) on XDP, and each one again on one TC hook, alternating.
fn header_matrix() -> Vec<Case> {
    let mut cases = Vec::new();
    let mut tc_turn = 0;
    for (encap, outer) in ENCAPS {
        for (l3l4, inner, why) in L3L4S {
            let what = format!("{encap}_{l3l4}");
            cases.push(kernel(Hook::Xdp, &what, inner(outer()), why));
            let tc = if tc_turn % 2 == 0 {
                Hook::TcIngress
            } else {
                Hook::TcEgress
            };
            tc_turn += 1;
            cases.push(kernel(tc, &what, inner(outer()), why));
        }
    }
    cases
}

/// Well-formed frames beyond the plain matrix: VLAN variants, IPv4 options and fragments,
/// IPv6 extension chains, Ethernet padding, and the kernel-only protocols.
fn well_formed() -> Vec<Case> {
    use Hook::{TcEgress, TcIngress, Xdp};
    let v4 = || Pkt::eth().ipv4(A4, B4);
    let v6 = || Pkt::eth().ipv6(A6, B6);
    // 39 NOPs and an EOL: the longest IPv4 header (IHL 15).
    let max_options = [[1u8; 39].as_slice(), &[0]].concat();
    vec![
        kernel(
            Xdp,
            "qinq_9100_ipv4_udp",
            Pkt::eth()
                .vlan(ethertype::VLAN_QINQ_9100, 10)
                .vlan(ethertype::VLAN_8021Q, 20)
                .ipv4(A4, B4)
                .udp(1000, 2000),
            reason::NO_STAGE_IPV4_UDP,
        ),
        kernel(
            Xdp,
            "ipv4_tcp_syn_with_options",
            v4().tcp(40000, 80, tcp_flags::SYN).tcp_options(&[
                2, 4, 0x05, 0xb4, // MSS 1460
                4, 2, // SACK permitted
                8, 10, 0, 0, 0, 1, 0, 0, 0, 0, // timestamps
                1, 3, 3, 7, // NOP, window scale 7
            ]),
            reason::NO_STAGE_IPV4_TCP,
        ),
        kernel(
            Xdp,
            "ipv4_options_router_alert_tcp",
            v4().ipv4_options(&[0x94, 0x04, 0, 0])
                .tcp(1, 2, tcp_flags::ACK),
            reason::NO_STAGE_IPV4_TCP,
        ),
        kernel(
            TcIngress,
            "ipv4_options_ihl15_udp",
            v4().ipv4_options(&max_options).udp(1, 2).payload(b"x"),
            reason::NO_STAGE_IPV4_UDP,
        ),
        kernel(
            Xdp,
            "ipv4_first_fragment",
            v4().ipv4_fragment(0, true).udp(1, 2).payload(&[0xab; 32]),
            reason::IPV4_FRAGMENT,
        ),
        kernel(
            Xdp,
            "ipv4_non_first_fragment",
            v4().ipv4_fragment(185, false)
                .ip_proto(proto::UDP)
                .payload(&[0xab; 16]),
            reason::IPV4_FRAGMENT,
        ),
        // A fragment's L4 is never parsed: 3 bytes of "UDP" are no truncation.
        kernel(
            TcEgress,
            "ipv4_middle_fragment_short",
            v4().ipv4_fragment(5, true)
                .ip_proto(proto::UDP)
                .payload(&[1, 2, 3]),
            reason::IPV4_FRAGMENT,
        ),
        kernel(
            Xdp,
            "ipv4_dont_fragment_is_not_fragment",
            v4().ipv4_flags_frag(0x4000).tcp(1, 2, tcp_flags::ACK),
            reason::NO_STAGE_IPV4_TCP,
        ),
        kernel(
            Xdp,
            "ipv4_gre",
            v4().ip_proto(proto::GRE).payload(&[0, 0, 0x08, 0]),
            reason::NO_STAGE_IPV4_OTHER,
        ),
        // ICMPv6's protocol number inside IPv4 is just another protocol: no ICMP length check,
        // so a 4-byte payload is not "truncated".
        kernel(
            Xdp,
            "ipv4_proto_58_is_not_icmp",
            v4().ip_proto(58).payload(&[128, 0, 0, 0]),
            reason::NO_STAGE_IPV4_OTHER,
        ),
        kernel(
            TcIngress,
            "ipv6_next_header_1_is_not_icmpv6",
            v6().ip_proto(proto::ICMP).payload(&[8, 0]),
            reason::NO_STAGE_IPV6_OTHER,
        ),
        kernel(
            Xdp,
            "ipv6_hop_by_hop_tcp",
            v6().ipv6_ext(Ipv6Ext::hop_by_hop())
                .tcp(1, 2, tcp_flags::SYN),
            reason::NO_STAGE_IPV6_TCP,
        ),
        kernel(
            Xdp,
            "ipv6_routing_udp",
            v6().ipv6_ext(Ipv6Ext::routing(C6)).udp(1, 2),
            reason::NO_STAGE_IPV6_UDP,
        ),
        kernel(
            Xdp,
            "ipv6_hop_by_hop_beyond_parser_window",
            v6().ipv6_ext(Ipv6Ext::HopByHop { len_units: 130 })
                .tcp(1, 2, tcp_flags::SYN),
            reason::HEADERS_TOO_DEEP,
        ),
        kernel(
            TcIngress,
            "ipv6_dest_opts_icmpv6",
            v6().ipv6_ext(Ipv6Ext::DestOpts { len_units: 2 })
                .icmpv6_echo(1, 1),
            reason::NO_STAGE_IPV6_ICMP,
        ),
        kernel(
            Xdp,
            "ipv6_first_fragment",
            v6().ipv6_ext(Ipv6Ext::fragment(0, true, 0x1234))
                .udp(1, 2)
                .payload(&[0xab; 32]),
            reason::IPV6_FRAGMENT,
        ),
        kernel(
            TcEgress,
            "ipv6_non_first_fragment",
            v6().ipv6_ext(Ipv6Ext::fragment(100, false, 0x1234))
                .ip_proto(proto::UDP)
                .payload(&[1; 8]),
            reason::IPV6_FRAGMENT,
        ),
        kernel(
            Xdp,
            "ipv6_ext_chain_4_tcp",
            v6().ipv6_ext(Ipv6Ext::hop_by_hop())
                .ipv6_ext(Ipv6Ext::dest_opts())
                .ipv6_ext(Ipv6Ext::routing(C6))
                .ipv6_ext(Ipv6Ext::DestOpts { len_units: 1 })
                .tcp(1, 2, tcp_flags::ACK),
            reason::NO_STAGE_IPV6_TCP,
        ),
        kernel(
            Xdp,
            "ipv6_ext_chain_6_udp",
            ext_chain(6).udp(1, 2),
            reason::NO_STAGE_IPV6_UDP,
        ),
        kernel(
            TcIngress,
            "ipv6_ext_chain_6_udp",
            ext_chain(6).udp(1, 2),
            reason::NO_STAGE_IPV6_UDP,
        ),
        kernel(
            Xdp,
            "ipv6_ext_chain_5_then_fragment",
            ext_chain(5)
                .ipv6_ext(Ipv6Ext::fragment(0, true, 7))
                .udp(1, 2),
            reason::IPV6_FRAGMENT,
        ),
        kernel(
            Xdp,
            "ipv6_ext_chain_7_too_long",
            ext_chain(7).udp(1, 2),
            reason::IPV6_EXT_CHAIN_TOO_LONG,
        ),
        kernel(
            TcEgress,
            "ipv6_ext_chain_6_then_fragment_too_long",
            ext_chain(6)
                .ipv6_ext(Ipv6Ext::fragment(0, true, 7))
                .udp(1, 2),
            reason::IPV6_EXT_CHAIN_TOO_LONG,
        ),
        kernel(
            Xdp,
            "ipv6_no_next_header",
            v6().payload(&[0; 8]),
            reason::NO_STAGE_IPV6_OTHER,
        ),
        kernel(
            Xdp,
            "ipv6_esp",
            v6().ip_proto(proto::ESP).payload(&[0; 16]),
            reason::NO_STAGE_IPV6_OTHER,
        ),
        // Ethernet padding: the IP length is shorter than the frame, which is valid.
        kernel(
            Xdp,
            "ipv4_tcp_ack_padded_to_60",
            v4().tcp(1, 2, tcp_flags::ACK).pad_min(),
            reason::NO_STAGE_IPV4_TCP,
        ),
        kernel(
            TcIngress,
            "ipv4_udp_padded_to_60",
            v4().udp(1, 2).pad_min(),
            reason::NO_STAGE_IPV4_UDP,
        ),
        kernel(
            Xdp,
            "vlan_ipv4_icmp_padded_to_60",
            Pkt::eth()
                .vlan(ethertype::VLAN_8021Q, 5)
                .ipv4(A4, B4)
                .icmp_echo(1, 1)
                .pad_min(),
            reason::NO_STAGE_IPV4_ICMP,
        ),
        kernel(
            Xdp,
            "ipv4_udp_long_trailer",
            v4().udp(1, 2).payload(b"data").pad_to(200),
            reason::NO_STAGE_IPV4_UDP,
        ),
        kernel(
            TcEgress,
            "ipv6_udp_trailer",
            v6().udp(1, 2).pad_to(100),
            reason::NO_STAGE_IPV6_UDP,
        ),
        kernel(
            Xdp,
            "arp_request",
            Pkt::eth().arp_request(A4, B4),
            reason::ARP,
        ),
        kernel(
            TcEgress,
            "vlan_arp_request",
            Pkt::eth()
                .vlan(ethertype::VLAN_8021Q, 100)
                .arp_request(A4, B4),
            reason::ARP,
        ),
        kernel(
            Xdp,
            "ipv6_nd_neighbour_solicit",
            v6().icmpv6_neighbour_solicit(B6),
            reason::IPV6_ND,
        ),
        kernel(
            TcIngress,
            "ipv6_nd_neighbour_solicit",
            v6().icmpv6_neighbour_solicit(B6),
            reason::IPV6_ND,
        ),
        kernel(
            Xdp,
            "ipv6_nd_router_solicit",
            v6().icmpv6(icmp_type::V6_ROUTER_SOLICIT, 0, [0; 4]),
            reason::IPV6_ND,
        ),
        kernel(
            Xdp,
            "ipv6_nd_redirect",
            v6().icmpv6(icmp_type::V6_REDIRECT, 0, [0; 4])
                .payload(&[B6, C6].concat()),
            reason::IPV6_ND,
        ),
        // Just outside the ND range on both sides: MLD done (132) and router renumbering (138).
        kernel(
            Xdp,
            "ipv6_icmpv6_mld_done_not_nd",
            v6().icmpv6(132, 0, [0; 4]).payload(&C6),
            reason::NO_STAGE_IPV6_ICMP,
        ),
        kernel(
            Xdp,
            "ipv6_icmpv6_138_not_nd",
            v6().icmpv6(138, 0, [0; 4]),
            reason::NO_STAGE_IPV6_ICMP,
        ),
        kernel(
            Xdp,
            "lldp",
            Pkt::eth()
                .ethertype(ethertype::LLDP)
                .payload(&[0x02, 0x07, 0x04, 0, 0, 0, 0, 0, 1]),
            reason::NON_IP,
        ),
        kernel(
            Xdp,
            "unknown_ethertype_header_only",
            Pkt::eth(),
            reason::NON_IP,
        ),
        kernel(
            TcIngress,
            "ieee_802_3_length_field",
            Pkt::eth().ethertype(46).payload(&[0x42; 46]),
            reason::NON_IP,
        ),
        kernel(
            TcEgress,
            "vlan_lldp",
            Pkt::eth()
                .vlan(ethertype::VLAN_8021Q, 1)
                .ethertype(ethertype::LLDP)
                .payload(&[0; 8]),
            reason::NON_IP,
        ),
        kernel(Xdp, "three_vlan_tags", three_vlans(), reason::VLAN_TOO_DEEP),
        kernel(
            TcIngress,
            "three_vlan_tags",
            three_vlans(),
            reason::VLAN_TOO_DEEP,
        ),
    ]
}

/// An IPv6 header followed by `n` alternating hop-by-hop/destination-options headers.
fn ext_chain(n: usize) -> Pkt {
    let mut p = Pkt::eth().ipv6(A6, B6);
    for i in 0..n {
        p = p.ipv6_ext(if i % 2 == 0 {
            Ipv6Ext::hop_by_hop()
        } else {
            Ipv6Ext::dest_opts()
        });
    }
    p
}

fn three_vlans() -> Pkt {
    Pkt::eth()
        .vlan(ethertype::VLAN_8021AD, 1)
        .vlan(ethertype::VLAN_8021Q, 2)
        .vlan(ethertype::VLAN_8021Q, 3)
        .ipv4(A4, B4)
        .udp(1, 2)
}

/// Malformed frames with the default config: handed to the kernel with their reason.
fn malformed() -> Vec<Case> {
    use Hook::{TcEgress, TcIngress, Xdp};
    let v4 = || Pkt::eth().ipv4(A4, B4);
    let v6 = || Pkt::eth().ipv6(A6, B6);
    let v4_udp_len = v4().udp(1, 2).payload(b"data").build().len();
    let v6_udp_len = v6().udp(1, 2).payload(b"data").build().len();
    vec![
        // --- truncation at and inside every header ---
        kernel(
            Xdp,
            "trunc_in_vlan_tag",
            Pkt::eth()
                .vlan(ethertype::VLAN_8021Q, 100)
                .ipv4(A4, B4)
                .udp(1, 2)
                .truncate(16),
            reason::TRUNC_VLAN,
        ),
        kernel(
            TcIngress,
            "trunc_in_inner_vlan_tag",
            Pkt::eth()
                .vlan(ethertype::VLAN_8021AD, 10)
                .vlan(ethertype::VLAN_8021Q, 100)
                .ipv4(A4, B4)
                .udp(1, 2)
                .truncate(20),
            reason::TRUNC_VLAN,
        ),
        kernel(
            Xdp,
            "trunc_after_eth_ipv4",
            v4().tcp(1, 2, 0).truncate(14),
            reason::TRUNC_IPV4,
        ),
        kernel(
            Xdp,
            "trunc_after_vlan_ipv4",
            Pkt::eth()
                .vlan(ethertype::VLAN_8021Q, 100)
                .ipv4(A4, B4)
                .udp(1, 2)
                .truncate(18),
            reason::TRUNC_IPV4,
        ),
        kernel(
            Xdp,
            "trunc_in_ipv4_header",
            v4().tcp(1, 2, 0).truncate(14 + 19),
            reason::TRUNC_IPV4,
        ),
        kernel(
            TcEgress,
            "trunc_in_ipv4_header_vlan",
            Pkt::eth()
                .vlan(ethertype::VLAN_8021Q, 100)
                .ipv4(A4, B4)
                .udp(1, 2)
                .truncate(18 + 10),
            reason::TRUNC_IPV4,
        ),
        kernel(
            Xdp,
            "trunc_in_ipv4_options",
            v4().ipv4_options(&[1; 12]).udp(1, 2).truncate(14 + 24),
            reason::TRUNC_IPV4,
        ),
        kernel(
            Xdp,
            "trunc_after_ipv4_header_tcp",
            v4().tcp(1, 2, 0).cut_l4(0),
            reason::TRUNC_L4,
        ),
        kernel(
            Xdp,
            "trunc_after_eth_ipv6",
            v6().udp(1, 2).truncate(14),
            reason::TRUNC_IPV6,
        ),
        kernel(
            Xdp,
            "trunc_in_ipv6_header",
            v6().udp(1, 2).truncate(14 + 39),
            reason::TRUNC_IPV6,
        ),
        kernel(
            TcIngress,
            "trunc_in_ipv6_header_qinq",
            Pkt::eth()
                .vlan(ethertype::VLAN_8021AD, 10)
                .vlan(ethertype::VLAN_8021Q, 100)
                .ipv6(A6, B6)
                .udp(1, 2)
                .truncate(22 + 20),
            reason::TRUNC_IPV6,
        ),
        // The payload length ends inside the 16-byte hop-by-hop header.
        kernel(
            Xdp,
            "trunc_in_ipv6_ext_body",
            v6().ipv6_ext(Ipv6Ext::HopByHop { len_units: 1 })
                .tcp(1, 2, 0)
                .ipv6_payload_len(12)
                .truncate(14 + 40 + 12),
            reason::TRUNC_IPV6_EXT,
        ),
        // ... or inside its fixed 8 bytes.
        kernel(
            TcIngress,
            "trunc_in_ipv6_ext_fixed_part",
            v6().ipv6_ext(Ipv6Ext::hop_by_hop())
                .tcp(1, 2, 0)
                .ipv6_payload_len(4)
                .truncate(14 + 44),
            reason::TRUNC_IPV6_EXT,
        ),
        // A header-extension-length byte that claims more than the payload holds.
        kernel(
            Xdp,
            "ipv6_ext_len_beyond_payload",
            v6().ipv6_ext(Ipv6Ext::Raw {
                kind: proto::DSTOPTS,
                body: vec![4, 1, 4, 0, 0, 0, 0],
            })
            .udp(1, 2),
            reason::TRUNC_IPV6_EXT,
        ),
        kernel(
            Xdp,
            "trunc_in_ipv6_fragment_header",
            v6().ipv6_ext(Ipv6Ext::fragment(0, true, 1))
                .udp(1, 2)
                .ipv6_payload_len(6)
                .truncate(14 + 46),
            reason::TRUNC_IPV6_EXT,
        ),
        kernel(
            Xdp,
            "trunc_in_ipv4_tcp",
            v4().tcp(1, 2, 0).cut_l4(10),
            reason::TRUNC_L4,
        ),
        kernel(
            Xdp,
            "trunc_in_ipv4_udp",
            v4().udp(1, 2).cut_l4(4),
            reason::TRUNC_L4,
        ),
        kernel(
            TcEgress,
            "trunc_in_ipv4_icmp",
            v4().icmp_echo(1, 1).cut_l4(6),
            reason::TRUNC_L4,
        ),
        kernel(
            Xdp,
            "trunc_in_ipv6_tcp",
            v6().tcp(1, 2, tcp_flags::SYN).cut_l4(19),
            reason::TRUNC_L4,
        ),
        kernel(
            TcEgress,
            "trunc_in_ipv6_udp",
            v6().udp(1, 2).cut_l4(7),
            reason::TRUNC_L4,
        ),
        kernel(
            Xdp,
            "trunc_in_ipv6_icmpv6",
            v6().icmpv6_echo(1, 1).cut_l4(4),
            reason::TRUNC_L4,
        ),
        kernel(
            Xdp,
            "trunc_after_ipv6_ext_tcp",
            v6().ipv6_ext(Ipv6Ext::hop_by_hop()).tcp(1, 2, 0).cut_l4(0),
            reason::TRUNC_L4,
        ),
        // --- bad length and version fields ---
        kernel(
            Xdp,
            "ipv4_ihl_4",
            v4().ihl(4).udp(1, 2),
            reason::BAD_IPV4_IHL,
        ),
        kernel(
            TcIngress,
            "ipv4_ihl_0",
            v4().ihl(0).udp(1, 2),
            reason::BAD_IPV4_IHL,
        ),
        kernel(
            Xdp,
            "ipv4_total_len_shorter_than_header",
            v4().ip_total_len(19).udp(1, 2),
            reason::BAD_IPV4_TOTAL_LEN,
        ),
        kernel(
            Xdp,
            "ipv4_total_len_shorter_than_options",
            v4().ipv4_options(&[1; 8]).ip_total_len(24).udp(1, 2),
            reason::BAD_IPV4_TOTAL_LEN,
        ),
        kernel(
            Xdp,
            "ipv4_total_len_longer_than_frame",
            v4().udp(1, 2).payload(b"data").truncate(v4_udp_len - 1),
            reason::BAD_IPV4_TOTAL_LEN,
        ),
        kernel(
            TcEgress,
            "ipv4_total_len_longer_than_frame",
            v4().udp(1, 2).ip_total_len(1500),
            reason::BAD_IPV4_TOTAL_LEN,
        ),
        kernel(
            Xdp,
            "ipv6_payload_len_longer_than_frame",
            v6().udp(1, 2).payload(b"data").truncate(v6_udp_len - 1),
            reason::BAD_IPV6_PAYLOAD_LEN,
        ),
        kernel(
            TcIngress,
            "ipv6_payload_len_longer_than_frame",
            v6().tcp(1, 2, 0).ipv6_payload_len(21),
            reason::BAD_IPV6_PAYLOAD_LEN,
        ),
        kernel(
            Xdp,
            "ipv6_payload_len_zero",
            v6().udp(1, 2).ipv6_payload_len(0),
            reason::BAD_IPV6_PAYLOAD_LEN,
        ),
        // A jumbogram: zero payload length with a hop-by-hop header (which carries the real
        // length). Not malformed: the kernel gets it even with drop_malformed on.
        kernel_despite_drop_malformed(
            TcEgress,
            "ipv6_jumbogram_payload_len_zero_with_hop_by_hop",
            v6().ipv6_ext(Ipv6Ext::hop_by_hop())
                .udp(1, 2)
                .ipv6_payload_len(0),
            reason::GSO_JUMBO,
        ),
        kernel(
            Xdp,
            "ethertype_ipv4_carries_ipv6",
            v6().udp(1, 2).ethertype(ethertype::IPV4),
            reason::BAD_IP_VERSION,
        ),
        kernel(
            Xdp,
            "ethertype_ipv6_carries_ipv4",
            v4().tcp(1, 2, 0).ethertype(ethertype::IPV6),
            reason::BAD_IP_VERSION,
        ),
        kernel(
            TcEgress,
            "ipv4_version_5",
            v4().ip_version(5).udp(1, 2),
            reason::BAD_IP_VERSION,
        ),
        kernel(
            TcIngress,
            "ipv6_version_4",
            v6().ip_version(4).udp(1, 2),
            reason::BAD_IP_VERSION,
        ),
        kernel(
            Xdp,
            "tcp_data_offset_4",
            v4().tcp(1, 2, tcp_flags::SYN).tcp_data_offset(4),
            reason::BAD_TCP_DATA_OFFSET,
        ),
        kernel(
            Xdp,
            "tcp_data_offset_beyond_payload",
            v4().tcp(1, 2, tcp_flags::SYN)
                .tcp_data_offset(15)
                .payload(&[0; 39]),
            reason::BAD_TCP_DATA_OFFSET,
        ),
        kernel(
            TcIngress,
            "ipv6_tcp_data_offset_0",
            v6().tcp(1, 2, tcp_flags::ACK).tcp_data_offset(0),
            reason::BAD_TCP_DATA_OFFSET,
        ),
    ]
}

/// TCP flag combinations Linux's conntrack calls invalid, on an interface that tracks and
/// routes nothing: the kernel's, counted `tcp_invalid_flags` (dropped with `drop_malformed`);
/// a fragment (no flags parsed) is still a fragment, and valid combinations keep their reason.
fn tcp_invalid_flags() -> Vec<Case> {
    use Hook::{TcEgress, TcIngress, Xdp};
    let v4 = |flags: u8| Pkt::eth().ipv4(A4, B4).tcp(40000, 80, flags);
    let v6 = |flags: u8| Pkt::eth().ipv6(A6, B6).tcp(40000, 443, flags);
    let invalid = reason::TCP_INVALID_FLAGS;
    vec![
        kernel(
            Xdp,
            "tcp_invalid_flags_syn_fin_v4",
            v4(tcp_flags::SYN | tcp_flags::FIN),
            invalid,
        ),
        kernel(Xdp, "tcp_invalid_flags_none_v6", v6(0), invalid),
        kernel(
            TcIngress,
            "tcp_invalid_flags_every_flag_v4",
            v4(0xff),
            invalid,
        ),
        kernel(
            TcEgress,
            "tcp_invalid_flags_fin_alone_v6",
            v6(tcp_flags::FIN),
            invalid,
        ),
        dropped(
            Xdp,
            "drop_tcp_invalid_flags_syn_rst_v4",
            v4(tcp_flags::SYN | tcp_flags::RST),
            invalid,
        ),
        dropped(
            TcIngress,
            "drop_tcp_invalid_flags_fin_rst_v6",
            v6(tcp_flags::FIN | tcp_flags::RST),
            invalid,
        ),
        // Positive controls: ECE|CWR|PSH do not matter; SYN|URG is valid.
        kernel(
            Xdp,
            "tcp_valid_flags_ecn_syn_v4",
            v4(tcp_flags::SYN | 0x40 | 0x80),
            reason::NO_STAGE_IPV4_TCP,
        ),
        kernel_despite_drop_malformed(
            Xdp,
            "drop_malformed_keeps_syn_urg_v6",
            v6(tcp_flags::SYN | tcp_flags::URG),
            reason::NO_STAGE_IPV6_TCP,
        ),
    ]
}

/// `drop_malformed` on: malformed frames are dropped with the same reason, everything else
/// still goes to the kernel.
fn drop_malformed() -> Vec<Case> {
    use Hook::{TcEgress, TcIngress, Xdp};
    let v4 = || Pkt::eth().ipv4(A4, B4);
    let v6 = || Pkt::eth().ipv6(A6, B6);
    vec![
        dropped(
            Xdp,
            "drop_trunc_in_vlan_tag",
            Pkt::eth()
                .vlan(ethertype::VLAN_8021Q, 100)
                .ipv4(A4, B4)
                .truncate(17),
            reason::TRUNC_VLAN,
        ),
        dropped(
            Xdp,
            "drop_trunc_in_ipv4_header",
            v4().udp(1, 2).truncate(30),
            reason::TRUNC_IPV4,
        ),
        dropped(
            TcIngress,
            "drop_ipv4_ihl_4",
            v4().ihl(4).tcp(1, 2, 0),
            reason::BAD_IPV4_IHL,
        ),
        dropped(
            TcEgress,
            "drop_tcp_data_offset_4",
            v4().tcp(1, 2, tcp_flags::SYN).tcp_data_offset(4),
            reason::BAD_TCP_DATA_OFFSET,
        ),
        dropped(
            Xdp,
            "drop_ipv6_payload_len_zero",
            v6().udp(1, 2).ipv6_payload_len(0),
            reason::BAD_IPV6_PAYLOAD_LEN,
        ),
        dropped(
            TcEgress,
            "drop_trunc_in_ipv6_ext",
            v6().ipv6_ext(Ipv6Ext::hop_by_hop())
                .tcp(1, 2, 0)
                .ipv6_payload_len(4)
                .truncate(58),
            reason::TRUNC_IPV6_EXT,
        ),
        dropped(
            Xdp,
            "drop_trunc_in_ipv6_udp",
            v6().udp(1, 2).cut_l4(7),
            reason::TRUNC_L4,
        ),
        kernel_despite_drop_malformed(
            Xdp,
            "drop_malformed_keeps_valid_tcp",
            v4().tcp(1, 2, tcp_flags::SYN),
            reason::NO_STAGE_IPV4_TCP,
        ),
        kernel_despite_drop_malformed(
            TcIngress,
            "drop_malformed_keeps_valid_padded_udp",
            v4().udp(1, 2).pad_min(),
            reason::NO_STAGE_IPV4_UDP,
        ),
        kernel_despite_drop_malformed(
            Xdp,
            "drop_malformed_keeps_arp",
            Pkt::eth().arp_request(A4, B4),
            reason::ARP,
        ),
        kernel_despite_drop_malformed(
            TcEgress,
            "drop_malformed_keeps_three_vlan_tags",
            three_vlans(),
            reason::VLAN_TOO_DEEP,
        ),
        kernel_despite_drop_malformed(
            Xdp,
            "drop_malformed_keeps_ext_chain_too_long",
            ext_chain(7).tcp(1, 2, 0),
            reason::IPV6_EXT_CHAIN_TOO_LONG,
        ),
        kernel_despite_drop_malformed(
            TcIngress,
            "drop_malformed_keeps_ipv6_fragment",
            v6().ipv6_ext(Ipv6Ext::fragment(0, true, 1)).udp(1, 2),
            reason::IPV6_FRAGMENT,
        ),
    ]
}

/// The whole parser table.
pub fn parser_cases() -> Vec<Case> {
    let mut cases = header_matrix();
    cases.extend(well_formed());
    cases.extend(malformed());
    cases.extend(drop_malformed());
    cases.extend(tcp_invalid_flags());
    cases
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    #[test]
    fn names_are_unique_and_inputs_runnable() {
        let cases = parser_cases();
        let mut names = BTreeSet::new();
        for c in &cases {
            assert!(
                names.insert(c.name.as_str()),
                "duplicate case name {}",
                c.name
            );
            assert!(
                c.input.len() >= super::super::fixture::MIN_INPUT_LEN,
                "{} is too short",
                c.name
            );
        }
    }

    #[test]
    fn every_parser_reason_is_covered_except_unreachable_ones() {
        let covered: BTreeSet<u32> = parser_cases()
            .iter()
            .flat_map(|c| c.expect_counters.iter().map(|d| d.reason))
            .collect();
        // The stateful firewall's codes (fw_*) need conntrack state: the conntrack sequences
        // cover them (ct_cases::tests::every_firewall_reason_is_covered).
        for code in 1..reason::FW_NO_CONNECTION {
            // trunc_eth: the kernel refuses test input below 14 bytes. headers_not_linear:
            // BPF_PROG_TEST_RUN builds a fully linear skb.
            if code == reason::TRUNC_ETH || code == reason::HEADERS_NOT_LINEAR {
                continue;
            }
            assert!(
                covered.contains(&code),
                "no case covers {}",
                reason::name(code)
            );
        }
    }
}
