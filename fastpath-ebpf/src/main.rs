//! fastpath datapath entry points: thin wrappers that build a [`Packet`], run the shared
//! pipeline, count the outcome once, and translate the verdict for their hook.
#![no_std]
#![no_main]
#![allow(
    internal_features,
    reason = "`core::intrinsics::atomic_xadd`: the BPF target has no `fetch_add` in \
              `core::sync::atomic`"
)]
#![feature(core_intrinsics)]
#![feature(asm_experimental_arch)]
#![allow(
    clippy::not_unsafe_ptr_arg_deref,
    reason = "aya's program macros expand each entry point into a pub extern fn over the \
              kernel's context pointer, which the kernel guarantees valid"
)]

#[cfg(feature = "bench")]
mod bench;
mod clock;
mod conntrack;
mod ctx;
mod dsr;
mod express;
mod fib;
mod flowcache;
mod gateway;
mod lb;
mod maps;
mod nat;
mod packet;
mod parse;
mod pipeline;
mod ratelimit;
mod reject;
mod route;
mod settings;
mod stats;
mod vlan;
mod vxlan;

use aya_ebpf::{
    EbpfContext as _,
    bindings::{__sk_buff, TC_ACT_SHOT, TC_ACT_UNSPEC, xdp_action},
    helpers::bpf_redirect,
    macros::{classifier, xdp},
    programs::{TcContext, XdpContext},
};
use fastpath_common::{
    Hook, Verdict,
    ct::{IFACE_F_CT_TC_INGRESS, IFACE_F_VLAN_TC, IFACE_F_VLAN_XDP, IFACE_F_VXLAN_UNDERLAY},
    reason,
};

use crate::packet::{Packet, tc_packet, xdp_packet};

/// `tail` of `fastpath_xdp` when no tail program is wanted.
const NO_TAIL: u32 = u32::MAX;

/// Bytes made linear in TC when the headers are not: every header the parser reads fits in it
/// for ordinary packets (Ethernet + 2 VLAN + IPv6 + a few extension headers + TCP).
const PULL_LEN: u32 = 256;

// perf: `#[xdp]` wraps this body in the program's entry function; `inline(always)` keeps it
// there. Left to the inliner, a body this large becomes a BPF-to-BPF call on every packet
// (tens of ns where `ret` is mitigated; measured +10 ns on every path).
#[xdp]
#[inline(always)]
pub fn fastpath_xdp(ctx: XdpContext) -> u32 {
    let ifindex = ctx.ingress_ifindex() as u32;
    // A steady packet of a connection this CPU's flow cache holds, as the pipeline treated
    // the last one (an 802.1Q port's frames take the pipeline).
    if let Some(iface) = maps::FP_IFACE.get(ifindex)
        && iface.flags & IFACE_F_VLAN_XDP == 0
        && let Some(action) = express::serve(&xdp_packet(&ctx), ifindex, iface)
    {
        return action;
    }
    // An 802.1Q port's frames are untagged first (refused ones are counted with the
    // unparsable, from one place: this program's stack has no room for another).
    let popped = match vlan::port(ifindex, IFACE_F_VLAN_XDP) {
        Some(vid) => vlan::pop_xdp(&ctx, vid),
        None => Ok(()),
    };
    let pkt = xdp_packet(&ctx);
    let len = pkt.len;
    let (verdict, reason) = match popped.and_then(|()| pipeline::parse(&pkt)) {
        Ok(p) => pipeline::process(&pkt, p, Hook::Xdp, true, ifindex, false),
        Err(code) => pipeline::unparsed(code),
    };
    xdp_finish(&ctx, verdict, reason, len)
}

/// Tail program of `fastpath_xdp` (`FP_TAILS[TAIL_NEW_CONNECTION]`): the pipeline after
/// conntrack for a packet that may start a connection conntrack did not find
/// (`pipeline::missed`), from the packet context the main program parsed (`FP_PKT_CTX`,
/// this CPU's); then counted and sent on as the main program does.
#[xdp]
#[inline(always)]
pub fn fastpath_xdp_new_connection(ctx: XdpContext) -> u32 {
    let ifindex = ctx.ingress_ifindex() as u32;
    let pkt = xdp_packet(&ctx);
    let len = pkt.len;
    let (verdict, reason) = match maps::FP_PKT_CTX.get(0) {
        Some(p) => pipeline::missed(&pkt, p, Hook::Xdp, ifindex),
        None => (Verdict::Kernel, fastpath_common::reason::NONE),
    };
    xdp_finish(&ctx, verdict, reason, len)
}

