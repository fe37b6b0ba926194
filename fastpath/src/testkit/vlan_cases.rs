//! The 802.1Q ports' fixtures (`vlan = N`): frames tagged with the port's VLAN are untagged
//! at XDP and at TC ingress, anything else arriving is dropped, and frames the fast path
//! routes out of a VLAN port leave with that port's tag — checked byte for byte against
//! frames built from scratch. The routed cases use the FIB of [`ROUTE_NETNS_SETUP`]'s
//! namespace (`r0` → `r1`), like the routing fixtures.
//!
//! [`ROUTE_NETNS_SETUP`]: super::route_cases::ROUTE_NETNS_SETUP

use fastpath_common::{
    Hook, Verdict,
    ct::{IFACE_F_ROUTE, IFACE_F_ROUTE_TC, IFACE_F_VLAN_TC, IFACE_F_VLAN_XDP, IfaceConfig},
    reason,
};

use super::{
    cases::case,
    fixture::{Case, CounterDelta, Seed},
    packet::{Pkt, ethertype},
    route_cases::{HOP4_MAC, HOP6_MAC, R0_MAC, R1_MAC, RouteIfaces},
};

/// The VLAN of `r0` and the one of `r1` in the routed cases.
const VLAN_R0: u16 = 100;
const VLAN_R1: u16 = 200;
const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 1, 0x77];

/// `r0`, `r1` with these flags and VLANs (0: no VLAN flag).
fn seed(ifx: RouteIfaces, r0: (u32, u16), r1: (u32, u16)) -> Seed {
    let port = |mac, (flags, vlan): (u32, u16)| IfaceConfig {
        flags,
        mac,
        vlan: vlan.to_be_bytes(),
        ..IfaceConfig::default()
    };
    Seed::default()
        .with_iface_config(ifx.r0, port(R0_MAC, r0))
        .with_iface_config(ifx.r1, port(R1_MAC, r1))
}

fn udp4(dst: [u8; 4]) -> Pkt {
    Pkt::eth()
        .macs(R0_MAC, CLIENT_MAC)
        .ipv4([10, 1, 0, 1], dst)
        .udp(40000, 53)
        .payload(b"on a VLAN")
}

fn udp6(host: u8) -> Pkt {
    let mut dst = [0u8; 16];
    dst[..2].copy_from_slice(&[0xfd, 0x02]);
    dst[15] = host;
    let mut src = [0u8; 16];
    src[..2].copy_from_slice(&[0xfd, 0x01]);
    src[15] = 1;
    Pkt::eth()
        .macs(R0_MAC, CLIENT_MAC)
        .ipv6(src, dst)
        .udp(40000, 53)
        .payload(b"on a VLAN")
}

/// A tag of VLAN `vid` with priority `pcp`.
fn tci(pcp: u16, vid: u16) -> u16 {
    pcp << 13 | vid
}

