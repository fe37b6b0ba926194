//! The pipeline every entry point runs: parse, then (as they land) firewall, conntrack, lb,
//! nat, l3/l2, vxlan. Each stage either claims the packet (forward/drop) or lets it continue;
//! whatever no stage claims goes to the kernel, the slow path, with a reason.

use fastpath_common::{DatapathConfig, Hook, Verdict, reason, stats::CONFIG_F_DROP_MALFORMED};

use crate::{
    conntrack,
    maps::FP_CONFIG,
    packet::Packet,
    parse::{self, FAMILY_IPV4, IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP, Parsed},
};

/// ICMPv6 router solicitation .. redirect (133..=137): neighbour discovery.
const ICMPV6_ND_FIRST: u8 = 133;
const ICMPV6_ND_LAST: u8 = 137;

/// Runs the pipeline over one packet seen by `hook` on interface `ifindex` (`local`: sent by
/// this node, seen at egress) and returns the verdict and its reason code.
// verifier: a real function (BPF-to-BPF call), not inlined: TC may run it twice (after a
// pull), and two inlined copies would not fit the 512-byte stack together.
#[inline(never)]
pub fn run(pkt: &Packet, hook: Hook, ifindex: u32, local: bool) -> (Verdict, u32) {
    let mut parsed = Parsed::new();
    let code = parse::parse_into(pkt, &mut parsed);
    if code != reason::NONE {
        return (unparsed_verdict(code), code);
    }
    conntrack::fp_ct_track(hook as u32, ifindex, local as u32, &parsed, pkt.len as u32);
    (Verdict::Kernel, unhandled_reason(&parsed))
}

/// Verdict for a packet the parser refused: malformed ones are dropped only when configured.
#[inline(always)]
fn unparsed_verdict(code: u32) -> Verdict {
    if reason::is_malformed(code) && drop_malformed() {
        Verdict::Drop
    } else {
        Verdict::Kernel
    }
}

#[inline(always)]
fn drop_malformed() -> bool {
    match FP_CONFIG.get(0) {
        Some(DatapathConfig { flags, .. }) => flags & CONFIG_F_DROP_MALFORMED != 0,
        None => false,
    }
}

/// Reason for a well-formed packet that no stage claimed.
#[inline(always)]
fn unhandled_reason(p: &Parsed) -> u32 {
    let v4 = p.family == FAMILY_IPV4;
    if p.fragment != 0 {
        return if v4 {
            reason::IPV4_FRAGMENT
        } else {
            reason::IPV6_FRAGMENT
        };
    }
    match (v4, p.l4_proto) {
        (true, IPPROTO_TCP) => reason::NO_STAGE_IPV4_TCP,
        (true, IPPROTO_UDP) => reason::NO_STAGE_IPV4_UDP,
        (true, IPPROTO_ICMP) => reason::NO_STAGE_IPV4_ICMP,
        (true, _) => reason::NO_STAGE_IPV4_OTHER,
        (false, IPPROTO_TCP) => reason::NO_STAGE_IPV6_TCP,
        (false, IPPROTO_UDP) => reason::NO_STAGE_IPV6_UDP,
        (false, IPPROTO_ICMPV6) => {
            if p.icmp_type >= ICMPV6_ND_FIRST && p.icmp_type <= ICMPV6_ND_LAST {
                reason::IPV6_ND
            } else {
                reason::NO_STAGE_IPV6_ICMP
            }
        }
        (false, _) => reason::NO_STAGE_IPV6_OTHER,
    }
}