/// The end of an XDP pipeline run: the tail program a verdict needs, the packet counted once
/// under its reason, the XDP action.
#[inline(always)]
fn xdp_finish(ctx: &XdpContext, mut verdict: Verdict, mut reason: u32, len: usize) -> u32 {
    // Rare paths whose stack does not fit beside this program's: their tail programs.
    // verifier: a plain index with a "none" value, not an `Option` (whose payload LLVM may
    // read uninitialised on the `None` path, which the verifier refuses).
    let family_tail = |v4: u32, v6: u32| if pipeline::is_ipv4() { v4 } else { v6 };
    let mut tail = match reason {
        pipeline::NEW_CONNECTION => fastpath_common::TAIL_NEW_CONNECTION,
        fastpath_common::reason::LB_ICMP_ERROR => family_tail(
            fastpath_common::TAIL_ICMP_ERROR,
            fastpath_common::TAIL_ICMP6_ERROR,
        ),
        fastpath_common::reason::LB_REJECTED => {
            family_tail(fastpath_common::TAIL_REJECT, fastpath_common::TAIL_REJECT6)
        }
        // UDP no stage took: VXLAN, if it arrived on an underlay (the tail program looks).
        fastpath_common::reason::NO_STAGE_IPV4_UDP
        | fastpath_common::reason::NO_STAGE_IPV6_UDP
        | fastpath_common::reason::ROUTE_NOT_FORWARDED
            if verdict == Verdict::Kernel && settings::vxlan_configured() =>
        {
            route::hand_over(reason);
            fastpath_common::TAIL_VXLAN_DECAP
        }
        _ => NO_TAIL,
    };
    // Forwarded out of an 802.1Q port or a vxlan device: tagged or encapsulated by a tail
    // program (no stack room here).
    if verdict == Verdict::Forward
        && let Some(t) = route::egress_tail(route::out_ifindex())
    {
        route::hand_over(reason);
        // Where the tail program is missing, dropped rather than sent half-done.
        verdict = Verdict::Drop;
        tail = t;
    }
    if tail != NO_TAIL {
        // SAFETY: the tail program takes the same context; it does not return here.
        unsafe { maps::FP_TAILS.tail_call(ctx, tail) };
        // The tail program is missing: the packet goes on as it is.
        reason = fastpath_common::reason::LB_REWRITE_FAILED;
    }
    stats::count(Hook::Xdp, verdict, reason, len);
    match verdict {
        Verdict::Drop => xdp_action::XDP_DROP,
        Verdict::Kernel => xdp_action::XDP_PASS,
        // Routed, or direct server return: out of the interface the stage chose (its MAC
        // addresses are in place).
        Verdict::Forward => route::xdp_redirect(route::out_ifindex()),
    }
}

/// Tail program of `fastpath_xdp` (`FP_TAILS[TAIL_VLAN_FORWARD]`): a frame forwarded out of
/// an 802.1Q port gets the port's tag, and is counted and redirected as the main program
/// decided (`route::hand_over`).
#[xdp]
pub fn fastpath_xdp_vlan_forward(ctx: XdpContext) -> u32 {
    let len = xdp_packet(&ctx).len;
    let out = route::out_ifindex();
    let tagged = match vlan::port(out, vlan::ANY) {
        Some(vid) => vlan::push_xdp(&ctx, vid),
        None => false,
    };
    if tagged {
        stats::count(Hook::Xdp, Verdict::Forward, route::handed_over(), len);
        route::xdp_redirect(out)
    } else {
        stats::count(
            Hook::Xdp,
            Verdict::Drop,
            fastpath_common::reason::VLAN_FAILED,
            len,
        );
        xdp_action::XDP_DROP
    }
}