/// Every VLAN case, arriving on `r0`.
pub fn vlan_cases(ifx: RouteIfaces) -> Vec<Case> {
    let arriving = |mut c: Case| {
        c.arrives_on = Some(ifx.r0);
        c
    };
    // r0 a VLAN port untagging at XDP (or TC), nothing else configured.
    let xdp_port = seed(ifx, (IFACE_F_VLAN_XDP, VLAN_R0), (0, 0));
    let tc_port = seed(ifx, (IFACE_F_VLAN_TC, VLAN_R0), (0, 0));
    // Counted as the stages see the frame: untagged.
    let counted = |mut c: Case, out: Vec<u8>, verdict: Verdict, why: u32| {
        c.expect_counters = vec![CounterDelta::new(c.hook, verdict, why, 1, out.len() as u64)];
        c.expect_output = Some(out);
        arriving(c)
    };
    let popped = |hook: Hook, what: &str, tagged: Pkt, untagged: Pkt, why: u32| {
        let seed = if hook == Hook::Xdp {
            &xdp_port
        } else {
            &tc_port
        };
        let c = case(
            hook,
            what,
            seed.clone(),
            tagged.build(),
            Verdict::Kernel,
            why,
        );
        counted(c, untagged.build(), Verdict::Kernel, why)
    };
    let dropped = |hook: Hook, what: &str, input: Pkt| {
        let seed = if hook == Hook::Xdp {
            &xdp_port
        } else {
            &tc_port
        };
        arriving(case(
            hook,
            what,
            seed.clone(),
            input.build(),
            Verdict::Drop,
            reason::VLAN_NOT_MEMBER,
        ))
    };
    let q = ethertype::VLAN_8021Q;
    let v4 = || udp4([10, 2, 0, 1]);
    let mut cases = Vec::new();
    for hook in [Hook::Xdp, Hook::TcIngress] {
        cases.extend([
            popped(
                hook,
                "vlan_pop_v4",
                v4().vlan(q, VLAN_R0),
                v4(),
                reason::NO_STAGE_IPV4_UDP,
            ),
            popped(
                hook,
                "vlan_pop_keeps_no_priority",
                v4().vlan(q, tci(5, VLAN_R0)),
                v4(),
                reason::NO_STAGE_IPV4_UDP,
            ),
            popped(
                hook,
                "vlan_pop_v6",
                udp6(1).vlan(q, VLAN_R0),
                udp6(1),
                reason::NO_STAGE_IPV6_UDP,
            ),
            // 802.1Q in 802.1Q: the outer tag goes, the inner one stays — in the frame at
            // XDP; at TC the kernel keeps it out of band (as it does on arrival), where
            // BPF_PROG_TEST_RUN's output does not show it.
            popped(
                hook,
                "vlan_pop_outer_of_two",
                v4().vlan(q, VLAN_R0).vlan(q, 7),
                if hook == Hook::Xdp {
                    v4().vlan(q, 7)
                } else {
                    v4()
                },
                reason::NO_STAGE_IPV4_UDP,
            ),
            dropped(hook, "vlan_untagged_dropped", v4()),
            dropped(hook, "vlan_other_vid_dropped", v4().vlan(q, 101)),
            dropped(
                hook,
                "vlan_8021ad_outer_dropped",
                v4().vlan(ethertype::VLAN_8021AD, VLAN_R0),
            ),
            dropped(
                hook,
                "vlan_arp_untagged_dropped",
                Pkt::eth().ethertype(ethertype::ARP).payload(&[0; 28]),
            ),
        ]);
    }
    // A frame that ends inside its tag.
    cases.push(dropped(
        Hook::Xdp,
        "vlan_truncated_tag_dropped",
        Pkt::eth().vlan(q, VLAN_R0).truncate(15),
    ));

    // Routed r0 → r1: the tag of r1's VLAN on the way out, none from an untagged r1.
    let routed = |hook: Hook, what: &str, r0: u16, r1: u16, pkt: Pkt, hop: [u8; 6]| {
        let (route, vlan) = if hook == Hook::Xdp {
            (IFACE_F_ROUTE, IFACE_F_VLAN_XDP)
        } else {
            (IFACE_F_ROUTE_TC, IFACE_F_VLAN_TC)
        };
        let flags = |vid: u16| route | if vid == 0 { 0 } else { vlan };
        let tagged = |p: Pkt, vid: u16| if vid == 0 { p } else { p.vlan(q, vid) };
        let c = case(
            hook,
            what,
            seed(ifx, (flags(r0), r0), (flags(r1), r1)),
            tagged(pkt.clone(), r0).build(),
            Verdict::Forward,
            reason::ROUTED,
        );
        let mut c = counted(c, pkt.clone().build(), Verdict::Forward, reason::ROUTED);
        c.expect_output = Some(tagged(pkt.macs(hop, R1_MAC).ttl(63), r1).build());
        c
    };
    cases.extend([
        routed(
            Hook::Xdp,
            "vlan_routed_v4_vlan_to_vlan",
            VLAN_R0,
            VLAN_R1,
            v4(),
            HOP4_MAC,
        ),
        routed(
            Hook::Xdp,
            "vlan_routed_v6_vlan_to_vlan",
            VLAN_R0,
            VLAN_R1,
            udp6(1),
            HOP6_MAC,
        ),
        routed(
            Hook::Xdp,
            "vlan_routed_v4_untagged_to_vlan",
            0,
            VLAN_R1,
            v4(),
            HOP4_MAC,
        ),
        routed(
            Hook::Xdp,
            "vlan_routed_v4_vlan_to_untagged",
            VLAN_R0,
            0,
            v4(),
            HOP4_MAC,
        ),
        // At TC the tag goes on at r1's TC egress (out of band): the redirected frame is
        // untagged here.
        routed(
            Hook::TcIngress,
            "vlan_routed_v4_vlan_to_untagged",
            VLAN_R0,
            0,
            v4(),
            HOP4_MAC,
        ),
    ]);
    cases
}
