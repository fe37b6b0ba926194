//! The pipeline every entry point runs, stage by stage in this order: parse, conntrack (with
//! the stateful firewall), load balancing (and gateway SNAT) for a connection conntrack did
//! not find, NAT, the L3 stage (VXLAN and VLAN egress are tail programs, see main.rs). Each
//! stage either claims the packet (forward/drop) or lets it continue; whatever no stage claims
//! goes to the kernel, the slow path, with a reason. Stages do not call each other: what one
//! needs of another comes through here.

use fastpath_common::{
    Hook, Verdict,
    lb::{SVC_F_NO_BACKEND_DROP, SVC_F_NO_BACKEND_REJECT},
    reason,
};

use crate::{
    conntrack::{self, Action},
    ctx::{HopRef, Miss},
    dsr, express, gateway, lb,
    maps::FP_PKT_CTX,
    nat,
    packet::Packet,
    parse::{self, FAMILY_IPV4, IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP, Parsed},
    route, settings, stats,
};

/// ICMPv6 router solicitation .. redirect (133..=137): neighbour discovery.
const ICMPV6_ND_FIRST: u8 = 133;
const ICMPV6_ND_LAST: u8 = 137;

/// Parses `pkt` into this CPU's packet context (`FP_PKT_CTX`), which the later stages read.
/// `Err` carries the reason the packet is not for the fast path.
#[inline(always)]
pub fn parse(pkt: &Packet) -> Result<&'static mut Parsed, u32> {
    // verifier: map memory, not the stack — the context would not fit the 512-byte stack
    // with the stages' own state, and values read back from a map are not tracked as
    // constants, which keeps the verifier from re-walking every stage once per parse path.
    let Some(ctx) = FP_PKT_CTX.get_ptr_mut(0) else {
        return Err(reason::NONE);
    };
    // SAFETY: this CPU's slot of a per-CPU array, used by this program run only (BPF
    // programs do not preempt each other on one CPU).
    let ctx = unsafe { &mut *ctx };
    parse::parse(pkt, ctx)?;
    Ok(ctx)
}

/// The rest of the pipeline for a parsed packet seen by `hook` on interface `ifindex`
/// (`local`: sent by this node, seen at egress; `lb`: with the load-balancing stages, see
/// `conntrack::track`); returns the verdict and its reason code.
#[inline(always)]
pub fn process(
    pkt: &Packet,
    p: &Parsed,
    hook: Hook,
    lb: bool,
    ifindex: u32,
    local: bool,
) -> (Verdict, u32) {
    // One clock read for every stage, by the first that needs it (0: not read yet); none for
    // a packet that is neither tracked nor routed.
    let mut now = 0;
    let Some(mut hop) = route::scratch_hop() else {
        return (Verdict::Kernel, reason::NONE);
    };
    let (action, unsaved) = match conntrack::track(
        hook, lb, ifindex, local, pkt, p, pkt.len, &mut now, &mut hop,
    ) {
        // At XDP the rest is the tail program `fastpath_xdp_new_connection`'s (`missed`).
        Action::Miss if hook == Hook::Xdp => return (Verdict::Kernel, NEW_CONNECTION),
        Action::Miss => match conntrack::missed() {
            Some(m) => new_connection(m, pkt, p, ifindex, &mut hop),
            None => (Action::Pass, None),
        },
        tracked => (tracked, None),
    };
    // At XDP a packet may have been served from a flow-cache copy.
    let learns = hook == Hook::Xdp;
    committed(
        act(action, pkt, p, hook, learns, ifindex, now, &hop),
        unsaved,
    )
}

/// The reason `process` gives a packet whose connection is created by the tail program
/// `fastpath_xdp_new_connection` ([`missed`]); never counted (the entry point calls that
/// program, or counts the packet under another reason when it is missing).
pub const NEW_CONNECTION: u32 = u32::MAX - 1;

/// The pipeline after conntrack for a packet it reported as a miss (`conntrack::missed`):
/// the LB stage, the connection's creation, then as [`process`].
#[inline(always)]
pub fn missed(pkt: &Packet, p: &Parsed, hook: Hook, ifindex: u32) -> (Verdict, u32) {
    // A load-balanced connection's first packet has the FIB's answer kept in its entry.
    let Some(mut hop) = route::scratch_hop() else {
        return (Verdict::Kernel, reason::NONE);
    };
    let ((action, unsaved), now) = match conntrack::missed() {
        Some(m) => (new_connection(m, pkt, p, ifindex, &mut hop), m.now),
        None => ((Action::Pass, None), 0),
    };
    // A new connection's packet was served from no copy: nothing to learn.
    committed(
        act(action, pkt, p, hook, false, ifindex, now, &hop),
        unsaved,
    )
}

/// The packet's verdict once a new load-balanced connection's entry is inserted (see
/// `conntrack::commit`), if it has one.
#[inline(always)]
fn committed(verdict: (Verdict, u32), unsaved: Option<conntrack::Unsaved>) -> (Verdict, u32) {
    match unsaved {
        Some(u) => conntrack::commit(u, verdict),
        None => verdict,
    }
}