/// Tail program of `fastpath_xdp` (`FP_TAILS[TAIL_VXLAN_ENCAP]`): a frame the L3 stage
/// routed to a vxlan device gets the outer headers learned for its next hop and goes out of
/// the underlay (see `vxlan::encap`).
#[xdp]
pub fn fastpath_xdp_vxlan_encap(ctx: XdpContext) -> u32 {
    let len = xdp_packet(&ctx).len;
    match vxlan::encap(&ctx) {
        vxlan::Encap::Sent(underlay) => {
            stats::count(Hook::Xdp, Verdict::Forward, reason::VXLAN_ENCAP, len);
            route::xdp_redirect(underlay)
        }
        vxlan::Encap::Kernel(why) => {
            stats::count(Hook::Xdp, Verdict::Kernel, why, len);
            xdp_action::XDP_PASS
        }
        vxlan::Encap::Drop => {
            stats::count(Hook::Xdp, Verdict::Drop, reason::ROUTE_OTHER, len);
            xdp_action::XDP_DROP
        }
    }
}

/// Tail program of `fastpath_xdp` (`FP_TAILS[TAIL_VXLAN_DECAP]`): UDP that no stage took
/// (its reason handed over), decapsulated if it is VXLAN arriving on an underlay (see
/// `vxlan::decap`). Counted with the outer length.
#[xdp]
pub fn fastpath_xdp_vxlan_decap(ctx: XdpContext) -> u32 {
    let len = xdp_packet(&ctx).len;
    match vxlan::decap(&ctx) {
        vxlan::Decap::Forward(why) => {
            let out = route::out_ifindex();
            if let Some(tail) = route::egress_tail(out) {
                route::hand_over(why);
                // SAFETY: the tail program takes the same context; it does not return here.
                unsafe { maps::FP_TAILS.tail_call(&ctx, tail) };
                stats::count(Hook::Xdp, Verdict::Drop, reason::ROUTE_OTHER, len);
                return xdp_action::XDP_DROP;
            }
            stats::count(Hook::Xdp, Verdict::Forward, why, len);
            route::xdp_redirect(out)
        }
        vxlan::Decap::Kernel(why) => {
            stats::count(Hook::Xdp, Verdict::Kernel, why, len);
            xdp_action::XDP_PASS
        }
        vxlan::Decap::Drop => {
            stats::count(Hook::Xdp, Verdict::Drop, reason::ROUTE_OTHER, len);
            xdp_action::XDP_DROP
        }
    }
}

/// Tail program of `fastpath_tc_ingress` (`FP_TC_TAILS[TC_TAIL_VXLAN_ENCAP]`): as
/// `fastpath_xdp_vxlan_encap` (see `vxlan::encap_tc`).
#[classifier]
pub fn fastpath_tc_vxlan_encap(ctx: TcContext) -> i32 {
    let len = ctx.len() as usize;
    match vxlan::encap_tc(&ctx) {
        vxlan::Encap::Sent(underlay) => {
            stats::count(Hook::TcIngress, Verdict::Forward, reason::VXLAN_ENCAP, len);
            route::tc_redirect(underlay)
        }
        vxlan::Encap::Kernel(why) => {
            stats::count(Hook::TcIngress, Verdict::Kernel, why, len);
            TC_ACT_UNSPEC
        }
        vxlan::Encap::Drop => {
            stats::count(Hook::TcIngress, Verdict::Drop, reason::ROUTE_OTHER, len);
            TC_ACT_SHOT
        }
    }
}

/// Tail program of `fastpath_tc_ingress` (`FP_TC_TAILS[TC_TAIL_VXLAN_DECAP]`): as
/// `fastpath_xdp_vxlan_decap` (see `vxlan::decap_tc`). Counted with the outer length.
#[classifier]
pub fn fastpath_tc_vxlan_decap(ctx: TcContext) -> i32 {
    let len = ctx.len() as usize;
    match vxlan::decap_tc(&ctx) {
        vxlan::Decap::Forward(why) => {
            stats::count(Hook::TcIngress, Verdict::Forward, why, len);
            route::tc_redirect(route::out_ifindex())
        }
        vxlan::Decap::Kernel(why) => {
            stats::count(Hook::TcIngress, Verdict::Kernel, why, len);
            TC_ACT_UNSPEC
        }
        vxlan::Decap::Drop => {
            stats::count(Hook::TcIngress, Verdict::Drop, reason::ROUTE_OTHER, len);
            TC_ACT_SHOT
        }
    }
}

/// Tail programs of `fastpath_xdp` (`FP_TAILS[TAIL_REJECT]`, `[TAIL_REJECT6]`): answer a new
/// connection to a service without backends (`no_backend = "reject"`) — see `reject`.
#[xdp]
pub fn fastpath_xdp_reject(ctx: XdpContext) -> u32 {
    reject::answer(&ctx, true)
}

#[xdp]
pub fn fastpath_xdp_reject6(ctx: XdpContext) -> u32 {
    reject::answer(&ctx, false)
}

#[classifier]
#[inline(always)]
pub fn fastpath_tc_ingress(ctx: TcContext) -> i32 {
    tc(ctx, Hook::TcIngress)
}

/// Tail program of `fastpath_tc_ingress` (`FP_TC_TAILS[TC_TAIL_LB]`): the rest of its
/// pipeline with the load-balancing stages (translation of load-balanced, full-NAT, gateway
/// and DSR connections, and of ICMP errors about them by the ICMP tail programs), for a
/// packet it parsed (`FP_PKT_CTX`, this CPU's) on an interface that tracks connections at TC
/// ingress. A program of its own: these stages' stack does not fit beside the parser's and
/// the TC prologue's.
#[classifier]
#[inline(always)]
pub fn fastpath_tc_lb(ctx: TcContext) -> i32 {
    let pkt = tc_packet(&ctx);
    let len = pkt.len;
    // SAFETY: the context pointer is the kernel's __sk_buff for the duration of the program.
    let ifindex = unsafe { (*(ctx.as_ptr() as *const __sk_buff)).ifindex };
    let (verdict, reason) = match maps::FP_PKT_CTX.get(0) {
        Some(p) => pipeline::process(&pkt, p, Hook::TcIngress, true, ifindex, false),
        None => (Verdict::Kernel, fastpath_common::reason::NONE),
    };
    tc_finish(&ctx, Hook::TcIngress, ifindex, verdict, reason, len)
}

#[classifier]
#[inline(always)]
pub fn fastpath_tc_egress(ctx: TcContext) -> i32 {
    tc(ctx, Hook::TcEgress)
}

#[inline(always)]
fn tc(ctx: TcContext, hook: Hook) -> i32 {
    let mut len = ctx.len();
    // SAFETY: the context pointer is the kernel's __sk_buff for the duration of the program.
    let (ifindex, ingress_ifindex) = unsafe {
        let skb = ctx.as_ptr() as *const __sk_buff;
        ((*skb).ifindex, (*skb).ingress_ifindex)
    };
    // At egress, a packet that never arrived on an interface was sent by this node.
    let local = hook == Hook::TcEgress && ingress_ifindex == 0;
    let mut pkt = tc_packet(&ctx);
    if hook == Hook::TcIngress
        && let Some(vid) = vlan::port(ifindex, IFACE_F_VLAN_TC)
    {
        if let Err(code) = vlan::pop_tc(&ctx, &pkt, vid) {
            stats::count(hook, Verdict::Drop, code, len as usize);
            return TC_ACT_SHOT;
        }
        pkt = tc_packet(&ctx);
        // Counted as the stages see it (as at XDP).
        len = ctx.len();
    }
    // Leaving a VXLAN underlay: the kernel's vxlan packets teach the cache.
    if hook == Hook::TcEgress
        && maps::FP_IFACE
            .get(ifindex)
            .is_some_and(|i| i.flags & IFACE_F_VXLAN_UNDERLAY != 0)
    {
        vxlan::learn(&pkt, ifindex);
    }
    let mut parsed = pipeline::parse(&pkt);
    if matches!(parsed, Err(fastpath_common::reason::HEADERS_NOT_LINEAR)) {
        // Headers beyond the linear area: make the first bytes linear and parse again. Only
        // here, never per packet: a pull may copy (and reallocate cloned skbs).
        let want = if len < PULL_LEN { len } else { PULL_LEN };
        match ctx.pull_data(want) {
            Ok(()) => {
                pkt = tc_packet(&ctx);
                parsed = pipeline::parse(&pkt);
            }
            Err(_) => {
                // verifier: a message without arguments — formatted arguments make aya-log
                // write unaligned stack slots, which the verifier refuses once packet loads
                // may be unaligned (see build.rs).
                if ratelimit::allow() {
                    aya_log_ebpf::warn!(&ctx, "bpf_skb_pull_data failed; headers not linear");
                }
            }
        }
    }
    let (verdict, reason) = match parsed {
        Ok(p) => {
            // A tag the kernel took out of the frame before TC (one the parser cannot see)
            // counts as one.
            if vlan::out_of_band(&ctx).is_some() {
                p.vlan_count += 1;
            }
            // An interface that tracks connections here: the rest of the pipeline is the
            // tail program with the load-balancing stages.
            if hook == Hook::TcIngress
                && maps::FP_IFACE
                    .get(ifindex)
                    .is_some_and(|i| i.flags & IFACE_F_CT_TC_INGRESS != 0)
            {
                // SAFETY: the tail program takes the same context; it does not return here.
                unsafe { maps::FP_TC_TAILS.tail_call(&ctx, fastpath_common::TC_TAIL_LB) };
                // The tail program is missing: tracked here, without load balancing.
                // verifier: kernels before 6.13 forget packet pointers at a tail call (as at
                // a helper that may move data), so the bounds are read again.
                pkt = tc_packet(&ctx);
            }
            pipeline::process(&pkt, p, hook, false, ifindex, local)
        }
        Err(code) => pipeline::unparsed(code),
    };
    tc_finish(&ctx, hook, ifindex, verdict, reason, len as usize)
}