/// The stages after conntrack and load balancing: carries out `action` (NAT, direct server
/// return), then routes; `learns`: the express path learns from a packet a flow-cache copy
/// served (`express::noted`).
#[expect(
    clippy::too_many_arguments,
    reason = "the packet, where it was seen and what the stages before decided, passed down once"
)]
#[inline(always)]
fn act(
    action: Action,
    pkt: &Packet,
    p: &Parsed,
    hook: Hook,
    learns: bool,
    ifindex: u32,
    now: u64,
    hop: &HopRef,
) -> (Verdict, u32) {
    // A packet a flow-cache copy served teaches the express path what to do with the next.
    let learning = learns && express::noted(pkt, p);
    // Where packets arrive, the L3 stage routes what the earlier stages let through (at
    // egress the kernel has routed them already). One call site per program: the stage is
    // inlined once.
    let (verdict, code) = match action {
        // Not tracked here (the tracking hook judged it where there is one): a TCP flag
        // combination Linux's conntrack calls invalid is not routed either (see
        // `reason::TCP_INVALID_FLAGS`); as a malformed packet, the kernel's unless
        // `drop_malformed`.
        Action::Pass if p.tcp_flags_invalid() => {
            let verdict = if settings::drop_malformed() {
                Verdict::Drop
            } else {
                Verdict::Kernel
            };
            return (verdict, reason::TCP_INVALID_FLAGS);
        }
        Action::Pass | Action::Miss => (Verdict::Kernel, reason::NONE),
        Action::Drop(code) => return (Verdict::Drop, code),
        Action::Kernel(code) => return (Verdict::Kernel, code),
        // Translated by the tail program the entry point calls for this reason.
        Action::Nat(code) if nat::icmp_error_planned() => return (Verdict::Kernel, code),
        Action::Nat(code) if nat::dsr_planned() => {
            return if dsr::forward(pkt, p, ifindex, now, hop) {
                if learning {
                    express::learn(pkt, p, code, false);
                }
                (Verdict::Forward, code)
            } else {
                (Verdict::Drop, reason::LB_DSR_NO_NEIGHBOR)
            };
        }
        Action::Nat(code) => {
            if !nat::rewrite(pkt, p, hook != Hook::Xdp) {
                return (Verdict::Drop, reason::LB_REWRITE_FAILED);
            }
            (Verdict::Kernel, code)
        }
    };
    // At TC the rewrite's checksum helper may have moved the packet's data.
    let reread;
    let pkt = if hook == Hook::Xdp {
        pkt
    } else {
        reread = pkt.reread_skb();
        &reread
    };
    let routed = if hook == Hook::TcEgress {
        Err(reason::NONE)
    } else {
        route::forward(pkt, p, hook, ifindex, now, hop)
    };
    // A translated packet keeps its translation's reason; the verdict says who routed it.
    match (routed, code) {
        (Ok(()), code) => {
            let code = if code == reason::NONE {
                reason::ROUTED
            } else {
                code
            };
            if learning {
                express::learn(pkt, p, code, true);
            }
            (Verdict::Forward, code)
        }
        (Err(reason::NONE), reason::NONE) => (verdict, unhandled_reason(p)),
        (Err(why), reason::NONE) => (verdict, why),
        (Err(_), code) => (verdict, code),
    }
}

/// The LB stage for a packet that may start a connection conntrack did not find (`m`): the
/// service its destination names, else gateway SNAT's for where it is routed; a backend for
/// it; then conntrack creates the connection with its binding (its entry [`committed`] after
/// the later stages). Without a service, a plain connection.
#[inline(always)]
fn new_connection(
    m: &Miss,
    pkt: &Packet,
    p: &Parsed,
    ifindex: u32,
    hop: &mut HopRef,
) -> (Action, Option<conntrack::Unsaved>) {
    // perf: a `match`, not `or_else`: a closure is a function LLVM may leave out of line (a
    // BPF-to-BPF call, and the caller's registers spilled around it).
    let svc = match lb::service(pkt, p) {
        Some(svc) => Some(svc),
        None => gateway::snat_service(pkt, p, ifindex),
    };
    let Some(svc) = svc else {
        return (conntrack::create_plain(m, p, pkt.len), None);
    };
    let Some(state) = conntrack::lb_start(m, p) else {
        return (conntrack::lb_refused(m), None);
    };
    let Some(key) = conntrack::missed_key() else {
        return (Action::Pass, None);
    };
    let Some((idx, backend)) = lb::pick_for_client(svc, key, pkt, p, m.now) else {
        stats::service_no_backend(svc.id);
        let action = if svc.flags & SVC_F_NO_BACKEND_REJECT != 0 {
            // Answered by the tail program the entry point calls for this reason.
            Action::Kernel(reason::LB_REJECTED)
        } else if svc.flags & SVC_F_NO_BACKEND_DROP != 0 {
            Action::Drop(reason::LB_NO_BACKEND)
        } else {
            Action::Kernel(reason::LB_NO_BACKEND)
        };
        return (action, None);
    };
    conntrack::create_lb(m, state, svc, idx, backend, pkt, p, pkt.len, hop)
}

/// Whether this CPU's parsed packet is IPv4.
#[inline(always)]
pub fn is_ipv4() -> bool {
    FP_PKT_CTX.get(0).is_some_and(|p| p.family == FAMILY_IPV4)
}

/// Verdict and reason for a packet the parser refused.
#[inline(always)]
pub fn unparsed(code: u32) -> (Verdict, u32) {
    (unparsed_verdict(code), code)
}

/// Verdict for a packet the parser refused: malformed ones are dropped only when configured.
/// Also for a frame an 802.1Q port refused (`vlan`): always dropped.
#[inline(always)]
fn unparsed_verdict(code: u32) -> Verdict {
    if code == reason::VLAN_NOT_MEMBER
        || code == reason::VLAN_FAILED
        || (reason::is_malformed(code) && settings::drop_malformed())
    {
        Verdict::Drop
    } else {
        Verdict::Kernel
    }
}

/// Reason for a well-formed packet that no stage claimed.
#[inline(always)]
pub fn unhandled_reason(p: &Parsed) -> u32 {
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