/// The end of the TC pipeline at `hook` for a packet (`len` bytes as the stages saw it) the
/// stages gave `verdict` and `reason`: a tail program where one takes over, an 802.1Q tag
/// leaving a port, the count, and the TC action.
#[inline(always)]
fn tc_finish(
    ctx: &TcContext,
    hook: Hook,
    ifindex: u32,
    mut verdict: Verdict,
    mut reason: u32,
    len: usize,
) -> i32 {
    // An ICMP error to translate; routed to a vxlan device, or UDP no stage took arriving
    // where VXLAN may: the tail programs (as at XDP).
    if hook == Hook::TcIngress {
        let tail = if reason == fastpath_common::reason::LB_ICMP_ERROR {
            if pipeline::is_ipv4() {
                fastpath_common::TC_TAIL_ICMP_ERROR
            } else {
                fastpath_common::TC_TAIL_ICMP6_ERROR
            }
        } else if reason == fastpath_common::reason::LB_REJECTED {
            // Not answered at TC (see `reject`): the new connection is dropped.
            (verdict, reason) = (Verdict::Drop, fastpath_common::reason::LB_NO_BACKEND);
            NO_TAIL
        } else if verdict == Verdict::Forward && route::egress_is_vxlan(route::out_ifindex()) {
            // Where the tail program is missing, dropped rather than sent half-done.
            verdict = Verdict::Drop;
            fastpath_common::TC_TAIL_VXLAN_ENCAP
        } else if verdict == Verdict::Kernel
            && matches!(
                reason,
                fastpath_common::reason::NO_STAGE_IPV4_UDP
                    | fastpath_common::reason::NO_STAGE_IPV6_UDP
                    | fastpath_common::reason::ROUTE_NOT_FORWARDED
            )
            && settings::vxlan_configured()
        {
            fastpath_common::TC_TAIL_VXLAN_DECAP
        } else {
            NO_TAIL
        };
        if tail != NO_TAIL {
            route::hand_over(reason);
            // SAFETY: the tail program takes the same context; it does not return here.
            unsafe { maps::FP_TC_TAILS.tail_call(ctx, tail) };
            // The tail program is missing: the packet goes on as it is.
            reason = fastpath_common::reason::LB_REWRITE_FAILED;
        }
    }
    // Leaving an 802.1Q port: with its tag (this node's frames, and those redirected to it).
    if hook == Hook::TcEgress
        && verdict != Verdict::Drop
        && let Some(vid) = vlan::port(ifindex, vlan::ANY)
        && !vlan::push_tc(ctx, vid)
    {
        (verdict, reason) = (Verdict::Drop, fastpath_common::reason::VLAN_FAILED);
    }
    stats::count(hook, verdict, reason, len);
    match verdict {
        Verdict::Drop => TC_ACT_SHOT,
        // TC_ACT_UNSPEC is TCX_NEXT: later TCX programs and tc filters still run, then the
        // stack. TC_ACT_OK would end the chain here and hide the packet from them.
        Verdict::Kernel => TC_ACT_UNSPEC,
        // Routed at TC ingress (see fastpath_xdp): TC_ACT_REDIRECT.
        Verdict::Forward if hook == Hook::TcIngress => route::tc_redirect(route::out_ifindex()),
        // SAFETY: bpf_redirect has no preconditions; it returns the TC action to take.
        Verdict::Forward => unsafe { bpf_redirect(route::out_ifindex(), 0) as i32 },
    }
}

/// Tail programs of `fastpath_xdp` (`FP_TAILS[TAIL_ICMP_ERROR]` for IPv4,
/// `[TAIL_ICMP6_ERROR]` for IPv6): translate an ICMP error about a load-balanced connection
/// as the conntrack stage planned it (`FP_NAT`), from the packet context the main program
/// parsed (`FP_PKT_CTX`, this CPU's), and count the packet. Programs of their own: the
/// rewrite's stack does not fit beside the main program's (nor both families in one).
#[xdp]
pub fn fastpath_xdp_icmp_error(ctx: XdpContext) -> u32 {
    if icmp_error_tail(&xdp_packet(&ctx), Hook::Xdp, true) {
        xdp_action::XDP_PASS
    } else {
        xdp_action::XDP_DROP
    }
}

#[xdp]
pub fn fastpath_xdp_icmp6_error(ctx: XdpContext) -> u32 {
    if icmp_error_tail(&xdp_packet(&ctx), Hook::Xdp, false) {
        xdp_action::XDP_PASS
    } else {
        xdp_action::XDP_DROP
    }
}

/// Tail programs of `fastpath_tc_lb` (`FP_TC_TAILS[TC_TAIL_ICMP_ERROR]`,
/// `[TC_TAIL_ICMP6_ERROR]`): as `fastpath_xdp_icmp_error` and `fastpath_xdp_icmp6_error`.
#[classifier]
pub fn fastpath_tc_icmp_error(ctx: TcContext) -> i32 {
    if icmp_error_tail(&tc_packet(&ctx), Hook::TcIngress, true) {
        TC_ACT_UNSPEC
    } else {
        TC_ACT_SHOT
    }
}

#[classifier]
pub fn fastpath_tc_icmp6_error(ctx: TcContext) -> i32 {
    if icmp_error_tail(&tc_packet(&ctx), Hook::TcIngress, false) {
        TC_ACT_UNSPEC
    } else {
        TC_ACT_SHOT
    }
}

/// Translates the ICMP error and counts it; false: it is to be dropped (counted so).
#[inline(always)]
fn icmp_error_tail(pkt: &Packet, hook: Hook, v4: bool) -> bool {
    let ok = match maps::FP_PKT_CTX.get(0) {
        Some(p) => nat::icmp_error(pkt, p, v4),
        None => false,
    };
    if ok {
        stats::count(
            hook,
            Verdict::Kernel,
            fastpath_common::reason::LB_ICMP_ERROR,
            pkt.len,
        );
    } else {
        stats::count(
            hook,
            Verdict::Drop,
            fastpath_common::reason::LB_REWRITE_FAILED,
            pkt.len,
        );
    }
    ok
}

/// Empty XDP program: the floor `cargo xtask bench` measures in the same run. Never attached.
#[cfg(feature = "bench")]
#[xdp]
pub fn bench_floor_xdp(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

/// Synthetic conntrack event producer for the ring-drain benchmark: each run emits a fixed
/// batch of numbered events through the conntrack stage's `emit`. Never attached.
#[cfg(feature = "bench")]
#[xdp]
pub fn bench_ct_events(_ctx: XdpContext) -> u32 {
    bench::ct_events();
    xdp_action::XDP_PASS
}

/// Sends every frame back out of the interface it came in on: run by BPF_PROG_TEST_RUN in
/// live-frames mode on a namespace's veth, an in-kernel traffic generator for the routing
/// benchmark. Never attached.
/// The frame comes back from the page pool with the headers the path rewrote (MAC
/// addresses, TTL): they are restored from `FP_BENCH_FRAME` first.
#[cfg(feature = "bench")]
#[xdp]
pub fn bench_xdp_tx(ctx: XdpContext) -> u32 {
    let pkt = xdp_packet(&ctx);
    if let Some(words) = maps::FP_BENCH_FRAME.get(0) {
        pkt.store_words(0, *words);
    }
    xdp_action::XDP_TX
}

/// `bench_xdp_tx` with each frame a new TCP flow: the frame (a TCP SYN) is restored, then
/// stamped with the next frame number (`fastpath_common::bench::flow_stamp`), checksums
/// updated. The replication benchmark's generator of new connections. Never attached.
#[cfg(feature = "bench")]
#[xdp]
pub fn bench_xdp_flows(ctx: XdpContext) -> u32 {
    bench::flow_frame(&xdp_packet(&ctx));
    xdp_action::XDP_TX
}

/// The conntrack table's lookup of the key in `FP_BENCH_CT_KEY`, and nothing else: the share
/// of the hash lookup in the CT-hit path, for the benchmark. XDP_PASS when the key is in the
/// table, XDP_DROP when it is not. Never attached.
#[cfg(feature = "bench")]
#[xdp]
pub fn bench_ct_lookup(_ctx: XdpContext) -> u32 {
    let Some(key) = maps::FP_BENCH_CT_KEY.get(0) else {
        return xdp_action::XDP_ABORTED;
    };
    // SAFETY: the value is only tested for presence, not read.
    if unsafe { maps::FP_CT.get(key) }.is_some() {
        xdp_action::XDP_PASS
    } else {
        xdp_action::XDP_DROP
    }
}

/// A table-kind run (`fastpath_common::bench::TableRun` in the frame) on the conntrack hash.
/// Never attached.
#[cfg(feature = "bench")]
#[xdp]
pub fn bench_table_hash(ctx: XdpContext) -> u32 {
    bench::table_hash(&xdp_packet(&ctx))
}

/// The same run on the open-addressed table (`FP_BENCH_SLOTS`). Never attached.
#[cfg(feature = "bench")]
#[xdp]
pub fn bench_table_slots(ctx: XdpContext) -> u32 {
    bench::table_slots(&xdp_packet(&ctx))
}

/// The same run on an LRU hash (`FP_BENCH_LRU`). Never attached.
#[cfg(feature = "bench")]
#[xdp]
pub fn bench_table_lru(ctx: XdpContext) -> u32 {
    bench::table_lru(&xdp_packet(&ctx))
}

/// A traffic sink for the load-balancer benchmark, attached to the backends' links: drops
/// IPv4 UDP datagrams to `bench::SINK_UDP_PORT` (no IP options) and passes everything else
/// (ARP, TCP, ...) to the stack. The veth counts what it dropped (`ethtool -S`: xdp_drops).
#[cfg(feature = "bench")]
#[xdp]
pub fn bench_xdp_sink(ctx: XdpContext) -> u32 {
    if sink_takes(&xdp_packet(&ctx)).is_some() {
        xdp_action::XDP_DROP
    } else {
        xdp_action::XDP_PASS
    }
}

/// `Some` for what `bench_xdp_sink` drops.
#[cfg(feature = "bench")]
#[inline(always)]
fn sink_takes(pkt: &Packet) -> Option<()> {
    // verifier: one value at a time with `?` (a tuple of `Option`s let LLVM read an
    // uninitialised register on a `None` path).
    let ty: [u8; 2] = pkt.load_now(12)?;
    let version_ihl: u8 = pkt.load_now(14)?;
    let proto: u8 = pkt.load_now(23)?;
    let port: [u8; 2] = pkt.load_now(36)?;
    (ty == [0x08, 0x00]
        && version_ihl == 0x45
        && proto == 17
        && u16::from_be_bytes(port) == fastpath_common::bench::SINK_UDP_PORT)
        .then_some(())
}

/// The daemon's batch writer of conntrack entries: the "packet" is a run of `CtRecord`s,
/// carried out in order while they are the simple case; returns how many were (see
/// `conntrack::install`). Run by BPF_PROG_TEST_RUN, one syscall for up to `CT_INSTALL_MAX`
/// writes instead of one to four each. Never attached.
#[xdp]
pub fn fastpath_ct_install(ctx: XdpContext) -> u32 {
    conntrack::install(&xdp_packet(&ctx))
}

/// Empty TC program: the floor for the TC entry points. Never attached.
#[cfg(feature = "bench")]
#[classifier]
pub fn bench_floor_tc(_ctx: TcContext) -> i32 {
    aya_ebpf::bindings::TC_ACT_OK
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // verifier: unreachable in a verified program; the loop satisfies the `!` type.
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
